"""Engines killed mid-request: their streams end with an error event, never a hang, and they
leave dispatch within their heartbeat TTL. Runs last: it kills the shared tiny fleet's engines."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.integration.support import RunningFleet, dispatched, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.destructive]


def _kill_engine(pid: int) -> None:
    """SIGKILL the engine and vLLM's processes under it, as when its pod dies (supervisord gives
    each program its own process group)."""
    os.killpg(os.getpgid(pid), signal.SIGKILL)


def _router_state(fleet: RunningFleet, engine_id: str) -> str | None:
    engines: dict[str, str] = httpx.get(fleet.base_url + "/health", timeout=5).json()["engines"]
    return engines.get(engine_id)


async def test_killed_engines_end_their_streams_and_leave_dispatch(tiny_fleet: RunningFleet) -> None:
    records = {i: tiny_fleet.engine_record(tiny_fleet.cfg.engine_id(i)) for i in range(2)}
    assert all(records.values())
    dispatched_before = dispatched(tiny_fleet)
    chosen: list[str] = []
    client = openai.AsyncOpenAI(
        base_url=tiny_fleet.base_url + "/v1", api_key="unused", max_retries=0, timeout=120
    )
    have_tokens = [threading.Event() for _ in range(4)]

    async def long_stream(i: int) -> str:
        stream = await client.completions.create(
            model=tiny_fleet.model,
            prompt=[7, 8, 9],
            max_tokens=1900,
            stream=True,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        received = 0
        try:
            async for _ in stream:
                received += 1
                if received == 5:
                    have_tokens[i].set()
                # Hand the loop to the other streams: buffered chunks would let one task run
                # its whole stream before the others read their first token.
                await asyncio.sleep(0)
        except openai.APIError as exc:
            return f"error: {exc.message}"
        return "completed"

    def kill_once_all_have_tokens() -> None:
        # A thread, so that the kill does not wait for the busy event loop.
        for event in have_tokens:
            assert event.wait(60), "a stream got no tokens"
        # The victim is an engine that runs some of these streams, as the router counted them.
        after = dispatched(tiny_fleet)
        busy = [e for e in sorted(after, reverse=True) if after[e] > dispatched_before.get(e, 0)]
        chosen.append(busy[0])
        _kill_engine(next(r.pid for r in records.values() if r and r.engine_id == busy[0]))

    # Dispatch spreads four streams over the two engines; kill one once every stream has tokens,
    # so that none of them is simply sent again elsewhere.
    killer = threading.Thread(target=kill_once_all_have_tokens)
    killer.start()
    tasks = [asyncio.create_task(long_stream(i)) for i in range(4)]
    results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=90)
    killer.join()
    victim = chosen[0]
    survivor = next(r.engine_id for r in records.values() if r and r.engine_id != victim)
    survivor_pid = next(r.pid for r in records.values() if r and r.engine_id == survivor)
    errors = [r for r in results if r.startswith("error")]
    assert errors, results
    assert all(victim in e for e in errors), errors
    assert results.count("completed") == 4 - len(errors)

    # The heartbeat expires and the router forgets the engine; new requests go to the survivor.
    wait_until(
        lambda: tiny_fleet.redis.get(tiny_fleet.keys.engine(victim)) is None,
        10.0,
        f"{victim}'s Redis record to expire",
    )
    wait_until(lambda: _router_state(tiny_fleet, victim) is None, 5.0, f"the router to forget {victim}")
    for _ in range(4):
        reply = await client.completions.create(model=tiny_fleet.model, prompt=[1, 2], max_tokens=2)
        assert reply.usage is not None and reply.usage.completion_tokens >= 1

    # With the machine quiet, time how fast the last engine leaves dispatch once killed.
    _kill_engine(survivor_pid)
    killed_at = time.monotonic()
    wait_until(
        lambda: _router_state(tiny_fleet, survivor) in (None, "UNREACHABLE"),
        tiny_fleet.cfg.heartbeat_ttl_s,
        f"{survivor} to leave dispatch",
    )
    assert time.monotonic() - killed_at <= tiny_fleet.cfg.heartbeat_ttl_s
    async with httpx.AsyncClient(timeout=30) as http:
        reply_503 = await http.post(
            tiny_fleet.base_url + "/v1/completions",
            json={"model": tiny_fleet.model, "prompt": [1, 2], "max_tokens": 2},
        )
    assert reply_503.status_code == 503
    assert reply_503.json()["error"]["code"] == "no_engine"
    assert "retry-after" in reply_503.headers
