"""Overload on a real router process (one slot, one place in line, a 2 s wait at most):
one request runs, one waits in line, the next is refused at once with 429 and ``Retry-After``,
the waiting one is refused when its wait runs out, a flood of refusals leaves the router's
memory where it was, and once the running request ends the router serves again.

The engines' vLLM processes are frozen while the router is full, so the running request holds
its slot for as long as the test needs (the tiny model would otherwise finish it in moments)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.integration.support import STALL_S, RunningFleet, extra_router, metric, models_frozen, wait_until

pytestmark = pytest.mark.integration

BODY = {"prompt": [4, 5, 6], "max_tokens": 4}


def _complete(url: str, model: str, timeout_s: float) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": model, **BODY}, timeout=timeout_s)


def test_a_full_router_refuses_with_429_and_serves_again(tiny_fleet: RunningFleet, tmp_path: Path) -> None:
    records = [r for i in range(2) if (r := tiny_fleet.engine_record(tiny_fleet.cfg.engine_id(i)))]
    limits = ("--max-inflight-requests", "1", "--max-queued-requests", "1", "--queue-timeout-s", "2")
    replies: dict[str, httpx.Response] = {}

    def post(url: str, name: str) -> None:
        replies[name] = _complete(url, tiny_fleet.model, 120)

    with extra_router(tiny_fleet, "router-small", tmp_path, *limits) as (url, router):
        process = psutil.Process(router.pid)
        with models_frozen(tiny_fleet, [r.engine_id for r in records]):
            running = threading.Thread(target=post, args=(url, "running"))
            running.start()
            wait_until(
                lambda: metric(url, "shoal_router_requests_inflight") == 1, STALL_S, "a request to run"
            )
            waiting = threading.Thread(target=post, args=(url, "waiting"))
            waiting.start()
            wait_until(lambda: metric(url, "shoal_router_requests_queued") == 1, STALL_S, "a request to wait")

            started = time.monotonic()
            refused = _complete(url, tiny_fleet.model, 30)
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["code"] == "router_busy"
            assert int(refused.headers["retry-after"]) >= 1
            assert time.monotonic() - started < 1.5, "a full line must refuse at once, not after a wait"

            # A flood of refusals holds no memory (nothing is queued past the bound).
            rss_before = process.memory_info().rss
            with httpx.Client(timeout=STALL_S) as http:
                for _ in range(300):
                    reply = http.post(url + "/v1/completions", json={"model": tiny_fleet.model, **BODY})
                    assert reply.status_code == 429
            assert process.memory_info().rss - rss_before < 32 * 2**20

            waiting.join(timeout=STALL_S)
            assert replies["waiting"].status_code == 429
            assert "no slot freed up within 2 s" in replies["waiting"].json()["error"]["message"]
        running.join(timeout=120)
        assert replies["running"].status_code == 200, replies["running"].text
        served = _complete(url, tiny_fleet.model, 60)
        assert served.status_code == 200, served.text
