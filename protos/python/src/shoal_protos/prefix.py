"""What engines hold in their prefix caches, as routers learn it: block hashes and the records
that carry them through Redis.

vLLM names each cached KV block by a hash chained over the block's tokens and every block
before it, but its hash is seeded per process (unless ``PYTHONHASHSEED`` is fixed on every
engine) and its algorithm is a setting, so a router cannot compute it. Shoal names a block by
its own chained hash of the same tokens (``chain_hashes``): engines translate vLLM's
``BlockStored`` events into it, routers compute it for a prompt, and both agree whatever vLLM's
seed and algorithm. A block's hash covers its ``block_size`` tokens and, through its parent, every
token before it, so equal hashes mean equal prefixes.

In Redis (keys under the cluster's prefix, ``Keys``)::

    prefix-events:<engine>     STREAM of PrefixEvents, one per publish, trimmed to the newest
    prefix-snapshot:<engine>   PrefixSnapshot: every block the engine holds, as of one event

A router reads an engine's snapshot once, then its events after the snapshot's; an event whose
``seq`` is not the one after the last it applied (it missed some, or the engine restarted:
another ``epoch``) sends it back to the snapshot.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

import msgspec

ROOT = 0
"""The parent of a prompt's first block."""


def chain_hashes(
    token_ids: Sequence[int], block_size: int, parent: int = ROOT, limit: int | None = None
) -> list[int]:
    """The chained hash of each full block of ``block_size`` tokens of ``token_ids`` (the first
    ``limit`` blocks at most), the first chained to ``parent``: 64-bit BLAKE2b of the parent's
    hash and the block's tokens."""
    blocks = len(token_ids) // block_size
    if limit is not None:
        blocks = min(blocks, limit)
    if blocks <= 0:
        return []
    raw = memoryview(array("q", token_ids[: blocks * block_size]).tobytes())
    step = block_size * 8
    hashes: list[int] = []
    blake2b = hashlib.blake2b
    for start in range(0, blocks * step, step):
        digest = blake2b(parent.to_bytes(8, "little"), digest_size=8)
        digest.update(raw[start : start + step])
        parent = int.from_bytes(digest.digest(), "little")
        hashes.append(parent)
    return hashes


class PrefixEvent(msgspec.Struct, omit_defaults=True, kw_only=True):
    """What changed in an engine's prefix cache since its previous event."""

    epoch: str
    """The engine process's own id: a restarted engine starts a new epoch (and ``seq`` at 1)."""
    seq: int
    """1, 2, 3, ... within the epoch; a gap means events were lost."""
    stored: list[int] = []
    """Blocks now cached (``chain_hashes``), in order, a parent before its children."""
    removed: list[int] = []
    """Blocks evicted (applied after ``cleared``, before ``stored``)."""
    cleared: bool = False
    """The whole cache was emptied first (vLLM's prefix cache reset)."""


class PrefixSnapshot(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Every block an engine holds, as of its event ``seq`` (0: before any)."""

    epoch: str
    seq: int
    block_size: int
    blocks: list[int] = []
    stream_id: str = "0-0"
    """The Redis stream id of event ``seq``: a reader goes on after it."""


prefix_event_encoder = msgspec.json.Encoder()
prefix_event_decoder = msgspec.json.Decoder(PrefixEvent)
prefix_snapshot_decoder = msgspec.json.Decoder(PrefixSnapshot)
