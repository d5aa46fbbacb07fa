"""The balancing policy: when it moves a request (a lasting lead in freeness, a crowded source),
where to, and the hysteresis that keeps moves from ping-ponging."""

from __future__ import annotations

import msgspec

from shoal_protos.records import EngineRecord, EngineState, LoadReport
from shoal_router.core.dispatch import EngineView
from shoal_router.core.rebalance import BalancePolicy, Balancer

TOTAL = 1000


def view(engine_id: str, running: int, used: int, model: str = "m", control: str = "h:5800") -> EngineView:
    record = EngineRecord(
        engine_id=engine_id, model=model, zmq_address="tcp://h:1", http_address="http://h:2",
        state=EngineState.ACTIVE, max_model_len=4096, protocol_version=1, started_at=0.0,
        kv_blocks_total=TOTAL, control_address=control,
    )  # fmt: skip
    report = LoadReport(
        engine_id=engine_id, seq=1, time=0.0, num_running=running, kv_blocks_used=used,
        kv_blocks_free=TOTAL - used,
    )  # fmt: skip
    return EngineView(record, report)


def moves(balancer: Balancer, views: list[EngineView], now: float = 0.0) -> list[tuple[str, str]]:
    return [(s.engine_id, t.engine_id) for s, t in balancer.decide(views, now)]


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
    ((source, target),) = balancer.decide(fleet, 0.0)
    balancer.started(source, target)
    assert moves(balancer, fleet, 1.0) == []  # both engines busy with the move
    balancer.ended(source, target, now=2.0)
    assert moves(balancer, fleet, 6.9) == []  # resting until 7.0
    assert moves(balancer, fleet, 7.0) == [("a", "b")]
    other_model = [view("x", running=6, used=600, model="n"), view("y", running=0, used=0, model="n")]
    balancer.started(*balancer.decide(fleet, 8.0)[0])
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
