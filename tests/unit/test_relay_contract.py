"""What the SSE relay (``shoal_router.api.relay``) relies on, held against the installed uvicorn
and Starlette, and streams through middleware that transforms bodies.

* uvicorn's ``send`` of a body chunk, called from a plain callback (as the ingest task does),
  returns a coroutine that finishes without suspending while the client reads; one that
  suspended because the client stopped reading is finished by another task (``Resumed``), and
  every byte arrives in order.
* The layers Starlette and FastAPI put around the router's routes hand bodies on unchanged, so
  the events may skip them; the stack is pinned, so that a new layer shows up here.
* A body-transforming middleware (GZip) turns the direct writes off: the stream goes through
  it and decodes to the same events.
"""

from __future__ import annotations

import asyncio
import gzip
import socket
import types
import zlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import pytest
import uvicorn
from fastapi.middleware.asyncexitstack import AsyncExitStackMiddleware
from starlette.middleware import Middleware
from starlette.middleware.errors import ServerErrorMiddleware
from starlette.middleware.exceptions import ExceptionMiddleware
from starlette.middleware.gzip import GZipMiddleware
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from shoal_protos.messages import FinishReason, RequestPiece
from shoal_router.api.app import create_app
from shoal_router.api.gate import Gate
from shoal_router.api.relay import Resumed, passes_bodies_through
from shoal_router.api.serving import Generation
from shoal_router.ipc.tokenizing import TokenizerClient
from shoal_router.metrics import RouterMetrics
from tests.integration.support import free_port, until
from tests.unit.played_engines import MODEL, PlayedEngine, played_fleet, served

_START: Message = {
    "type": "http.response.start",
    "status": 200,
    "headers": [(b"content-type", b"text/plain")],
}
_END: Message = {"type": "http.response.body", "body": b"", "more_body": False}


def _body(data: bytes) -> Message:
    return {"type": "http.response.body", "body": data, "more_body": True}


async def _serve(app: Any) -> tuple[uvicorn.Server, asyncio.Task[None], int]:
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    serving = asyncio.create_task(server.serve())
    await until(lambda: server.started)
    return server, serving, port


async def _stop(server: uvicorn.Server, serving: asyncio.Task[None]) -> None:
    server.should_exit = True
    await asyncio.wait_for(serving, 10)


async def test_uvicorn_writes_a_body_chunk_sent_from_a_callback_without_suspending() -> None:
    steps: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send(_START)
        loop = asyncio.get_running_loop()
        written = loop.create_future()

        def write() -> None:  # a plain callback, outside the request's task
            coro = send(_body(b"from the callback\n"))
            written.set_result(None)
            if not isinstance(coro, types.CoroutineType):
                steps.append(type(coro).__name__)
                return
            steps.append("coroutine")
            try:
                coro.send(None)
            except StopIteration:
                steps.append("finished")
            else:
                steps.append("suspended")
                coro.close()

        loop.call_soon(write)
        await written
        await send(_END)

    server, serving, port = await _serve(app)
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            response = await client.get(f"http://127.0.0.1:{port}/")
    finally:
        await _stop(server, serving)
    assert steps == ["coroutine", "finished"]
    assert response.content == b"from the callback\n"


async def test_a_uvicorn_write_that_waits_for_its_client_is_finished_by_another_task() -> None:
    chunk_size = 256 * 1024
    sent: list[int] = []
    resumed: list[asyncio.Future[None]] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send(_START)
        while not resumed:
            assert len(sent) < 400, "the server never waited for the client"
            index = len(sent)
            sent.append(index)
            coro = send(_body(b"%08d" % index + b"." * (chunk_size - 8)))
            assert isinstance(coro, types.CoroutineType)
            try:
                awaiting = coro.send(None)
            except StopIteration:
                continue
            # The client is behind: another task finishes this write.
            resumed.append(asyncio.ensure_future(Resumed(coro, awaiting)))
        await resumed[0]
        await send(_END)

    server, serving, port = await _serve(app)
    try:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)  # else the kernel grows it
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        reader, writer = await asyncio.open_connection(sock=sock)
        writer.write(b"GET / HTTP/1.1\r\nHost: test\r\n\r\n")
        await until(lambda: bool(resumed))  # the client has read nothing yet
        raw = await asyncio.wait_for(_read_chunked(reader), 60)
        writer.close()
    finally:
        await _stop(server, serving)
    assert resumed[0].done() and resumed[0].exception() is None
    expected = b"".join(b"%08d" % index + b"." * (chunk_size - 8) for index in sent)
    assert raw == expected


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    """The body of a chunked HTTP/1.1 response."""
    await reader.readuntil(b"\r\n\r\n")
    body = bytearray()
    while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
        body.extend(await reader.readexactly(size))
        await reader.readexactly(2)
    return bytes(body)


def _router_app() -> Any:
    class _Generation:  # what create_app reads before a request
        metrics = RouterMetrics()

    return create_app(_Generation(), TokenizerClient("127.0.0.1:1", 1.0), 1)  # type: ignore[arg-type]


async def test_the_layers_around_the_routes_hand_bodies_on_unchanged() -> None:
    app = _router_app()

    async def chunks(_: Request) -> StreamingResponse:
        async def parts() -> AsyncIterator[bytes]:
            for part in (b"a", b"bb", b"ccc"):
                yield part

        return StreamingResponse(parts(), media_type="text/event-stream")

    app.router.routes.append(Route("/chunks", chunks))
    seen: list[Message] = []

    async def receive() -> Message:
        await asyncio.sleep(60)
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        seen.append(message)

    scope = {"type": "http", "method": "GET", "path": "/chunks", "headers": [], "query_string": b""}
    await app({**scope, "asgi": {"version": "3.0", "spec_version": "2.4"}}, receive, send)
    bodies = [(m["body"], m.get("more_body", False)) for m in seen if m["type"] == "http.response.body"]
    assert [part for part, more in bodies if more] == [b"a", b"bb", b"ccc"]
    assert bodies[-1] == (b"", False)
    # The stack those bodies went through, outermost first: a new layer lands here to be looked at.
    layers, layer = [], app.middleware_stack
    while layer is not app.router:
        layers.append(type(layer))
        layer = layer.app
    assert layers == [ServerErrorMiddleware, Gate, ExceptionMiddleware, AsyncExitStackMiddleware]
    assert passes_bodies_through(app)


def test_middleware_that_does_not_declare_it_turns_direct_writes_off() -> None:
    app = _router_app()
    assert passes_bodies_through(app)
    app.add_middleware(GZipMiddleware)
    assert not passes_bodies_through(app)
    assert not passes_bodies_through(GZipMiddleware(_router_app()))  # not a Starlette app


@pytest.fixture
async def fleet() -> AsyncIterator[tuple[Generation, dict[str, PlayedEngine]]]:
    async with played_fleet() as (generation, played):
        for view in generation.fleet.engines.values():
            view.connected = view.engine_id == "e0"
        yield generation, played


@pytest.mark.parametrize(
    ("middleware", "compressed"),
    [
        # Starlette's default leaves SSE alone but still holds the start until the first body.
        (Middleware(GZipMiddleware), False),
        (Middleware(GZipMiddleware, minimum_size=0, exclude_content_types=()), True),
    ],
    ids=["sse-excluded", "sse-compressed"],
)
async def test_a_stream_through_gzip_reaches_the_client_whole(
    fleet: tuple[Generation, dict[str, PlayedEngine]], middleware: Middleware, compressed: bool
) -> None:
    generation, played = fleet
    count = 40
    raw = bytearray()
    texts: list[str] = []
    async with served(generation, middleware) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:

        async def read() -> str | None:
            body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": count, "stream": True}
            request = client.build_request(
                "POST", "/v1/completions", json=body, headers={"Accept-Encoding": "gzip"}
            )
            response = await client.send(request, stream=True)
            assert response.status_code == 200, await response.aread()
            decoder = _GzipLines() if compressed else _PlainLines()
            async for chunk in response.aiter_raw():
                raw.extend(chunk)
                texts.extend(decoder.texts(chunk))
            await response.aclose()
            return response.headers.get("content-encoding")

        reading = asyncio.create_task(read())
        add = await played["e0"].next_add()
        for index in range(count):
            finish = FinishReason.LENGTH if index == count - 1 else None
            piece = RequestPiece(add.request_id, index, [index], f"<{index}>", finish_reason=finish)
            await played["e0"].send(add.reply_to, piece)
            # One token at a time, each seen by the client (through the compressor's flush):
            # the stream waits for each, so the ingest task writes it.
            await until(lambda: len(texts) == index + 1)  # noqa: B023 - awaited within the turn
        encoding = await asyncio.wait_for(reading, 10)
    assert encoding == ("gzip" if compressed else None)
    events = (gzip.decompress(bytes(raw)) if compressed else bytes(raw)).split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    assert "".join(texts) == "".join(f"<{index}>" for index in range(count))
    assert generation.inflight == 0


class _PlainLines:
    """The texts of the SSE events in a response's bytes, as they come."""

    def __init__(self) -> None:
        self._pending = b""

    def texts(self, data: bytes) -> list[str]:
        *events, self._pending = (self._pending + data).split(b"\n\n")
        return [
            str(msgspec.json.decode(event.removeprefix(b"data: "))["choices"][0]["text"])
            for event in events
            if event.startswith(b"data: {")
        ]


class _GzipLines(_PlainLines):
    """The same for a gzip stream, decompressed as it comes."""

    def __init__(self) -> None:
        super().__init__()
        self._inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)

    def texts(self, data: bytes) -> list[str]:
        return super().texts(self._inflate.decompress(data))
