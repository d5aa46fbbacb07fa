"""Which engine's prefix cache holds which blocks, as their events say (``shoal_protos.prefix``).

Each router keeps one index, built from the same events as every other router's, so all of them
place a prompt alike. A block is named by its chained hash (``chain_hashes``): the index maps it
to the engines that hold it, as a bit mask over the engines' slots, so the engines holding a
prompt's first ``n`` blocks are an AND of ``n`` masks, one pass over the prompt whatever the
number of engines. Each engine's own set of blocks lets it leave in time proportional to what it
held.

The index is bounded: an engine holds at most its KV blocks (it reports what vLLM caches), and
blocks past ``max_blocks`` distinct ones are not indexed (counted in ``dropped``) until others
leave.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from shoal_protos.prefix import ROOT, PrefixEvent, PrefixSnapshot, chain_hashes

MAX_BLOCKS = 4_000_000
"""Distinct blocks a router indexes by default (a few hundred MB at most)."""
HASH_BATCH = 256
"""Blocks of a prompt hashed at a time: a prompt none of whose first blocks is cached anywhere
costs one batch, not its whole length."""


@dataclass(slots=True)
class _Engine:
    slot: int
    block_size: int
    epoch: str
    seq: int
    stream_id: str
    blocks: set[int] = field(default_factory=set)


class PrefixIndex:
    def __init__(self, max_blocks: int = MAX_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self._holders: dict[int, int] = {}
        self._engines: dict[str, _Engine] = {}
        self._sizes: Counter[int] = Counter()
        """The engines' block sizes, each with how many engines have it."""
        self._free_slots: list[int] = []
        self._next_slot = 0
        self.dropped = 0
        """Blocks not indexed because the index was full."""

    # ---- what the engines say ----------------------------------------------------------------

    def load(self, engine_id: str, snapshot: PrefixSnapshot) -> None:
        """Replace what ``engine_id`` holds with its snapshot."""
        self.drop(engine_id)
        engine = _Engine(
            self._take_slot(), snapshot.block_size, snapshot.epoch, snapshot.seq, snapshot.stream_id
        )
        self._engines[engine_id] = engine
        self._sizes[engine.block_size] += 1
        self._store(engine, snapshot.blocks)

    def apply(self, engine_id: str, event: PrefixEvent, stream_id: str) -> bool:
        """Apply the engine's next event; False (nothing applied) when it is not the one after
        the last applied (events were lost, or the engine restarted): read its snapshot then.
        An event the snapshot already covers is skipped (True)."""
        engine = self._engines.get(engine_id)
        if engine is None or event.epoch != engine.epoch:
            return False
        if event.seq <= engine.seq:
            return True
        if event.seq != engine.seq + 1:
            return False
        if event.cleared:
            self._remove(engine, list(engine.blocks))
        self._remove(engine, event.removed)
        self._store(engine, event.stored)
        engine.seq = event.seq
        engine.stream_id = stream_id
        return True

    def drop(self, engine_id: str) -> None:
        """Forget the engine (it left the fleet, or its snapshot replaces what it held)."""
        engine = self._engines.pop(engine_id, None)
        if engine is None:
            return
        self._remove(engine, list(engine.blocks))
        self._sizes[engine.block_size] -= 1
        if not self._sizes[engine.block_size]:
            del self._sizes[engine.block_size]
        self._free_slots.append(engine.slot)

    def _take_slot(self) -> int:
        if self._free_slots:
            return self._free_slots.pop()
        self._next_slot += 1
        return self._next_slot - 1

    def _store(self, engine: _Engine, blocks: Iterable[int]) -> None:
        bit = 1 << engine.slot
        holders, held = self._holders, engine.blocks
        for block in blocks:
            if block in held:
                continue
            mask = holders.get(block)
            if mask is None:
                if len(holders) >= self.max_blocks:
                    self.dropped += 1
                    continue
                mask = 0
            holders[block] = mask | bit
            held.add(block)

    def _remove(self, engine: _Engine, blocks: Iterable[int]) -> None:
        keep = ~(1 << engine.slot)
        holders, held = self._holders, engine.blocks
        for block in blocks:
            if block not in held:
                continue
            held.discard(block)
            mask = holders[block] & keep
            if mask:
                holders[block] = mask
            else:
                del holders[block]

    # ---- what a router asks --------------------------------------------------------------------

    def position(self, engine_id: str) -> tuple[str, int, str] | None:
        """Where the engine's events were last applied: (epoch, seq, stream id)."""
        engine = self._engines.get(engine_id)
        return None if engine is None else (engine.epoch, engine.seq, engine.stream_id)

    def engines(self) -> list[str]:
        return list(self._engines)

    def block_sizes(self) -> tuple[int, ...]:
        """The engines' block sizes (a prompt is looked up in each)."""
        return tuple(self._sizes)

    def held(self, engine_id: str) -> int:
        """Blocks the engine holds, as indexed."""
        engine = self._engines.get(engine_id)
        return 0 if engine is None else len(engine.blocks)

    def shared(self, engine_a: str, engine_b: str) -> int:
        """Blocks both engines hold (0 when either is unknown or their block sizes differ)."""
        a, b = self._engines.get(engine_a), self._engines.get(engine_b)
        if a is None or b is None or a.block_size != b.block_size:
            return 0
        return len(a.blocks & b.blocks)

    def __len__(self) -> int:
        """Distinct blocks indexed."""
        return len(self._holders)

    def cached_tokens(
        self,
        token_ids: Sequence[int],
        engine_ids: Iterable[str],
        hashed: Mapping[int, Sequence[int]] | None = None,
    ) -> dict[str, int]:
        """Of ``engine_ids``, those whose prefix cache holds the prompt's first blocks, and how
        many of its tokens they hold (full blocks, in each engine's own block size). ``hashed``:
        the prompt's block hashes in some block sizes, already computed (by the tokenizer)."""
        by_size: dict[int, dict[int, str]] = {}
        for engine_id in engine_ids:
            engine = self._engines.get(engine_id)
            if engine is not None and engine.blocks:
                by_size.setdefault(engine.block_size, {})[engine.slot] = engine_id
        found: dict[str, int] = {}
        for block_size, slots in by_size.items():
            hashes = hashed.get(block_size) if hashed else None
            batches = [hashes] if hashes is not None else _batches(token_ids, block_size)
            for slot, blocks in self._matched(batches, slots).items():
                found[slots[slot]] = blocks * block_size
        return found

    def _matched(self, batches: Iterable[Sequence[int]], slots: dict[int, str]) -> dict[int, int]:
        """Leading blocks of the prompt (its block hashes, a batch at a time) each slot's
        engine holds (only those holding one)."""
        alive = 0
        for slot in slots:
            alive |= 1 << slot
        holders = self._holders
        matched: dict[int, int] = {}
        done = 0
        for batch in batches:
            for block in batch:
                still = alive & holders.get(block, 0)
                if still != alive:
                    _record(alive & ~still, done, matched)
                    alive = still
                    if not alive:
                        return matched
                done += 1
        _record(alive, done, matched)
        return matched


def _batches(token_ids: Sequence[int], block_size: int) -> Iterator[list[int]]:
    """The hashes of the prompt's full blocks, ``HASH_BATCH`` at a time, hashed as they are
    asked for."""
    total = len(token_ids) // block_size
    done, parent = 0, ROOT
    while done < total:
        start = done * block_size
        batch = chain_hashes(token_ids[start : start + HASH_BATCH * block_size], block_size, parent)
        yield batch
        done, parent = done + len(batch), batch[-1]


def _record(mask: int, blocks: int, matched: dict[int, int]) -> None:
    """Slots in ``mask`` matched ``blocks`` leading blocks (recorded when more than none)."""
    if not blocks:
        return
    while mask:
        low = mask & -mask
        matched[low.bit_length() - 1] = blocks
        mask ^= low
