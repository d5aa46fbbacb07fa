"""The router's view of an engine: its load from the last report and what was sent since
(dispatch over these views: ``test_scheduling.py``)."""

from __future__ import annotations

from shoal_protos.records import EngineRecord, EngineState, LoadReport
from shoal_router.core.dispatch import EngineView


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


def test_inflight_is_a_floor_not_an_addition() -> None:
    # The report already includes this router's requests: 4 reported, 2 of them ours -> 4, not 6.
    assert view("a", running=4, inflight=2).requests() == 4
    # A stale report saying idle while this router alone still runs 5 there: 5.
    assert view("b", running=0, inflight=5).requests() == 5


def test_engine_without_a_report_counts_as_idle() -> None:
    assert view("b", running=None).requests() == 0


def test_dispatchable_follows_record_state() -> None:
    assert view("a").dispatchable
    assert not view("a", state=EngineState.DRAINING).dispatchable


def _report(seq: int, running: int) -> LoadReport:
    return LoadReport(engine_id="a", seq=seq, time=float(seq), num_running=running)


def test_first_report_resets_sent_since_report() -> None:
    engine = view("a", running=None, sent=4)
    engine.pending_blocks = 12
    engine.update_report(_report(1, running=4))
    assert (engine.sent_since_report, engine.pending_blocks) == (0, 0)
    assert engine.requests() == 4


def test_new_report_resets_sent_since_report() -> None:
    engine = view("a", running=2, seq=7, sent=3)
    fresh = _report(8, running=5)

    engine.update_report(fresh)

    assert engine.report is fresh
    assert engine.sent_since_report == 0
    assert engine.requests() == 5


def test_same_report_read_again_keeps_sent_since_report() -> None:
    engine = view("a", running=2, seq=7, sent=3)
    original = engine.report

    engine.update_report(_report(7, running=2))

    assert engine.report is original
    assert engine.sent_since_report == 3
    assert engine.requests() == 5


ROUTER = "tcp://10.0.0.5:5700"


def _counted(seq: int, running: int, received: int) -> LoadReport:
    """A report whose engine took in ``received`` requests from ``ROUTER``."""
    return LoadReport(
        engine_id="a", seq=seq, time=float(seq), num_running=running, kv_blocks_used=0,
        kv_blocks_free=1000, received={ROUTER: received, "tcp://10.0.0.6:5700": 40},
    )  # fmt: skip


def _counting_view() -> EngineView:
    record = EngineRecord(
        engine_id="a", model="m", zmq_address="tcp://h:1", http_address="http://h:1",
        max_model_len=128, protocol_version=1, started_at=0.0, kv_blocks_total=1000,
    )  # fmt: skip
    return EngineView(record, _counted(1, running=0, received=0), reply_to=ROUTER)


def test_a_report_leaves_counted_the_sends_it_does_not_cover() -> None:
    engine = _counting_view()
    for blocks in (10, 20, 30):
        engine.sent(blocks, now=0.0)
    # Written when the engine had taken in the first send only, read after all three.
    engine.update_report(_counted(2, running=1, received=1), now=0.1)
    assert (engine.sent_since_report, engine.pending_blocks) == (2, 50)
    assert engine.room == 1000 - 50
    engine.update_report(_counted(3, running=3, received=3), now=0.2)
    assert (engine.sent_since_report, engine.pending_blocks) == (0, 0)


def test_a_send_no_report_covers_stops_counting_after_a_while() -> None:
    # The engine restarted at the same address and counts from zero again.
    engine = _counting_view()
    engine.sent(10, now=0.0)
    engine.sent(20, now=1.5)
    engine.update_report(_counted(2, running=0, received=0), now=2.2)
    assert (engine.sent_since_report, engine.pending_blocks) == (1, 20)


def test_an_engine_that_does_not_count_has_its_report_cover_every_send() -> None:
    engine = _counting_view()
    engine.sent(10, now=0.0)
    engine.update_report(LoadReport(engine_id="a", seq=2, time=2.0, num_running=1), now=0.1)
    assert (engine.sent_since_report, engine.pending_blocks) == (0, 0)


def _live_report(seq: int, running: int, mine: int, received: int) -> LoadReport:
    """A report of ``running`` requests, ``mine`` of them from ``ROUTER``."""
    others = running - mine
    return LoadReport(
        engine_id="a", seq=seq, time=float(seq), num_running=running, kv_blocks_used=0,
        kv_blocks_free=1000, received={ROUTER: received, "tcp://10.0.0.6:5700": 40},
        live={ROUTER: mine, "tcp://10.0.0.6:5700": others} if others else {ROUTER: mine},
    )  # fmt: skip


def test_requests_of_this_router_that_ended_since_the_report_do_not_count() -> None:
    # Six requests of this router ran there when the engine wrote its report; all six ended
    # since (the router saw them end), and a new request comes before the next report: the
    # engine is idle, not busy with six.
    engine = _counting_view()
    for _ in range(6):
        engine.sent(1, now=0.0)
    engine.update_report(_live_report(2, running=6, mine=6, received=6), now=0.1)
    assert engine.requests() == 6
    for _ in range(6):
        engine.inflight -= 1
    assert engine.requests() == 0
    assert engine.free == 1000.0


def test_other_routers_requests_count_from_the_report() -> None:
    engine = _counting_view()
    engine.sent(1, now=0.0)  # one of ours, not in the report yet
    engine.update_report(_live_report(2, running=3, mine=0, received=0), now=0.1)
    assert engine.requests() == 3 + 1
    # An engine that does not say whose are whose: the report plus the sends it does not cover.
    engine.update_report(_counted(3, running=3, received=0), now=0.2)
    assert engine.requests() == 3 + 1
