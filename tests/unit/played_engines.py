"""Two engines played by a test over real ZeroMQ sockets, behind the router's real
``Generation``: the router's frames arrive on plain PULL sockets, and the test sends pieces back
with the real frames. Used by the unit tests of the request path (resume, hold, streams, clients
that leave); ``served`` puts the router's app over it in a real uvicorn server."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
import redis.asyncio as aioredis
import uvicorn
import zmq
import zmq.asyncio
from starlette.middleware import Middleware

from shoal_protos.messages import (
    PROTOCOL_VERSION,
    AbortRequest,
    AddRequest,
    EngineRequestDecoder,
    OutputBatch,
    RequestPiece,
)
from shoal_protos.records import EngineRecord, Keys
from shoal_router.api.app import create_app
from shoal_router.api.relay import with_server_send
from shoal_router.api.serving import Generation
from shoal_router.core.dispatch import EngineView
from shoal_router.ipc.engines import EngineClient
from shoal_router.ipc.fleet import FleetView
from shoal_router.ipc.tokenizing import TokenizerClient
from shoal_router.metrics import RouterMetrics
from tests.integration.support import free_port, until

MODEL = "m"


@dataclass
class PlayedEngine:
    """An engine played by the test: receives the router's frames, sends pieces back."""

    engine_id: str
    pull: zmq.asyncio.Socket
    push: zmq.asyncio.Socket | None = None
    address: str = ""

    @classmethod
    def bound(cls, engine_id: str, ctx: zmq.asyncio.Context) -> PlayedEngine:
        """An engine whose PULL socket listens on a free local port, at ``address``."""
        address = f"tcp://127.0.0.1:{free_port()}"
        pull = ctx.socket(zmq.PULL)
        pull.bind(address)
        return cls(engine_id, pull, address=address)

    def close(self) -> None:
        self.pull.close(linger=0)
        if self.push is not None:
            self.push.close(linger=0)

    async def next_frame(self) -> AddRequest | AbortRequest:
        """The next request the router sends this engine (within a deadline)."""
        frames = await asyncio.wait_for(self.pull.recv_multipart(), timeout=5)
        return EngineRequestDecoder().decode(frames[0], frames[1])

    async def next_add(self) -> AddRequest:
        message = await self.next_frame()
        assert isinstance(message, AddRequest), message
        return message

    async def send(self, reply_to: str, *pieces: RequestPiece) -> None:
        if self.push is None:
            self.push = self.pull.context.socket(zmq.PUSH)
            self.push.connect(reply_to)
        body = msgspec.msgpack.encode(OutputBatch(self.engine_id, 0, list(pieces)))
        await self.push.send_multipart([b"\x02", body])


@contextlib.asynccontextmanager
async def played_fleet(
    kv_blocks_total: int = 0, **generation: Any
) -> AsyncIterator[tuple[Generation, dict[str, PlayedEngine]]]:
    """A ``Generation`` over engines ``e0`` and ``e1`` (``kv_blocks_total`` KV blocks each; 0:
    unknown), both played by the test; ``generation`` goes to ``Generation``."""
    ctx = zmq.asyncio.Context()
    metrics = RouterMetrics()
    reply_to = f"tcp://127.0.0.1:{free_port()}"
    engines = EngineClient(ctx, reply_to, 100, on_link=lambda *_: None, metrics=metrics)
    fleet = FleetView(aioredis.Redis(), Keys("test"), lambda _: None, engines.engine_lost)
    played: dict[str, PlayedEngine] = {}
    for engine_id in ("e0", "e1"):
        engine = played[engine_id] = PlayedEngine.bound(engine_id, ctx)
        record = EngineRecord(
            engine_id=engine_id,
            model=MODEL,
            zmq_address=engine.address,
            http_address="",
            max_model_len=100,
            protocol_version=PROTOCOL_VERSION,
            started_at=time.time(),
            kv_blocks_total=kv_blocks_total,
        )
        fleet.engines[engine_id] = EngineView(record)
        engines.connect(engine_id, engine.address)
    generation.setdefault("max_inflight", 10)
    generation.setdefault("max_attempts", 3)
    router = Generation("r", [MODEL], fleet, engines, metrics, **generation)
    ingest = asyncio.create_task(engines.ingest_forever())
    try:
        yield router, played
    finally:
        ingest.cancel()
        await engines.aclose()
        for engine in played.values():
            engine.close()
        ctx.term()


@contextlib.asynccontextmanager
async def served(generation: Generation, *middleware: Middleware) -> AsyncIterator[str]:
    """The router's app over ``generation`` in a real uvicorn server on this loop, with
    ``middleware`` added to it (the last outermost); its URL."""
    router_app = create_app(generation, TokenizerClient("127.0.0.1:1", 1.0), 1)
    for cls, args, kwargs in middleware:
        router_app.add_middleware(cls, *args, **kwargs)
    app = with_server_send(router_app)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    serving = asyncio.create_task(server.serve())
    await until(lambda: server.started)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 10)
