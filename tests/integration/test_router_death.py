"""A router that dies mid-stream: the engine aborts the requests it owned (nothing generates for
a client that is gone) and the client's connection closes instead of hanging.

A second router process on the tiny fleet sends a request to an engine whose vLLM processes the
test froze (so the request cannot finish by itself), is SIGKILLed, and the test waits for the
engine to drop the request while its model is still frozen."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import httpx
import pytest

from tests.integration.support import STALL_S, RunningFleet, extra_router, models_frozen, wait_until

pytestmark = pytest.mark.integration


def _finished(fleet: RunningFleet, engine_id: str, reason: str) -> float:
    text = fleet.engine_metrics(engine_id)
    pattern = rf'^shoal_engine_requests_total\{{[^}}]*finish_reason="{reason}"[^}}]*\}} (\S+)$'
    return sum(float(count) for count in re.findall(pattern, text, re.M))


def _running(fleet: RunningFleet, engine_id: str) -> int:
    record = fleet.engine_record(engine_id)
    assert record is not None
    return int(httpx.get(record.http_address + "/health", timeout=STALL_S).json()["requests"])


def test_engines_abort_the_requests_of_a_router_that_died(tiny_fleet: RunningFleet, tmp_path: Path) -> None:
    records = [r for i in range(2) if (r := tiny_fleet.engine_record(tiny_fleet.cfg.engine_id(i)))]
    assert len(records) == 2
    aborted_before = {r.engine_id: _finished(tiny_fleet, r.engine_id, "abort") for r in records}
    # Freeze vLLM under both engines first: the request is admitted but cannot finish by itself.
    body = {"model": tiny_fleet.model, "prompt": [5, 6, 7], "max_tokens": 64, "stream": True}
    client_saw: list[BaseException] = []

    def client(url: str) -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as reply:
                reply.read()
        except httpx.HTTPError as exc:
            client_saw.append(exc)

    with (
        extra_router(tiny_fleet, "router-doomed", tmp_path) as (url, router),
        models_frozen(tiny_fleet, [r.engine_id for r in records]),
    ):
        streaming = threading.Thread(target=client, args=(url,))
        streaming.start()
        wait_until(
            lambda: sum(_running(tiny_fleet, r.engine_id) for r in records) == 1,
            STALL_S,
            "an engine to take the request",
        )
        engine_id = next(r.engine_id for r in records if _running(tiny_fleet, r.engine_id))
        router.kill()
        router.wait(timeout=STALL_S)
        # The client's connection closes with the router (no hang); the engine, told by its
        # link to the router, drops the request though its model never ran a step for it.
        streaming.join(timeout=STALL_S)
        assert not streaming.is_alive(), "the client hangs on a dead router"
        assert client_saw and isinstance(client_saw[0], httpx.RemoteProtocolError), client_saw
        wait_until(
            lambda: _running(tiny_fleet, engine_id) == 0,
            STALL_S,
            f"{engine_id} to drop the dead router's request",
        )
    assert _finished(tiny_fleet, engine_id, "abort") == aborted_before[engine_id] + 1
