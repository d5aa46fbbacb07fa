"""The router's gate: API keys and the count of responses, in front of every route."""

from __future__ import annotations

from collections.abc import Awaitable

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shoal_router.api.auth import KeyFile
from shoal_router.metrics import RouterMetrics

# The gate asks for a key on ``/v1/*`` and these alone: the probes (``/livez``, ``/readyz`` and
# ``/health``) answer without one, since the kubelet sends none.
ADMIN_PATHS = frozenset({"/metrics", "/fleet", "/fleet/state"})

_UNKNOWN_KEY = {
    "error": {
        "message": "missing or unknown API key (send Authorization: Bearer <key>)",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
    }
}


class Gate:
    """ASGI middleware in front of every route: checks the API key (``/v1/*``) or admin key (the
    admin paths) when keys are configured, and counts responses by route and status.

    Plain ASGI rather than ``@app.middleware("http")``: Starlette's ``BaseHTTPMiddleware`` passes
    every chunk of a streamed response through a memory stream and another task, a cost paid
    for every token relayed. It acts on a response's start alone, so streamed events may pass
    it by (``api.relay``)."""

    passes_bodies_through = True

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
        keys = self.api_keys if path.startswith("/v1/") else self.admin_keys if path in ADMIN_PATHS else None
        if keys is not None:
            caller = keys.identify(Headers(scope=scope).get("authorization"))
            if caller is None:
                self.metrics.requests.labels("other", "401").inc()
                refusal = JSONResponse(_UNKNOWN_KEY, status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await refusal(scope, receive, send)
                return
            scope.setdefault("state", {})["api_key"] = caller

        def counted(message: Message) -> Awaitable[None]:
            # A plain function handing back ``send``'s awaitable: no coroutine of its own for
            # every streamed chunk.
            if message["type"] == "http.response.start":
                endpoint = getattr(scope.get("route"), "path", "other")
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            return send(message)

        await self.app(scope, receive, counted)
