"""The engine's presence in Redis: its record, heartbeat and load reports.

One task on the event loop writes, every ``load_report_interval_s``, in one pipeline:

* the ``LoadReport`` under ``load:<id>``, expiring after the heartbeat TTL,
* a fresh TTL on the ``EngineRecord`` under ``engine:<id>`` (the heartbeat), and
* its id into the ``engines`` index set. A router that found the record expired removes the id
  from the index; if the engine wrote its record again in between, the next tick puts the id
  back, so a live engine never stays out of the index.

If the process dies, both keys expire within the TTL and routers stop dispatching to it. A Redis
outage does not stop serving: the failed write is counted and logged, and the next tick retries.
Nothing ends the loop but ``unregister``: an unexpected error is logged with its traceback and the
next tick tries again, and a tick that comes late (the event loop was blocked, or the machine did
not run the process) is logged with the delay, since a late heartbeat is what makes routers drop a
live engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shoal_engine.metrics import EngineMetrics
from shoal_protos.records import EngineRecord, EngineState, Keys, LoadReport, json_encoder

logger = logging.getLogger(__name__)
STOP_WAIT_S = 5.0
"""Longest wait, past one report interval, for the report loop to end (longer than a Redis
call's timeout)."""


class EngineRegistration:
    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        record: EngineRecord,
        ttl_s: float,
        interval_s: float,
        make_report: Callable[[int], LoadReport],
        metrics: EngineMetrics,
    ) -> None:
        self._client = client
        self._keys = keys
        self._record = record
        self._ttl_ms = int(ttl_s * 1000)
        self._interval_s = interval_s
        self._make_report = make_report
        self._metrics = metrics
        self._seq = 0
        self._task: asyncio.Task[None] | None = None
        self._reporting = False

    async def register(self) -> None:
        await self._write_record()
        await self._client.sadd(self._keys.engines, self._record.engine_id)
        self._reporting = True
        self._task = asyncio.create_task(self._report_forever(), name="load-reports")

    async def set_state(self, state: EngineState) -> None:
        self._record.state = state
        await self._write_record()

    async def _write_record(self) -> None:
        key = self._keys.engine(self._record.engine_id)
        await self._client.set(key, json_encoder.encode(self._record), px=self._ttl_ms)

    async def _report_forever(self) -> None:
        engine_id = self._record.engine_id
        load_key, engine_key = self._keys.load(engine_id), self._keys.engine(engine_id)
        failing = False
        loop = asyncio.get_running_loop()
        due = loop.time()
        while self._reporting:
            late_s = loop.time() - due
            if late_s > self._ttl_ms / 2000:
                logger.warning(
                    "heartbeat %.1f s late: the event loop was blocked or the process did not run", late_s
                )
            self._seq += 1
            try:
                report = self._make_report(self._seq)
                async with self._client.pipeline(transaction=False) as pipe:
                    pipe.set(load_key, json_encoder.encode(report), px=self._ttl_ms)
                    pipe.pexpire(engine_key, self._ttl_ms)
                    pipe.sadd(self._keys.engines, engine_id)
                    _, renewed, _ = await pipe.execute()
                if not renewed:
                    # The record expired (Redis restarted or we stalled past the TTL): write it again.
                    await self._write_record()
                if failing:
                    logger.info("load reports to Redis work again")
                failing = False
            except (RedisError, OSError) as exc:
                self._metrics.load_report_errors.inc()
                if not failing:
                    logger.warning("cannot write load report to Redis: %s", exc)
                failing = True
            except Exception:
                self._metrics.load_report_errors.inc()
                logger.exception("load report failed; retrying")
            due = loop.time() + self._interval_s
            await asyncio.sleep(self._interval_s)

    async def unregister(self) -> None:
        self._reporting = False
        if self._task is not None:
            # A cancellation landing inside a Redis call may not end the task (the client can
            # take it for a failed call); the loop also stops at its next turn now, so the wait
            # is bounded either way and shutdown never hangs on it.
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=self._interval_s + STOP_WAIT_S)
        engine_id = self._record.engine_id
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.delete(self._keys.engine(engine_id), self._keys.load(engine_id))
                pipe.srem(self._keys.engines, engine_id)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            logger.warning("cannot remove engine from Redis (its keys expire by TTL): %s", exc)
