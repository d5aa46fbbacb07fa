"""Parts that must not die unseen: a supervised task that ends is logged with its traceback and
turns the router's liveness to 503 (the engine stops instead); the engine's socket threads
report their end to the engine; fire-and-forget work logs the exception it ends with. Failures
are injected through each part's own inputs: a batch the sender cannot encode, the request
socket's context destroyed under its thread, a task that raises."""

from __future__ import annotations

import asyncio
import logging
import queue

import httpx
import pytest
import zmq

from shoal_engine.ipc.sockets import OutputSender, RequestReceiver
from shoal_protos.messages import OutputBatch, RequestPiece
from shoal_protos.tasks import Supervisor, background
from shoal_router.api.app import create_app
from shoal_router.ipc.tokenizing import TokenizerClient
from tests.integration.support import free_port
from tests.unit.played_engines import played_fleet


async def _fail_after(event: asyncio.Event) -> None:
    await event.wait()
    raise RuntimeError("injected")


async def test_a_supervised_task_that_fails_is_logged_and_recorded(caplog: pytest.LogCaptureFixture) -> None:
    failures: list[tuple[str, BaseException]] = []
    supervisor = Supervisor(on_failure=lambda name, exc: failures.append((name, exc)))
    go = asyncio.Event()
    failing = supervisor.start(_fail_after(go), "ingest")
    cancelled = supervisor.start(asyncio.Event().wait(), "poll")
    cancelled.cancel()
    with caplog.at_level(logging.ERROR, logger="shoal_protos.tasks"):
        go.set()
        await asyncio.wait([failing, cancelled])
    assert supervisor.failed == {"ingest": "RuntimeError: injected"}  # not the cancelled one
    assert [name for name, _ in failures] == ["ingest"]
    assert "task ingest failed" in caplog.text and "Traceback" in caplog.text and "injected" in caplog.text
    # Once the process stops, its tasks may end as they like.
    supervisor.stopping = True
    await asyncio.wait([supervisor.start(_fail_after(go), "late")])
    assert "late" not in supervisor.failed


async def test_background_work_logs_its_exception(caplog: pytest.LogCaptureFixture) -> None:
    go = asyncio.Event()
    with caplog.at_level(logging.ERROR, logger="shoal_protos.tasks"):
        task = background(_fail_after(go), "free-staging-m1")
        go.set()
        await asyncio.wait([task])
    assert "background task free-staging-m1 failed" in caplog.text and "injected" in caplog.text


async def test_a_failed_router_task_turns_liveness_and_readiness_to_503() -> None:
    supervisor = Supervisor()
    async with played_fleet() as (generation, _):
        app = create_app(generation, TokenizerClient("127.0.0.1:1", 1.0), 1, supervisor=supervisor)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            assert (await client.get("/livez")).status_code == 200
            go = asyncio.Event()
            task = supervisor.start(_fail_after(go), "zmq-ingest")
            go.set()
            await asyncio.wait([task])
            live, ready = await client.get("/livez"), await client.get("/readyz")
    assert live.status_code == 503 and live.json() == {
        "status": "failed",
        "failed": {"zmq-ingest": "RuntimeError: injected"},
    }
    assert ready.status_code == 503 and ready.json()["failed"] == {"zmq-ingest": "RuntimeError: injected"}


def test_the_output_thread_reports_its_end() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    ended: queue.SimpleQueue[BaseException] = queue.SimpleQueue()
    sender = OutputSender(ctx, 100, on_fatal=ended.put)
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    sender.start()
    try:
        # A token id msgspec cannot encode: the thread's send raises.
        sender.send(f"tcp://127.0.0.1:{port}", OutputBatch("e0", 1, [RequestPiece("r", 0, [object()])]))  # type: ignore[list-item]
        assert isinstance(ended.get(timeout=10), TypeError)
    finally:
        sender.stop()
        pull.close(linger=0)
        ctx.destroy(linger=0)


async def test_the_request_thread_reports_its_end_but_not_a_stop() -> None:
    ended: queue.SimpleQueue[BaseException] = queue.SimpleQueue()
    loop = asyncio.get_running_loop()
    for stop_first in (True, False):
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        receiver = RequestReceiver(
            ctx, f"tcp://127.0.0.1:{free_port()}", loop, lambda _: None, on_fatal=ended.put
        )
        receiver.start()
        if stop_first:
            receiver.stop()
        ctx.destroy(linger=0)  # the socket's context gone under the running thread
        await asyncio.to_thread(receiver._thread.join, 10)
        if stop_first:
            assert ended.empty()
        else:
            assert isinstance(ended.get(timeout=10), zmq.ZMQError)
