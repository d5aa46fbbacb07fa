"""The engine's probes: ``/livez`` answers 200 while the engine drains and 503 only once its
backend is dead; ``/readyz`` (and ``/health``, its first name) answers 503 in both cases. The
service and the backend are real: an ``EngineService`` over a ``SimulatedBackend``, whose
``check_health`` fails once its step loop has ended."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI

from shoal_engine.main import build_http_app
from shoal_engine.metrics import EngineMetrics
from shoal_engine.serving import EngineService
from shoal_protos.messages import OutputBatch
from shoal_sim.engine import SimConfig, SimulatedBackend

ENGINE_ID = "engine-probes"


class Engine:
    def __init__(self, backend: SimulatedBackend) -> None:
        self.backend = backend
        self.fatal: list[BaseException] = []
        metrics = EngineMetrics(ENGINE_ID, "sim")
        self.service = EngineService(ENGINE_ID, backend, self._send, metrics, self.fatal.append)
        self.app: FastAPI = build_http_app(self.service, backend, metrics)

    def _send(self, reply_to: str, batch: OutputBatch) -> None:
        raise AssertionError("no request was sent")

    async def get(self, path: str) -> httpx.Response:
        transport = httpx.ASGITransport(app=self.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            return await client.get(path)

    async def kill_backend(self) -> None:
        """End the simulated engine's step loop, as a crashed vLLM engine core ends."""
        task = self.backend._task
        assert task is not None
        self.backend.shutdown()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    backend = SimulatedBackend(SimConfig(speed=20.0))
    await backend.start()
    try:
        yield Engine(backend)
    finally:
        backend.shutdown()


async def test_a_serving_engine_is_live_and_ready(engine: Engine) -> None:
    for path in ("/livez", "/readyz", "/health"):
        reply = await engine.get(path)
        assert reply.status_code == 200, (path, reply.text)
    assert (await engine.get("/livez")).json() == {"status": "ok"}
    assert (await engine.get("/readyz")).json() == {"status": "ok", "requests": 0}


async def test_a_draining_engine_is_live_but_not_ready(engine: Engine) -> None:
    engine.service.set_draining(True)
    live = await engine.get("/livez")
    assert live.status_code == 200 and live.json() == {"status": "ok"}
    ready, health = await engine.get("/readyz"), await engine.get("/health")
    assert ready.status_code == 503 and ready.json() == {"status": "draining", "requests": 0}
    # ``/health`` answers as it always did: as ``/readyz``.
    assert health.status_code == 503 and health.json() == ready.json()
    # Back in the rotation (a drain that rejoins): ready again.
    engine.service.set_draining(False)
    assert (await engine.get("/readyz")).status_code == 200


@pytest.mark.parametrize("draining", [False, True], ids=["serving", "draining"])
async def test_an_engine_whose_backend_died_is_not_live(engine: Engine, draining: bool) -> None:
    engine.service.set_draining(draining)
    await engine.kill_backend()
    for path in ("/livez", "/readyz", "/health"):
        reply = await engine.get(path)
        assert reply.status_code == 503, (path, reply.text)
        body = reply.json()
        assert body["status"] == "dead" and "step loop ended" in body["error"], path
