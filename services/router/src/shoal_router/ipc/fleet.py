"""The router's view of the fleet, read from Redis every ``fleet_poll_interval_s``.

Each poll is one round trip: a Lua script (``_READ_FLEET``) reads the engine index (a SET) and
every engine's record, load report and emptying mark (``Keys.emptying``: the balancing leader is
emptying it). The same reads as two pipelined round trips cost the router 0.3 ms of CPU per
poll with 2 engines and 10 ms with 256; the script, 0.08 and 0.7 ms (``docs/benchmarks.md``).

An engine whose record says DEAD is lost: its socket closes and its requests go on on other
engines. One whose record expired (no heartbeat within its TTL) is SILENT first: it gets no new
requests, but its requests stay where they are, for ``silence_grace_s``. A heartbeat within
that time makes it ACTIVE again with nothing lost; none, and it is lost too. A machine that
stalls every process for longer than the TTL (or engines cut off from Redis for a while, but
not from the router) lets every record expire at once while every engine is alive and
streaming; without the grace, the router would stop every stream of the fleet to start it
again elsewhere. An engine process that dies drops its ZeroMQ link, which the router notices
at once, whatever its record says (``EngineClient``).

A DRAINING engine keeps its requests but gets no new ones, and so does an EMPTYING one (its
requests move away). Nothing on the token path waits on Redis; if Redis cannot be read, the last
view stays in force and the next poll tries again.

A Redis that restarted empty looks like every engine's record expiring at once. The poll also
sets the cluster's ``epoch`` key if it is missing; when it was, Redis lost its data,
and engines whose records are gone keep serving for ``restart_grace_s`` while they register
again (they do at their next heartbeat).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import cast

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shoal_protos.messages import PROTOCOL_VERSION
from shoal_protos.records import (
    EngineRecord,
    EngineState,
    Keys,
    LoadReport,
    MigrationRecord,
    engine_record_decoder,
    load_report_decoder,
    migration_record_decoder,
)
from shoal_router.core.dispatch import EngineView
from shoal_router.metrics import RouterMetrics

logger = logging.getLogger(__name__)

_READ_FLEET = """
-- KEYS[1]: the epoch key, KEYS[2]: the engine index; ARGV[1]: the cluster's key prefix.
-- Returns: 1 when the epoch key was missing (else 0), then for each engine id in the index its
-- id, record, load report (false: none) and emptying mark (0 or 1).
local missing = redis.call('SET', KEYS[1], '1', 'NX')
local out = {missing and 1 or 0}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  out[#out + 1] = id
  out[#out + 1] = redis.call('GET', ARGV[1] .. 'engine:' .. id)
  out[#out + 1] = redis.call('GET', ARGV[1] .. 'load:' .. id)
  out[#out + 1] = redis.call('EXISTS', ARGV[1] .. 'emptying:' .. id)
end
return out
"""
"""The fleet's state in one call. It reads keys named from the index it reads (``Keys.engine``,
``Keys.load``, ``Keys.emptying`` of each id) rather than declared in ``KEYS``: a single Redis,
replicated or not, allows that; a sharded Redis Cluster would not."""


class FleetView:
    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        on_engine_added: Callable[[EngineRecord], None],
        on_engine_lost: Callable[[str, str], None],
        restart_grace_s: float = 10.0,
        silence_grace_s: float = 1.0,
        metrics: RouterMetrics | None = None,
        reply_to: str = "",
    ) -> None:
        self._client = client
        # This router's output address, which engines count the requests they took in by.
        self._reply_to = reply_to
        self._restart_grace_s = restart_grace_s
        self._silence_grace_s = silence_grace_s
        # Engines whose record expired, and when this router first found it gone.
        self._silent_since: dict[str, float] = {}
        self._metrics = metrics
        self._restarted_at = float("-inf")
        self._keys = keys
        self._on_added = on_engine_added
        self._on_lost = on_engine_lost
        self.engines: dict[str, EngineView] = {}
        self.redis_ok = False
        self.polls = 0
        self.after_poll: list[Callable[[], None]] = []
        """Called after every poll, read or not (the router releases held requests there)."""
        self._read_fleet = client.register_script(_READ_FLEET)

    def engines_for(self, model: str) -> list[EngineView]:
        return [view for view in self.engines.values() if view.record.model == model]

    def models(self) -> set[str]:
        return {view.record.model for view in self.engines.values()}

    def max_model_len(self, model: str) -> int | None:
        lens = [view.record.max_model_len for view in self.engines_for(model)]
        return min(lens) if lens else None

    async def refresh(self) -> None:
        keys = self._keys
        values = await self._read_fleet(keys=[keys.epoch, keys.engines], args=[keys.prefix])
        if values[0] and self.engines:
            self._restarted_at = time.monotonic()
            logger.warning(
                "Redis lost the fleet state (restarted?); engines have %.0f s to register again",
                self._restart_grace_s,
            )
        seen: set[str] = set()
        dead: set[str] = set()
        stale: list[str] = []
        # In id order, as the engines are listed everywhere else.
        entries = sorted((values[i].decode(), *values[i + 1 : i + 4]) for i in range(1, len(values), 4))
        for engine_id, raw_record, raw_report, emptying in entries:
            if raw_record is None:
                stale.append(engine_id)
                continue
            try:
                record = engine_record_decoder.decode(raw_record)
                report: LoadReport | None = load_report_decoder.decode(raw_report) if raw_report else None
            except msgspec.DecodeError as exc:
                logger.warning("ignoring unreadable record of engine %s: %s", engine_id, exc)
                continue
            if record.protocol_version != PROTOCOL_VERSION:
                logger.warning(
                    "ignoring engine %s: protocol %d, router speaks %d",
                    engine_id,
                    record.protocol_version,
                    PROTOCOL_VERSION,
                )
                continue
            if record.state == EngineState.DEAD:
                dead.add(engine_id)
                continue
            seen.add(engine_id)
            self._upsert(record, report, bool(emptying))
        now = time.monotonic()
        # Right after Redis lost its data, a missing record is no sign of death (DEAD still is).
        in_grace = now - self._restarted_at < self._restart_grace_s
        for engine_id in [e for e in self.engines if e not in seen]:
            if engine_id in dead:
                self._lose(engine_id, "was marked DEAD")
            elif not in_grace:
                since = self._silent_since.setdefault(engine_id, now)
                if now - since >= self._silence_grace_s:
                    self._count_silence("lost")
                    self._lose(engine_id, "stopped heartbeating")
                elif not self.engines[engine_id].silent:
                    self.engines[engine_id].silent = True
                    logger.warning(
                        "engine %s missed its heartbeat: no new requests for it; its requests stay "
                        "there for %.1f s while it may come back",
                        engine_id,
                        self._silence_grace_s,
                    )
        if stale:
            # Index entries whose record expired; the engine re-adds itself if it comes back.
            await self._client.srem(self._keys.engines, *stale)

    def _count_silence(self, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.engine_silences.labels(outcome).inc()

    def _lose(self, engine_id: str, reason: str) -> None:
        del self.engines[engine_id]
        self._silent_since.pop(engine_id, None)
        logger.warning("engine %s %s: it leaves the fleet", engine_id, reason)
        self._on_lost(engine_id, reason)

    def _upsert(self, record: EngineRecord, report: LoadReport | None, emptying: bool = False) -> None:
        view = self.engines.get(record.engine_id)
        if view is None or view.record.zmq_address != record.zmq_address:
            if view is not None:
                self._on_lost(record.engine_id, "restarted at a new address")
            view = self.engines[record.engine_id] = EngineView(record, reply_to=self._reply_to)
            self._on_added(record)
            logger.info(
                "engine %s joined: model %s at %s", record.engine_id, record.model, record.zmq_address
            )
        view.record = record
        if self._silent_since.pop(record.engine_id, None) is not None and view.silent:
            view.silent = False
            self._count_silence("back")
            logger.info(
                "engine %s is heartbeating again: back in dispatch, its requests never moved",
                record.engine_id,
            )
        if view.emptying != emptying:
            view.emptying = emptying
        if report is not None:
            view.update_report(report)

    async def recent_migrations(self, count: int = 20) -> list[MigrationRecord]:
        """The cluster's latest migration records, newest first (none if Redis cannot say)."""
        try:
            ids = cast(list[bytes], await self._client.lrange(self._keys.migrations, 0, count - 1))
            raws = await self._client.mget([self._keys.migration(i.decode()) for i in ids]) if ids else []
        except (RedisError, OSError):
            return []
        records = []
        for raw in raws:
            if raw is None:
                continue  # expired
            try:
                records.append(migration_record_decoder.decode(raw))
            except msgspec.DecodeError:
                continue
        return records

    async def poll_forever(self, interval_s: float) -> None:
        while True:
            try:
                await self.refresh()
                if not self.redis_ok:
                    logger.info("reading fleet state from Redis")
                self.redis_ok = True
            except (RedisError, OSError) as exc:
                if self.redis_ok or self.polls == 0:
                    logger.warning("cannot read fleet state from Redis: %s", exc)
                self.redis_ok = False
            except Exception:
                # A bug in a callback must not freeze the router's view of the fleet for good.
                logger.exception("fleet poll failed; retrying")
            self.polls += 1
            for callback in self.after_poll:
                try:
                    callback()
                except Exception:
                    logger.exception("a callback after the fleet poll failed")
            await asyncio.sleep(interval_s)
