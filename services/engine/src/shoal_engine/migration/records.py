"""What a move leaves behind: its result in the engine's history and metrics, its record in
Redis (read by routers, the operator's drains and the fleet page), the request's new owner
(fenced by generation), and the stall its target measured."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shoal_engine.metrics import EngineMetrics
from shoal_protos import engine_control_pb2 as pb
from shoal_protos.messages import AddRequest
from shoal_protos.moves import OUTCOME_NAMES, MoveCode
from shoal_protos.records import (
    Keys,
    MigrationRecord,
    OwnerRecord,
    json_encoder,
    migration_record_decoder,
)
from shoal_protos.tasks import background

logger = logging.getLogger(__name__)

RECORD_WAIT_S = 15.0
"""How long a target waits for the source's migration record, to add the stall to it."""

RECORD_TTL_S = 86400
OWNER_TTL_S = 3600

# Sets the owner record only if its generation moves forward (fencing).
_SET_OWNER = """
local current = redis.call('GET', KEYS[1])
if current then
  local generation = cjson.decode(current)['generation']
  if generation and generation >= tonumber(ARGV[2]) then return 0 end
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
return 1
"""


class MoveLog:
    def __init__(self, redis_client: aioredis.Redis, keys: Keys, metrics: EngineMetrics) -> None:
        self._redis = redis_client
        self._keys = keys
        self._metrics = metrics
        self._owner_script = redis_client.register_script(_SET_OWNER)
        self._history: deque[pb.MigrationResult] = deque(maxlen=256)
        # Records being written to Redis, by migration id (``written`` waits for one).
        self._writing: dict[str, asyncio.Task[None]] = {}

    def finish(
        self, result: pb.MigrationResult, code: MoveCode, detail: str, started: float
    ) -> pb.MigrationResult:
        """End the move with ``code``: count it, log it, keep it in the history and write its
        record to Redis (in the background; ``written`` waits for it)."""
        result.outcome = code.outcome
        result.detail = detail
        result.code = code.value
        result.duration_ms = (time.perf_counter() - started) * 1000
        name = OUTCOME_NAMES[code.outcome]
        self._metrics.migrated("source", result.reason, name, code)
        for phase, ms in result.phase_ms.items():
            self._metrics.migration_phase(phase, ms / 1000)
        self._history.appendleft(result)
        log = logger.info if code is MoveCode.MOVED else logger.warning
        log(
            "migration %s of %s to %s: %s%s (%d stages, %d bytes, %d blocks held there, %d tokens warm, "
            "downtime %.1f ms, %.1f ms in all)",
            result.migration_id,
            result.request_id,
            result.target_engine_id or "?",
            name,
            f" ({detail})" if detail else "",
            result.stages,
            result.bytes,
            result.target_cached_blocks,
            result.warm_tokens,
            result.downtime_ms,
            result.duration_ms,
        )
        migration_id = result.migration_id
        writing = background(self._write_record(result, name), f"record-{migration_id}")
        self._writing[migration_id] = writing
        writing.add_done_callback(lambda _: self._writing.pop(migration_id, None))
        return result

    async def written(self, migration_id: str) -> None:
        """Wait until the record of ``migration_id`` is in Redis (or could not be written)."""
        writing = self._writing.get(migration_id)
        if writing is not None:
            await asyncio.shield(writing)

    def history(self, limit: int) -> list[pb.MigrationResult]:
        return list(self._history)[: limit or None]

    async def _write_record(self, result: pb.MigrationResult, outcome: str) -> None:
        record = MigrationRecord(
            migration_id=result.migration_id,
            request_id=result.request_id,
            source=result.source_engine_id,
            target=result.target_engine_id,
            reason=result.reason,
            outcome=outcome,
            detail=result.detail,
            code=result.code,
            stages=result.stages,
            bytes=result.bytes,
            blocks=result.blocks,
            kv_tokens=result.kv_tokens,
            warm_tokens=result.warm_tokens,
            target_cached_blocks=result.target_cached_blocks,
            total_tokens=result.total_tokens,
            downtime_ms=result.downtime_ms,
            duration_ms=result.duration_ms,
            phase_ms=dict(result.phase_ms),
            source_step_ms=result.source_step_ms,
            source_step_ms_before=result.source_step_ms_before,
            finished_at=time.time(),
        )
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.set(
                    self._keys.migration(result.migration_id),
                    json_encoder.encode(record),
                    ex=RECORD_TTL_S,
                    nx=True,
                )
                pipe.lpush(self._keys.migrations, result.migration_id)
                pipe.ltrim(self._keys.migrations, 0, 999)
                await pipe.execute()
        except RedisError as exc:
            logger.warning("could not write migration record %s: %s", result.migration_id, exc)

    async def record_owner(self, add: AddRequest, engine_id: str) -> None:
        """Record ``engine_id`` as the request's owner, unless a later generation already is."""
        owner = OwnerRecord(
            request_id=add.request_id, engine_id=engine_id, generation=add.generation, router=add.reply_to
        )
        try:
            await self._owner_script(
                keys=[self._keys.owner(add.request_id)],
                args=[json_encoder.encode(owner), add.generation, OWNER_TTL_S],
            )
        except RedisError as exc:
            # Serving does not wait on Redis: the router learns the owner from the pieces.
            logger.warning("could not record the new owner of %s: %s", add.request_id, exc)

    async def record_stall(self, migration_id: str, stall_ms: float, phases: dict[str, float]) -> None:
        """Add the stall the target measured (and its parts) to the source's record."""
        key = self._keys.migration(migration_id)
        # The source writes the record when the commit returns; it may not be there yet (and a
        # loaded machine can hold the source up for seconds).
        deadline = time.monotonic() + RECORD_WAIT_S
        while time.monotonic() < deadline:
            try:
                raw = await self._redis.get(key)
                if raw is not None:
                    record = migration_record_decoder.decode(raw)
                    record.stall_ms = stall_ms
                    record.target_phase_ms = phases
                    await self._redis.set(key, json_encoder.encode(record), keepttl=True)
                    return
            except RedisError as exc:
                logger.warning("could not record the stall of migration %s: %s", migration_id, exc)
                return
            await asyncio.sleep(0.05)
