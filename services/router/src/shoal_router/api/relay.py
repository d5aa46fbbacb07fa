"""The SSE relay: the path of a streamed completion from the engines' output to the client's bytes.

::

    engines ─▶ ingest task ─▶ RequestOutputCollector.put ─┬─▶ Pusher.push ─────┬─▶ send ─▶ client
               (ipc.engines)  (core.outputs)              └─▶ EventStream task ─┘

``EventStream`` is the streamed response. Its own task writes the first event, the events of
tokens that were waiting when it looked (a client or a router that fell behind), the usage, the
error or ``[DONE]``. While it waits for tokens, the ingest task writes them itself through the
stream's ``Pusher`` (``RequestOutputCollector.push``), so most events are written without a task
being woken for them. ``SseEvents`` makes the bytes; ``WhileConnected`` stops the work when the
client leaves.

Where the events go
-------------------
Starlette passes a response's messages through a wrapper of ``send`` per layer (its error
middleware, its exception middleware, the route's handler, the router's ``Gate``); the layers
the router uses act on a response's start alone. So the start and the end of a stream go
through them, and the events between go straight to the server's own ``send``, which
``with_server_send`` leaves in the request's scope. It does that only while every middleware
the app was given declares ``passes_bodies_through``: one that transforms bodies (GZip, say) is
then between the server and the route, and the events take the ordinary ``send`` through it.

The server's ``send``: what the relay relies on
-----------------------------------------------
For an ``http.response.body`` message, the server's ``send`` (uvicorn's, for the router):

1. may be called from any task of the loop (the ingest task writes while the stream's task waits);
2. returns a coroutine that finishes without suspending while the client keeps up: it hands
   the bytes to the transport, and suspends only for flow control, when the transport's buffer
   is over its high-water mark, until the client has read enough;
3. finishes the write it began if another task resumes it after it suspended.

``Pusher`` starts the coroutine by hand and is done when it returns; if it suspends, a task
finishes it (``Resumed``) and the pusher steps aside until the stream's task has seen that
write end. A ``send`` that returns some other awaitable is awaited in a task of its own, every
time. ``tests/unit/test_relay_contract.py`` holds the installed uvicorn and
Starlette to these points.
"""

from __future__ import annotations

import asyncio
import logging
import time
import types
from collections.abc import AsyncIterator, Coroutine, Generator
from typing import Any

import msgspec
from starlette.responses import StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from shoal_router.api.serving import GenerationHandle
from shoal_router.core.outputs import RequestDelta
from shoal_router.errors import RouterError
from shoal_router.metrics import LoopHistogram

logger = logging.getLogger(__name__)

# The key of the server's own ``send`` in an HTTP request's ``scope["state"]``.
SERVER_SEND = "server_send"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

_json = msgspec.json.Encoder()


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + _json.encode(payload) + b"\n\n"


def finish(delta: RequestDelta) -> str | None:
    return str(delta.finish_reason) if delta.finish_reason is not None else None


def usage(handle: GenerationHandle) -> dict[str, int]:
    return {
        "prompt_tokens": handle.prompt_tokens,
        "completion_tokens": handle.output_tokens,
        "total_tokens": handle.prompt_tokens + handle.output_tokens,
    }


async def aclose(deltas: AsyncIterator[RequestDelta]) -> None:
    close = getattr(deltas, "aclose", None)
    if close is not None:
        await close()


# Stand-ins for the text and token ids while a stream's event is encoded once (``SseEvents``);
# the bytes are cut where they land, and they are never sent.
_TEXT, _IDS = "\x00shoal-text\x00", "\x00shoal-token-ids\x00"


class SseEvents:
    """The SSE events of one streamed completion (``chat``: a chat completion).

    Every event between the first and the last differs from the others only in its text (and
    token ids, with ``prompt_token_ids`` given): those are encoded once per stream with
    stand-ins, and each event splices the encoded text into the bytes around them rather than
    building and encoding the whole object again, since that is done for every event. The
    first event, the last and the usage event are encoded whole."""

    def __init__(
        self,
        response_id: str,
        model: str,
        *,
        chat: bool,
        include_usage: bool,
        prompt_token_ids: list[int] | None,
        created: int | None = None,
    ) -> None:
        self._id, self._model, self._chat = response_id, model, chat
        self._object = "chat.completion.chunk" if chat else "text_completion"
        self._created = int(time.time()) if created is None else created
        self._include_usage = include_usage
        self._prompt_token_ids = prompt_token_ids
        token_ids = prompt_token_ids is not None
        # An event of the middle, cut where its text and token ids go.
        middle = sse(self._payload(_TEXT, _IDS if token_ids else [], None, first=False))
        # The choice comes after the id and the model, which the client chose: cut at the last
        # stand-in of each.
        self._head, rest = middle.rsplit(_json.encode(_TEXT), 1)
        self._ids_at, self._tail = rest.rsplit(_json.encode(_IDS), 1) if token_ids else (b"", rest)

    def _payload(
        self, text: str, token_ids: list[int] | str, finish_reason: str | None, first: bool
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
        if self._chat:
            choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        else:
            choice["text"] = text
        if self._prompt_token_ids is not None:
            choice["token_ids"] = token_ids
        payload: dict[str, Any] = {
            "id": self._id,
            "object": self._object,
            "created": self._created,
            "model": self._model,
            "choices": [choice],
        }
        if first and self._prompt_token_ids is not None:
            payload["prompt_token_ids"] = self._prompt_token_ids
        if self._include_usage:
            payload["usage"] = None
        return payload

    def whole(self, delta: RequestDelta, first: bool = False) -> bytes:
        """The event for ``delta``, built and encoded whole."""
        return sse(self._payload(delta.text, delta.token_ids, finish(delta), first))

    def first(self, delta: RequestDelta) -> bytes:
        return self.whole(delta, first=True)

    def event(self, delta: RequestDelta) -> bytes:
        """The event for ``delta`` after the first: the same bytes as ``whole``."""
        if delta.finish_reason is not None:
            return self.whole(delta)
        text = _json.encode(delta.text)
        if self._prompt_token_ids is None:
            return self._head + text + self._tail
        return self._head + text + self._ids_at + _json.encode(delta.token_ids) + self._tail

    def usage(self, counts: dict[str, int]) -> bytes:
        return sse(
            {
                "id": self._id,
                "object": self._object,
                "created": self._created,
                "model": self._model,
                "choices": [],
                "usage": counts,
            }
        )


class WhileConnected:
    """``async with``: the block is cancelled if the client disconnects while it runs, and
    ends quietly then with ``left`` true (any other cancellation goes on).

    One plain task listens for the disconnect and cancels the handler's own task, which is
    waiting in the block (for a slot, for room on an engine, for output): a cancellation can
    reach the task only where it waits, so only inside the block. This takes one task per
    request, where waiting on the work and the listener together (``asyncio.wait``, or
    Starlette's task group for a streamed response) would take more."""

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self.left = False

    async def __aenter__(self) -> WhileConnected:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._listener = asyncio.get_running_loop().create_task(self._listen())
        return self

    async def _listen(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self.left = True
        self._task.cancel()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> bool:
        self._listener.cancel()
        # The listener's cancel ends here; one from elsewhere as well (the server shutting
        # down) goes on.
        return exc_type is asyncio.CancelledError and self.left and not self._task.uncancel()


class Resumed:
    """An awaitable that finishes a coroutine whose first step suspended (what ``yield from``
    does with it, for a coroutine that was started by hand)."""

    def __init__(self, coro: Coroutine[Any, Any, None], awaiting: Any) -> None:
        self._coro, self._awaiting = coro, awaiting

    def __await__(self) -> Generator[Any, Any, None]:
        coro, awaiting = self._coro, self._awaiting
        while True:
            thrown: BaseException | None = None
            sent = None
            try:
                sent = yield awaiting
            except BaseException as exc:  # handed to the coroutine, as yield from does
                thrown = exc
            try:
                awaiting = coro.send(sent) if thrown is None else coro.throw(thrown)
            except StopIteration:
                return


class Pusher:
    """Writes a stream's events from the ingest task, as the engine's tokens come in, while the
    stream's own task waits for them (``RequestOutputCollector.push``).

    ``push`` starts the write's coroutine by hand and is done when it returns (point 2 of the
    module's contract). When it suspends, the client is behind: ``push`` lets a task finish that
    write and removes itself, so the tokens that come next wait in the mailbox and merge, as
    they do without it; the stream's task waits for that write before it writes again
    (``settle``) and puts ``push`` back after (``resume``)."""

    def __init__(
        self, handle: GenerationHandle, events: SseEvents, send: Send, relay_delay: LoopHistogram
    ) -> None:
        self._handle, self._events, self._send, self._relay_delay = handle, events, send, relay_delay
        self._collector = handle.collector
        self._writing: asyncio.Future[None] | None = None
        self._failed: BaseException | None = None

    def push(self, delta: RequestDelta) -> None:
        try:
            self._write(delta)
        except Exception as exc:  # the ingest task goes on; the stream's task raises it (``settle``)
            self._failed = exc
            self._collector.push = None

    def _write(self, delta: RequestDelta) -> None:
        self._handle.observe(delta)
        data = self._events.event(delta)
        if delta.arrived:
            self._relay_delay.observe(time.perf_counter() - delta.arrived)
        write = self._send({"type": "http.response.body", "body": data, "more_body": True})
        if not isinstance(write, types.CoroutineType):  # a server whose send is some other awaitable
            self._collector.push = None
            self._writing = asyncio.ensure_future(write)
            return
        try:
            awaiting = write.send(None)
        except StopIteration:
            return
        # The write waits for the client: a task finishes it, and the mailbox takes what comes.
        self._collector.push = None
        self._writing = asyncio.ensure_future(Resumed(write, awaiting))

    async def settle(self) -> None:
        """Wait for a pushed write still in progress; raise what a pushed write raised."""
        writing, self._writing = self._writing, None
        if writing is not None:
            await writing
        if self._failed is not None:
            raise self._failed

    def resume(self) -> None:
        self._collector.push = self.push

    def stop(self) -> None:
        self._collector.push = None
        writing, self._writing = self._writing, None
        if writing is not None:
            writing.cancel()
            if writing.done() and not writing.cancelled():
                writing.exception()  # a write that failed as the stream ended: nothing to tell


async def relay_events(
    handle: GenerationHandle,
    first: RequestDelta,
    deltas: AsyncIterator[RequestDelta],
    events: SseEvents,
    include_usage: bool,
    relay_delay: LoopHistogram,
) -> AsyncIterator[bytes]:
    """The events the stream's own task writes: ``first``'s, those of the deltas it reads, the
    usage, and ``[DONE]``; an error after the first token becomes a last event of its own."""
    try:
        clock = time.perf_counter
        data = events.first(first)
        if first.arrived:
            relay_delay.observe(clock() - first.arrived)
        yield data
        if not first.finished:
            event = events.event
            async for delta in deltas:
                data = event(delta)
                if delta.arrived:
                    relay_delay.observe(clock() - delta.arrived)
                yield data
        if include_usage:
            yield events.usage(usage(handle))
        yield b"data: [DONE]\n\n"
    except RouterError as exc:
        logger.warning("request %s failed while streaming: %s", handle.request_id, exc.message)
        yield sse(exc.to_body())
    finally:
        await aclose(deltas)


class EventStream(StreamingResponse):
    """The streamed SSE response of a request whose first output is ``first`` and the rest
    ``deltas``. Its start and end go through the ``send`` it is called with; its events go to
    ``server_send`` when there is one (the module's docstring), else to that ``send`` as well.
    The events that come while the response's task waits are written by a ``Pusher``."""

    def __init__(
        self,
        handle: GenerationHandle,
        first: RequestDelta,
        deltas: AsyncIterator[RequestDelta],
        events: SseEvents,
        *,
        include_usage: bool,
        relay_delay: LoopHistogram,
        headers: dict[str, str],
        server_send: Send | None,
    ) -> None:
        body = relay_events(handle, first, deltas, events, include_usage, relay_delay)
        super().__init__(body, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
        self._body = body
        self._handle, self._events, self._relay_delay = handle, events, relay_delay
        self._server_send = server_send

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        direct = self._server_send or send
        pusher = Pusher(self._handle, self._events, direct, self._relay_delay)
        try:
            async for event in self._body:
                await pusher.settle()
                await direct({"type": "http.response.body", "body": event, "more_body": True})
                pusher.resume()
        finally:
            pusher.stop()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Stream, and stop streaming when the client leaves: one plain task listens and
        cancels this one (``WhileConnected``), where Starlette's own ``StreamingResponse`` runs
        a task group of two per response."""
        async with WhileConnected(receive):
            await self.stream_response(send)


def server_send(scope: Scope) -> Send | None:
    """The server's own ``send`` that ``WithServerSend`` left for the request, if it did."""
    found: Send | None = scope.get("state", {}).get(SERVER_SEND)
    return found


def passes_bodies_through(app: ASGIApp) -> bool:
    """Whether every middleware the Starlette ``app`` was given declares, with a true class
    attribute ``passes_bodies_through``, that it hands response bodies on unchanged and in
    order, acting on a response's start alone (an app that is not Starlette's: no)."""
    middleware = getattr(app, "user_middleware", None)
    if middleware is None:
        return False
    return all(getattr(entry.cls, "passes_bodies_through", False) is True for entry in middleware)


class WithServerSend:
    """``app`` behind a layer that leaves the server's own ``send`` in each HTTP request's
    state (``SERVER_SEND``) for ``EventStream``'s events, while every middleware of the app
    passes bodies through (``passes_bodies_through``; read at the first request, since
    Starlette takes no middleware once it has started). It sits outside Starlette's error
    middleware, which the app puts outside every middleware of its own."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._direct: bool | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if self._direct is None:
                self._direct = passes_bodies_through(self.app)
            if self._direct:
                scope.setdefault("state", {})[SERVER_SEND] = send
        await self.app(scope, receive, send)


def with_server_send(app: ASGIApp) -> ASGIApp:
    return WithServerSend(app)
