"""Stream events written by the ingest task (``Pusher``) while the stream's own task waits.

Two levels: the pusher alone, with ASGI ``send`` functions played by the test (one that writes
at once, one that waits for its client as uvicorn does when its buffer is full, one that
fails); and the real router app in a real uvicorn server over played engines, with a client
that keeps up and one that stops reading until the server's buffers fill. Either way every
token reaches the client once, in order.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import pytest

from shoal_protos.messages import FinishReason, RequestPiece
from shoal_router.api.relay import Pusher, SseEvents
from shoal_router.api.serving import Generation
from shoal_router.core.outputs import RequestDelta, RequestOutputCollector
from shoal_router.metrics import RouterMetrics
from tests.integration.support import until
from tests.unit.played_engines import MODEL, PlayedEngine, played_fleet, served

RID = "r-1"


class _Handle:
    """The part of a ``GenerationHandle`` the pusher uses (the test's seam)."""

    def __init__(self) -> None:
        self.collector = RequestOutputCollector(RID)
        self.observed: list[list[int]] = []

    def observe(self, delta: RequestDelta) -> None:
        self.observed.append(list(delta.token_ids))


def _text(body: bytes) -> str:
    return str(msgspec.json.decode(body.removeprefix(b"data: "))["choices"][0]["text"])


def _piece(index: int) -> RequestPiece:
    return RequestPiece(RID, index, [index], f"<{index}>")


async def _reader(collector: RequestOutputCollector, got: list[RequestDelta]) -> None:
    while not collector.finished:
        got.append(await collector.get())


async def _waiting_stream(
    handle: _Handle, send: Any, got: list[RequestDelta]
) -> tuple[Pusher, asyncio.Task[None]]:
    """A pusher over ``send`` lent to a stream whose reader (the task returned) waits for
    tokens, putting what it reads in ``got``."""
    events = SseEvents("cmpl-1", MODEL, chat=False, include_usage=False, prompt_token_ids=None)
    pusher = Pusher(handle, events, send, RouterMetrics().relay_delay)  # type: ignore[arg-type]
    reader = asyncio.create_task(_reader(handle.collector, got))
    await until(lambda: handle.collector._waiter is not None)
    pusher.resume()
    return pusher, reader


async def test_a_waiting_stream_is_written_by_the_put_itself() -> None:
    handle, written = _Handle(), []

    async def send(message: dict[str, Any]) -> None:
        written.append(_text(message["body"]))

    got: list[RequestDelta] = []
    _, reader = await _waiting_stream(handle, send, got)

    for index in range(3):
        handle.collector.put("e0", _piece(index))
        # Written before the loop runs anything else: no task was woken for it.
        assert written[-1] == f"<{index}>"
    assert handle.observed == [[0], [1], [2]]
    assert got == [] and not reader.done()

    # The last piece wakes the reader, which writes it itself.
    handle.collector.put("e0", RequestPiece(RID, 3, [3], "<3>", finish_reason=FinishReason.LENGTH))
    await asyncio.wait_for(reader, 5)
    assert [delta.token_ids for delta in got] == [[3]]
    assert got[0].finished


async def test_a_write_that_waits_for_its_client_holds_the_next_tokens_back_in_order() -> None:
    handle, written = _Handle(), []
    client_ready = asyncio.get_running_loop().create_future()

    async def send(message: dict[str, Any]) -> None:
        # As uvicorn does while its buffer is over the high-water mark: wait, then write.
        if not client_ready.done():
            await client_ready
        written.append(_text(message["body"]))

    got: list[RequestDelta] = []
    pusher, reader = await _waiting_stream(handle, send, got)

    handle.collector.put("e0", _piece(0))
    assert written == []  # its write waits for the client...
    assert handle.collector.push is None  # ...so the pusher steps aside
    handle.collector.put("e0", _piece(1))
    handle.collector.put("e0", _piece(2))
    await until(lambda: len(got) == 1)
    # The reader took the two later tokens as one delta; it must not write before the first.
    settled = asyncio.create_task(pusher.settle())
    await asyncio.sleep(0)
    assert not settled.done()
    client_ready.set_result(None)
    await asyncio.wait_for(settled, 5)
    assert written == ["<0>"]
    assert got[0].token_ids == [1, 2]
    reader.cancel()
    pusher.stop()


async def test_a_write_that_fails_is_raised_to_the_stream_task() -> None:
    handle = _Handle()

    async def send(message: dict[str, Any]) -> None:
        raise RuntimeError("the connection is gone")

    pusher, reader = await _waiting_stream(handle, send, [])
    handle.collector.put("e0", _piece(0))  # the ingest task does not see the error
    assert handle.collector.push is None
    with pytest.raises(RuntimeError, match="the connection is gone"):
        await pusher.settle()
    reader.cancel()


@pytest.fixture
async def fleet() -> AsyncIterator[tuple[Generation, dict[str, PlayedEngine]]]:
    async with played_fleet() as (generation, played):
        for view in generation.fleet.engines.values():
            view.connected = view.engine_id == "e0"
        yield generation, played


def _events(raw: bytes) -> list[bytes]:
    """The SSE data lines of a chunked HTTP response body."""
    return [line for line in raw.split(b"\n") if line.startswith(b"data: {")]


async def test_streams_through_uvicorn_deliver_every_token_once(
    fleet: tuple[Generation, dict[str, PlayedEngine]],
) -> None:
    generation, played = fleet
    count = 90  # the played engines' context is 100 tokens
    texts: list[str] = []
    async with served(generation) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:

        async def read() -> None:
            body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": count, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200, await response.aread()
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        texts.append(_text(line.encode()))

        reading = asyncio.create_task(read())
        add = await played["e0"].next_add()
        for index in range(count):
            finish = FinishReason.LENGTH if index == count - 1 else None
            piece = RequestPiece(add.request_id, index, [index], f"<{index}>", finish_reason=finish)
            await played["e0"].send(add.reply_to, piece)
            # One token at a time: the stream waits for each, so the pusher writes it.
            await until(lambda: len(texts) == index + 1)  # noqa: B023 - awaited within the turn
        await asyncio.wait_for(reading, 10)
    assert "".join(texts) == "".join(f"<{index}>" for index in range(count))
    assert generation.inflight == 0


async def test_a_client_that_stops_reading_gets_every_token_once_when_it_reads_again(
    fleet: tuple[Generation, dict[str, PlayedEngine]],
) -> None:
    """The server's buffers fill while the client reads nothing: uvicorn's send then waits, the
    pusher steps aside, and the tokens that come meanwhile merge in the mailbox. Once the client
    has read them, the pusher writes again."""
    generation, played = fleet
    # Tokens of 150 kB each (the played engines' context is 100 tokens): some tens of them
    # are more than the server's socket buffer (4 MB here at most) and the client's hold.
    count, filler = 90, "x" * 150_000

    def piece(index: int) -> RequestPiece:
        finish = FinishReason.LENGTH if index == count - 1 else None
        return RequestPiece(add.request_id, index, [index], f"<{index}>{filler}", finish_reason=finish)

    async with served(generation) as url:
        host, port = url.removeprefix("http://").split(":")
        # A fixed receive buffer: the kernel would otherwise grow it to tens of MB.
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
        reader, writer = await asyncio.open_connection(sock=sock)
        body = msgspec.json.encode({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": count, "stream": True})
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        add = await played["e0"].next_add()
        collector = generation.engines._requests[add.request_id].collector

        def streaming_waits() -> bool:
            return collector._waiter is not None and collector.push is not None

        await played["e0"].send(add.reply_to, piece(0))
        raw = await _read_until(reader, b"<0>" + filler.encode())
        sent = 1
        # Five tokens at a time, each lot written by the pusher, until a write has to wait
        # for the client.
        while collector.push is not None:
            await until(streaming_waits)
            assert sent < 60, "the server's buffers never filled"
            await played["e0"].send(add.reply_to, *map(piece, range(sent, sent + 5)))
            sent += 5
            await until(lambda: collector.delivered == sent)  # noqa: B023 - awaited within the turn
        # These wait in the mailbox, behind the write that waits.
        await played["e0"].send(add.reply_to, *map(piece, range(sent, sent + 5)))
        sent += 5
        raw += await _read_until(reader, b"<%d>" % (sent - 1))
        await until(streaming_waits)  # the client caught up: the pusher is back
        await played["e0"].send(add.reply_to, *map(piece, range(sent, count)))
        raw += await _read_until(reader, b"data: [DONE]")
        writer.close()
    events = _events(raw)
    text = "".join(_text(event) for event in events)
    assert text == "".join(f"<{index}>{filler}" for index in range(count))
    # Tokens that came while the client was behind went out together.
    assert len(events) < count


async def _read_until(reader: asyncio.StreamReader, marker: bytes) -> bytes:
    """What the server sends until the end of the event holding ``marker`` (within a deadline)."""
    raw = bytearray()

    async def read() -> None:
        while (at := raw.find(marker)) < 0 or raw.find(b"\n\n", at) < 0:
            chunk = await reader.read(1 << 20)
            assert chunk, f"the server closed the stream: {bytes(raw[-300:])!r}"
            raw.extend(chunk)

    await asyncio.wait_for(read(), 60)
    return bytes(raw)
