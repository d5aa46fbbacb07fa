"""The router's HTTP surface: OpenAI routes, health, metrics, and the mapping of errors to HTTP.

Every error leaves as OpenAI JSON ``{"error": {"message", "type", "param", "code"}}``. Errors
found before the first output token get their own status code; an error after streaming began
becomes a final SSE event with the same JSON (the ``openai`` client raises it as ``APIError``).

The generation routes are in ``api.completions``, the path of a streamed answer in
``api.relay``, the key check in ``api.gate`` and the OpenAPI document in ``api.openapi``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

from shoal_protos.tasks import Supervisor
from shoal_router.api.auth import KeyFile
from shoal_router.api.completions import GenerationRoutes, invalid_body
from shoal_router.api.fleet_page import PAGE, fleet_state
from shoal_router.api.gate import Gate
from shoal_router.api.openapi import openapi_document
from shoal_router.api.relay import with_server_send
from shoal_router.api.serving import Generation
from shoal_router.core.ratelimit import RateLimiter
from shoal_router.errors import RouterError, ServiceUnavailableError, TooManyRequestsError
from shoal_router.ipc.tokenizing import TokenizerClient

# ``with_server_send``: what the app is served behind (``main``).
__all__ = ["create_app", "error_response", "with_server_send"]


def error_response(exc: RouterError, retry_after_s: int = 1) -> JSONResponse:
    busy = isinstance(exc, ServiceUnavailableError | TooManyRequestsError)
    wait_s = getattr(exc, "retry_after_s", None) if isinstance(exc, TooManyRequestsError) else None
    headers = {"Retry-After": str(wait_s or retry_after_s)} if busy else None
    return JSONResponse(exc.to_body(), status_code=exc.status_code, headers=headers)


async def _router_error(retry_after_s: int, _: Request, exc: Exception) -> Response:
    assert isinstance(exc, RouterError)
    return error_response(exc, retry_after_s)


async def _invalid(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    # FastAPI's errors name where the value was ("body", "query") before the field.
    errors = [{**error, "loc": tuple(error.get("loc", ()))[1:]} for error in exc.errors()]
    return error_response(invalid_body(errors))


async def _http_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    body = {"error": {"message": str(exc.detail), "type": error_type, "param": None, "code": None}}
    return JSONResponse(body, status_code=exc.status_code)


class ServiceRoutes:
    """The routes besides generation: probes, the fleet page, metrics and the model list."""

    def __init__(self, generation: Generation, supervisor: Supervisor) -> None:
        self._generation = generation
        self._supervisor = supervisor

    def add_to(self, app: FastAPI) -> None:
        # ``/health`` is what ``/readyz`` answers, under its first name; launchers and older
        # manifests probe it.
        app.get("/health")(self.health)
        app.get("/livez")(self.liveness)
        app.get("/readyz")(self.readiness)
        app.get("/fleet", include_in_schema=False)(self.fleet_page)
        app.get("/fleet/state")(self.fleet_page_state)
        app.get("/metrics", response_class=PlainTextResponse)(self.prometheus_metrics)
        app.get("/v1/models")(self.list_models)

    def _ready_state(self) -> JSONResponse:
        generation, supervisor = self._generation, self._supervisor
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

    async def health(self) -> JSONResponse:
        return self._ready_state()

    async def liveness(self) -> JSONResponse:
        """200 while the router process runs: the handler runs on the event loop, so an answer
        shows that the loop turns. It does not look at the engines: a router with none to send
        to is still alive, and restarting it would not bring one. 503 once a task the router
        needs ended (its ZeroMQ ingest, fleet poll or balancer; ``failed`` names it): a restart
        brings it back."""
        if self._supervisor.failed:
            return JSONResponse({"status": "failed", "failed": self._supervisor.failed}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def readiness(self) -> JSONResponse:
        """200 while some engine can take requests, even if Redis is down; 503, with the same
        body, while none can (during a cold start of the engines, for one)."""
        return self._ready_state()

    async def fleet_page(self) -> HTMLResponse:
        return HTMLResponse(PAGE)

    async def fleet_page_state(self) -> JSONResponse:
        """Engines, this router's requests in flight and recent migrations (the fleet page's data)."""
        generation = self._generation
        prefix_cache = generation.scheduler.prefix_cache
        index = prefix_cache.index if prefix_cache is not None else None
        return JSONResponse(
            await fleet_state(generation.router_id, generation.fleet, generation.engines, index)
        )

    async def prometheus_metrics(self) -> Response:
        metrics = self._generation.metrics
        metrics.set_fleet(self._generation.fleet.engines.values())
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def list_models(self) -> dict[str, Any]:
        created = int(time.time())
        fleet = self._generation.fleet
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "shoal",
                "max_model_len": fleet.max_model_len(name),
            }
            for name in self._generation.served_models()
        ]
        return {"object": "list", "data": data}


def create_app(
    generation: Generation,
    tokenizer: TokenizerClient,
    retry_after_s: int,
    lifespan: Callable[[FastAPI], Any] | None = None,
    api_keys: KeyFile | None = None,
    admin_keys: KeyFile | None = None,
    rate_limiter: RateLimiter | None = None,
    supervisor: Supervisor | None = None,
) -> FastAPI:
    """The router's app. Serve it behind ``with_server_send``, which lets streamed events skip
    the layers that act on a response's start alone (``api.relay``)."""
    app = FastAPI(title="Shoal router", version="0.1.0", lifespan=lifespan)
    app.openapi = functools.partial(openapi_document, app, api_keys is not None)  # type: ignore[method-assign]
    app.add_exception_handler(RouterError, functools.partial(_router_error, retry_after_s))
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_middleware(Gate, api_keys=api_keys, admin_keys=admin_keys, metrics=generation.metrics)
    ServiceRoutes(generation, supervisor or Supervisor()).add_to(app)
    generate = GenerationRoutes(generation, tokenizer, rate_limiter)
    # First in the route table: the router tries each route's path in turn.
    app.router.routes[:0] = [
        Route("/v1/completions", generate.completions, methods=["POST"]),
        Route("/v1/chat/completions", generate.chat_completions, methods=["POST"]),
    ]
    return app
