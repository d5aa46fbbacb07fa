"""The router's HTTP surface: OpenAI routes, health, metrics, and the mapping of errors to HTTP.

Every error leaves as OpenAI JSON ``{"error": {"message", "type", "param", "code"}}``. Errors
found before the first output token get their own status code; an error after streaming began
becomes a final SSE event with the same JSON (the ``openai`` client raises it as ``APIError``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator, Sequence
from typing import Any, TypeVar

import msgspec
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shoal_protos.tasks import Supervisor
from shoal_router.api.auth import KeyFile
from shoal_router.api.fleet_page import PAGE, fleet_state
from shoal_router.api.protocol import ChatCompletionRequest, CompletionRequest, UnsupportedFieldError
from shoal_router.api.serving import Generation, GenerationHandle
from shoal_router.core.outputs import RequestDelta
from shoal_router.core.ratelimit import ApiKey, RateLimiter
from shoal_router.errors import (
    InvalidRequestError,
    PriorityNotAllowedError,
    RouterError,
    ServiceUnavailableError,
    TooManyRequestsError,
)
from shoal_router.ipc.tokenizing import TokenizerClient
from shoal_router.metrics import RouterMetrics

logger = logging.getLogger(__name__)

ENGINE_HEADER = "X-Shoal-Engine"
# The request's id across the fleet (engines, migrations, Redis records).
REQUEST_HEADER = "X-Shoal-Request-Id"
"""Response header naming the engine that produced the first tokens (for operators and tests)."""
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def error_response(exc: RouterError, retry_after_s: int = 1) -> JSONResponse:
    busy = isinstance(exc, ServiceUnavailableError | TooManyRequestsError)
    wait_s = getattr(exc, "retry_after_s", None) if isinstance(exc, TooManyRequestsError) else None
    headers = {"Retry-After": str(wait_s or retry_after_s)} if busy else None
    return JSONResponse(exc.to_body(), status_code=exc.status_code, headers=headers)


def invalid_body(errors: Sequence[Any]) -> InvalidRequestError:
    """The 400 for a request body that failed validation (pydantic's ``errors()``), naming the
    field at fault in ``param``."""
    first = errors[0] if errors else {}
    loc = [str(part) for part in first.get("loc", ())]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, UnsupportedFieldError):
        return InvalidRequestError(str(cause), param=cause.field)
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "")
        return InvalidRequestError(f"the request body is not valid JSON: {reason}")
    if first.get("type") in ("model_type", "model_attributes_type") or not loc:
        return InvalidRequestError(f"the request body must be a JSON object: {first.get('msg', '')}")
    param = ".".join(loc)
    return InvalidRequestError(f"invalid value for {param!r}: {first.get('msg', 'invalid')}", param=param)


_Body = TypeVar("_Body", bound=BaseModel)


async def request_body(request: Request, model: type[_Body]) -> _Body:
    """The request's JSON body read as ``model`` (pydantic parses the bytes itself); a body
    that is not JSON, not an object, or breaks the model raises the 400 naming the field."""
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        raise invalid_body(exc.errors()) from None


def _now() -> int:
    return int(time.time())


_json = msgspec.json.Encoder()


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + _json.encode(payload) + b"\n\n"


# Stand-ins for the text and token ids while a stream's event is encoded once (``SseEvents``);
# the bytes are cut where they land, and they are never sent.
_TEXT, _IDS = "\x00shoal-text\x00", "\x00shoal-token-ids\x00"


class SseEvents:
    """The SSE events of one streamed completion (``chat``: a chat completion).

    Every event between the first and the last differs from the others only in its text (and
    token ids, with ``prompt_token_ids`` given): those are encoded once per stream with
    stand-ins, and each event splices the encoded text into the bytes around them, which costs
    a small part of building and encoding the whole object (the stream path does it for every
    event). The first event, the last and the usage event are encoded whole."""

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
        self._created = _now() if created is None else created
        self._include_usage = include_usage
        self._prompt_token_ids = prompt_token_ids
        token_ids = prompt_token_ids is not None
        # An event of the middle, cut where its text and token ids go.
        middle = _sse(self._payload(_TEXT, _IDS if token_ids else [], None, first=False))
        # The choice comes after the id and the model, which the client chose: cut at the last
        # stand-in of each.
        self._head, rest = middle.rsplit(_json.encode(_TEXT), 1)
        self._ids_at, self._tail = rest.rsplit(_json.encode(_IDS), 1) if token_ids else (b"", rest)

    def _payload(
        self, text: str, token_ids: list[int] | str, finish: str | None, first: bool
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
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
        return _sse(self._payload(delta.text, delta.token_ids, _finish(delta), first))

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

    def usage(self, usage: dict[str, int]) -> bytes:
        return _sse(
            {
                "id": self._id,
                "object": self._object,
                "created": self._created,
                "model": self._model,
                "choices": [],
                "usage": usage,
            }
        )


def _usage(handle: GenerationHandle) -> dict[str, int]:
    return {
        "prompt_tokens": handle.prompt_tokens,
        "completion_tokens": handle.output_tokens,
        "total_tokens": handle.prompt_tokens + handle.output_tokens,
    }


# The gate asks for a key on ``/v1/*`` and these alone: the probes (``/livez``, ``/readyz`` and
# ``/health``) answer without one, since the kubelet sends none.
_ADMIN_PATHS = frozenset({"/metrics", "/fleet", "/fleet/state"})
# The paths that answer 503 while no engine can take requests (``/health`` is ``/readyz`` under
# the name it had first).
_READINESS_PATHS = frozenset({"/health", "/readyz"})

_ERROR_SCHEMA: dict[str, Any] = {
    "title": "Error",
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "code": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            },
        }
    },
}
_ERRORS = {
    400: "Invalid request: malformed JSON, a bad or unsupported field (named in `param`), or a "
    "prompt plus `max_tokens` over the model's context",
    401: "Missing or unknown API key (when the router has a keys file)",
    403: "The API key may not ask for this `priority` (when the router has a keys file)",
    404: "Unknown model",
    429: "The router is full, or the API key is over its rate limit (see `Retry-After`)",
    502: "The engine failed the request before its first token and no other engine could take it",
    503: "No engine serves the model right now, or the tokenizer is unreachable (see `Retry-After`)",
}
_GENERATION_ERRORS = (400, 401, 403, 404, 429, 502, 503)
# The generation routes (plain Starlette routes, which FastAPI does not document): their body
# models and the summaries FastAPI would give them.
_GENERATION_ROUTES: dict[str, tuple[type[BaseModel], str]] = {
    "/v1/completions": (CompletionRequest, "Completions"),
    "/v1/chat/completions": (ChatCompletionRequest, "Chat Completions"),
}


def _generation_operations(schemas: dict[str, Any]) -> dict[str, Any]:
    """The generation routes' path items as FastAPI writes an operation with a body model;
    their models' schemas go into ``schemas``."""
    refs, definitions = models_json_schema(
        [(model, "validation") for model, _ in _GENERATION_ROUTES.values()],
        ref_template="#/components/schemas/{model}",
    )
    schemas.update(definitions.get("$defs", {}))
    paths: dict[str, Any] = {}
    for path, (model, summary) in _GENERATION_ROUTES.items():
        paths[path] = {
            "post": {
                "summary": summary,
                "operationId": summary.lower().replace(" ", "_") + path.replace("/", "_") + "_post",
                "requestBody": {
                    "content": {"application/json": {"schema": refs[(model, "validation")]}},
                    "required": True,
                },
                "responses": {
                    "200": {
                        "description": "Successful Response",
                        "content": {"application/json": {"schema": {}}},
                    }
                },
            }
        }
    return paths


def _openapi_document(app: FastAPI, keys_on: bool) -> dict[str, Any]:
    """FastAPI's document, with the generation routes, and the router's real error answers:
    OpenAI error JSON for each status a route can give (and no 422: invalid bodies are 400s),
    SSE for streamed answers, and bearer auth where keys are on."""
    if app.openapi_schema:
        return app.openapi_schema
    document = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    document["paths"] = dict(sorted({**document["paths"], **_generation_operations(schemas)}.items()))
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    schemas["Error"] = _ERROR_SCHEMA
    error_content = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    if keys_on:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, operations in document["paths"].items():
        for operation in operations.values():
            responses = operation["responses"]
            responses.pop("422", None)
            if path in ("/v1/completions", "/v1/chat/completions"):
                statuses: tuple[int, ...] = _GENERATION_ERRORS
                responses["200"]["content"]["text/event-stream"] = {"schema": {"type": "string"}}
            elif path.startswith("/v1/") or path in _ADMIN_PATHS:
                statuses = (401,)
            else:
                statuses = ()
            if path in _READINESS_PATHS:
                responses["503"] = {
                    "description": "No engine can take requests (same body as 200)",
                    "content": responses["200"]["content"],
                }
            for status in statuses:
                responses[str(status)] = {"description": _ERRORS[status], "content": error_content}
            if keys_on and path.startswith("/v1/"):
                operation["security"] = [{"bearer": []}]
    app.openapi_schema = document
    return document


_UNKNOWN_KEY = {
    "error": {
        "message": "missing or unknown API key (send Authorization: Bearer <key>)",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
    }
}


class _Gate:
    """ASGI middleware in front of every route: checks the API key (``/v1/*``) or admin key (the
    admin paths) when keys are configured, and counts responses by route and status.

    Plain ASGI rather than ``@app.middleware("http")``: Starlette's ``BaseHTTPMiddleware`` passes
    every chunk of a streamed response through a memory stream and another task, which cost
    the router most of its CPU per token (``docs/benchmarks.md``, relay)."""

    def __init__(
        self, app: ASGIApp, api_keys: KeyFile | None, admin_keys: KeyFile | None, metrics: RouterMetrics
    ) -> None:
        self.app = app
        self.api_keys = api_keys
        self.admin_keys = admin_keys
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        keys = self.api_keys if path.startswith("/v1/") else self.admin_keys if path in _ADMIN_PATHS else None
        if keys is not None:
            caller = keys.identify(Headers(scope=scope).get("authorization"))
            if caller is None:
                self.metrics.requests.labels("other", "401").inc()
                refusal = JSONResponse(_UNKNOWN_KEY, status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await refusal(scope, receive, send)
                return
            scope.setdefault("state", {})["api_key"] = caller
        # For the events of a streamed response (``_EventStream``), unless ``with_server_send``
        # left the server's own: the wrappers between here and the route act on a response's
        # start alone.
        scope.setdefault("state", {}).setdefault("body_send", send)

        def counted(message: Message) -> Awaitable[None]:
            # A plain function handing back ``send``'s awaitable: no coroutine of its own for
            # every streamed chunk.
            if message["type"] == "http.response.start":
                endpoint = getattr(scope.get("route"), "path", "other")
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            return send(message)

        await self.app(scope, receive, counted)


def with_server_send(app: ASGIApp) -> ASGIApp:
    """``app`` behind a layer that leaves the server's own ``send`` in each HTTP request's
    state, for the events of streamed responses (``_EventStream``): Starlette puts its error
    middleware outside every middleware of the app, the gate's included."""

    async def outermost(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})["body_send"] = send
        await app(scope, receive, send)

    return outermost


class _Resumed:
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


class _Pusher:
    """Writes a stream's events from the ingest task, as the engine's tokens come in, while the
    stream's own task waits for them (``RequestOutputCollector.push``).

    The ASGI ``send`` of a body chunk returns without suspending while the client keeps up
    (uvicorn writes to the socket and waits only when its buffer is over the high-water mark),
    so ``push`` starts it by hand and is done when it returns. When it suspends, the client is
    behind: ``push`` lets a task finish that write and removes itself, so the tokens that come
    next wait in the mailbox and merge, as they do without it; the stream's task waits for that
    write before it writes again (``settle``) and puts ``push`` back after (``resume``)."""

    def __init__(self, handle: GenerationHandle, events: SseEvents, send: Send, relay_delay: Any) -> None:
        self._handle, self._events, self._send, self._relay_delay = handle, events, send, relay_delay
        self._collector = handle.collector
        self._writing: asyncio.Task[None] | None = None
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
        self._writing = asyncio.ensure_future(_Resumed(write, awaiting))

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


class _EventStream(StreamingResponse):
    """A streamed SSE response whose events go straight to the server's ``send``
    (``with_server_send``), or else to the one the gate was given.

    Between the server and the route, Starlette's error middleware, its two exception handlers
    and the gate's counter each wrap ``send``, and each acts only on the response's start;
    passing every event through them cost about 1 us of the router's CPU per event. The start
    and the end of the response still go through them.

    The events between the first and the last are mostly written by the ingest task as they
    come (``pusher`` makes its ``_Pusher`` over the ``send`` the events go to); the rest come
    from ``events``."""

    def __init__(
        self,
        events: AsyncIterator[bytes],
        headers: dict[str, str],
        body_send: Send | None,
        pusher: Callable[[Send], _Pusher],
    ) -> None:
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._events = events
        self._body_send = body_send
        self._pusher = pusher

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        direct = self._body_send or send
        pusher = self._pusher(direct)
        try:
            async for event in self._events:
                await pusher.settle()
                await direct({"type": "http.response.body", "body": event, "more_body": True})
                pusher.resume()
        finally:
            pusher.stop()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Stream, and stop streaming when the client leaves.

        Starlette does this with a task group of two (the stream, and a listener that cancels
        it when the client leaves): an anyio task, a cancel scope and a formatted task repr
        per response, about 9 % of the router's CPU for a short streamed request. Here one plain
        task listens and cancels the handler's own task (``_WhileConnected``)."""
        async with _WhileConnected(receive):
            await self.stream_response(send)


def create_app(  # noqa: C901, PLR0915 (over the complexity budget: to be split)
    generation: Generation,
    tokenizer: TokenizerClient,
    retry_after_s: int,
    lifespan: Callable[[FastAPI], Any] | None = None,
    api_keys: KeyFile | None = None,
    admin_keys: KeyFile | None = None,
    rate_limiter: RateLimiter | None = None,
    supervisor: Supervisor | None = None,
) -> FastAPI:
    app = FastAPI(title="Shoal router", version="0.1.0", lifespan=lifespan)
    supervisor = supervisor or Supervisor()
    app.openapi = functools.partial(_openapi_document, app, api_keys is not None)  # type: ignore[method-assign]
    metrics = generation.metrics

    @app.exception_handler(RouterError)
    async def _router_error(_: Request, exc: RouterError) -> JSONResponse:
        return error_response(exc, retry_after_s)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's errors name where the value was ("body", "query") before the field.
        errors = [{**error, "loc": tuple(error.get("loc", ()))[1:]} for error in exc.errors()]
        return error_response(invalid_body(errors))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        body = {"error": {"message": str(exc.detail), "type": error_type, "param": None, "code": None}}
        return JSONResponse(body, status_code=exc.status_code)

    app.add_middleware(_Gate, api_keys=api_keys, admin_keys=admin_keys, metrics=metrics)

    def ready_state() -> JSONResponse:
        engines = generation.fleet.engines
        body = {
            "status": "ok",
            "redis": generation.fleet.redis_ok,
            "engines": {eid: view.state for eid, view in engines.items()},
            "models": generation.served_models(),
            "inflight": generation.inflight,
        }
        # Ready while some engine can serve, even if Redis is down: dispatch goes on from the
        # last fleet state read (and this router's own counts) until Redis is back.
        ready = any(view.usable for view in engines.values())
        if not ready:
            body["status"] = "unavailable"
        if supervisor.failed:
            ready = False
            body["status"] = "failed"
            body["failed"] = supervisor.failed
        return JSONResponse(body, status_code=200 if ready else 503)

    # What ``/readyz`` answers, under its first name; launchers and older manifests probe it.
    @app.get("/health")
    async def health() -> JSONResponse:
        return ready_state()

    @app.get("/livez")
    async def liveness() -> JSONResponse:
        """200 while the router process runs: the handler runs on the event loop, so an answer
        shows that the loop turns. It does not look at the engines: a router with none to send
        to is still alive, and restarting it would not bring one. 503 once a task the router
        needs ended (its ZeroMQ ingest, fleet poll or balancer; ``failed`` names it): a restart
        brings it back."""
        if supervisor.failed:
            return JSONResponse({"status": "failed", "failed": supervisor.failed}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/readyz")
    async def readiness() -> JSONResponse:
        """200 while some engine can take requests, even if Redis is down; 503, with the same
        body, while none can (during a cold start of the engines, for one)."""
        return ready_state()

    @app.get("/fleet", include_in_schema=False)
    async def fleet_page() -> HTMLResponse:
        return HTMLResponse(PAGE)

    @app.get("/fleet/state")
    async def fleet_page_state() -> JSONResponse:
        """Engines, this router's requests in flight and recent migrations (the fleet page's data)."""
        return JSONResponse(await fleet_state(generation.router_id, generation.fleet, generation.engines))

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus_metrics() -> Response:
        metrics.set_fleet(generation.fleet.engines.values())
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        created = _now()
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "shoal",
                "max_model_len": generation.fleet.max_model_len(name),
            }
            for name in generation.served_models()
        ]
        return {"object": "list", "data": data}

    # The two generation routes are plain Starlette routes that read their body with pydantic
    # themselves: FastAPI's per-request dependency solving and body handling cost about 60 us
    # of the router's CPU per request (``docs/benchmarks.md``, request rate). The OpenAPI
    # document describes them from the same models (``_openapi_document``).
    async def completions(request: Request) -> Response:
        body = await request_body(request, CompletionRequest)
        generation.check_model(body.model)
        if isinstance(body.prompt, str):
            prompt_ids = await tokenizer.tokenize_text(body.model, body.prompt)
        else:
            prompt_ids = list(body.prompt)  # type: ignore[arg-type]
        max_tokens = body.max_tokens if body.max_tokens is not None else 16
        return await _generate(request, body, prompt_ids, max_tokens, chat=False)

    async def chat_completions(request: Request) -> Response:
        body = await request_body(request, ChatCompletionRequest)
        generation.check_model(body.model)
        messages = [(m.role, m.text()) for m in body.messages]
        prompt_ids = await tokenizer.tokenize_chat(body.model, messages)
        return await _generate(request, body, prompt_ids, body.output_limit(), chat=True)

    # First in the route table: the router tries each route's path in turn.
    app.router.routes[:0] = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]

    async def _generate(
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        prompt_ids: list[int],
        max_tokens: int | None,
        chat: bool,
    ) -> Response:
        sampling = generation.sampling(
            body.model,
            len(prompt_ids),
            max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed,
            stop=body.stop_list(),
            ignore_eos=body.ignore_eos,
        )
        caller: ApiKey | None = getattr(request.state, "api_key", None)
        if caller is not None and body.priority < caller.min_priority:
            raise PriorityNotAllowedError(caller.name, body.priority, caller.min_priority)
        charge = None
        if caller is not None and rate_limiter is not None:
            try:
                rate_limiter.admit(caller, len(prompt_ids))
            except TooManyRequestsError:
                metrics.rate_limited.labels(caller.name).inc()
                raise
            charge = functools.partial(rate_limiter.charge, caller)
        session = request.headers.get(generation.session_header)
        deltas: AsyncIterator[RequestDelta] | None = None
        connected = _WhileConnected(request.receive)
        try:
            async with connected:
                handle = await generation.start(
                    body.model, prompt_ids, sampling, on_close=charge, session=session, priority=body.priority
                )
                deltas = handle.deltas()
                # Wait for the first output before answering, so that an engine refusing the
                # request still gets an HTTP status of its own rather than an error event in a
                # 200 stream.
                first = await anext(deltas)
                response_id = ("chatcmpl-" if chat else "cmpl-") + handle.request_id.rsplit("-", 1)[-1]
                if not body.stream:
                    return await _collect(handle, body, first, deltas, response_id, chat)
        except BaseException:
            if deltas is not None:
                await _aclose(deltas)
            raise
        if connected.left:  # the client went away before the answer began
            if deltas is not None:
                await _aclose(deltas)
            return Response(status_code=499)
        assert deltas is not None
        events = SseEvents(
            response_id,
            body.model,
            chat=chat,
            include_usage=body.include_usage,
            prompt_token_ids=handle.prompt_token_ids if body.return_token_ids else None,
        )
        return _EventStream(
            _stream(handle, body, first, deltas, events),
            headers={**_SSE_HEADERS, ENGINE_HEADER: first.engine_id, REQUEST_HEADER: handle.request_id},
            body_send=getattr(request.state, "body_send", None),
            pusher=lambda send: _Pusher(handle, events, send, metrics.relay_delay),
        )

    async def _stream(
        handle: GenerationHandle,
        body: CompletionRequest | ChatCompletionRequest,
        first: RequestDelta,
        deltas: AsyncIterator[RequestDelta],
        events: SseEvents,
    ) -> AsyncIterator[bytes]:
        try:
            relay_delay, clock = metrics.relay_delay, time.perf_counter
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
            if body.include_usage:
                yield events.usage(_usage(handle))
            yield b"data: [DONE]\n\n"
        except RouterError as exc:
            logger.warning("request %s failed while streaming: %s", handle.request_id, exc.message)
            yield _sse(exc.to_body())
        finally:
            await _aclose(deltas)

    async def _collect(
        handle: GenerationHandle,
        body: CompletionRequest | ChatCompletionRequest,
        first: RequestDelta,
        deltas: AsyncIterator[RequestDelta],
        response_id: str,
        chat: bool,
    ) -> Response:
        parts = [first.text]
        token_ids = list(first.token_ids)
        last = first
        try:
            if not first.finished:
                async for delta in deltas:
                    parts.append(delta.text)
                    token_ids.extend(delta.token_ids)
                    last = delta
        finally:
            await _aclose(deltas)
        text = "".join(parts)
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": _finish(last)}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if body.return_token_ids:
            choice["token_ids"] = token_ids
        answer = {
            "id": response_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": _now(),
            "model": body.model,
            "choices": [choice],
            "usage": _usage(handle),
        }
        return Response(
            _json.encode(answer),
            media_type="application/json",
            headers={ENGINE_HEADER: last.engine_id, REQUEST_HEADER: handle.request_id},
        )

    return app


def _finish(delta: RequestDelta) -> str | None:
    return str(delta.finish_reason) if delta.finish_reason is not None else None


async def _aclose(deltas: AsyncIterator[RequestDelta]) -> None:
    aclose = getattr(deltas, "aclose", None)
    if aclose is not None:
        await aclose()


class _WhileConnected:
    """``async with``: the block is cancelled if the client disconnects while it runs, and
    ends quietly then with ``left`` true (any other cancellation goes on).

    One plain task listens for the disconnect and cancels the handler's own task, which is
    waiting in the block (for a slot, for room on an engine, for output): a cancellation can
    reach the task only where it waits, so only inside the block. Waiting on the work and the
    listener as two tasks (``asyncio.wait``) cost two tasks per request, and once more for a
    whole answer."""

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self.left = False

    async def __aenter__(self) -> _WhileConnected:
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
