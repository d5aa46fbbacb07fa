"""The scheduler's plugins one by one, and their profiles: filters, Llumnix's freeness,
consistent hashing with bounded load for prefix and session affinity, round-robin."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from shoal_protos.records import EngineRecord, EngineState, LoadReport
from shoal_router.config import RouterConfig
from shoal_router.core.dispatch import DEFAULT_BLOCK_SIZE, EngineView
from shoal_router.core.hold import HoldPolicy
from shoal_router.core.scheduling import (
    PREFIX_BLOCK_TOKENS,
    Ask,
    BoundedRing,
    Scheduler,
    freeness,
    parse_weights,
    prefix_key,
)

TOTAL = 1000


def view(
    engine_id: str,
    running: int | None = 0,
    waiting: int = 0,
    kv_used: int = 0,
    *,
    total: int = TOTAL,
    sent: int = 0,
    pending: int = 0,
    inflight: int = 0,
    state: EngineState = EngineState.ACTIVE,
    reserved: int = 0,
    block_size: int = 0,
) -> EngineView:
    """An engine of ``total`` KV blocks of ``block_size`` tokens (0: not said);
    ``running=None``: no load report read yet."""
    record = EngineRecord(
        engine_id=engine_id, model="m", zmq_address="tcp://h:1", http_address="http://h:1", state=state,
        max_model_len=4096, protocol_version=1, started_at=0.0, kv_blocks_total=total,
        kv_block_size=block_size,
    )  # fmt: skip
    report = None
    if running is not None:
        report = LoadReport(
            engine_id=engine_id, seq=1, time=0.0, num_running=running, num_waiting=waiting,
            kv_blocks_used=kv_used, kv_blocks_free=total - kv_used, kv_blocks_reserved=reserved,
        )  # fmt: skip
    return EngineView(record, report, sent_since_report=sent, inflight=inflight, pending_blocks=pending)


def ask(tokens: int = 8, session: str | None = None, exclude: set[str] | None = None, first: int = 0) -> Ask:
    return Ask("m", list(range(first, first + tokens)), session, frozenset(exclude or ()))


def pick(scheduler: Scheduler, views: list[EngineView], request: Ask | None = None) -> str | None:
    chosen = scheduler.pick(request or ask(), views)
    return None if chosen is None else chosen.engine_id


# ---- filters ------------------------------------------------------------------------------


@pytest.mark.parametrize("state", [EngineState.DRAINING, EngineState.DEAD])
def test_non_active_engines_are_never_picked(state: EngineState) -> None:
    views = [view("idle-but-leaving", state=state), view("busy", running=50, kv_used=900)]
    scheduler = Scheduler(rng=random.Random(0))
    assert {pick(scheduler, views) for _ in range(50)} == {"busy"}


def test_unreachable_and_failed_engines_are_left_out() -> None:
    unreachable = view("a")
    unreachable.connected = False
    views = [unreachable, view("b"), view("c", running=9, kv_used=500)]
    assert pick(Scheduler(), views, ask(exclude={"b"})) == "c"
    assert pick(Scheduler(), views, ask(exclude={"b", "c"})) is None
    assert pick(Scheduler(), []) is None


def test_engines_without_room_for_the_prompt_are_left_out_unless_none_has_room() -> None:
    prompt = ask(tokens=40 * DEFAULT_BLOCK_SIZE)  # 40 blocks of an engine that does not say its size
    # a has the most room per slot, but not 40 free blocks once this router's pending ones count.
    full = view("a", running=0, kv_used=970, total=1000)
    roomy = view("b", running=30, kv_used=500, total=1000)
    assert pick(Scheduler(), [full, roomy], prompt) == "b"
    tight = view("c", running=30, kv_used=990, total=1000, pending=5)
    assert pick(Scheduler(), [full, tight], prompt) == "a"  # nobody has room: best freeness, vLLM queues


def test_a_prompts_demand_is_counted_in_each_engines_own_blocks() -> None:
    prompt = ask(tokens=1000)  # 63 blocks of 16 tokens, 32 of 32, 8 of 128
    cpu = view("cpu", running=0, kv_used=980, total=1000, block_size=128)  # 20 free: 2,560 tokens
    gpu = view("gpu", running=0, kv_used=980, total=1000, block_size=32)  # 20 free: 640 tokens
    assert (prompt.blocks_on(cpu), prompt.blocks_on(gpu), prompt.blocks_on(view("old"))) == (8, 32, 63)
    # Only the 128-token engine has room for it, and it is placed there on every pick.
    assert {pick(Scheduler(rng=random.Random(i)), [gpu, cpu], prompt) for i in range(20)} == {"cpu"}
    # The hold line weighs the same blocks: 12 left for 2 slots on the 128-token engine; the
    # 32-token one would be oversubscribed.
    policy = HoldPolicy(below=2.0)
    assert policy.room(cpu, prompt) and not policy.room(gpu, prompt)
    # What the router sent counts in the engine's blocks too.
    cpu.sent(prompt.blocks_on(cpu))
    assert cpu.room == 20 - 8
    # Engines are compared in tokens: 10 free blocks of 128 tokens beat 30 of 32.
    fewer = view("cpu", running=0, kv_used=990, total=1000, block_size=128)
    more = view("gpu", running=0, kv_used=970, total=1000, block_size=32)
    assert pick(Scheduler(), [more, fewer], ask(tokens=100)) == "cpu"
    assert Scheduler().roomiest(ask(tokens=100), [more, fewer]) is fewer


# ---- least load: freeness -----------------------------------------------------------------


def test_freeness_is_free_blocks_per_batch_slot() -> None:
    assert freeness(view("a", running=3, kv_used=400)) == pytest.approx((1000 - 400) / 4)
    # Waiting requests are a demand: each as big as the running ones on average.
    assert freeness(view("a", running=2, waiting=2, kv_used=400)) == pytest.approx((1000 - 400 - 400) / 5)
    # What this router sent since the report counts, slots and blocks.
    assert freeness(view("a", running=3, kv_used=400, sent=2, pending=100)) == pytest.approx(500 / 6)
    # This router's own in-flight requests are a floor for the slots.
    assert freeness(view("a", running=0, kv_used=0, inflight=4)) == pytest.approx(1000 / 5)
    assert freeness(view("a", running=None, inflight=1)) == pytest.approx(1000 / 2)


def test_least_load_prefers_fewer_requests_then_fewer_blocks() -> None:
    scheduler = Scheduler()
    assert (
        pick(
            scheduler,
            [view("a", running=3, waiting=1), view("b", running=1, waiting=2), view("c", running=2)],
        )
        == "c"
    )
    assert pick(scheduler, [view("a", running=2, kv_used=300), view("b", running=2, kv_used=200)]) == "b"
    # A stale report (idle) under requests this router still runs there.
    assert pick(scheduler, [view("a", running=3), view("b", running=0, inflight=5)]) == "a"
    assert pick(scheduler, [view("a", running=1), view("b", running=None)]) == "b"


@pytest.mark.parametrize("profile", ["round_robin", "prefix_affinity", "session_affinity", "least_load"])
def test_the_roomiest_engine_is_the_freest_whatever_the_profile(profile: str) -> None:
    scheduler = Scheduler(profile)
    views = [view("a", running=2, kv_used=900), view("b", running=2, kv_used=100), view("c", running=9)]
    assert scheduler.roomiest(ask(64, session="s"), views) is views[1]
    # The filters still apply: an engine that failed the request is not the fallback.
    assert scheduler.roomiest(ask(64, exclude={"b"}), views) is views[2]
    assert scheduler.roomiest(ask(64), []) is None


def test_free_memory_can_outweigh_a_request_more() -> None:
    """Llumnix's point: an engine nearly out of KV blocks is not the place for a new request even
    when it runs fewer of them (it would preempt soon)."""
    crowded = view("a", running=1, kv_used=900)  # 100 free for 2 slots
    roomy = view("b", running=2, kv_used=100)  # 900 free for 3 slots
    assert pick(Scheduler(), [crowded, roomy]) == "b"


def test_headroom_for_priority_requests_counts_as_used() -> None:
    """Llumnix's virtual usage: an engine holding priority requests reports KV headroom for them,
    which dispatch counts as used (room for a prompt stays physical), so new requests go
    elsewhere and the priority requests decode in a smaller batch."""
    other = view("b", running=2, kv_used=200)
    assert pick(Scheduler(), [view("a", running=1, kv_used=100), other]) == "a"  # no headroom
    holding = view("a", running=1, kv_used=100, reserved=500)
    assert freeness(holding) == pytest.approx((1000 - 100 - 500) / 2)
    assert holding.room == 900
    assert pick(Scheduler(), [holding, other]) == "b"


def test_equal_engines_share_the_picks() -> None:
    views = [view("a", running=1, kv_used=10), view("b", running=1, kv_used=10), view("c", running=5)]
    scheduler = Scheduler(rng=random.Random(0))
    counts = Counter(pick(scheduler, views) for _ in range(200))
    assert set(counts) == {"a", "b"} and min(counts.values()) >= 60


# ---- affinity -----------------------------------------------------------------------------


def test_bounded_ring_is_consistent_and_bounded() -> None:
    ring = BoundedRing()
    engines = {f"e{i}": 0 for i in range(8)}
    keys = [random.Random(k).getrandbits(64) for k in range(400)]
    owners = [ring.owner(k, engines) for k in keys]
    assert len(set(owners)) == 8  # every engine owns some keys
    # Another router (its own ring) maps every key the same way.
    assert [BoundedRing().owner(k, engines) for k in keys] == owners
    # An engine leaving moves only its own keys.
    fewer = {e: 0 for e in engines if e != "e3"}
    moved = [k for k, o in zip(keys, owners, strict=True) if o != "e3" and ring.owner(k, fewer) != o]
    assert moved == []
    # Bounded load: an engine at the cap passes its keys on to the next one on the ring.
    busy = dict(engines, e0=100)
    cap = -(-(1.25 * 101) // 8)
    assert all(ring.owner(k, busy) != "e0" for k in keys) and busy["e0"] >= cap


def test_prefix_affinity_sends_a_shared_prefix_to_one_engine() -> None:
    views = [view(f"e{i}") for i in range(4)]
    scheduler = Scheduler("prefix_affinity", prefix_blocks=2)
    system = list(range(1000, 1000 + 2 * PREFIX_BLOCK_TOKENS))
    chosen = {pick(scheduler, views, Ask("m", [*system, 7, 8, 9 + i])) for i in range(20)}
    assert len(chosen) == 1  # the questions differ, the system prompt does not
    # Different prefixes spread over the engines.
    spread = {pick(scheduler, views, ask(tokens=2 * PREFIX_BLOCK_TOKENS, first=100 * i)) for i in range(40)}
    assert len(spread) == 4


def test_prefix_affinity_gives_way_when_its_engine_is_overloaded() -> None:
    system = list(range(2 * PREFIX_BLOCK_TOKENS))
    scheduler = Scheduler("prefix_affinity", prefix_blocks=2)
    views = [view(f"e{i}") for i in range(4)]
    home = pick(scheduler, views, Ask("m", system))
    loaded = [view(v.engine_id, running=40 if v.engine_id == home else 1) for v in views]
    assert pick(scheduler, loaded, Ask("m", system)) != home


def test_a_prompt_under_one_block_has_no_prefix_key() -> None:
    assert prefix_key(4)(ask(tokens=PREFIX_BLOCK_TOKENS - 1)) is None
    assert prefix_key(4)(ask(tokens=PREFIX_BLOCK_TOKENS)) is not None
    # Only the first blocks count.
    long_a, long_b = ask(tokens=10 * PREFIX_BLOCK_TOKENS), Ask("m", [*range(4 * PREFIX_BLOCK_TOKENS), 99, 98])
    assert prefix_key(4)(long_a) == prefix_key(4)(long_b)


def test_session_affinity_keeps_a_session_on_its_engine() -> None:
    views = [view(f"e{i}", running=i) for i in range(4)]
    scheduler = Scheduler("session_affinity")
    homes = {s: pick(scheduler, views, ask(session=f"user-{s}", first=s)) for s in range(40)}
    assert all(pick(scheduler, views, ask(session=f"user-{s}", first=99 + s)) == homes[s] for s in range(40))
    assert len(set(homes.values())) >= 3
    # Without a session header: least load.
    assert pick(scheduler, views, ask()) == "e0"


# ---- round-robin and profiles -------------------------------------------------------------


def test_round_robin_takes_engines_in_turn_whatever_their_load() -> None:
    views = [view("c"), view("a", running=50, kv_used=900), view("b")]
    scheduler = Scheduler("round_robin")
    assert [pick(scheduler, views) for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]
    assert pick(scheduler, views, ask(exclude={"b"})) in {"a", "c"}


def test_weights_spelled_out() -> None:
    assert parse_weights("prefix_affinity=2,least_load") == {"prefix_affinity": 2.0, "least_load": 1.0}
    assert Scheduler("session_affinity=3, least_load=0.5").name == "session_affinity=3, least_load=0.5"
    for bad, message in [
        ("fastest", "unknown scorer 'fastest'"),
        ("least_load=x", "is not a number"),
        ("least_load=-1", "positive"),
        ("", "no scorer"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_weights(bad)
    with pytest.raises(ValueError, match="unknown scorer"):
        RouterConfig(scheduler="fastest")
    assert RouterConfig(scheduler="prefix_affinity").scheduler == "prefix_affinity"
