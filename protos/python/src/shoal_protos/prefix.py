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

from array import array
from collections.abc import Container, Iterable, Sequence

import msgspec
import numpy as np
import numpy.typing as npt

ROOT = 0
"""The parent of a prompt's first block."""

_MASK = (1 << 64) - 1
_RADIX = 0xD1B54A32D192ED03
"""The chain's multiplier (odd, so invertible modulo 2**64)."""
_RADIX_INVERSE = pow(_RADIX, -1, 1 << 64)


def _splitmix64(count: int, seed: int = 0x5EED_B10C) -> list[int]:
    """``count`` well-mixed 64-bit numbers from ``seed`` (SplitMix64): fixed forever, so every
    process of every version names a block alike."""
    out, state = [], seed
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & _MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        out.append(z ^ (z >> 31))
    return out


class _Tables:
    """Position keys and powers of the radix, grown as longer blocks and prompts come."""

    def __init__(self) -> None:
        self.keys = np.zeros(0, dtype=np.uint64)
        self.up = np.zeros(0, dtype=np.uint64)
        self.down = np.zeros(0, dtype=np.uint64)

    def position_keys(self, block_size: int) -> npt.NDArray[np.uint64]:
        if len(self.keys) < block_size:
            self.keys = np.array(_splitmix64(max(block_size, 2 * len(self.keys))), dtype=np.uint64)
        return self.keys[:block_size]

    def powers(self, blocks: int) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
        """The radix to the powers 1..blocks, and its inverse to the same."""
        if len(self.up) < blocks:
            count = max(blocks, 2 * len(self.up), 1024)
            up, down, a, b = [], [], 1, 1
            for _ in range(count):
                a, b = (a * _RADIX) & _MASK, (b * _RADIX_INVERSE) & _MASK
                up.append(a)
                down.append(b)
            self.up, self.down = np.array(up, dtype=np.uint64), np.array(down, dtype=np.uint64)
        return self.up[:blocks], self.down[:blocks]


_TABLES = _Tables()


def chain_hashes(
    token_ids: Sequence[int], block_size: int, parent: int = ROOT, limit: int | None = None
) -> list[int]:
    """The chained hash of each full block of ``block_size`` tokens of ``token_ids`` (the first
    ``limit`` blocks at most), the first chained to ``parent``.

    A block's own hash is a multilinear hash of its tokens (each times a fixed 64-bit key of its
    position), and the chain is a polynomial over the blocks: ``h[i] = h[i-1] * R + block[i]``
    modulo 2**64, computed for all blocks at once (``h[i] = R**i * (parent + sum of block[j] *
    R**-j)``). Not cryptographic: a collision only places a request where its KV is not (vLLM
    checks its own hashes), and a router must hash a long prompt within its dispatch budget."""
    blocks = len(token_ids) // block_size
    if limit is not None:
        blocks = min(blocks, limit)
    if blocks <= 0:
        return []
    # Unsigned: CPython converts a list of ints to unsigned machine words several times faster
    # than to signed ones, and this conversion is most of a long prompt's lookup.
    raw = array("Q", token_ids[: blocks * block_size] if len(token_ids) > blocks * block_size else token_ids)
    tokens = np.frombuffer(raw, dtype=np.uint64).reshape(blocks, block_size)
    own = tokens @ _TABLES.position_keys(block_size)
    up, down = _TABLES.powers(blocks)
    chained = up * (np.cumsum(own * down, dtype=np.uint64) + np.uint64(parent))
    return chained.tolist()  # type: ignore[no-any-return]


def leading(block_hashes: Iterable[int], held: Container[int]) -> int:
    """How many of a request's first blocks (``block_hashes``, first first) are in ``held``: as
    many as a prefix-cache lookup would find."""
    count = 0
    for block in block_hashes:
        if block not in held:
            break
        count += 1
    return count


class PrefixEvent(msgspec.Struct, omit_defaults=True, kw_only=True):
    """What changed in an engine's prefix cache since its previous event."""

    epoch: str
    """The engine process's own id: a restarted engine starts a new epoch (and ``seq`` at 1)."""
    seq: int
    """1, 2, 3, ... within the epoch; a gap means events were lost."""
    stored: list[int] = []
    """Blocks now cached (``chain_hashes``)."""
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
