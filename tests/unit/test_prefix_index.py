"""The router's prefix-cache index (``PrefixIndex``) and the ``prefix_cache`` scorer: leading
blocks per engine, engines of different block sizes, engines that leave, the memory bound, and
load that outweighs a cache hit."""

from __future__ import annotations

import random
import tracemalloc

import msgspec

from shoal_protos.prefix import PrefixEvent, PrefixSnapshot, chain_hashes
from shoal_router.core.prefix_index import PrefixIndex
from shoal_router.core.scheduling import Ask, Scheduler
from tests.unit.test_scheduling import view

BLOCK = 16


def tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(count)]


def snapshot(blocks: list[int], block_size: int = BLOCK, epoch: str = "a", seq: int = 0) -> PrefixSnapshot:
    return PrefixSnapshot(epoch=epoch, seq=seq, block_size=block_size, blocks=blocks)


def test_each_engine_is_credited_with_the_leading_blocks_it_holds() -> None:
    prompt = tokens(1, 10 * BLOCK + 5)
    hashes = chain_hashes(prompt, BLOCK)
    index = PrefixIndex()
    index.load("whole", snapshot(hashes))
    index.load("half", snapshot(hashes[:5]))
    # Blocks 0-2 and 4-9: a hole at 3 ends the prefix it can serve.
    index.load("holed", snapshot(hashes[:3] + hashes[4:]))
    index.load("cold", snapshot(chain_hashes(tokens(2, 4 * BLOCK), BLOCK)))
    index.load("tail-only", snapshot(hashes[1:]))
    engines = ["whole", "half", "holed", "cold", "tail-only", "unknown"]
    assert index.cached_tokens(prompt, engines) == {"whole": 160, "half": 80, "holed": 48}
    # The same from the hashes the tokenizer sends along; the lookup reads those it is given.
    given = {BLOCK: hashes}
    assert index.cached_tokens(prompt, engines, given) == {"whole": 160, "half": 80, "holed": 48}
    assert index.cached_tokens(prompt, engines, {BLOCK: [hashes[0], *[7] * 9]}) == {
        "whole": 16, "half": 16, "holed": 16,
    }  # fmt: skip
    # Only the engines asked about.
    assert index.cached_tokens(prompt, ["half"]) == {"half": 80}
    # Same tokens behind a different first token: nothing is shared.
    assert index.cached_tokens([7, *prompt[1:]], engines) == {}
    assert index.cached_tokens(prompt[: BLOCK - 1], engines) == {}


def test_engines_of_other_block_sizes_are_matched_in_their_own_blocks() -> None:
    prompt = tokens(3, 300)
    index = PrefixIndex()
    index.load("b16", snapshot(chain_hashes(prompt, 16), block_size=16))
    index.load("b128", snapshot(chain_hashes(prompt, 128), block_size=128))
    assert index.cached_tokens(prompt, ["b16", "b128"]) == {"b16": 288, "b128": 256}
    # Sizes the tokenizer did not hash the prompt in are hashed here.
    assert index.cached_tokens(prompt, ["b16", "b128"], {16: chain_hashes(prompt, 16)}) == {
        "b16": 288, "b128": 256,
    }  # fmt: skip
    assert index.block_sizes() == (16, 128)
    index.drop("b128")
    assert index.block_sizes() == (16,)


def test_events_apply_in_order_and_a_gap_or_another_epoch_is_refused() -> None:
    prompt = tokens(4, 4 * BLOCK)
    first, second, third, fourth = chain_hashes(prompt, BLOCK)
    index = PrefixIndex()
    index.load("e", snapshot([first, second], seq=3))
    assert index.apply("e", PrefixEvent(epoch="a", seq=2, stored=[third]), "1-0")  # covered: skipped
    assert index.cached_tokens(prompt, ["e"]) == {"e": 32}
    assert index.apply("e", PrefixEvent(epoch="a", seq=4, stored=[third, fourth]), "2-0")
    assert index.cached_tokens(prompt, ["e"]) == {"e": 64}
    assert index.position("e") == ("a", 4, "2-0")
    assert not index.apply("e", PrefixEvent(epoch="a", seq=6, removed=[first]), "3-0")
    assert not index.apply("e", PrefixEvent(epoch="b", seq=5, removed=[first]), "3-0")
    assert index.cached_tokens(prompt, ["e"]) == {"e": 64}
    assert index.apply("e", PrefixEvent(epoch="a", seq=5, removed=[second]), "3-0")
    assert index.cached_tokens(prompt, ["e"]) == {"e": 16}
    assert index.apply("e", PrefixEvent(epoch="a", seq=6, cleared=True, stored=[first]), "4-0")
    assert index.cached_tokens(prompt, ["e"]) == {"e": 16} and index.held("e") == 1
    assert not index.apply("unknown", PrefixEvent(epoch="a", seq=1), "5-0")


def test_an_engine_that_leaves_takes_its_blocks_and_its_slot_is_reused() -> None:
    prompt = tokens(5, 3 * BLOCK)
    hashes = chain_hashes(prompt, BLOCK)
    index = PrefixIndex()
    index.load("a", snapshot(hashes))
    index.load("b", snapshot(hashes[:1]))
    assert len(index) == 3
    index.drop("a")
    assert len(index) == 1 and index.cached_tokens(prompt, ["a", "b"]) == {"b": 16}
    index.load("c", snapshot([]))  # takes a's slot: none of a's blocks may show up as c's
    assert index.cached_tokens(prompt, ["b", "c"]) == {"b": 16}
    index.drop("b")
    assert len(index) == 0 and index.engines() == ["c"]


def test_the_index_holds_at_most_max_blocks_distinct_blocks() -> None:
    index = PrefixIndex(max_blocks=10)
    index.load("a", snapshot(chain_hashes(tokens(6, 8 * BLOCK), BLOCK)))
    index.load("b", snapshot(chain_hashes(tokens(7, 8 * BLOCK), BLOCK)))
    assert len(index) == 10 and index.dropped == 6
    index.drop("a")
    assert len(index) == 2


def test_memory_per_indexed_block_is_bounded() -> None:
    """Distinct blocks held by one engine each: what a router pays per cached block."""
    blocks = 50_000
    hashes = chain_hashes(tokens(8, blocks * BLOCK), BLOCK)
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    index = PrefixIndex()
    index.load("a", snapshot(hashes))
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    assert len(index) == blocks
    assert grown / blocks < 300, f"{grown / blocks:.0f} bytes per block"


# ---- the scorer ---------------------------------------------------------------------------


def test_prefix_cache_places_a_prompt_where_its_prefix_is_cached() -> None:
    scheduler = Scheduler("prefix_cache", rng=random.Random(0))
    assert scheduler.prefix_cache is not None
    index = scheduler.prefix_cache.index
    prompt = tokens(9, 20 * BLOCK)
    index.load("e1", snapshot(chain_hashes(prompt, BLOCK), block_size=BLOCK))
    index.load("e2", snapshot(chain_hashes(prompt, BLOCK)[:5], block_size=BLOCK))
    views = [view(f"e{i}", running=2, kv_used=100, block_size=BLOCK) for i in range(4)]
    picks = {scheduler.pick(Ask("m", [*prompt, 1, 2]), views).engine_id for _ in range(20)}  # type: ignore[union-attr]
    assert picks == {"e1"}
    # The same with the hashes the tokenizer sent along.
    hashed = Ask("m", [*prompt, 1, 2], block_hashes={BLOCK: chain_hashes(prompt, BLOCK)})
    assert scheduler.pick(hashed, views).engine_id == "e1"  # type: ignore[union-attr]
    # A prompt nobody holds: least load decides (e3 has the most room).
    views[3] = view("e3", running=0, block_size=BLOCK)
    assert {scheduler.pick(Ask("m", tokens(10, 64)), views).engine_id for _ in range(20)} == {"e3"}  # type: ignore[union-attr]


def picked_beside_an_idle_engine(running: int, slots: int = 0) -> str:
    """Where ``prefix_cache`` sends a prompt that engine "hot" holds whole, with ``running``
    requests there (and ``slots`` batch slots, 0: not said), beside an engine "idle" with none."""
    scheduler = Scheduler("prefix_cache", rng=random.Random(0))
    assert scheduler.prefix_cache is not None
    prompt = tokens(11, 20 * BLOCK)
    scheduler.prefix_cache.index.load("hot", snapshot(chain_hashes(prompt, BLOCK)))
    busy = view("hot", running=running, kv_used=200, block_size=BLOCK)
    if slots:
        busy.record = msgspec.structs.replace(busy.record, max_num_seqs=slots)
    picked = scheduler.pick(Ask("m", prompt), [busy, view("idle", running=0, block_size=BLOCK)])
    assert picked is not None
    return picked.engine_id


def test_an_overloaded_cached_engine_loses_to_a_cold_idle_one() -> None:
    # 3 requests against none: over the cap of ceil(1.25 * 4 / 2) = 3, so the cache counts not.
    assert picked_beside_an_idle_engine(running=3) == "idle"
    # Under the cap, the cache wins over more room.
    assert picked_beside_an_idle_engine(running=1) == "hot"


def test_an_engine_with_many_batch_slots_keeps_its_cache_score_for_a_few_requests_more() -> None:
    # 10 requests against none: over the ratio's cap (7) and the least slack (mean 5 + 2).
    assert picked_beside_an_idle_engine(running=10) == "idle"
    # With 256 batch slots its slack is 16: joining a batch of 10 costs less than the prompt.
    assert picked_beside_an_idle_engine(running=10, slots=256) == "hot"
    # At 42 (over the mean of 21 plus 16) it is overloaded again.
    assert picked_beside_an_idle_engine(running=42, slots=256) == "idle"


def test_prefix_cache_is_a_scorer_and_a_profile() -> None:
    assert Scheduler("prefix_cache=3,least_load=1").prefix_weight == 3
    assert Scheduler("least_load").prefix_cache is None
