"""Holding new requests at the router while every engine is short of KV (``core.hold``): the
line on its own over engine views fed load reports, then the router's ``Generation`` using it
with engines played over real ZeroMQ sockets (``played_engines``)."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from shoal_protos.messages import SamplingOptions
from shoal_protos.records import EngineRecord, LoadReport
from shoal_router.api.serving import Generation
from shoal_router.core.dispatch import EngineView
from shoal_router.core.hold import HoldLine, HoldPolicy, freeness_after
from shoal_router.core.scheduling import Ask, Scheduler
from shoal_router.errors import NoEngineError
from tests.integration.support import until
from tests.unit.played_engines import MODEL, played_fleet

BLOCKS = 1024
_seq = itertools.count(1)


def report(view: EngineView, running: int, used: int) -> None:
    """A new load report: ``running`` requests holding ``used`` of the engine's blocks."""
    view.update_report(
        LoadReport(
            engine_id=view.engine_id,
            seq=next(_seq),
            time=0.0,
            num_running=running,
            kv_blocks_used=used,
            kv_blocks_free=view.record.kv_blocks_total - used,
        )
    )


def engine(engine_id: str, running: int, used: int) -> EngineView:
    record = EngineRecord(
        engine_id=engine_id, model=MODEL, zmq_address=f"tcp://h:{engine_id}", http_address="",
        max_model_len=4096, protocol_version=1, started_at=0.0, kv_blocks_total=BLOCKS,
    )  # fmt: skip
    view = EngineView(record)
    report(view, running, used)
    return view


def ask(prompt_tokens: int) -> Ask:
    return Ask(MODEL, range(prompt_tokens))


class Sent:
    """What the line sent (request name -> engine) and failed (request name -> exception)."""

    def __init__(self) -> None:
        self.to: dict[str, str] = {}
        self.failed: dict[str, Exception] = {}
        self.order: list[str] = []

    def send(self, name: str, request: Ask):  # type: ignore[no-untyped-def]
        def send(view: EngineView) -> None:
            view.sent(request.blocks_on(view))
            self.to[name] = view.engine_id
            self.order.append(name)

        return send

    def fail(self, name: str):  # type: ignore[no-untyped-def]
        def fail(exc: Exception) -> None:
            self.failed[name] = exc

        return fail


def line_over(views: list[EngineView], policy: HoldPolicy, profile: str = "least_load") -> HoldLine:
    """A line over ``views`` that picks engines as the router's ``Generation`` does."""
    scheduler = Scheduler(profile)

    def pick(request: Ask) -> EngineView:
        view = scheduler.pick(request, views)
        if view is None:
            raise NoEngineError(MODEL)
        return view

    return HoldLine(policy, pick, lambda request: scheduler.roomiest(request, views))


def offer(line: HoldLine, sent: Sent, name: str, prompt_tokens: int, now: float):  # type: ignore[no-untyped-def]
    request = ask(prompt_tokens)
    return line.offer(request, now, sent.send(name, request), sent.fail(name))


def test_freeness_after_is_the_views_freeness_once_the_prompt_is_sent() -> None:
    view = engine("e0", running=40, used=700)
    predicted = freeness_after(view, 12)
    view.sent(12)
    assert view.free == pytest.approx(predicted)


def test_a_request_goes_at_once_while_an_engine_has_room() -> None:
    views = [engine("e0", running=10, used=900), engine("e1", running=10, used=100)]
    sent, line = Sent(), line_over(views, HoldPolicy(below=2.0, max_s=1.0))
    assert offer(line, sent, "a", 320, now=0.0) is None
    assert sent.to == {"a": "e1"} and len(line) == 0


def test_a_full_fleet_holds_requests_in_order_until_a_report_shows_room() -> None:
    # 1,000 of 1,024 blocks used by 20 requests on each engine: about one block per slot.
    views = [engine("e0", running=20, used=1000), engine("e1", running=20, used=1000)]
    sent, line = Sent(), line_over(views, HoldPolicy(below=2.0, max_s=1.0))
    assert offer(line, sent, "big", 160, now=0.0) is not None  # 10 blocks
    assert offer(line, sent, "small", 16, now=0.1) is not None  # would fit nowhere either
    assert line.release(now=0.2) == 0 and not sent.to
    # e1 finishes requests: its next report shows room for the first in line, then the second.
    report(views[1], running=12, used=600)
    assert line.release(now=0.3) == 2
    assert sent.order == ["big", "small"] and sent.to == {"big": "e1", "small": "e1"}
    assert line.expired == 0


def test_a_later_request_does_not_overtake_one_that_waits() -> None:
    views = [engine("e0", running=20, used=990)]
    sent, line = Sent(), line_over(views, HoldPolicy(below=2.0, max_s=1.0))
    offer(line, sent, "big", 1600, now=0.0)  # 100 blocks: no room for a while
    # Room for a one-block request (64 blocks free, 11 slots), but one is waiting ahead of it.
    report(views[0], running=10, used=960)
    assert offer(line, sent, "small", 16, now=0.1) is not None
    assert line.release(now=0.15) == 0
    report(views[0], running=5, used=200)
    assert line.release(now=0.2) == 2 and sent.order == ["big", "small"]


def test_a_request_goes_out_once_it_waited_its_longest() -> None:
    views = [engine("e0", running=20, used=1000)]
    sent, line = Sent(), line_over(views, HoldPolicy(below=2.0, max_s=1.0))
    offer(line, sent, "a", 32, now=0.0)
    offer(line, sent, "b", 32, now=0.5)
    assert line.release(now=0.99) == 0
    assert line.release(now=1.0) == 1 and sent.order == ["a"]
    assert line.release(now=1.5) == 1 and sent.order == ["a", "b"]
    assert line.expired == 2 and len(line) == 0


def test_a_request_taken_out_is_never_sent() -> None:
    views = [engine("e0", running=20, used=1000)]
    sent, line = Sent(), line_over(views, HoldPolicy(below=2.0, max_s=1.0))
    gone = offer(line, sent, "gone", 32, now=0.0)
    offer(line, sent, "stays", 32, now=0.0)
    line.leave(gone)
    line.leave(gone)  # twice: no harm
    assert len(line) == 1
    line.release(now=2.0)
    assert sent.order == ["stays"]
    line.leave(gone)  # after the line moved on: no harm either


def test_when_no_engine_is_left_the_held_requests_fail_and_the_line_goes_on() -> None:
    views = [engine("e0", running=20, used=1000)]
    sent, line = Sent(), line_over(views, HoldPolicy(below=2.0, max_s=1.0))
    offer(line, sent, "a", 32, now=0.0)
    offer(line, sent, "b", 32, now=0.0)
    views.clear()  # the engine left the fleet
    assert line.release(now=0.1) == 0
    assert set(sent.failed) == {"a", "b"} and all(isinstance(e, NoEngineError) for e in sent.failed.values())
    assert len(line) == 0


def test_an_engine_whose_kv_size_is_unknown_is_not_waited_for() -> None:
    record = EngineRecord(
        engine_id="e0", model=MODEL, zmq_address="tcp://h:1", http_address="",
        max_model_len=4096, protocol_version=1, started_at=0.0,
    )  # fmt: skip
    unreported = EngineView(record)
    sent, line = Sent(), line_over([unreported], HoldPolicy(below=2.0, max_s=1.0))
    assert offer(line, sent, "a", 320, now=0.0) is None and sent.to == {"a": "e0"}
    # A report without KV numbers (a backend that keeps none) leaves it unknown too.
    report(unreported, running=3, used=0)
    assert offer(line, sent, "b", 320, now=0.0) is None and sent.to == {"a": "e0", "b": "e0"}


def test_a_zero_wait_never_holds() -> None:
    views = [engine("e0", running=20, used=1020)]
    sent, line = Sent(), line_over(views, HoldPolicy(below=2.0, max_s=0.0))
    assert offer(line, sent, "a", 32, now=0.0) is None and sent.to == {"a": "e0"}


def favourite(views: list[EngineView], prompt_tokens: int) -> str:
    """The engine prefix affinity sends ``ask(prompt_tokens)`` to while every engine has room."""
    view = Scheduler("prefix_affinity").pick(ask(prompt_tokens), views)
    assert view is not None
    return view.engine_id


def test_a_request_whose_affinity_engine_is_short_goes_to_an_engine_with_room() -> None:
    views = [engine("e0", running=10, used=100), engine("e1", running=10, used=100)]
    home = favourite(views, 320)
    other = next(v for v in views if v.engine_id != home)
    report(next(v for v in views if v.engine_id == home), running=10, used=1000)  # as busy, no room
    sent, line = Sent(), line_over(views, HoldPolicy(below=2.0, max_s=1.0), "prefix_affinity")
    assert offer(line, sent, "a", 320, now=0.0) is None
    assert sent.to == {"a": other.engine_id} and line.spilled == 1 and len(line) == 0


def test_a_request_held_for_its_affinity_engine_goes_wherever_room_shows_first() -> None:
    views = [engine("e0", running=20, used=1000), engine("e1", running=20, used=1000)]
    home = favourite([engine("e0", 0, 0), engine("e1", 0, 0)], 320)
    other = next(v for v in views if v.engine_id != home)
    sent, line = Sent(), line_over(views, HoldPolicy(below=2.0, max_s=1.0), "prefix_affinity")
    assert offer(line, sent, "a", 320, now=0.0) is not None
    assert offer(line, sent, "b", 320, now=0.1) is not None
    report(other, running=20, used=200)  # as busy as before (affinity still prefers home), with room
    assert line.release(now=0.2) == 2
    assert sent.to == {"a": other.engine_id, "b": other.engine_id} and line.spilled == 2


def test_a_held_request_whose_wait_ran_out_goes_to_its_affinity_engine() -> None:
    views = [engine("e0", running=20, used=1000), engine("e1", running=20, used=1000)]
    home = favourite([engine("e0", 0, 0), engine("e1", 0, 0)], 320)
    sent, line = Sent(), line_over(views, HoldPolicy(below=2.0, max_s=1.0), "prefix_affinity")
    offer(line, sent, "a", 320, now=0.0)
    assert line.release(now=1.0) == 1
    assert sent.to == {"a": home} and line.expired == 1 and line.spilled == 0


# ---- the router's Generation with a hold line --------------------------------------------------


def sample(gen: Generation, name: str) -> float | None:
    return gen.metrics.registry.get_sample_value(name)


async def test_the_router_holds_a_request_until_a_report_shows_room_and_sends_it_then() -> None:
    async with played_fleet(kv_blocks_total=BLOCKS, hold=HoldPolicy(below=2.0, max_s=30.0)) as (gen, played):
        for view in gen.fleet.engines.values():
            report(view, running=20, used=1000)
        starting = asyncio.create_task(gen.start(MODEL, list(range(64)), SamplingOptions(max_tokens=4)))
        await until(lambda: gen.held is not None and len(gen.held) == 1)
        assert not starting.done()
        assert sample(gen, "shoal_router_requests_held") == 1
        gen.release_held()  # a poll with the same reports: it waits on
        assert not starting.done()
        report(gen.fleet.engines["e1"], running=5, used=200)
        gen.release_held()
        handle = await asyncio.wait_for(starting, 5)
        add = await played["e1"].next_add()
        assert add.request_id == handle.request_id and handle.dispatched
        assert sample(gen, "shoal_router_requests_held") == 0
        handle.close()


async def test_a_priority_request_is_never_held() -> None:
    async with played_fleet(kv_blocks_total=BLOCKS, hold=HoldPolicy(below=2.0, max_s=30.0)) as (gen, _):
        for view in gen.fleet.engines.values():
            report(view, running=20, used=1000)
        handle = await asyncio.wait_for(
            gen.start(MODEL, [1, 2, 3], SamplingOptions(max_tokens=4), priority=-1), 5
        )
        assert handle.dispatched
        handle.close()


async def test_a_held_request_whose_wait_is_cancelled_gives_its_slot_back() -> None:
    async with played_fleet(
        kv_blocks_total=BLOCKS, hold=HoldPolicy(below=2.0, max_s=30.0), max_inflight=1
    ) as (gen, played):
        for view in gen.fleet.engines.values():
            report(view, running=20, used=1000)
        starting = asyncio.create_task(gen.start(MODEL, [1, 2, 3], SamplingOptions(max_tokens=4)))
        await until(lambda: gen.held is not None and len(gen.held) == 1)
        starting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await starting
        assert len(gen.held or []) == 0
        # The one slot is free again, and the fleet has room: the next request goes at once.
        report(gen.fleet.engines["e0"], running=1, used=10)
        handle = await asyncio.wait_for(gen.start(MODEL, [1, 2, 3], SamplingOptions(max_tokens=4)), 5)
        assert (await played["e0"].next_add()).request_id == handle.request_id
        handle.close()


async def test_the_router_sends_a_held_request_after_its_longest_wait_and_counts_it() -> None:
    async with played_fleet(kv_blocks_total=BLOCKS, hold=HoldPolicy(below=2.0, max_s=0.2)) as (gen, _):
        for view in gen.fleet.engines.values():
            report(view, running=20, used=1000)
        starting = asyncio.create_task(gen.start(MODEL, [1, 2, 3], SamplingOptions(max_tokens=4)))

        async def poll() -> None:  # as the fleet poll calls it, every 10 ms here
            while not starting.done():
                gen.release_held()
                await asyncio.sleep(0.01)

        await asyncio.wait_for(poll(), 5)
        handle = starting.result()
        assert handle.dispatched and sample(gen, "shoal_router_hold_expired_total") == 1
        handle.close()


async def test_the_router_sends_a_request_past_its_short_favourite_and_counts_it() -> None:
    async with played_fleet(
        kv_blocks_total=BLOCKS, hold=HoldPolicy(below=2.0, max_s=30.0), scheduler=Scheduler("prefix_affinity")
    ) as (gen, played):
        prompt = list(range(64))
        home = favourite(list(gen.fleet.engines.values()), len(prompt))
        other = next(e for e in gen.fleet.engines if e != home)
        report(gen.fleet.engines[home], running=10, used=1000)
        report(gen.fleet.engines[other], running=10, used=100)
        handle = await asyncio.wait_for(gen.start(MODEL, prompt, SamplingOptions(max_tokens=4)), 5)
        assert (await played[other].next_add()).request_id == handle.request_id
        assert sample(gen, "shoal_router_hold_spilled_total") == 1
        assert sample(gen, "shoal_router_requests_held") == 0
        handle.close()
