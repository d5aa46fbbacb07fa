"""The router's probes: ``/livez`` answers while the process runs, engines or none; ``/readyz``
(and ``/health``, its first name) answers 503 while no engine can take requests. Neither asks
for a key, and the OpenAPI document says which may answer 503. The app runs over the router's
real ``Generation`` with engines played by the test (``played_engines``)."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from shoal_router.api.app import create_app
from shoal_router.api.auth import KeyFile
from shoal_router.api.serving import Generation
from shoal_router.ipc.tokenizing import TokenizerClient
from tests.unit.played_engines import played_fleet

PROBES = ("/livez", "/readyz", "/health")


@pytest.fixture
async def generation() -> AsyncIterator[Generation]:
    async with played_fleet() as (generation, _):
        yield generation


def _app(
    generation: Generation, api_keys: KeyFile | None = None, admin_keys: KeyFile | None = None
) -> FastAPI:
    return create_app(
        generation, TokenizerClient("127.0.0.1:1", 1.0), 1, api_keys=api_keys, admin_keys=admin_keys
    )


async def _get(app: FastAPI, path: str, **kwargs: Any) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        return await client.get(path, **kwargs)


def _unreachable(generation: Generation) -> None:
    for view in generation.fleet.engines.values():
        view.connected = False


def _gone(generation: Generation) -> None:
    generation.fleet.engines.clear()


async def test_with_a_usable_engine_every_probe_answers_200(generation: Generation) -> None:
    app = _app(generation)
    for path in PROBES:
        reply = await _get(app, path)
        assert reply.status_code == 200, (path, reply.text)
    assert (await _get(app, "/livez")).json() == {"status": "ok"}
    ready = (await _get(app, "/readyz")).json()
    assert ready["status"] == "ok" and ready["engines"] == {"e0": "ACTIVE", "e1": "ACTIVE"}


@pytest.mark.parametrize("no_engine", [_unreachable, _gone], ids=["unreachable", "none-registered"])
async def test_with_no_usable_engine_the_router_is_alive_but_not_ready(
    generation: Generation, no_engine: Callable[[Generation], None]
) -> None:
    app = _app(generation)
    no_engine(generation)
    live = await _get(app, "/livez")
    assert live.status_code == 200 and live.json() == {"status": "ok"}
    ready, health = await _get(app, "/readyz"), await _get(app, "/health")
    assert ready.status_code == 503 and ready.json()["status"] == "unavailable"
    # ``/health`` answers as it always did: as ``/readyz``.
    assert health.status_code == 503 and health.json() == ready.json()


def _keys(path: Path, name: str, key: str) -> KeyFile:
    path.write_text(f"{name} {hashlib.sha256(key.encode()).hexdigest()}\n")
    return KeyFile(path)


@pytest.mark.parametrize("usable", [True, False], ids=["ready", "not-ready"])
async def test_the_probes_need_no_key_where_keys_are_on(
    generation: Generation, tmp_path: Path, usable: bool
) -> None:
    app = _app(
        generation, _keys(tmp_path / "api", "team", "sk-team"), _keys(tmp_path / "admin", "ops", "sk-ops")
    )
    if not usable:
        _unreachable(generation)
    # The gate is on: the API and admin paths refuse a caller without a key.
    assert (await _get(app, "/v1/models")).status_code == 401
    assert (await _get(app, "/metrics")).status_code == 401
    assert (await _get(app, "/livez")).status_code == 200
    for path in ("/readyz", "/health"):
        assert (await _get(app, path)).status_code == (200 if usable else 503), path


@pytest.mark.parametrize("keys_on", [False, True], ids=["open", "keyed"])
async def test_the_openapi_document_lists_the_probes_and_which_may_answer_503(
    generation: Generation, tmp_path: Path, keys_on: bool
) -> None:
    keys = _keys(tmp_path / "api", "team", "sk-team") if keys_on else None
    paths: dict[str, Any] = (await _get(_app(generation, keys), "/openapi.json")).json()["paths"]
    assert set(paths["/livez"]) == set(paths["/readyz"]) == set(paths["/health"]) == {"get"}
    assert set(paths["/livez"]["get"]["responses"]) == {"200"}
    for path in ("/readyz", "/health"):
        responses = paths[path]["get"]["responses"]
        assert set(responses) == {"200", "503"}, path
        assert responses["503"]["content"] == responses["200"]["content"]
    for path in PROBES:
        assert "security" not in paths[path]["get"], path
    if keys_on:
        assert paths["/v1/models"]["get"]["security"] == [{"bearer": []}]
