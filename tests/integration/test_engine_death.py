"""An engine killed mid-request: its streams end with an error event, never a hang, and it leaves
dispatch within its heartbeat TTL. Runs last: it takes an engine out of the shared tiny fleet."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import openai
import pytest

from tests.integration.support import RunningFleet, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.destructive]


async def test_killed_engine_ends_its_streams_and_leaves_dispatch(tiny_fleet: RunningFleet) -> None:
    victim = tiny_fleet.cfg.engine_id(1)
    record = tiny_fleet.engine_record(victim)
    assert record is not None
    client = openai.AsyncOpenAI(base_url=tiny_fleet.base_url + "/v1", api_key="unused", max_retries=0,
                                timeout=120)

    async def long_stream() -> str:
        stream = await client.completions.create(
            model=tiny_fleet.model, prompt=[7, 8, 9], max_tokens=1900, stream=True, temperature=0,
            extra_body={"ignore_eos": True})
        try:
            async for _ in stream:
                pass
        except openai.APIError as exc:
            return f"error: {exc.message}"
        return "completed"

    tasks = [asyncio.create_task(long_stream()) for _ in range(4)]
    deadline = time.monotonic() + 30
    while not ((report := tiny_fleet.load_report(victim)) and report.num_running >= 1):
        assert time.monotonic() < deadline, "no stream reached the engine about to be killed"
        await asyncio.sleep(0.05)

    os.kill(record.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
    errors = [r for r in results if r.startswith("error")]
    assert errors, results
    assert all(victim in e for e in errors), errors

    # Out of dispatch within the heartbeat TTL (plus one poll of the router).
    def gone() -> bool:
        engines = httpx.get(tiny_fleet.base_url + "/health", timeout=5).json()["engines"]
        return victim not in engines

    wait_until(gone, tiny_fleet.cfg.heartbeat_ttl_s + 1.0, f"{victim} to leave the router's view")
    assert time.monotonic() - killed_at <= tiny_fleet.cfg.heartbeat_ttl_s + 1.5
    assert tiny_fleet.redis.get(tiny_fleet.keys.engine(victim)) is None

    # Every new request now goes to the surviving engine and succeeds.
    for _ in range(4):
        reply = await client.completions.create(model=tiny_fleet.model, prompt=[1, 2], max_tokens=2)
        assert reply.usage is not None and reply.usage.completion_tokens >= 1
