"""Least-loaded dispatch over the router's view of the engines."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from shoal_protos.records import EngineRecord, EngineState, LoadReport
from shoal_router.core.dispatch import EngineView, pick_least_loaded


def view(
    engine_id: str,
    running: int | None = 0,
    waiting: int = 0,
    kv_used: int = 0,
    *,
    sent: int = 0,
    inflight: int = 0,
    state: EngineState = EngineState.ACTIVE,
    seq: int = 1,
) -> EngineView:
    """An engine view; ``running=None`` means no load report was read yet."""
    record = EngineRecord(
        engine_id=engine_id,
        model="m",
        zmq_address=f"tcp://h:{len(engine_id)}",
        http_address="http://h:1",
        state=state,
        max_model_len=128,
        protocol_version=1,
        started_at=0.0,
    )
    report = None
    if running is not None:
        report = LoadReport(
            engine_id=engine_id,
            seq=seq,
            time=0.0,
            num_running=running,
            num_waiting=waiting,
            kv_blocks_used=kv_used,
        )
    return EngineView(record, report, sent_since_report=sent, inflight=inflight)


def pick(candidates: list[EngineView], seed: int = 0) -> str | None:
    chosen = pick_least_loaded(candidates, random.Random(seed))
    return None if chosen is None else chosen.engine_id


def test_lowest_reported_running_plus_waiting_wins() -> None:
    candidates = [
        view("a", running=3, waiting=1),
        view("b", running=1, waiting=2),
        view("c", running=2, waiting=0),
    ]
    assert pick(candidates) == "c"


def test_waiting_counts_like_running() -> None:
    assert pick([view("a", running=0, waiting=4), view("b", running=3)]) == "b"


def test_requests_sent_since_the_report_count_as_load() -> None:
    candidates = [view("a", running=2), view("b", running=0, sent=3)]
    assert pick(candidates) == "a"


def test_inflight_is_a_floor_for_a_stale_report() -> None:
    # b's report says idle, but this router alone still runs 5 requests there.
    candidates = [view("a", running=3), view("b", running=0, inflight=5)]
    assert pick(candidates) == "a"


def test_inflight_is_a_floor_not_an_addition() -> None:
    # The report already includes this router's requests: 4 reported, 2 of them ours -> 4, not 6.
    candidates = [view("a", running=4, inflight=2), view("b", running=5)]
    assert pick(candidates) == "a"
    assert candidates[0].load_score() == (4, 0)


def test_engine_without_a_report_counts_as_idle() -> None:
    candidates = [view("a", running=1), view("b", running=None)]
    assert pick(candidates) == "b"
    assert candidates[1].load_score() == (0, 0)


def test_kv_blocks_in_use_break_ties() -> None:
    candidates = [
        view("a", running=2, kv_used=300),
        view("b", running=1, waiting=1, kv_used=100),
        view("c", running=2, kv_used=200),
    ]
    for seed in range(20):
        assert pick(candidates, seed) == "b"


def test_kv_blocks_do_not_outweigh_request_count() -> None:
    candidates = [view("a", running=1, kv_used=1000), view("b", running=2, kv_used=0)]
    assert pick(candidates) == "a"


def test_equal_engines_share_the_picks() -> None:
    candidates = [view("a", running=1, kv_used=10), view("b", running=1, kv_used=10)]
    rng = random.Random(0)

    counts = Counter(pick_least_loaded(candidates, rng).engine_id for _ in range(200))  # type: ignore[union-attr]

    assert set(counts) == {"a", "b"}
    assert min(counts.values()) >= 60


def test_only_tied_engines_are_drawn() -> None:
    candidates = [view("a", running=1), view("b", running=1), view("c", running=2)]
    rng = random.Random(0)
    picks = {pick_least_loaded(candidates, rng).engine_id for _ in range(100)}  # type: ignore[union-attr]
    assert picks == {"a", "b"}


@pytest.mark.parametrize("state", [EngineState.DRAINING, EngineState.DEAD])
def test_non_active_engines_are_never_picked(state: EngineState) -> None:
    candidates = [view("idle-but-leaving", running=0, state=state), view("busy", running=50, kv_used=900)]
    rng = random.Random(0)
    for _ in range(100):
        chosen = pick_least_loaded(candidates, rng)
        assert chosen is not None
        assert chosen.engine_id == "busy"


def test_no_candidates_gives_none() -> None:
    assert pick_least_loaded([]) is None


def test_only_draining_candidates_gives_none() -> None:
    candidates = [view("a", state=EngineState.DRAINING), view("b", state=EngineState.DEAD)]
    assert pick_least_loaded(candidates, random.Random(0)) is None


def test_dispatchable_follows_record_state() -> None:
    assert view("a").dispatchable
    assert not view("a", state=EngineState.DRAINING).dispatchable


def _report(seq: int, running: int) -> LoadReport:
    return LoadReport(engine_id="a", seq=seq, time=float(seq), num_running=running)


def test_first_report_resets_sent_since_report() -> None:
    engine = view("a", running=None, sent=4)
    engine.update_report(_report(1, running=4))
    assert engine.sent_since_report == 0
    assert engine.load_score() == (4, 0)


def test_new_report_resets_sent_since_report() -> None:
    engine = view("a", running=2, seq=7, sent=3)
    fresh = _report(8, running=5)

    engine.update_report(fresh)

    assert engine.report is fresh
    assert engine.sent_since_report == 0
    assert engine.load_score() == (5, 0)


def test_same_report_read_again_keeps_sent_since_report() -> None:
    engine = view("a", running=2, seq=7, sent=3)
    original = engine.report

    engine.update_report(_report(7, running=2))

    assert engine.report is original
    assert engine.sent_since_report == 3
    assert engine.load_score() == (5, 0)
