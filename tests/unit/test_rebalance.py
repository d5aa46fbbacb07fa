"""The balancing policy: when it moves a request (a lasting lead in freeness, a crowded source),
where to, and the hysteresis that keeps moves from ping-ponging; and consolidation: which engine
it empties, where the requests go, and when the engine goes back to dispatch."""

from __future__ import annotations

import msgspec
import pytest

from shoal_protos.records import EngineRecord, EngineState, LoadReport
from shoal_router.core.dispatch import EngineView
from shoal_router.core.rebalance import BalancePolicy, Balancer

TOTAL = 1000


def view(
    engine_id: str, running: int, used: int, model: str = "m", control: str = "h:5800", slots: int = 0
) -> EngineView:
    record = EngineRecord(
        engine_id=engine_id, model=model, zmq_address="tcp://h:1", http_address="http://h:2",
        state=EngineState.ACTIVE, max_model_len=4096, protocol_version=1, started_at=0.0,
        kv_blocks_total=TOTAL, control_address=control, max_num_seqs=slots,
    )  # fmt: skip
    report = LoadReport(
        engine_id=engine_id, seq=1, time=0.0, num_running=running, kv_blocks_used=used,
        kv_blocks_free=TOTAL - used,
    )  # fmt: skip
    return EngineView(record, report)


def moves(balancer: Balancer, views: list[EngineView], now: float = 0.0) -> list[tuple[str, str]]:
    return [(m.source.engine_id, m.target.engine_id) for m in balancer.decide(views, now)]


def test_a_lasting_lead_moves_a_request_from_the_most_crowded_to_the_most_free() -> None:
    balancer = Balancer(BalancePolicy(threshold=0.1, patience=2))
    fleet = [view("a", running=5, used=500), view("b", running=1, used=50), view("c", running=3, used=300)]
    assert moves(balancer, fleet) == []  # one check: not yet
    assert moves(balancer, fleet) == [("a", "b")]


def test_no_move_within_the_threshold_or_off_a_lone_request() -> None:
    balancer = Balancer(BalancePolicy(threshold=0.1, patience=1))
    # 3 vs 2 requests of similar size: a lead of about 0.09 of the cache per slot.
    assert moves(balancer, [view("a", running=3, used=300), view("b", running=2, used=200)]) == []
    # A single request, however big: moving it only moves the load.
    assert moves(balancer, [view("a", running=1, used=900), view("b", running=0, used=0)]) == []


def test_a_lead_that_does_not_last_starts_over() -> None:
    balancer = Balancer(BalancePolicy(threshold=0.1, patience=2))
    crowded = [view("a", running=5, used=500), view("b", running=1, used=50)]
    even = [view("a", running=3, used=300), view("b", running=3, used=300)]
    assert moves(balancer, crowded) == []
    assert moves(balancer, even) == []
    assert moves(balancer, crowded) == []  # the streak began again
    assert moves(balancer, crowded) == [("a", "b")]


def test_engines_rest_during_and_after_a_move_and_moves_are_bounded() -> None:
    policy = BalancePolicy(threshold=0.1, patience=1, cooldown_s=5.0, max_concurrent=1)
    balancer = Balancer(policy)
    fleet = [view("a", running=6, used=600), view("b", running=0, used=0)]
    (move,) = balancer.decide(fleet, 0.0)
    assert move.reason == "balance"
    balancer.started(move)
    assert moves(balancer, fleet, 1.0) == []  # both engines busy with the move
    balancer.ended(move, now=2.0)
    assert moves(balancer, fleet, 6.9) == []  # resting until 7.0
    assert moves(balancer, fleet, 7.0) == [("a", "b")]
    other_model = [view("x", running=6, used=600, model="n"), view("y", running=0, used=0, model="n")]
    balancer.started(balancer.decide(fleet, 8.0)[0])
    assert moves(balancer, other_model, 8.0) == []  # max_concurrent reached


def test_only_engines_that_can_migrate_and_of_the_same_model_are_paired() -> None:
    balancer = Balancer(BalancePolicy(threshold=0.1, patience=1))
    no_control = view("b", running=0, used=0, control="")
    assert moves(balancer, [view("a", running=5, used=500), no_control]) == []
    two_models = [view("a", running=5, used=500), view("b", running=0, used=0, model="n")]
    assert moves(balancer, two_models) == []
    draining = view("b", running=0, used=0)
    draining.record = msgspec.structs.replace(draining.record, state=EngineState.DRAINING)
    assert moves(balancer, [view("a", running=5, used=500), draining]) == []


def test_several_crowded_engines_are_paired_with_the_freest_in_order() -> None:
    balancer = Balancer(BalancePolicy(threshold=0.1, patience=1, max_concurrent=4))
    fleet = [
        view("a", running=6, used=700),  # least free
        view("b", running=5, used=500),
        view("c", running=1, used=100),
        view("d", running=0, used=0),  # most free
        view("e", running=1, used=900),  # a lone request: never a source
    ]
    assert moves(balancer, fleet) == [("a", "d"), ("b", "c")]
    bounded = Balancer(BalancePolicy(threshold=0.1, patience=1, max_concurrent=1))
    assert moves(bounded, fleet) == [("a", "d")]


def test_a_move_goes_to_the_nearly_freest_engine_whose_cache_shares_most_with_its_source() -> None:
    fleet = [
        view("a", running=6, used=700),  # the source
        view("b", running=1, used=400),  # much less free than the freest: never its target
        view("c", running=1, used=150),  # nearly as free as d
        view("d", running=1, used=0),  # the freest
    ]
    shares = {("a", "b"): 900, ("a", "c"): 300, ("a", "d"): 10}
    policy = BalancePolicy(threshold=0.1, patience=1, max_concurrent=1)

    def shared(one: str, other: str) -> int:
        return shares.get((one, other), 0)

    assert moves(Balancer(policy, shared=shared), fleet) == [("a", "c")]
    # Without an index, or when nothing is shared, the freest.
    assert moves(Balancer(policy), fleet) == [("a", "d")]
    assert moves(Balancer(policy, shared=lambda one, other: 0), fleet) == [("a", "d")]
    # The next crowded engine gets the freest left.
    fleet.insert(1, view("e", running=5, used=650))
    both = BalancePolicy(threshold=0.1, patience=1, max_concurrent=2)
    assert moves(Balancer(both, shared=shared), fleet) == [("a", "c"), ("e", "d")]


def consolidating(below: float = 0.5, release: float = 0.7, **policy: float) -> Balancer:
    return Balancer(
        BalancePolicy(threshold=0.1, patience=1, max_concurrent=4, consolidate_below=below,
                      consolidate_release=release, **policy)  # type: ignore[arg-type]
    )  # fmt: skip


def test_a_light_fleet_empties_its_lightest_engine_onto_the_fullest_that_fit() -> None:
    balancer = consolidating(below=0.5)
    # 1,000 KV blocks each; 600 in use in all: over three engines 0.2, over two 0.3.
    fleet = [view("a", running=2, used=300), view("b", running=1, used=100), view("c", running=2, used=200)]
    decided = balancer.decide(fleet, 0.0)
    assert balancer.emptying == ["b"]
    # b's request goes to the least free engine that still has room: a, not c.
    assert [(m.source.engine_id, m.target.engine_id, m.reason) for m in decided] == [
        ("b", "a", "consolidate")
    ]


def test_one_more_engine_per_check_while_the_rest_can_carry_the_load() -> None:
    balancer = consolidating(below=0.5)
    fleet = [view(name, running=1, used=100) for name in "abcd"]  # 400 blocks in use of 4,000
    balancer.decide(fleet, 0.0)
    assert balancer.emptying == ["a"]
    balancer.decide(fleet, 10.0)
    assert balancer.emptying == ["a", "b"]
    balancer.decide(fleet, 20.0)
    assert balancer.emptying == ["a", "b", "c"]  # 400 over d's 1,000: 0.4
    balancer.decide(fleet, 30.0)
    assert balancer.emptying == ["a", "b", "c"]  # the last engine always stays


def test_no_consolidation_when_the_rest_would_be_too_full_or_short_of_batch_slots() -> None:
    balancer = consolidating(below=0.5)
    # 1,200 blocks in use: over two engines 0.6.
    assert not balancer.decide([view(n, running=2, used=400) for n in "abc"], 0.0)
    assert balancer.emptying == []
    # Little KV in use, but 20 requests over the 16 batch slots two engines would have.
    busy = [view(n, running=7, used=70, slots=8) for n in "abc"]
    balancer.decide(busy, 0.0)
    assert balancer.emptying == []


def test_the_emptying_engine_goes_back_to_dispatch_when_the_load_climbs() -> None:
    balancer = consolidating(below=0.5, release=0.7)
    light = [view("a", running=1, used=100), view("b", running=1, used=50), view("c", running=1, used=100)]
    balancer.decide(light, 0.0)
    assert balancer.emptying == ["b"]
    # 1,500 blocks in use over the 2,000 of a and c: 0.75, past the release point.
    heavy = [view("a", running=6, used=700), view("b", running=1, used=50), view("c", running=6, used=750)]
    balancer.decide(heavy, 10.0)
    assert balancer.emptying == []


def test_an_emptying_source_moves_again_at_once_and_is_never_a_target() -> None:
    balancer = consolidating(below=0.5, cooldown_s=5.0)
    fleet = [view("a", running=3, used=300), view("b", running=1, used=20), view("c", running=2, used=200)]
    (move,) = balancer.decide(fleet, 0.0)
    assert (move.source.engine_id, move.target.engine_id, move.reason) == ("b", "a", "consolidate")
    balancer.started(move)
    assert moves(balancer, fleet, 0.5) == []  # both busy with the move
    balancer.ended(move, now=1.0)
    # b (its report still shows a request) moves again at once; a rests, so c takes it.
    assert moves(balancer, fleet, 1.0) == [("b", "c")]


def test_dispatch_skips_an_emptying_engine_unless_only_such_engines_are_left() -> None:
    from shoal_router.core.scheduling import Ask, Scheduler

    scheduler = Scheduler("least_load")
    emptied, other = view("a", running=0, used=0), view("b", running=5, used=500)
    emptied.emptying = True
    assert emptied.state == "EMPTYING" and not emptied.dispatchable and emptied.usable
    picked = scheduler.pick(Ask("m", [1, 2, 3]), [emptied, other])
    assert picked is other
    assert scheduler.pick(Ask("m", [1, 2, 3]), [emptied]) is emptied


def test_consolidation_needs_a_release_point_above_its_start() -> None:
    with pytest.raises(ValueError, match="consolidate_release"):
        BalancePolicy(consolidate_below=0.6, consolidate_release=0.5)
