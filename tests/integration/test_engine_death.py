"""Engines killed mid-request: their streams end with an error event, never a hang, and they
leave dispatch within their heartbeat TTL. Runs last: it kills the shared tiny fleet's engines."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import openai
import psutil
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


def test_engine_frozen_past_its_ttl_comes_back_into_dispatch(tiny_fleet: RunningFleet) -> None:
    """A live engine whose heartbeat lapsed (its process was starved) leaves dispatch, registers
    again by itself once it runs, and the router takes it back and serves from it."""
    engine_id = tiny_fleet.cfg.engine_id(0)
    record = tiny_fleet.engine_record(engine_id)
    assert record is not None
    os.kill(record.pid, signal.SIGSTOP)
    try:
        wait_until(
            lambda: _router_state(tiny_fleet, engine_id) is None,
            tiny_fleet.cfg.heartbeat_ttl_s + 5.0,
            f"the router to drop the frozen {engine_id}",
        )
    finally:
        os.kill(record.pid, signal.SIGCONT)
    wait_until(
        lambda: _router_state(tiny_fleet, engine_id) == "ACTIVE", 10.0, f"the router to take {engine_id} back"
    )
    # Ties between idle engines break at random: 16 requests all missing it is a 1 in 65,536 chance.
    before = dispatched(tiny_fleet).get(engine_id, 0.0)
    for _ in range(16):
        reply = httpx.post(
            tiny_fleet.base_url + "/v1/completions",
            json={"model": tiny_fleet.model, "prompt": [1, 2, 3], "max_tokens": 2},
            timeout=30,
        )
        assert reply.status_code == 200, reply.text
    assert dispatched(tiny_fleet).get(engine_id, 0.0) > before


async def test_killed_engines_end_their_streams_and_leave_dispatch(tiny_fleet: RunningFleet) -> None:
    records = {
        r.engine_id: r for i in range(2) if (r := tiny_fleet.engine_record(tiny_fleet.cfg.engine_id(i)))
    }
    assert len(records) == 2
    engine_of: dict[int, str] = {}
    first_with_tokens: list[int] = []
    some_stream_has_tokens = threading.Event()
    body = {
        "model": tiny_fleet.model,
        "prompt": [7, 8, 9],
        # As long as the tiny model's context allows: the engines' front ends can lag their cores by
        # hundreds of tokens when the machine stalls, and a kill must still meet unfinished streams.
        "max_tokens": tiny_fleet.cfg.max_model_len - 192,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }

    async def long_stream(http: httpx.AsyncClient, i: int) -> str:
        """Read the SSE stream cheaply (the parsing of a full client would make this process,
        not the engines, the bottleneck) and return how it ended."""
        async with http.stream("POST", tiny_fleet.base_url + "/v1/completions", json=body) as reply:
            assert reply.status_code == 200
            # The router names the engine in a header; it is sent with the first token.
            engine_of[i] = reply.headers["x-shoal-engine"]
            last = ""
            async for line in reply.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if not first_with_tokens:
                    first_with_tokens.append(i)
                    some_stream_has_tokens.set()
                last = line
        if last == "data: [DONE]":
            return "completed"
        error = json.loads(last.removeprefix("data: "))["error"]
        return f"error: {error['message']}"

    busy_at_kill: dict[str, int] = {}

    def kill_a_busy_engine() -> str:
        # A thread, so that the kill does not wait for the busy event loop.
        assert some_stream_has_tokens.wait(60), "no stream got tokens"
        # The tiny model decodes a whole stream in a few seconds, so a request counted as
        # running could finish between the count and the kill. Freeze vLLM's processes under both
        # engines first: a request an engine still counts then cannot finish (short of its last
        # step's output already being on its way), and the kill meets it running.
        cores = {e: psutil.Process(r.pid).children(recursive=True) for e, r in records.items()}
        for processes in cores.values():
            for process in processes:
                process.suspend()
        victim = ""
        try:
            for engine_id, record in records.items():
                health = httpx.get(record.http_address + "/health", timeout=5).json()
                busy_at_kill[engine_id] = int(health.get("requests", 0))
            victim = max(busy_at_kill, key=lambda e: busy_at_kill[e])
            _kill_engine(records[victim].pid)
        finally:
            for engine_id, processes in cores.items():
                if engine_id != victim:
                    for process in processes:
                        process.resume()
        return victim

    async with httpx.AsyncClient(timeout=120) as http:
        tasks = [asyncio.create_task(long_stream(http, i)) for i in range(4)]
        victim = await asyncio.to_thread(kill_a_busy_engine)
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=240)
    survivor = next(engine_id for engine_id in records if engine_id != victim)
    # Streams the killed engine was still running end with an error event naming it (they had
    # tokens already: headers come with the first one); the others complete. None hangs.
    errors = [i for i, result in enumerate(results) if result.startswith("error")]
    for i, result in enumerate(results):
        if i in errors:
            assert engine_of[i] == victim and victim in result, (i, result)
        else:
            assert result == "completed", (i, result)
    if busy_at_kill[victim]:
        assert errors, (busy_at_kill, results)
    client = openai.AsyncOpenAI(
        base_url=tiny_fleet.base_url + "/v1", api_key="unused", max_retries=0, timeout=120
    )

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
    _kill_engine(records[survivor].pid)
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
