"""Live migration: move a running request, with its KV cache, to another engine.

One ``MigrationManager`` per engine plays both roles. As the **source** (``migrate``)::

    prepare   target reserves room or refuses            (gRPC PrepareMigration)
    pre-copy  full KV blocks -> target's staging area,    (KV agent SendBlocks, in stages,
              while the request keeps decoding here        bounded by max stages / last-stage blocks)
    stop      at a step boundary, no final piece; vLLM     (EngineService.stop_for_migration,
              keeps the blocks while the agent holds them   KV agent Hold / Release)
    last      the blocks filled since, the partial one too (SendBlocks partial=True)
    commit    token state -> target, which admits          (gRPC CommitMigration)
              prompt + outputs so far with the KV loaded
    switch    owner record in Redis (fencing generation),  (hand-over piece to the router)
              the router moves the request to the target
    free      vLLM freed the source's blocks at the stop

Full blocks never change again, so they are copied while the request decodes; only the few
blocks filled since the last pre-copy stage, and the partly filled last one, are copied while
the request is stopped. The target loads the KV of every token but the last sampled one, which
it computes like a decode step, so the output goes on exactly as if the request never moved.
Every step has a deadline. A target that refuses or fails
before the stop leaves the request running here; one that fails after the stop gets the request
back here: it resumes from its tokens, with this engine's prefix cache still holding its KV.

As the **target** it answers ``PrepareMigration`` / ``CommitMigration`` / ``CancelMigration``;
a staging area with no commit is freed when its reservation times out.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
import msgspec
import redis.asyncio as aioredis
import zmq
import zmq.asyncio
from redis.exceptions import RedisError

from shoal_engine.backend import BackendRequestError, EngineTimes
from shoal_engine.config import EngineConfig
from shoal_engine.ipc.sockets import valid_reply_to
from shoal_engine.metrics import EngineMetrics
from shoal_engine.serving import EngineService, StoppedRequest
from shoal_protos import engine_control_pb2 as pb
from shoal_protos import engine_control_pb2_grpc as pb_grpc
from shoal_protos import kv
from shoal_protos.addresses import zmq_connect
from shoal_protos.messages import (
    AbortRequest,
    AddRequest,
    EngineRequestDecoder,
    FrameType,
    RouterRequestEncoder,
)
from shoal_protos.records import (
    TARGET_PHASES,
    EngineRecord,
    EngineState,
    Keys,
    MigrationRecord,
    OwnerRecord,
    engine_record_decoder,
    json_encoder,
    load_report_decoder,
    migration_record_decoder,
)
from shoal_protos.tasks import background
from shoal_protos.tls import FleetTls, aio_channel

logger = logging.getLogger(__name__)

_UNREACHABLE_S = 10.0
"""How long a target whose control API refused connections is left out of target picking."""
_RECORD_WAIT_S = 15.0
"""How long a target waits for the source's migration record, to add the stall to it."""

MIN_TOKENS_LEFT = 16
"""A request the engine picks to move must have this many tokens still to generate (moving one
about to finish costs more than it saves)."""

_OUTCOME_NAMES = {pb.MIGRATED: "MIGRATED", pb.REFUSED: "REFUSED", pb.FAILED: "FAILED", pb.GONE: "GONE"}

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


MAX_CHANNELS = 32
"""Channels to other engines' control APIs kept open; past this, the least recently used one
is closed."""


class MigrationError(Exception):
    """A migration step failed; the request stays on (or comes back to) the source."""


class AgentClient:
    """The engine service's line to its KV agent (a REQ socket; one call at a time)."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, timeout_s: float) -> None:
        self._ctx = ctx
        self._address = address
        self._timeout_s = timeout_s
        self._lock = asyncio.Lock()
        self._sock: zmq.asyncio.Socket | None = None

    async def call(self, command: kv.AgentCommand) -> kv.AgentReply:
        async with self._lock:
            if self._sock is None:
                self._sock = self._ctx.socket(zmq.REQ)
                self._sock.setsockopt(zmq.LINGER, 0)
                zmq_connect(self._sock, self._address)
            sock = self._sock
            try:
                await sock.send(kv.encoder.encode(command))
                if not await sock.poll(self._timeout_s * 1000):
                    raise MigrationError(f"KV agent did not answer within {self._timeout_s} s")
                reply = kv.agent_reply_decoder.decode(await sock.recv())
            except BaseException:
                # A REQ socket whose reply was not read (timeout, cancellation) is stuck in
                # its send-receive cycle: start over with a new one.
                sock.close(linger=0)
                self._sock = None
                raise
        if isinstance(reply, kv.AgentError):
            raise MigrationError(f"KV agent: {reply.message}")
        return reply

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)


@dataclass(slots=True)
class _Reservation:
    blocks: int
    expiry: asyncio.TimerHandle


_SHARDED = (
    "tensor- or pipeline-parallel engines do not move requests yet: each worker holds a shard of "
    "the KV cache, and the shards would have to go rank to rank"
)
"""Why an engine of several vLLM workers refuses moves, out and in. Each worker's KV agent
serves its own shard (on ports offset by its rank); a move through rank 0's alone would copy
part of the KV and corrupt the request on its target."""


class MigrationManager:
    def __init__(
        self,
        config: EngineConfig,
        service: EngineService,
        load_free_blocks: Callable[[], int],
        redis_client: aioredis.Redis,
        keys: Keys,
        metrics: EngineMetrics,
        tls: FleetTls | None = None,
    ) -> None:
        """``tls``: the fleet's TLS files (loaded once by the engine), for calls to other
        engines' EngineControl; None: plain calls."""
        self._config = config
        self._engine_id = config.engine_id
        self._service = service
        self._free_blocks = load_free_blocks
        self._redis = redis_client
        self._keys = keys
        self._metrics = metrics
        self._ctx = zmq.asyncio.Context()
        self._agent = AgentClient(self._ctx, config.kv_agent_address, config.migration_step_timeout_s)
        # Channels to other engines' control APIs, the most recently used last.
        self._channels: OrderedDict[str, grpc.aio.Channel] = OrderedDict()
        self._tls = tls
        self._peer_push: dict[str, zmq.Socket[bytes]] = {}
        self._push_ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(self._ctx.underlying)
        self._encoder = RouterRequestEncoder()
        self._add_decoder = EngineRequestDecoder()
        self._reserved: dict[str, _Reservation] = {}
        self._moving: set[str] = set()
        self._history: deque[pb.MigrationResult] = deque(maxlen=256)
        # Records being written to Redis, by migration id (``migrate`` returns after its own).
        self._writing: dict[str, asyncio.Task[None]] = {}
        self._status: kv.Status | None = None
        self._owner_script = redis_client.register_script(_SET_OWNER)
        # Migrated-in requests awaiting their first token: id -> (migration, source's last
        # output (wall clock), when the commit reached this engine (monotonic)).
        self._arriving: dict[str, tuple[str, float, float]] = {}
        service.forward_abort = self._forward_abort
        service.on_first_output = self._first_output
        # Takes the engine out of the rotation (True) or back in: the engine's main sets it to
        # its Redis record's state and the service's refusal of new requests.
        self.set_draining: Callable[[bool], Awaitable[None]] | None = None
        self._rejoin: asyncio.Task[None] | None = None
        # Engines whose control API could not be reached, until when they are not picked.
        self._unreachable: dict[str, float] = {}

    # ---- source side --------------------------------------------------------------------------

    async def migrate(
        self, request_id: str, target_engine_id: str, reason: str, mode: int = pb.PRECOPY
    ) -> pb.MigrationResult:
        """Move ``request_id`` (or, left empty, the request cheapest to move) to
        ``target_engine_id`` (or, left empty, the engine this one picks). The result comes back
        once its record is in Redis, so that a caller reading the records finds it."""
        result = await self._migrate_one(request_id, target_engine_id, reason, mode)
        writing = self._writing.get(result.migration_id)
        if writing is not None:
            await asyncio.shield(writing)
        return result

    async def _migrate_one(
        self, request_id: str, target_engine_id: str, reason: str, mode: int
    ) -> pb.MigrationResult:
        started = time.perf_counter()
        if not request_id:  # the caller (a balancing policy) leaves the choice to this engine
            request_id = self._service.cheapest_to_move(MIN_TOKENS_LEFT) or ""
        result = pb.MigrationResult(
            migration_id=uuid.uuid4().hex[:16],
            request_id=request_id,
            source_engine_id=self._engine_id,
            target_engine_id=target_engine_id,
            reason=reason or "admin",
        )
        if not request_id:
            detail = f"no running request here has produced a token and has {MIN_TOKENS_LEFT}+ to go"
            return self._finish(result, pb.GONE, detail, started, "no_candidate")
        if request_id in self._moving:
            return self._finish(result, pb.GONE, "the request is already moving", started, "already_moving")
        if self._service.tokens_of(request_id) is None:
            moved = self._service.moved_to(request_id)
            where = f" (it moved to {moved})" if moved else ""
            return self._finish(
                result, pb.GONE, f"the request is not running here{where}", started, "not_running"
            )
        if self._config.parallel_workers > 1:
            return self._finish(result, pb.REFUSED, _SHARDED, started, "sharded")
        self._moving.add(request_id)
        try:
            await self._migrate(result, started, mode)
        except (MigrationError, grpc.aio.AioRpcError, TimeoutError, RedisError, OSError) as exc:
            detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            code = "step_failed"
            if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE:
                # The target died but its record has not expired yet: pick others for a while.
                self._unreachable[result.target_engine_id] = time.monotonic() + _UNREACHABLE_S
                code = "target_unreachable"
            elif isinstance(exc, TimeoutError) or (
                isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            ):
                code = "step_timeout"
            return self._finish(result, pb.FAILED, detail or type(exc).__name__, started, code)
        finally:
            self._moving.discard(request_id)
        return result

    async def _migrate(  # noqa: PLR0915 (over the complexity budget: to be a state machine)
        self, result: pb.MigrationResult, started: float, mode: int
    ) -> None:
        config = self._config
        request_id = result.request_id
        clock = _PhaseClock(result, started)
        began = time.monotonic()  # the clock the KV agent stamps the forward passes on
        target = await self._pick_target(result.target_engine_id)
        if target is None:
            self._finish(result, pb.REFUSED, "no active engine to move to", started, "no_target")
            return
        result.target_engine_id = target.engine_id
        status = await self._agent_status()
        block = status.block_size
        stub = self._stub(target.control_address)
        timeout = config.migration_step_timeout_s
        # A request that just arrived (a move right after a move) has no blocks here before its
        # first step: pre-copy would find none to send, and the stop would send them all.
        await self._service.wait_output_here(request_id, timeout / 2)
        tokens = self._service.tokens_of(request_id) or 0
        max_tokens = self._service.max_tokens_of(request_id) or tokens
        prepared = await stub.PrepareMigration(
            pb.PrepareRequest(
                migration_id=result.migration_id,
                request_id=request_id,
                source_engine_id=self._engine_id,
                num_blocks=math.ceil(tokens / block),
                max_blocks=math.ceil(max_tokens / block),
                bytes_per_block=status.bytes_per_block,
            ),
            timeout=timeout,
        )
        clock.mark("prepare")
        if not prepared.accepted:
            self._finish(result, pb.REFUSED, prepared.detail, started, "target_refused")
            return
        stopped: StoppedRequest | None = None
        try:
            next_block = 0
            # A drain empties an engine that is leaving: its moves go at full speed.
            pace, share = (
                (0, 0.0)
                if result.reason == "drain"
                else (config.migration_precopy_mib_per_s << 20, config.migration_precopy_share)
            )
            while mode in (pb.PRECOPY, pb.PRECOPY_UNWARMED):
                sent = await self._agent.call(
                    kv.SendBlocks(
                        request_id=request_id,
                        migration_id=result.migration_id,
                        target=prepared.kv_address,
                        first_block=next_block,
                        max_bytes_per_s=pace,
                        max_busy_share=share,
                        # A paced stage sends what it can in half a step deadline; later
                        # stages send the rest.
                        max_seconds=timeout / 2 if pace or share else 0.0,
                    )
                )
                _count_stage(result, sent)
                if sent.preempted:
                    # Its blocks went back to vLLM during the stage: the next stage sends them
                    # again from the same block, once the request has recomputed them.
                    self._metrics.migration_stages_lost.inc()
                    logger.info(
                        "migration %s: %s was preempted during a pre-copy stage; sending it again",
                        result.migration_id,
                        request_id,
                    )
                next_block = sent.next_block
                now = self._service.tokens_of(request_id)
                if now is None:
                    raise _GoneError
                left = now // block - next_block
                # The last stage runs before the stop: it is at most this small.
                if (
                    left <= config.migration_last_stage_max_blocks
                    or result.stages >= config.migration_max_stages
                ):
                    break
            if mode in (pb.PRECOPY, pb.PRECOPY_UNWARMED):
                clock.mark("precopy")
            if mode == pb.PRECOPY and next_block and config.migration_warm and config.backend == "vllm":
                result.warm_tokens = await self._warm(
                    stub, result.migration_id, request_id, next_block, block
                )
                clock.mark("warm")
            # Stop right after an output with the blocks kept, send what is left (the last
            # block partly filled) at once, then let vLLM free them.
            await self._agent.call(kv.Hold(request_id=request_id, hold_s=timeout))
            stop_wall = time.time()
            try:
                stopped = await self._service.stop_for_migration(request_id, align_s=timeout / 2)
                if stopped is None:
                    raise _GoneError
                clock.mark("stop")
                sent = kv.SentBlocks(next_block=0, blocks=0, bytes=0, seconds=0.0, tokens_written=0)
                if mode != pb.RECOMPUTE:
                    sent = await self._agent.call(
                        kv.SendBlocks(
                            request_id=request_id,
                            migration_id=result.migration_id,
                            target=prepared.kv_address,
                            first_block=next_block,
                            partial=True,
                        )
                    )
            finally:
                await self._agent.call(kv.Release(request_id=request_id))
            clock.mark("last_stage")
            _count_stage(result, sent)
            written = sent.tokens_written
            add = msgspec.structs.replace(
                stopped.add, output_token_ids=stopped.output_ids, generation=stopped.add.generation + 1
            )
            result.kv_tokens = written
            result.total_tokens = len(add.prompt_token_ids) + len(add.output_token_ids)
            committed = await stub.CommitMigration(
                pb.CommitRequest(
                    migration_id=result.migration_id,
                    add_request=self._encoder.add(add)[1],
                    kv_tokens=result.kv_tokens,
                    last_output_at=stopped.last_output_at,
                ),
                timeout=timeout,
            )
            clock.mark("commit")
            if not committed.accepted:
                raise MigrationError(f"target refused the commit: {committed.detail}")
            # From the source's last token (or the stop, if none came) to the target taking over.
            result.downtime_ms = (time.time() - max(stopped.last_output_at, stop_wall)) * 1000
            self._service.hand_over(add, target.engine_id, add.generation)
            stopped = None
            await self._record_owner(add, target.engine_id)
            clock.mark("handover")
            await self._read_source_pace(result, began)
            self._metrics.migration_bytes.observe(result.bytes)
            self._metrics.migration_stages.observe(result.stages)
            self._metrics.migration_downtime.observe(result.downtime_ms / 1000)
            self._finish(result, pb.MIGRATED, "", started, "moved")
        except _GoneError:
            await self._cancel(stub, result.migration_id)
            self._finish(
                result, pb.GONE, "the request finished before it could move", started, "finished_first"
            )
        except BaseException:
            await self._cancel(stub, result.migration_id)
            if stopped is not None:
                self._resume_here(stopped)
            raise

    async def _read_source_pace(self, result: pb.MigrationResult, began: float) -> None:
        """The source's pace while the move ran and in as long a window just before it
        (``source_step_ms``, ``source_step_ms_before``), from when the KV agent saw its forward
        passes end; left 0 when the agent cannot say. Not read while other moves leave this
        engine: the agent answers one call at a time, a paced stage of theirs would hold this
        move's answer up, and their copies would be in its windows anyway."""
        if len(self._moving) > 1:
            return
        ended = time.monotonic()
        span = ended - began
        try:
            steps = await self._agent.call(kv.ReadSteps(since=began - span))
        except (MigrationError, zmq.ZMQError) as exc:
            logger.info("migration %s: no step times from the KV agent: %s", result.migration_id, exc)
            return
        if not isinstance(steps, kv.Steps):
            return
        result.source_step_ms_before = mean_step_ms(steps.ended, began - span, began)
        result.source_step_ms = mean_step_ms(steps.ended, began, ended)
        if result.source_step_ms and result.source_step_ms_before:
            self._metrics.migration_source_pace.observe(result.source_step_ms / result.source_step_ms_before)

    async def _warm(
        self,
        stub: pb_grpc.EngineControlStub,
        migration_id: str,
        request_id: str,
        staged_blocks: int,
        block: int,
    ) -> int:
        """Have the target take the staged blocks into its prefix cache before the stop; the
        tokens it took, or 0 (then the commit loads them all, as without a warm-up). The token
        ids this service has seen can trail the KV vLLM wrote (its outputs reach this event loop
        later): then only the whole blocks of the ids at hand go, one token short of them."""
        ids = self._service.token_ids_of(request_id)
        if ids is None:
            return 0
        kv_tokens = min(staged_blocks, (len(ids) - 1) // block) * block
        if kv_tokens <= 0:
            return 0
        try:
            reply = await stub.WarmMigration(
                pb.WarmRequest(
                    migration_id=migration_id, token_ids=ids[: kv_tokens + 1], kv_tokens=kv_tokens
                ),
                timeout=self._config.migration_step_timeout_s,
            )
        except grpc.aio.AioRpcError as exc:
            logger.warning(
                "migration %s: no warm-up on the target: %s", migration_id, exc.details() or exc.code()
            )
            return 0
        if not reply.warmed:
            logger.info("migration %s: no warm-up on the target: %s", migration_id, reply.detail)
            return 0
        return kv_tokens

    def _resume_here(self, stopped: StoppedRequest) -> None:
        """The target failed after the stop: run the request on here, after its tokens."""
        add = msgspec.structs.replace(
            stopped.add, output_token_ids=stopped.output_ids, generation=stopped.add.generation + 1
        )
        logger.warning("migration of %s failed after its stop; resuming it here", add.request_id)
        self._service.start(add)

    async def _cancel(self, stub: pb_grpc.EngineControlStub, migration_id: str) -> None:
        try:
            await stub.CancelMigration(pb.CancelRequest(migration_id=migration_id), timeout=2.0)
        except grpc.aio.AioRpcError as exc:
            logger.info(
                "could not cancel migration %s on its target (%s); its staging expires",
                migration_id,
                exc.code(),
            )

    async def drain(self, deadline_s: float) -> pb.DrainResult:
        """Move every running request away, a few at a time, until done or ``deadline_s``."""
        result = pb.DrainResult()
        deadline = time.monotonic() + deadline_s
        limit = asyncio.Semaphore(4)

        async def move(request_id: str) -> pb.MigrationResult:
            async with limit:
                if time.monotonic() > deadline:
                    return pb.MigrationResult(
                        request_id=request_id,
                        outcome=pb.FAILED,
                        detail="drain deadline passed",
                        code="drain_deadline",
                    )
                try:
                    return await self.migrate(request_id, "", "drain")
                except Exception as exc:
                    # One move's surprise must not cut the drain short: the others go on, and
                    # the engine still unregisters after it.
                    logger.exception("drain: moving %s failed", request_id)
                    return pb.MigrationResult(
                        request_id=request_id, outcome=pb.FAILED, detail=repr(exc), code="step_failed"
                    )

        while time.monotonic() < deadline:
            pending = self._service.request_ids()
            if not pending:
                break
            moves = await asyncio.gather(*(move(rid) for rid in pending))
            result.migrations.extend(moves)
            if not any(m.outcome == pb.MIGRATED for m in moves):
                if not any(m.target_engine_id in self._unreachable for m in moves):
                    break  # nowhere to go: do not spin
                # A target was down (and is now skipped): try the others.
                await asyncio.sleep(0.2)
        result.migrated = sum(1 for m in result.migrations if m.outcome == pb.MIGRATED)
        result.failed = sum(1 for m in result.migrations if m.outcome in (pb.FAILED, pb.REFUSED))
        result.remaining = len(self._service.request_ids())
        return result

    async def drain_for_removal(self, deadline_s: float, rejoin_after_s: float) -> pb.DrainResult:
        """Leave the rotation, then move every running request away (an engine about to be
        removed). Unless ``rejoin_after_s`` is 0, serve again if no shutdown followed by then."""
        if self.set_draining is None:
            raise MigrationError("this engine cannot leave the rotation")
        self.stop_rejoining()
        await self.set_draining(True)
        logger.info("leaving the rotation: draining for removal (deadline %.0f s)", deadline_s)
        result = await self.drain(deadline_s)
        if rejoin_after_s > 0:
            self._rejoin = asyncio.create_task(self._rejoin_after(rejoin_after_s), name="rejoin")
        return result

    async def _rejoin_after(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        if self.set_draining is not None:
            logger.warning("drained for removal %.0f s ago and still running: serving again", delay_s)
            await self.set_draining(False)

    def stop_rejoining(self) -> None:
        """The engine is stopping (or draining again): a pending return to service is off."""
        if self._rejoin is not None:
            self._rejoin.cancel()
            self._rejoin = None

    async def _pick_target(self, engine_id: str) -> EngineRecord | None:
        if engine_id:
            raw = await self._redis.get(self._keys.engine(engine_id))
            if raw is None:
                raise MigrationError(f"engine {engine_id} is not registered")
            record = engine_record_decoder.decode(raw)
            if not record.control_address or engine_id == self._engine_id:
                raise MigrationError(f"engine {engine_id} cannot take migrations")
            return record
        ids = sorted(m.decode() for m in await self._redis.smembers(self._keys.engines))
        best: tuple[int, EngineRecord] | None = None
        now = time.monotonic()
        for other in ids:
            if other == self._engine_id or self._unreachable.get(other, 0.0) > now:
                continue
            raw_record, raw_load = await self._redis.mget(self._keys.engine(other), self._keys.load(other))
            if raw_record is None:
                continue
            record = engine_record_decoder.decode(raw_record)
            if record.state != EngineState.ACTIVE or not record.control_address:
                continue
            free = load_report_decoder.decode(raw_load).kv_blocks_free if raw_load else 0
            if best is None or free > best[0]:
                best = (free, record)
        return best[1] if best else None

    async def warm_up_forever(self, interval_s: float = 5.0) -> None:
        """Open the KV transport's connection to every other active engine as it appears, so
        that no migration pays for making it (with gloo, a process group's rendezvous)."""
        warmed: set[str] = set()
        while True:
            try:
                ids = await self._redis.smembers(self._keys.engines)
                for engine_id in sorted(m.decode() for m in ids):
                    raw = (
                        await self._redis.get(self._keys.engine(engine_id))
                        if engine_id != self._engine_id
                        else None
                    )
                    record = engine_record_decoder.decode(raw) if raw else None
                    if record is None or record.state != EngineState.ACTIVE or not record.kv_address:
                        continue
                    if record.kv_address in warmed:
                        continue
                    try:
                        await self._agent.call(kv.Connect(record.kv_address))
                    except MigrationError as exc:
                        logger.info("KV link to %s not ready yet: %s", engine_id, exc)
                        continue
                    warmed.add(record.kv_address)
            except (RedisError, OSError, msgspec.DecodeError) as exc:
                logger.debug("KV warm-up pass failed: %s", exc)
            await asyncio.sleep(interval_s)

    async def _agent_status(self) -> kv.Status:
        if self._status is None:
            status = await self._agent.call(kv.AgentStatus())
            assert isinstance(status, kv.Status)
            self._status = status
        return self._status

    def _stub(self, address: str) -> pb_grpc.EngineControlStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = aio_channel(address, self._tls)
            # Engines come and go: the channels of those not met for longest are closed.
            while len(self._channels) > MAX_CHANNELS:
                _, oldest = self._channels.popitem(last=False)
                background(oldest.close(), "close-channel")
        else:
            self._channels.move_to_end(address)
        return pb_grpc.EngineControlStub(channel)

    async def _record_owner(self, add: AddRequest, engine_id: str) -> None:
        owner = OwnerRecord(
            request_id=add.request_id, engine_id=engine_id, generation=add.generation, router=add.reply_to
        )
        try:
            await self._owner_script(
                keys=[self._keys.owner(add.request_id)],
                args=[json_encoder.encode(owner), add.generation, 3600],
            )
        except RedisError as exc:
            # Serving does not wait on Redis: the router learns the owner from the pieces.
            logger.warning("could not record the new owner of %s: %s", add.request_id, exc)

    def _finish(
        self, result: pb.MigrationResult, outcome: int, detail: str, started: float, code: str
    ) -> pb.MigrationResult:
        result.outcome = outcome  # type: ignore[assignment]
        result.detail = detail
        result.code = code
        result.duration_ms = (time.perf_counter() - started) * 1000
        name = _OUTCOME_NAMES[outcome]
        self._metrics.migrated("source", result.reason, name)
        for phase, ms in result.phase_ms.items():
            self._metrics.migration_phase(phase, ms / 1000)
        self._history.appendleft(result)
        log = logger.info if outcome == pb.MIGRATED else logger.warning
        log(
            "migration %s of %s to %s: %s%s (%d stages, %d bytes, %d tokens warm, downtime %.1f ms, "
            "%.1f ms in all)",
            result.migration_id,
            result.request_id,
            result.target_engine_id or "?",
            name,
            f" ({detail})" if detail else "",
            result.stages,
            result.bytes,
            result.warm_tokens,
            result.downtime_ms,
            result.duration_ms,
        )
        writing = background(self._write_record(result, name), f"record-{result.migration_id}")
        self._writing[result.migration_id] = writing
        writing.add_done_callback(lambda _: self._writing.pop(result.migration_id, None))
        return result

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
                    self._keys.migration(result.migration_id), json_encoder.encode(record), ex=86400, nx=True
                )
                pipe.lpush(self._keys.migrations, result.migration_id)
                pipe.ltrim(self._keys.migrations, 0, 999)
                await pipe.execute()
        except RedisError as exc:
            logger.warning("could not write migration record %s: %s", result.migration_id, exc)

    def _forward_abort(self, owner: str, request_id: str, reason: str) -> None:
        background(self._send_abort(owner, request_id, reason), f"abort-{request_id}")

    async def _send_abort(self, owner: str, request_id: str, reason: str) -> None:
        try:
            raw = await self._redis.get(self._keys.engine(owner))
        except RedisError as exc:
            logger.warning("cannot pass the abort of %s on to %s: %s", request_id, owner, exc)
            return
        if raw is None:
            return
        address = engine_record_decoder.decode(raw).zmq_address
        sock = self._peer_push.get(address)
        if sock is None:
            sock = self._peer_push[address] = self._push_ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            zmq_connect(sock, address)
        try:
            sock.send_multipart(self._encoder.abort(AbortRequest([request_id], reason)), flags=zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("cannot pass the abort of %s on to %s: socket full", request_id, owner)

    # ---- target side --------------------------------------------------------------------------

    async def prepare(self, request: pb.PrepareRequest) -> pb.PrepareReply:
        if self._service.draining:
            return self._refuse_prepare(request, "the target is draining")
        if self._config.parallel_workers > 1:
            return self._refuse_prepare(request, _SHARDED)
        status = await self._agent_status()
        if request.bytes_per_block != status.bytes_per_block:
            return self._refuse_prepare(
                request,
                f"KV layout differs: {request.bytes_per_block} bytes per block there, "
                f"{status.bytes_per_block} here",
            )
        reserved = sum(r.blocks for r in self._reserved.values())
        free = self._free_blocks() - reserved
        # Room for what it holds now plus one block to grow into.
        if free < request.num_blocks + 1:
            return self._refuse_prepare(
                request, f"no room: {free} free KV blocks, {request.num_blocks + 1} needed"
            )
        ttl = self._config.migration_step_timeout_s * (self._config.migration_max_stages + 3)
        expiry = asyncio.get_running_loop().call_later(ttl, self._expire, request.migration_id)
        self._reserved[request.migration_id] = _Reservation(request.num_blocks + 1, expiry)
        return pb.PrepareReply(accepted=True, kv_address=self._config.kv_data_address, staging_ttl_s=ttl)

    def _refuse_prepare(self, request: pb.PrepareRequest, detail: str) -> pb.PrepareReply:
        self._metrics.migrated("target", "prepare", "REFUSED")
        logger.info("refused migration %s of %s: %s", request.migration_id, request.request_id, detail)
        return pb.PrepareReply(accepted=False, detail=detail)

    def _expire(self, migration_id: str) -> None:
        if self._reserved.pop(migration_id, None) is not None:
            logger.warning("migration %s: no commit in time; freeing its staging", migration_id)
            background(self._free_staging(migration_id), f"free-staging-{migration_id}")

    async def _free_staging(self, migration_id: str) -> None:
        try:
            await self._agent.call(kv.FreeStaging(migration_id=migration_id))
        except MigrationError as exc:
            logger.warning("could not free staging of %s: %s", migration_id, exc)

    async def warm(self, request: pb.WarmRequest) -> pb.WarmReply:
        """Run the staged context for one dropped token with its KV loaded (``keep``: the staging
        stays for the commit); its blocks then wait in vLLM's prefix cache for the commit's
        request, which loads only the blocks after them. Should they be evicted in between, the
        commit loads them from the staging area after all."""
        if request.migration_id not in self._reserved:
            return pb.WarmReply(
                warmed=False, detail="no such migration here (cancelled, or its time ran out)"
            )
        if self._config.backend != "vllm" or not self._config.migration_warm:
            return pb.WarmReply(warmed=False, detail="no warm-up on this engine")
        if not 0 < request.kv_tokens < len(request.token_ids):
            return pb.WarmReply(warmed=False, detail="kv_tokens must leave at least one token to compute")
        load = {"migration": request.migration_id, "tokens": request.kv_tokens, "keep": True}
        try:
            await asyncio.wait_for(
                self._service.prefill(
                    f"warm-{request.migration_id}", list(request.token_ids), {"load": load}
                ),
                self._config.migration_step_timeout_s,
            )
        except (BackendRequestError, TimeoutError) as exc:
            return pb.WarmReply(warmed=False, detail=f"{type(exc).__name__}: {exc}")
        return pb.WarmReply(warmed=True)

    async def commit(self, request: pb.CommitRequest) -> pb.CommitReply:
        reached = time.monotonic()
        reservation = self._reserved.pop(request.migration_id, None)
        if reservation is not None:
            reservation.expiry.cancel()
        try:
            add = self._add_decoder.decode(FrameType.ADD.value, request.add_request)
        except msgspec.DecodeError as exc:
            return pb.CommitReply(accepted=False, detail=f"undecodable request state: {exc}")
        if not isinstance(add, AddRequest):
            return pb.CommitReply(accepted=False, detail="request state is not an ADD")
        if not valid_reply_to(add.reply_to):
            # As the request socket checks every ADD: outputs go to routers' tcp://host:port only.
            return pb.CommitReply(
                accepted=False, detail=f"reply address {add.reply_to!r} is not tcp://host:port"
            )
        if self._service.draining:
            await self._free_staging(request.migration_id)
            return pb.CommitReply(accepted=False, detail="the target is draining")
        if self._service.tokens_of(add.request_id) is not None:
            return pb.CommitReply(accepted=False, detail="the request already runs here")
        # Requests that ended here before their first output (aborted as they arrived, say).
        for ended in [rid for rid in self._arriving if self._service.tokens_of(rid) is None]:
            del self._arriving[ended]
        self._arriving[add.request_id] = (request.migration_id, request.last_output_at, reached)
        load = {"migration": request.migration_id, "tokens": request.kv_tokens} if request.kv_tokens else None
        self._service.start(add, {"load": load} if load else None)
        self._metrics.migrated("target", "commit", "MIGRATED")
        return pb.CommitReply(accepted=True)

    async def cancel(self, request: pb.CancelRequest) -> pb.CancelReply:
        reservation = self._reserved.pop(request.migration_id, None)
        if reservation is not None:
            reservation.expiry.cancel()
        await self._free_staging(request.migration_id)
        return pb.CancelReply()

    def _first_output(
        self, add: AddRequest, at: float, engine_times: EngineTimes | None, delivered: float
    ) -> None:
        arriving = self._arriving.pop(add.request_id, None)
        if arriving is None:
            return
        migration_id, last_output_at, reached = arriving
        phases = target_phases_ms(reached, engine_times, delivered)
        for phase, ms in phases.items():
            self._metrics.migration_phase(phase, ms / 1000)
        if last_output_at:
            stall_s = max(0.0, at - last_output_at)
            self._metrics.migration_stall.observe(stall_s)
            background(self._record_stall(migration_id, stall_s * 1000, phases), f"stall-{migration_id}")

    async def _record_stall(self, migration_id: str, stall_ms: float, phases: dict[str, float]) -> None:
        key = self._keys.migration(migration_id)
        # The source writes the record when the commit returns; it may not be there yet (and a
        # loaded machine can hold the source up for seconds).
        deadline = time.monotonic() + _RECORD_WAIT_S
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

    def history(self, limit: int) -> list[pb.MigrationResult]:
        return list(self._history)[: limit or None]

    async def aclose(self) -> None:
        self.stop_rejoining()
        for handle in self._reserved.values():
            handle.expiry.cancel()
        for channel in self._channels.values():
            await channel.close()
        for sock in self._peer_push.values():
            sock.close(linger=0)
        self._agent.close()
        self._ctx.destroy(linger=0)


def mean_step_ms(ends: list[float], start: float, end: float) -> float:
    """The mean time between the steps that ended from ``start`` to ``end`` (seconds, oldest
    first), in ms; 0 when fewer than two did."""
    inside = [t for t in ends if start <= t <= end]
    if len(inside) < 2:
        return 0.0
    return (inside[-1] - inside[0]) / (len(inside) - 1) * 1000


def target_phases_ms(reached: float, engine_times: EngineTimes | None, delivered: float) -> dict[str, float]:
    """The parts of a hand-over on its target (``TARGET_PHASES``), in ms, from when the commit
    reached it, the engine's stamps of the request and when its first token reached the engine
    service (all ``time.monotonic``); empty without the engine's stamps. A stamp out of order
    (clocks read in other processes) counts its part as 0, never negative."""
    if engine_times is None:
        return {}
    marks = (
        reached,
        engine_times.queued,
        engine_times.scheduled,
        engine_times.first_token,
        delivered,
    )
    phases: dict[str, float] = {}
    last = reached
    for phase, mark in zip(TARGET_PHASES, marks[1:], strict=True):
        phases[phase] = max(0.0, mark - last) * 1000
        last = max(last, mark)
    return phases


class _PhaseClock:
    """Times the parts of a move into ``result.phase_ms``: each ``mark`` ends the part it names,
    which began where the previous part ended (the first, where the move began)."""

    def __init__(self, result: pb.MigrationResult, started: float) -> None:
        self._result = result
        self._last = started

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self._result.phase_ms[phase] = (now - self._last) * 1000
        self._last = now


def _count_stage(result: pb.MigrationResult, sent: kv.AgentReply) -> None:
    assert isinstance(sent, kv.SentBlocks), sent
    result.stages += 1
    result.bytes += sent.bytes
    result.blocks += sent.blocks


class _GoneError(Exception):
    """The request finished or was aborted while it was being moved."""


class EngineControlServicer(pb_grpc.EngineControlServicer):
    def __init__(self, manager: MigrationManager) -> None:
        self._manager = manager

    async def Migrate(  # noqa: N802 (gRPC method name)
        self, request: pb.MigrateRequest, context: grpc.aio.ServicerContext
    ) -> pb.MigrationResult:
        return await self._manager.migrate(
            request.request_id, request.target_engine_id, request.reason, request.mode
        )

    async def Drain(  # noqa: N802 (gRPC method name)
        self, request: pb.DrainRequest, context: grpc.aio.ServicerContext
    ) -> pb.DrainResult:
        deadline_s = request.deadline_s or 30.0
        if request.leave_rotation:
            try:
                return await self._manager.drain_for_removal(deadline_s, request.rejoin_after_s)
            except MigrationError as exc:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return await self._manager.drain(deadline_s)

    async def ListMigrations(  # noqa: N802 (gRPC method name)
        self, request: pb.ListMigrationsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListMigrationsResult:
        return pb.ListMigrationsResult(migrations=self._manager.history(request.limit))

    async def PrepareMigration(  # noqa: N802 (gRPC method name)
        self, request: pb.PrepareRequest, context: grpc.aio.ServicerContext
    ) -> pb.PrepareReply:
        return await self._manager.prepare(request)

    async def WarmMigration(  # noqa: N802 (gRPC method name)
        self, request: pb.WarmRequest, context: grpc.aio.ServicerContext
    ) -> pb.WarmReply:
        return await self._manager.warm(request)

    async def CommitMigration(  # noqa: N802 (gRPC method name)
        self, request: pb.CommitRequest, context: grpc.aio.ServicerContext
    ) -> pb.CommitReply:
        return await self._manager.commit(request)

    async def CancelMigration(  # noqa: N802 (gRPC method name)
        self, request: pb.CancelRequest, context: grpc.aio.ServicerContext
    ) -> pb.CancelReply:
        return await self._manager.cancel(request)
