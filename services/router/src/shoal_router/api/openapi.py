"""The router's OpenAPI document: FastAPI's, with the generation routes (plain Starlette routes
that FastAPI does not describe) and the answers the router really gives."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from shoal_router.api.gate import ADMIN_PATHS
from shoal_router.api.protocol import ChatCompletionRequest, CompletionRequest

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


def openapi_document(app: FastAPI, keys_on: bool) -> dict[str, Any]:
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
            elif path.startswith("/v1/") or path in ADMIN_PATHS:
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
