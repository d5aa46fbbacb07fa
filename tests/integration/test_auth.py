"""API keys on a real router: a second router process on the tiny fleet's Redis, tokenizer and
engines, started with a keys file for ``/v1/*`` and another for ``/metrics`` and the fleet page.
The official client with a wrong key gets a 401 it understands; the right key streams; the
admin endpoints want the admin key; ``/health`` stays open for probes; a rotated key takes
effect without a restart; priority requests are for the keys granted them."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.integration.support import STALL_S, RunningFleet, extra_router, wait_until

pytestmark = pytest.mark.integration


def _line(name: str, key: str) -> str:
    return f"{name} {hashlib.sha256(key.encode()).hexdigest()}\n"


@pytest.fixture
def keyed_router(tiny_fleet: RunningFleet, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    api_keys, admin_keys = tmp_path / "api-keys", tmp_path / "admin-keys"
    api_keys.write_text(
        _line("team-a", "sk-team-a").strip()
        + " priority=-10\n"
        + _line("team-b", "sk-team-b").strip()
        + " rpm=2\n"
    )
    admin_keys.write_text(_line("ops", "sk-ops"))
    keys = ("--api-keys-file", str(api_keys), "--admin-keys-file", str(admin_keys))
    with extra_router(tiny_fleet, "router-keys", tmp_path, *keys) as (url, _):
        yield url, api_keys


def test_api_keys_guard_the_api_and_the_admin_endpoints(
    tiny_fleet: RunningFleet, keyed_router: tuple[str, Path]
) -> None:
    url, api_keys = keyed_router

    def client(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)

    with pytest.raises(openai.AuthenticationError) as refused:
        client("sk-wrong").completions.create(model=tiny_fleet.model, prompt=[1, 2], max_tokens=2)
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
    bare = httpx.get(url + "/v1/models", timeout=STALL_S)
    assert bare.status_code == 401 and bare.headers["www-authenticate"] == "Bearer"

    stream = client("sk-team-a").completions.create(
        model=tiny_fleet.model, prompt=[1, 2], max_tokens=8, stream=True
    )
    assert sum(1 for _ in stream) >= 1

    for path in ("/metrics", "/fleet", "/fleet/state"):
        assert httpx.get(url + path, timeout=STALL_S).status_code == 401, path
        # The API key is not an admin key, and the admin key opens them.
        assert (
            httpx.get(url + path, headers={"Authorization": "Bearer sk-team-a"}, timeout=STALL_S).status_code
            == 401
        )
        assert (
            httpx.get(url + path, headers={"Authorization": "Bearer sk-ops"}, timeout=STALL_S).status_code
            == 200
        )
    for path in ("/health", "/livez", "/readyz"):  # probes need no key
        assert httpx.get(url + path, timeout=STALL_S).status_code == 200, path

    # Rotation: the file changes (as a mounted Secret does); the router reads it again.
    api_keys.write_text(_line("team-a", "sk-team-a-2"))
    os.utime(api_keys, ns=(1, 1))

    def rotated() -> bool:
        old = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer sk-team-a"}, timeout=STALL_S)
        new = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer sk-team-a-2"}, timeout=STALL_S)
        return old.status_code == 401 and new.status_code == 200

    wait_until(rotated, STALL_S, "the rotated key to take effect", every_s=0.2)


def test_a_key_over_its_rate_limit_gets_429_with_retry_after(
    tiny_fleet: RunningFleet, keyed_router: tuple[str, Path]
) -> None:
    url, _ = keyed_router
    limited = openai.OpenAI(base_url=url + "/v1", api_key="sk-team-b", max_retries=0, timeout=60)
    other = openai.OpenAI(base_url=url + "/v1", api_key="sk-team-a", max_retries=0, timeout=60)
    for _ in range(2):
        limited.completions.create(model=tiny_fleet.model, prompt=[1, 2], max_tokens=2)
    with pytest.raises(openai.RateLimitError) as refused:
        limited.completions.create(model=tiny_fleet.model, prompt=[1, 2], max_tokens=2)
    assert refused.value.code == "rate_limit_exceeded"
    assert "team-b" in refused.value.message
    # rpm=2 refills one request every 30 s; the machine may have spent some of that already.
    assert 1 <= int(refused.value.response.headers["retry-after"]) <= 30
    other.completions.create(model=tiny_fleet.model, prompt=[1, 2], max_tokens=2)  # its own bucket
    metrics = httpx.get(url + "/metrics", headers={"Authorization": "Bearer sk-ops"}, timeout=STALL_S).text
    assert 'shoal_router_rate_limited_total{key="team-b"} 1.0' in metrics


def test_priority_requests_are_for_the_keys_granted_them(
    tiny_fleet: RunningFleet, keyed_router: tuple[str, Path]
) -> None:
    """team-a's line grants priority down to -10; team-b's grants none. A refusal is a 403 the
    official client understands, and it costs the key nothing of its rate limit."""
    url, _ = keyed_router
    granted = openai.OpenAI(base_url=url + "/v1", api_key="sk-team-a", max_retries=0, timeout=60)
    plain = openai.OpenAI(base_url=url + "/v1", api_key="sk-team-b", max_retries=0, timeout=60)

    def ask(client: openai.OpenAI, priority: int) -> int:
        reply = client.completions.create(
            model=tiny_fleet.model, prompt=[1, 2], max_tokens=2, extra_body={"priority": priority}
        )
        assert reply.usage is not None
        return reply.usage.completion_tokens

    assert ask(granted, -10) >= 1
    with pytest.raises(openai.PermissionDeniedError) as refused:
        ask(granted, -11)
    assert refused.value.status_code == 403 and refused.value.code == "priority_not_allowed"
    assert "team-a" in refused.value.message and "-10" in refused.value.message
    for _ in range(3):  # three refusals, and team-b's rpm=2 still lets two requests through
        with pytest.raises(openai.PermissionDeniedError):
            ask(plain, -1)
    assert ask(plain, 0) >= 1 and ask(plain, 5) >= 1  # later than the default is anyone's
    body = httpx.post(
        url + "/v1/completions",
        headers={"Authorization": "Bearer sk-team-b"},
        json={"model": tiny_fleet.model, "prompt": [1, 2], "max_tokens": 2, "priority": -1},
        timeout=60,
    ).json()
    assert body["error"]["type"] == "permission_error" and body["error"]["param"] == "priority"
