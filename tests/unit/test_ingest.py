"""The router's ingest task over real ZeroMQ sockets: it reads the engines' batches without a
future per message and waits on the socket's descriptor only when the socket is empty. A
ZeroMQ descriptor signals edges, so a wait that starts at the wrong moment would hang with
batches queued; these tests send batches one at a time (a wait before each), in bursts larger
than one drain, and across a restart of the task."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import zmq.asyncio

from shoal_protos.messages import AddRequest, RequestPiece, SamplingOptions
from shoal_router.core.outputs import RequestOutputCollector
from shoal_router.ipc import engines as engines_module
from shoal_router.ipc.engines import EngineClient
from tests.integration.support import free_port
from tests.unit.played_engines import PlayedEngine


@contextlib.asynccontextmanager
async def _router() -> AsyncIterator[tuple[EngineClient, PlayedEngine]]:
    ctx = zmq.asyncio.Context()
    client = EngineClient(ctx, f"tcp://127.0.0.1:{free_port()}", 100, on_link=lambda *_: None)
    engine = PlayedEngine.bound("e0", ctx)
    client.connect("e0", engine.address)
    try:
        yield client, engine
    finally:
        await client.aclose()
        engine.close()
        ctx.term()


def _track(client: EngineClient, request_id: str) -> RequestOutputCollector:
    collector = RequestOutputCollector(request_id)
    add = AddRequest(request_id, [1, 2, 3], SamplingOptions(max_tokens=100_000), client.reply_to)
    client.add("e0", add, collector)
    return collector


async def _read(collector: RequestOutputCollector, tokens: int) -> list[int]:
    """The next ``tokens`` token ids the collector gets (5 s at most for each delivery)."""
    got: list[int] = []
    while len(got) < tokens:
        got += (await asyncio.wait_for(collector.get(), 5)).token_ids
    return got


@contextlib.asynccontextmanager
async def _ingesting(client: EngineClient) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(client.ingest_forever())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_batches_one_at_a_time_each_wake_the_task() -> None:
    """Every batch arrives while the task waits on the descriptor: none is left queued."""
    async with _router() as (client, engine), _ingesting(client):
        collector = _track(client, "r")
        for i in range(200):
            await engine.send(client.reply_to, RequestPiece("r", i, [i]))
            assert await _read(collector, 1) == [i]


async def test_a_burst_larger_than_a_drain_arrives_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """More batches than one drain takes: the task flushes, lets the loop run, and reads on."""
    monkeypatch.setattr(engines_module, "_DRAIN_PIECES", 16)
    async with _router() as (client, engine):
        collectors = [_track(client, f"r{k}") for k in range(4)]
        # Queued before the task starts, so that its first drain finds them all waiting.
        for i in range(100):
            await engine.send(client.reply_to, *(RequestPiece(f"r{k}", i, [i]) for k in range(4)))
        async with _ingesting(client):
            for collector in collectors:
                assert await _read(collector, 100) == list(range(100))
            # And the task still wakes for what comes after the burst.
            await engine.send(client.reply_to, RequestPiece("r0", 100, [100]))
            assert await _read(collectors[0], 1) == [100]


async def test_a_restarted_task_reads_on() -> None:
    """A cancelled task leaves the descriptor to the next one (a router that restarts its
    ingest), and what was sent in between is read then."""
    async with _router() as (client, engine):
        collector = _track(client, "r")
        async with _ingesting(client):
            await engine.send(client.reply_to, RequestPiece("r", 0, [7]))
            assert await _read(collector, 1) == [7]
        await engine.send(client.reply_to, RequestPiece("r", 1, [8]))
        async with _ingesting(client):
            assert await _read(collector, 1) == [8]
