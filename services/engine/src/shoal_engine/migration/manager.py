"""``MigrationManager``: one per engine, the engine's part in every move, as source and target;
and ``EngineControlServicer``, the gRPC face of it (``EngineControl``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable

import grpc
import redis.asyncio as aioredis
import zmq
import zmq.asyncio
from redis.exceptions import RedisError

from shoal_engine.config import EngineConfig
from shoal_engine.metrics import EngineMetrics
from shoal_engine.migration.common import (
    MIN_TOKENS_LEFT,
    AgentCaller,
    MigrationError,
    MoveEndedError,
)
from shoal_engine.migration.drain import Drainer
from shoal_engine.migration.peers import Peers, cached_blocks
from shoal_engine.migration.records import MoveLog
from shoal_engine.migration.source import SourceMove, failure_code
from shoal_engine.migration.target import TargetSide
from shoal_engine.migration.workers import WorkerAgents
from shoal_engine.serving import EngineService
from shoal_protos import engine_control_pb2 as pb
from shoal_protos import engine_control_pb2_grpc as pb_grpc
from shoal_protos import kv
from shoal_protos.moves import MoveCode
from shoal_protos.prefix import chain_hashes, leading
from shoal_protos.records import Keys
from shoal_protos.tls import FleetTls

_STEP_ERRORS = (MigrationError, grpc.aio.AioRpcError, TimeoutError, RedisError, OSError)
"""What a failed step raises: the move ends FAILED, the request runs on here."""


class MigrationManager:
    """The engine's moves: out (``migrate``, ``drain``) through ``SourceMove``, in through
    ``TargetSide``; what they leave behind through ``MoveLog``; the other engines through
    ``Peers``."""

    def __init__(
        self,
        config: EngineConfig,
        service: EngineService,
        load_free_blocks: Callable[[], int],
        redis_client: aioredis.Redis,
        keys: Keys,
        metrics: EngineMetrics,
        tls: FleetTls | None = None,
        *,
        agent: AgentCaller | None = None,
        control_stub: Callable[[str], pb_grpc.EngineControlStub] | None = None,
    ) -> None:
        """``tls``: the fleet's TLS files (loaded once by the engine), for calls to other
        engines' EngineControl; None: plain calls. ``agent`` and ``control_stub`` stand in for
        the KV agent's line and the other engines' control APIs (tests); by default the real
        ones."""
        self._config = config
        self._service = service
        self._metrics = metrics
        self._ctx = zmq.asyncio.Context()
        # Every vLLM worker's agent, for its shard of the KV cache (one on a simulated engine,
        # whose own agent stands in for them all).
        self._agents = WorkerAgents.connect(
            self._ctx,
            config.kv_agent_address,
            config.parallel_workers if config.backend == "vllm" else 1,
            config.tensor_parallel_size if config.backend == "vllm" else 1,
            config.migration_step_timeout_s,
        )
        self._agent: AgentCaller = agent or self._agents
        push_ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(self._ctx.underlying)
        self.peers = Peers(config.engine_id, redis_client, keys, tls, push_ctx)
        self._stub = control_stub or self.peers.stub
        self.log = MoveLog(redis_client, keys, metrics)
        self.target = TargetSide(
            config, service, load_free_blocks, self._agent, self._agent_status, metrics, self.log
        )
        self._drainer = Drainer(service, self.migrate, self.peers)
        self._status: kv.Status | None = None
        self._moving: set[str] = set()
        service.forward_abort = self.peers.forward_abort
        service.on_first_output = self.target.first_output

    @property
    def set_draining(self) -> Callable[[bool], Awaitable[None]] | None:
        """Takes the engine out of the rotation (True) or back in: the engine's main sets it to
        its Redis record's state and the service's refusal of new requests."""
        return self._drainer.set_draining

    @set_draining.setter
    def set_draining(self, set_draining: Callable[[bool], Awaitable[None]] | None) -> None:
        self._drainer.set_draining = set_draining

    # ---- source side --------------------------------------------------------------------------

    async def migrate(
        self, request_id: str, target_engine_id: str, reason: str, mode: int = pb.PRECOPY
    ) -> pb.MigrationResult:
        """Move ``request_id`` (or, left empty, the request cheapest to move) to
        ``target_engine_id`` (or, left empty, the engine this one picks). The result comes back
        once its record is in Redis, so that a caller reading the records finds it."""
        started = time.perf_counter()
        if not request_id:  # the caller (a balancing policy) leaves the choice to this engine
            request_id = await self._cheapest_to(target_engine_id)
        result = pb.MigrationResult(
            migration_id=uuid.uuid4().hex[:16],
            request_id=request_id,
            source_engine_id=self._config.engine_id,
            target_engine_id=target_engine_id,
            reason=reason or "admin",
        )
        code, detail = await self._move(result, started, mode)
        self.log.finish(result, code, detail, started)
        await self.log.written(result.migration_id)
        return result

    async def _cheapest_to(self, target_engine_id: str) -> str:
        """The request cheapest to move to ``target_engine_id`` (any target, left empty): the
        least KV to copy, less what the target's prefix cache holds of it; "" when none may."""
        cached = (
            cached_blocks(await self.peers.prefix_snapshot(target_engine_id)) if target_engine_id else set()
        )
        if not cached:
            return self._service.cheapest_to_move(MIN_TOKENS_LEFT) or ""
        block = (await self._agent_status()).block_size

        def held(ids: list[int]) -> int:
            return leading(chain_hashes(ids, block, limit=(len(ids) - 1) // block), cached) * block

        return self._service.cheapest_to_move(MIN_TOKENS_LEFT, held) or ""

    async def _move(self, result: pb.MigrationResult, started: float, mode: int) -> tuple[MoveCode, str]:
        """Run the move; the code it ended with and why."""
        refusal = self._refusal(result.request_id)
        if refusal is not None:
            return refusal
        request_id = result.request_id
        self._moving.add(request_id)
        try:
            await SourceMove(
                result,
                mode,
                started,
                config=self._config,
                service=self._service,
                agent=self._agent,
                agent_status=self._agent_status,
                stub=self._stub,
                peers=self.peers,
                log=self.log,
                metrics=self._metrics,
                others_moving=lambda: len(self._moving) > 1,
            ).run()
        except MoveEndedError as ended:
            return ended.code, ended.detail
        except _STEP_ERRORS as exc:
            code = failure_code(exc)
            if code is MoveCode.TARGET_UNREACHABLE:
                self.peers.mark_unreachable(result.target_engine_id)
            detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            return code, detail or type(exc).__name__
        finally:
            self._moving.discard(request_id)
        return MoveCode.MOVED, ""

    def _refusal(self, request_id: str) -> tuple[MoveCode, str] | None:
        """Why ``request_id`` cannot move from here at all; None if it can try."""
        if not request_id:
            detail = f"no running request here has produced a token and has {MIN_TOKENS_LEFT}+ to go"
            return MoveCode.NO_CANDIDATE, detail
        if request_id in self._moving:
            return MoveCode.ALREADY_MOVING, "the request is already moving"
        if self._service.tokens_of(request_id) is None:
            moved = self._service.moved_to(request_id)
            where = f" (it moved to {moved})" if moved else ""
            return MoveCode.NOT_RUNNING, f"the request is not running here{where}"
        return None

    async def drain(self, deadline_s: float) -> pb.DrainResult:
        """Move every running request away, a few at a time, until done or ``deadline_s``."""
        return await self._drainer.drain(deadline_s)

    async def drain_for_removal(self, deadline_s: float, rejoin_after_s: float) -> pb.DrainResult:
        """Leave the rotation, then move every running request away (an engine about to be
        removed). Unless ``rejoin_after_s`` is 0, serve again if no shutdown followed by then."""
        return await self._drainer.drain_for_removal(deadline_s, rejoin_after_s)

    def stop_rejoining(self) -> None:
        """The engine is stopping (or draining again): a pending return to service is off."""
        self._drainer.stop_rejoining()

    async def warm_up_forever(self, interval_s: float = 5.0) -> None:
        """Open the KV transport's connection to every other active engine as it appears, so
        that no migration pays for making it (with gloo, a process group's rendezvous)."""
        await self.peers.warm_up_forever(self._agent, interval_s)

    def history(self, limit: int) -> list[pb.MigrationResult]:
        return self.log.history(limit)

    async def _agent_status(self) -> kv.Status:
        if self._status is None:
            status = await self._agent.call(kv.AgentStatus())
            assert isinstance(status, kv.Status)
            self._status = status
        return self._status

    # ---- target side --------------------------------------------------------------------------

    async def prepare(self, request: pb.PrepareRequest) -> pb.PrepareReply:
        return await self.target.prepare(request)

    async def warm(self, request: pb.WarmRequest) -> pb.WarmReply:
        return await self.target.warm(request)

    async def commit(self, request: pb.CommitRequest) -> pb.CommitReply:
        return await self.target.commit(request)

    async def cancel(self, request: pb.CancelRequest) -> pb.CancelReply:
        return await self.target.cancel(request)

    async def aclose(self) -> None:
        self.stop_rejoining()
        self.target.close()
        await self.peers.aclose()
        self._agents.close()
        self._ctx.destroy(linger=0)


# protoc writes the servicer base without annotations.
class EngineControlServicer(pb_grpc.EngineControlServicer):  # type: ignore[misc]
    def __init__(self, manager: MigrationManager) -> None:
        self._manager = manager

    async def Migrate(  # noqa: N802 (gRPC method name)
        self,
        request: pb.MigrateRequest,
        context: grpc.aio.ServicerContext[pb.MigrateRequest, pb.MigrationResult],
    ) -> pb.MigrationResult:
        return await self._manager.migrate(
            request.request_id, request.target_engine_id, request.reason, request.mode
        )

    async def Drain(  # noqa: N802 (gRPC method name)
        self, request: pb.DrainRequest, context: grpc.aio.ServicerContext[pb.DrainRequest, pb.DrainResult]
    ) -> pb.DrainResult:
        deadline_s = request.deadline_s or 30.0
        if request.leave_rotation:
            try:
                return await self._manager.drain_for_removal(deadline_s, request.rejoin_after_s)
            except MigrationError as exc:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return await self._manager.drain(deadline_s)

    async def ListMigrations(  # noqa: N802 (gRPC method name)
        self,
        request: pb.ListMigrationsRequest,
        context: grpc.aio.ServicerContext[pb.ListMigrationsRequest, pb.ListMigrationsResult],
    ) -> pb.ListMigrationsResult:
        return pb.ListMigrationsResult(migrations=self._manager.history(request.limit))

    async def PrepareMigration(  # noqa: N802 (gRPC method name)
        self,
        request: pb.PrepareRequest,
        context: grpc.aio.ServicerContext[pb.PrepareRequest, pb.PrepareReply],
    ) -> pb.PrepareReply:
        return await self._manager.prepare(request)

    async def WarmMigration(  # noqa: N802 (gRPC method name)
        self, request: pb.WarmRequest, context: grpc.aio.ServicerContext[pb.WarmRequest, pb.WarmReply]
    ) -> pb.WarmReply:
        return await self._manager.warm(request)

    async def CommitMigration(  # noqa: N802 (gRPC method name)
        self, request: pb.CommitRequest, context: grpc.aio.ServicerContext[pb.CommitRequest, pb.CommitReply]
    ) -> pb.CommitReply:
        return await self._manager.commit(request)

    async def CancelMigration(  # noqa: N802 (gRPC method name)
        self, request: pb.CancelRequest, context: grpc.aio.ServicerContext[pb.CancelRequest, pb.CancelReply]
    ) -> pb.CancelReply:
        return await self._manager.cancel(request)
