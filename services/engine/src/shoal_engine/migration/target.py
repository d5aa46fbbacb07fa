"""The target's side of a move: reserve room (``PrepareMigration``), take staged blocks into the
prefix cache early (``WarmMigration``), admit the request with its KV loaded
(``CommitMigration``) or free the staging (``CancelMigration``, or a reservation that timed
out), then time the hand-over from the request's first token here."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import msgspec

from shoal_engine.backend import BackendRequestError, EngineTimes
from shoal_engine.config import EngineConfig
from shoal_engine.ipc.sockets import valid_reply_to
from shoal_engine.kv.params import KvLoad
from shoal_engine.metrics import EngineMetrics
from shoal_engine.migration.common import AgentCaller, MigrationError, sharded, target_phases_ms
from shoal_engine.migration.records import MoveLog
from shoal_engine.serving import EngineService
from shoal_protos import engine_control_pb2 as pb
from shoal_protos import kv
from shoal_protos.messages import AddRequest, EngineRequestDecoder, FrameType
from shoal_protos.moves import MoveCode
from shoal_protos.tasks import background

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Reservation:
    blocks: int
    expiry: asyncio.TimerHandle


@dataclass(slots=True)
class _Arriving:
    """A migrated-in request awaiting its first token here."""

    migration_id: str
    last_output_at: float
    """The source's last output (wall clock)."""
    reached: float
    """When the commit reached this engine (``time.monotonic``)."""


class TargetSide:
    def __init__(
        self,
        config: EngineConfig,
        service: EngineService,
        load_free_blocks: Callable[[], int],
        agent: AgentCaller,
        agent_status: Callable[[], Awaitable[kv.Status]],
        metrics: EngineMetrics,
        log: MoveLog,
    ) -> None:
        self._config = config
        self._service = service
        self._free_blocks = load_free_blocks
        self.agent = agent
        self._agent_status = agent_status
        self._metrics = metrics
        self._log = log
        self._add_decoder = EngineRequestDecoder()
        self._reserved: dict[str, _Reservation] = {}
        self.arriving: dict[str, _Arriving] = {}
        self.held_prefix: Callable[[Sequence[int]], int] = lambda hashes: 0
        """How many of a request's first blocks (chained hashes) this engine's prefix cache
        holds; the engine sets it where it follows its cache (``--prefix-events``)."""

    async def prepare(self, request: pb.PrepareRequest) -> pb.PrepareReply:
        """Reserve room for the request's blocks, or refuse."""
        refusal = await self._refusal(request)
        if refusal is not None:
            code, detail = refusal
            self._metrics.migrated("target", "prepare", "REFUSED", code)
            logger.info("refused migration %s of %s: %s", request.migration_id, request.request_id, detail)
            return pb.PrepareReply(accepted=False, detail=detail, code=code.value)
        ttl = self._config.migration_step_timeout_s * (self._config.migration_max_stages + 3)
        expiry = asyncio.get_running_loop().call_later(ttl, self._expire, request.migration_id)
        self._reserved[request.migration_id] = _Reservation(request.num_blocks + 1, expiry)
        cached = 0 if request.recompute else self.held_prefix(request.block_hashes)
        return pb.PrepareReply(
            accepted=True, kv_address=self._config.kv_data_address, staging_ttl_s=ttl, cached_blocks=cached
        )

    async def _refusal(self, request: pb.PrepareRequest) -> tuple[MoveCode, str] | None:
        if self._service.draining:
            return MoveCode.TARGET_DRAINING, "the target is draining"
        if not request.recompute:
            config = self._config
            here = (config.tensor_parallel_size, config.pipeline_parallel_size)
            source = (request.tensor_parallel_size or 1, request.pipeline_parallel_size or 1)
            if source != here:
                return MoveCode.SHARDED, sharded(source, here)
            bytes_per_block = (await self._agent_status()).bytes_per_block
            if request.bytes_per_block != bytes_per_block:
                there = request.bytes_per_block
                detail = f"KV layout differs: {there} bytes per block there, {bytes_per_block} here"
                return MoveCode.LAYOUT_DIFFERS, detail
        reserved = sum(r.blocks for r in self._reserved.values())
        free = self._free_blocks() - reserved
        # Room for what it holds now plus one block to grow into.
        if free < request.num_blocks + 1:
            return MoveCode.NO_ROOM, f"no room: {free} free KV blocks, {request.num_blocks + 1} needed"
        return None

    def _expire(self, migration_id: str) -> None:
        if self._reserved.pop(migration_id, None) is not None:
            logger.warning("migration %s: no commit in time; freeing its staging", migration_id)
            background(self.free_staging(migration_id), f"free-staging-{migration_id}")

    async def free_staging(self, migration_id: str) -> None:
        try:
            await self.agent.call(kv.FreeStaging(migration_id=migration_id))
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
        load = KvLoad(migration=request.migration_id, tokens=request.kv_tokens, keep=True)
        try:
            async with asyncio.timeout(self._config.migration_step_timeout_s):
                await self._service.prefill(f"warm-{request.migration_id}", list(request.token_ids), load)
        except (BackendRequestError, TimeoutError) as exc:
            return pb.WarmReply(warmed=False, detail=f"{type(exc).__name__}: {exc}")
        return pb.WarmReply(warmed=True)

    async def commit(self, request: pb.CommitRequest) -> pb.CommitReply:
        reached = time.monotonic()
        reservation = self._reserved.pop(request.migration_id, None)
        if reservation is not None:
            reservation.expiry.cancel()
        add, refusal = self._decode_add(request.add_request)
        if add is None:
            return pb.CommitReply(accepted=False, detail=refusal)
        if self._service.draining:
            await self.free_staging(request.migration_id)
            return pb.CommitReply(accepted=False, detail="the target is draining")
        if self._service.tokens_of(add.request_id) is not None:
            return pb.CommitReply(accepted=False, detail="the request already runs here")
        # Requests that ended here before their first output (aborted as they arrived, say).
        for ended in [rid for rid in self.arriving if self._service.tokens_of(rid) is None]:
            del self.arriving[ended]
        self.arriving[add.request_id] = _Arriving(request.migration_id, request.last_output_at, reached)
        load = KvLoad(migration=request.migration_id, tokens=request.kv_tokens) if request.kv_tokens else None
        self._service.start(add, load)
        self._metrics.migrated("target", "commit", "MIGRATED", MoveCode.MOVED)
        return pb.CommitReply(accepted=True)

    def _decode_add(self, raw: bytes) -> tuple[AddRequest | None, str]:
        """The request state a commit carries, or None and why it is refused."""
        try:
            add = self._add_decoder.decode(FrameType.ADD.value, raw)
        except msgspec.DecodeError as exc:
            return None, f"undecodable request state: {exc}"
        if not isinstance(add, AddRequest):
            return None, "request state is not an ADD"
        if not valid_reply_to(add.reply_to):
            # As the request socket checks every ADD: outputs go to routers' tcp://host:port only.
            return None, f"reply address {add.reply_to!r} is not tcp://host:port"
        return add, ""

    async def cancel(self, request: pb.CancelRequest) -> pb.CancelReply:
        reservation = self._reserved.pop(request.migration_id, None)
        if reservation is not None:
            reservation.expiry.cancel()
        await self.free_staging(request.migration_id)
        return pb.CancelReply()

    def first_output(
        self, add: AddRequest, at: float, engine_times: EngineTimes | None, delivered: float
    ) -> None:
        """A request's first output reached the service: if it just moved in, time the move's
        parts here and its stall (from the source's last output)."""
        arriving = self.arriving.pop(add.request_id, None)
        if arriving is None:
            return
        phases = target_phases_ms(arriving.reached, engine_times, delivered)
        for phase, ms in phases.items():
            self._metrics.migration_phase(phase, ms / 1000)
        if arriving.last_output_at:
            stall_s = max(0.0, at - arriving.last_output_at)
            self._metrics.migration_stall.observe(stall_s)
            background(
                self._log.record_stall(arriving.migration_id, stall_s * 1000, phases),
                f"stall-{arriving.migration_id}",
            )

    def close(self) -> None:
        for reservation in self._reserved.values():
            reservation.expiry.cancel()
