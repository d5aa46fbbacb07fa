"""The engine's heartbeat against a real Redis server: it outlives errors, expiry and a frozen Redis.

A heartbeat that stops while the engine lives makes every router drop a healthy engine for good,
so the loop must survive anything short of ``unregister``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import pytest
import redis.asyncio as aioredis

from shoal_engine.metrics import EngineMetrics
from shoal_engine.registry import EngineRegistration
from shoal_protos.records import (
    EngineRecord,
    EngineState,
    Keys,
    LoadReport,
    engine_record_decoder,
    state_client,
)
from tests.integration.support import redis_server as run_redis
from tests.integration.support import until

pytestmark = pytest.mark.integration

PORT = 16390
TTL_S = 1.0
INTERVAL_S = 0.05


@pytest.fixture(scope="module")
def redis_server() -> Iterator[subprocess.Popen[bytes]]:
    with run_redis(PORT) as proc:
        yield proc


class _Reports:
    """Builds load reports; raises on the calls a test asks it to."""

    def __init__(self) -> None:
        self.fail_next = 0
        self.calls = 0

    def __call__(self, seq: int) -> LoadReport:
        self.calls += 1
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("report source broke")
        return LoadReport(
            engine_id="engine-hb",
            seq=seq,
            time=time.time(),
            num_running=0,
            num_waiting=0,
            kv_blocks_used=0,
            kv_blocks_free=10,
            step_time_ms=0.0,
        )


@dataclass
class Heartbeat:
    registration: EngineRegistration
    client: aioredis.Redis
    keys: Keys
    reports: _Reports
    metrics: EngineMetrics

    def errors(self) -> float:
        value = self.metrics.registry.get_sample_value(
            "shoal_engine_load_report_errors_total", {"engine": "engine-hb", "model": "m"}
        )
        return value or 0.0


@pytest.fixture
async def heartbeat(redis_server: subprocess.Popen[bytes]) -> AsyncIterator[Heartbeat]:
    client = state_client(f"redis://127.0.0.1:{PORT}/0", 0.3)
    await client.flushall()
    keys = Keys("hb")
    record = EngineRecord(
        engine_id="engine-hb",
        model="m",
        zmq_address="tcp://127.0.0.1:1",
        http_address="http://127.0.0.1:2",
        max_model_len=64,
        kv_blocks_total=10,
        pid=os.getpid(),
        protocol_version=1,
        started_at=time.time(),
    )
    reports = _Reports()
    metrics = EngineMetrics("engine-hb", "m")
    reg = EngineRegistration(client, keys, record, TTL_S, INTERVAL_S, reports, metrics)
    await reg.register()
    yield Heartbeat(reg, client, keys, reports, metrics)
    await reg.unregister()
    await client.aclose()


async def _record(client: aioredis.Redis, keys: Keys) -> EngineRecord | None:
    raw = await client.get(keys.engine("engine-hb"))
    return engine_record_decoder.decode(raw) if raw else None


async def test_heartbeat_survives_a_failing_report(heartbeat: Heartbeat) -> None:
    client, keys, reports = heartbeat.client, heartbeat.keys, heartbeat.reports
    reports.fail_next = 3
    calls = reports.calls

    async def went_on() -> bool:
        return reports.calls > calls + 5

    await until(went_on, 5.0, "reports after the failures")
    assert reports.fail_next == 0
    assert await client.pttl(keys.engine("engine-hb")) > 0


async def test_expired_record_is_written_again(heartbeat: Heartbeat) -> None:
    client, keys = heartbeat.client, heartbeat.keys
    await client.delete(keys.engine("engine-hb"))
    await client.srem(keys.engines, "engine-hb")

    async def back() -> bool:
        record = await _record(client, keys)
        return record is not None and bool(await client.sismember(keys.engines, "engine-hb"))

    await until(back, 5.0, "the engine to register again")


async def test_index_entry_removed_while_the_record_lives_comes_back(heartbeat: Heartbeat) -> None:
    """A router that read the record expired removes the id from the index; if the engine wrote
    its record again in between, the heartbeat alone must put the id back."""
    client, keys = heartbeat.client, heartbeat.keys
    await client.srem(keys.engines, "engine-hb")
    assert await _record(client, keys) is not None  # the record never went away

    async def indexed() -> bool:
        return bool(await client.sismember(keys.engines, "engine-hb"))

    await until(indexed, 5.0, "the heartbeat to index the engine again")


async def test_heartbeat_resumes_after_redis_froze(
    heartbeat: Heartbeat, redis_server: subprocess.Popen[bytes]
) -> None:
    keys = heartbeat.keys
    errors_before = heartbeat.errors()
    # A frozen Redis answers nothing; calls must time out instead of hanging the heartbeat.
    os.kill(redis_server.pid, signal.SIGSTOP)
    try:
        frozen_at = time.monotonic()
        await asyncio.sleep(3 * TTL_S)
    finally:
        os.kill(redis_server.pid, signal.SIGCONT)
    # Each call timed out and was counted, instead of one call waiting on Redis all along.
    assert heartbeat.errors() >= errors_before + 2
    # Redis expires keys by its own clock, which ran on while it was stopped.
    checker = aioredis.Redis(port=PORT, socket_timeout=2)
    try:

        async def fresh() -> bool:
            raw = await checker.get(keys.load("engine-hb"))
            return raw is not None and await checker.pttl(keys.engine("engine-hb")) > 0

        await until(fresh, 5.0, "heartbeats to resume")
        assert time.monotonic() - frozen_at < 3 * TTL_S + 5.0
        record = await _record(checker, keys)
        assert record is not None and record.state == EngineState.ACTIVE
    finally:
        await checker.aclose()
