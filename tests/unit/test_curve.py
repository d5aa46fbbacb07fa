"""ZeroMQ CURVE between a router and an engine, over real loopback sockets: members holding the
fleet's key exchange frames both ways; a peer speaking plain ZeroMQ, or CURVE with a key of its
own, gets nothing delivered. Key files are checked when read."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from shoal_engine.ipc.sockets import OutputSender, RequestReceiver
from shoal_protos import curve
from shoal_protos.messages import (
    AbortRequest,
    AddRequest,
    OutputBatch,
    RequestPiece,
    RouterRequestEncoder,
    SamplingOptions,
)
from shoal_router.core.outputs import RequestOutputCollector
from shoal_router.ipc.engines import EngineClient
from tests.integration.support import free_port

# What an outsider's frame would need to reach the engine: far more than loopback takes.
SILENCE_S = 1.5


@pytest.fixture
def keys(tmp_path: Path) -> curve.CurveKeys:
    path = tmp_path / "fleet.key"
    path.write_text(curve.generate())
    return curve.load(path)


class Engine:
    """An engine's two socket threads with the fleet key; requests land in ``received``."""

    def __init__(self, keys: curve.CurveKeys, loop: asyncio.AbstractEventLoop) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.authenticator = curve.start_authenticator(self.ctx, keys)
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.received: queue.SimpleQueue[AddRequest | AbortRequest] = queue.SimpleQueue()
        self.receiver = RequestReceiver(self.ctx, self.address, loop, self.received.put, keys)
        self.sender = OutputSender(self.ctx, 100, curve_keys=keys)
        self.receiver.start()
        self.sender.start()

    def close(self) -> None:
        self.receiver.stop()
        self.sender.stop()
        self.authenticator.stop()
        self.ctx.destroy(linger=0)


@pytest.fixture
def engine(keys: curve.CurveKeys) -> Iterator[Engine]:
    running = Engine(keys, asyncio.new_event_loop())
    yield running
    running.close()


async def _received(engine: Engine, timeout_s: float) -> AddRequest | AbortRequest | None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        try:
            return engine.received.get_nowait()
        except queue.Empty:
            await asyncio.sleep(0.02)
    return None


async def test_members_exchange_requests_and_outputs(keys: curve.CurveKeys) -> None:
    engine = Engine(keys, asyncio.get_running_loop())
    ctx = zmq.asyncio.Context()
    authenticator = curve.start_authenticator(zmq.Context.shadow(ctx.underlying), keys)
    router = EngineClient(ctx, f"tcp://127.0.0.1:{free_port()}", 100, lambda *_: None, curve_keys=keys)
    ingest = asyncio.create_task(router.ingest_forever())
    try:
        router.connect("e0", engine.address)
        collector = RequestOutputCollector("r1")
        router.add(
            "e0", AddRequest("r1", [1, 2, 3], SamplingOptions(max_tokens=4), router.reply_to), collector
        )
        add = await _received(engine, 10)
        assert isinstance(add, AddRequest) and add.prompt_token_ids == [1, 2, 3]

        engine.sender.send(add.reply_to, OutputBatch("e0", 1, [RequestPiece("r1", 0, [7, 8], "hi")]))
        delta = await asyncio.wait_for(collector.get(), timeout=10)
        assert delta.token_ids == [7, 8] and delta.text == "hi"
    finally:
        ingest.cancel()
        await router.aclose()
        authenticator.stop()
        ctx.destroy(linger=0)
        engine.close()


@pytest.mark.parametrize("outsider", ["plain", "own key"])
async def test_an_outsider_delivers_nothing(engine: Engine, keys: curve.CurveKeys, outsider: str) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    if outsider == "own key":
        public, secret = zmq.curve_keypair()
        sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = secret, public, keys.public
    sock.connect(engine.address)
    try:
        frames = RouterRequestEncoder().add(
            AddRequest("evil", [1], SamplingOptions(max_tokens=1), "tcp://127.0.0.1:9")
        )
        sock.send_multipart(frames, flags=zmq.NOBLOCK)
        assert await _received(engine, SILENCE_S) is None
    finally:
        sock.close()
        ctx.term()


def test_key_files_are_checked(tmp_path: Path) -> None:
    good = curve.generate().splitlines()
    other_public = zmq.curve_keypair()[0].decode()
    for text, problem in [
        ("", "two lines"),
        (good[0] + "\n", "two lines"),
        ("short\n" + good[1] + "\n", "two lines"),
        (other_public + "\n" + good[1] + "\n", "not the secret key's"),
    ]:
        path = tmp_path / "bad.key"
        path.write_text(text)
        with pytest.raises(ValueError, match=problem):
            curve.load(path)
    path.write_text("\n".join(good) + "\n")
    assert curve.load(path).public == good[0].encode()
