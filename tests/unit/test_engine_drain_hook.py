"""The engine's ``GET /drain`` (the preStop hook) answers only callers inside its own pod, and
the hook command builds the right address. The migration manager is a fake with the one
method the route calls."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.testclient import TestClient

from shoal_engine.main import build_http_app
from shoal_engine.prestop import drain_url
from shoal_protos import engine_control_pb2 as pb

POD_IP = "10.1.2.3"


class FakeMigrations:
    def __init__(self) -> None:
        self.calls: list[tuple[float, float]] = []

    async def drain_for_removal(self, deadline_s: float, rejoin_after_s: float) -> pb.DrainResult:
        self.calls.append((deadline_s, rejoin_after_s))
        return pb.DrainResult(migrated=3, remaining=0)


def _client(migrations: FakeMigrations, peer: str) -> TestClient:
    app = build_http_app(None, None, None, migrations, 30.0, POD_IP)  # type: ignore[arg-type]
    return TestClient(app, client=(peer, 40000))


@pytest.mark.parametrize("peer", [POD_IP, "127.0.0.1", "::1"])
def test_the_pod_itself_may_drain(peer: str) -> None:
    migrations = FakeMigrations()
    reply = _client(migrations, peer).get("/drain", params={"rejoin_after_s": 5})
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"migrated": 3, "remaining": 0}
    assert migrations.calls == [(30.0, 5.0)]


@pytest.mark.parametrize("peer", ["10.1.2.4", "192.168.0.7", "testclient", "fd00::5"])
def test_anyone_else_is_refused_and_nothing_drains(peer: str) -> None:
    migrations = FakeMigrations()
    reply = _client(migrations, peer).get("/drain")
    assert reply.status_code == 403
    body: dict[str, Any] = reply.json()
    assert body["error"]["code"] == "forbidden"
    assert migrations.calls == []


@pytest.mark.parametrize(
    ("host", "rejoin", "url"),
    [
        (POD_IP, 0.0, "http://10.1.2.3:8080/drain"),
        ("fd00::1", 0.0, "http://[fd00::1]:8080/drain"),
        ("127.0.0.1", 2.5, "http://127.0.0.1:8080/drain?rejoin_after_s=2.5"),
    ],
)
def test_the_hook_calls_the_pods_own_address(host: str, rejoin: float, url: str) -> None:
    assert drain_url(host, 8080, rejoin) == url
