"""Redis restarts empty under running streams: serving goes on from the last fleet state, no
request fails, the router never drops an engine, and the engines register again by themselves.

Redis runs without persistence, so after the restart every engine record is gone at once, which
is what an engine whose heartbeat lapsed looks like; the router tells the two apart by the
cluster's epoch key (see ``shoal_router.ipc.fleet``)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
import redis

from tests.integration.support import STALL_S, RunningFleet, wait_until

pytestmark = pytest.mark.integration


def _health(fleet: RunningFleet) -> tuple[int, dict[str, str]]:
    reply = httpx.get(fleet.base_url + "/health", timeout=STALL_S)
    return reply.status_code, reply.json()["engines"]


async def test_streams_and_dispatch_survive_a_redis_restart(tiny_fleet: RunningFleet) -> None:
    engine_ids = [tiny_fleet.cfg.engine_id(i) for i in range(2)]
    assert _health(tiny_fleet) == (200, dict.fromkeys(engine_ids, "ACTIVE"))
    body = {
        "model": tiny_fleet.model,
        "prompt": [3, 1, 4],
        # Long enough to run through the restart (the tiny fleet relays a few hundred a second),
        # even when the machine holds this test back for seconds.
        "max_tokens": tiny_fleet.cfg.max_model_len - 192,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    streaming = threading.Event()

    async def long_stream(http: httpx.AsyncClient) -> tuple[str, int]:
        last, usage = "", 0
        async with http.stream("POST", tiny_fleet.base_url + "/v1/completions", json=body) as reply:
            streaming.set()
            if reply.status_code != 200:
                await reply.aread()
                raise AssertionError(f"{reply.status_code} {reply.text}")
            async for line in reply.aiter_lines():
                if line.startswith("data: "):
                    last = line
                    if '"usage":{' in line:
                        usage = json.loads(line.removeprefix("data: "))["usage"]["completion_tokens"]
        return last, usage

    # What the router's /health says while Redis is away and back: it must stay ready with both
    # engines ACTIVE throughout (a router that took the empty Redis for dead engines drops them).
    seen: list[tuple[int, dict[str, str]]] = []
    stop_watching = threading.Event()

    def watch() -> None:
        while not stop_watching.is_set():
            seen.append(_health(tiny_fleet))
            time.sleep(0.05)

    def restart_redis() -> None:
        assert streaming.wait(180), "no stream started"
        tiny_fleet.fleet.restart("redis")

    watcher = threading.Thread(target=watch)
    async with httpx.AsyncClient(timeout=120) as http:
        streams = [asyncio.create_task(long_stream(http)) for _ in range(4)]
        watcher.start()
        try:
            await asyncio.to_thread(restart_redis)

            # The engines write their records again at their next heartbeat. (This test's own
            # client may still hold a connection from before the restart: it reads again.)
            def registered() -> bool:
                try:
                    return all(tiny_fleet.engine_record(e) is not None for e in engine_ids)
                except redis.ConnectionError:
                    return False

            await asyncio.to_thread(wait_until, registered, STALL_S, "the engines to register again")
            results = await asyncio.wait_for(asyncio.gather(*streams), timeout=240)
        finally:
            stop_watching.set()
            await asyncio.to_thread(watcher.join)

    assert results == [("data: [DONE]", body["max_tokens"])] * 4, results
    assert seen, "the router's health was never read"
    assert all(state == (200, dict.fromkeys(engine_ids, "ACTIVE")) for state in seen), [
        state for state in seen if state != (200, dict.fromkeys(engine_ids, "ACTIVE"))
    ]
    # The router marked the new Redis at its first poll after the restart.
    wait_until(lambda: tiny_fleet.redis.get(tiny_fleet.keys.epoch) is not None, STALL_S, "the epoch key")
    # New requests are dispatched as before.
    async with httpx.AsyncClient(timeout=60) as http:
        for _ in range(4):
            reply = await http.post(
                tiny_fleet.base_url + "/v1/completions",
                json={"model": tiny_fleet.model, "prompt": [1, 2], "max_tokens": 2},
            )
            assert reply.status_code == 200, reply.text
