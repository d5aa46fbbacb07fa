"""The source's side of one move, as a state machine.

Each state is one step of the protocol (the package's docstring draws it); each step is a method
that does its work and returns the next state::

    PICK_TARGET -> PREPARE -> PRECOPY (once per stage) -> WARM -> TAIL -> STOP -> LAST_STAGE
                -> COMMIT -> HANDOVER -> DONE

A recompute move skips the pre-copy and the tail and sends nothing at the stop; an unwarmed one
skips WARM; a stop-and-copy move goes from PREPARE to STOP.
A step that cannot go on raises: ``MoveEndedError`` for a refusal or a request that is gone (the
move ends with its code), anything else for a failure (``SourceMove.run``'s caller turns it
into a code). From PRECOPY on, the target holds a staging area that an early end cancels; from
STOP on, a failure puts the request back to run here."""

from __future__ import annotations

import enum
import logging
import math
import time
from collections.abc import Awaitable, Callable

import grpc
import msgspec
import zmq

from shoal_engine.config import EngineConfig
from shoal_engine.metrics import EngineMetrics
from shoal_engine.migration.common import (
    AgentCaller,
    MigrationError,
    MoveEndedError,
    PhaseClock,
    count_stage,
    mean_step_ms,
)
from shoal_engine.migration.peers import Peers
from shoal_engine.migration.records import MoveLog
from shoal_engine.serving import EngineService, StoppedRequest
from shoal_protos import engine_control_pb2 as pb
from shoal_protos import engine_control_pb2_grpc as pb_grpc
from shoal_protos import kv
from shoal_protos.messages import AddRequest, RouterRequestEncoder
from shoal_protos.moves import MoveCode
from shoal_protos.prefix import chain_hashes

logger = logging.getLogger(__name__)

_PRECOPY_MODES = (pb.PRECOPY, pb.PRECOPY_UNWARMED)

TAIL_TOKENS = 16
"""A pre-copy move sends the partly filled last block once more just before the stop; if the
request wrote at most this many tokens into it since (a step or two, as a rule), the target
computes them with its first step instead of the block going again while the stream stops.
Sending a block while stopped is what made several moves at once stall each other (each
waited for the others' blocks over one engine's core); a few tokens more in a prefill cost
less."""

_ENCODER = RouterRequestEncoder()


class State(enum.Enum):
    PICK_TARGET = "pick_target"
    PREPARE = "prepare"
    PRECOPY = "precopy"
    WARM = "warm"
    TAIL = "tail"
    STOP = "stop"
    LAST_STAGE = "last_stage"
    COMMIT = "commit"
    HANDOVER = "handover"
    DONE = "done"


def failure_code(exc: BaseException) -> MoveCode:
    """The code of a move that failed with ``exc``."""
    if isinstance(exc, grpc.aio.AioRpcError):
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            return MoveCode.TARGET_UNREACHABLE
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return MoveCode.STEP_TIMEOUT
    if isinstance(exc, TimeoutError):
        return MoveCode.STEP_TIMEOUT
    return MoveCode.STEP_FAILED


class SourceMove:
    """One move of ``result.request_id`` away from this engine; ``run`` takes it through its
    states and leaves what happened in ``result`` (the caller ends it with a code)."""

    def __init__(
        self,
        result: pb.MigrationResult,
        mode: int,
        started: float,
        *,
        config: EngineConfig,
        service: EngineService,
        agent: AgentCaller,
        agent_status: Callable[[], Awaitable[kv.Status]],
        stub: Callable[[str], pb_grpc.EngineControlStub],
        peers: Peers,
        log: MoveLog,
        metrics: EngineMetrics,
        others_moving: Callable[[], bool],
    ) -> None:
        self.result = result
        self._request_id = result.request_id
        self._mode = mode
        self._config = config
        self._timeout = config.migration_step_timeout_s
        self._service = service
        self._agent = agent
        self._agent_status = agent_status
        self._stub_for = stub
        self._peers = peers
        self._log = log
        self._metrics = metrics
        self._others_moving = others_moving
        self._clock = PhaseClock(result, started)
        self._began = time.monotonic()  # the clock the KV agent stamps the forward passes on
        self._steps: dict[State, Callable[[], Awaitable[State]]] = {
            State.PICK_TARGET: self._pick_target,
            State.PREPARE: self._prepare,
            State.PRECOPY: self._precopy_stage,
            State.WARM: self._warm,
            State.TAIL: self._tail,
            State.STOP: self._stop,
            State.LAST_STAGE: self._last_stage,
            State.COMMIT: self._commit,
            State.HANDOVER: self._handover,
        }
        self.state = State.PICK_TARGET
        # Set as the move goes on.
        self._target_engine_id = ""
        self._stub: pb_grpc.EngineControlStub | None = None
        self._block = 0
        self._control_address = ""
        self._kv_address = ""
        self._next_block = 0
        self._stop_wall = 0.0
        self._stopped: StoppedRequest | None = None
        self._last_sent: kv.SentBlocks | None = None
        # What the tail sent: the blocks it reached and the tokens written in them.
        self._tail_sent: tuple[int, int] | None = None
        self._add: AddRequest | None = None

    async def run(self) -> None:
        """Take the move through its states to DONE. Raises ``MoveEndedError`` when it ends early
        with a code of its own, and what a failed step raised otherwise."""
        try:
            while self.state is not State.DONE:
                self.state = await self._steps[self.state]()
        except BaseException:
            if self._stub is not None:  # the target has a staging area for the move
                await self._cancel()
            if self._stopped is not None:
                self._resume_here(self._stopped)
            raise

    # ---- the states ---------------------------------------------------------------------------

    async def _pick_target(self) -> State:
        self._block = (await self._agent_status()).block_size
        named = self.result.target_engine_id
        # Left to pick, it weighs what each engine's prefix cache holds of the request.
        target = await self._peers.pick_target(named, () if named else self._block_hashes())
        if target is None:
            raise MoveEndedError(MoveCode.NO_TARGET, "no active engine to move to")
        self.result.target_engine_id = self._target_engine_id = target.engine_id
        self._control_address = target.control_address
        return State.PREPARE

    async def _prepare(self) -> State:
        """Reserve room on the target."""
        status = await self._agent_status()
        stub = self._stub_for(self._control_address)
        # A request that just arrived (a move right after a move) has no blocks here before its
        # first step: pre-copy would find none to send, and the stop would send them all.
        await self._service.wait_output_here(self._request_id, self._timeout / 2)
        tokens = self._service.tokens_of(self._request_id) or 0
        max_tokens = self._service.max_tokens_of(self._request_id) or tokens
        hashes = [] if self._mode == pb.RECOMPUTE else self._block_hashes()
        request = pb.PrepareRequest(
            migration_id=self.result.migration_id,
            request_id=self._request_id,
            source_engine_id=self.result.source_engine_id,
            num_blocks=math.ceil(tokens / self._block),
            max_blocks=math.ceil(max_tokens / self._block),
            bytes_per_block=status.bytes_per_block,
            tensor_parallel_size=self._config.tensor_parallel_size,
            pipeline_parallel_size=self._config.pipeline_parallel_size,
            recompute=self._mode == pb.RECOMPUTE,
            block_hashes=hashes,
        )
        prepared = await stub.PrepareMigration(request, timeout=self._timeout)
        if self._recompute_instead(prepared):
            # An engine leaving (a rollout that changes tensorParallelSize) moves its requests
            # to engines of the new split, which cannot take its KV: they compute it again.
            logger.info(
                "migration %s: %s; moving %s without its KV",
                self.result.migration_id,
                prepared.detail,
                self._request_id,
            )
            self._mode = pb.RECOMPUTE
            without_kv = pb.PrepareRequest()
            without_kv.CopyFrom(request)
            without_kv.recompute = True
            prepared = await stub.PrepareMigration(without_kv, timeout=self._timeout)
        self._clock.mark("prepare")
        if not prepared.accepted:
            raise MoveEndedError(_refusal_code(prepared.code), prepared.detail)
        self._stub = stub
        self._kv_address = prepared.kv_address
        if self._mode != pb.RECOMPUTE:
            # The target's vLLM finds these in its own prefix cache: no stage sends them.
            self._next_block = self.result.target_cached_blocks = min(prepared.cached_blocks, len(hashes))
        return State.PRECOPY if self._mode in _PRECOPY_MODES else State.STOP

    def _recompute_instead(self, prepared: pb.PrepareReply) -> bool:
        """Whether a drain's move the target refused for its KV alone goes without it: the
        target splits or lays out its KV cache otherwise. Other moves end refused (a balancing
        move is worth its cost only with the KV copied)."""
        unfit = prepared.code in (MoveCode.SHARDED.value, MoveCode.LAYOUT_DIFFERS.value)
        return (
            not prepared.accepted and unfit and self.result.reason == "drain" and self._mode != pb.RECOMPUTE
        )

    async def _precopy_stage(self) -> State:
        """Send the full blocks not sent yet while the request decodes; another stage until
        what is left is small enough for the stop (or the stages run out)."""
        config = self._config
        # A drain empties an engine that is leaving: its moves go at full speed.
        paced = self.result.reason != "drain"
        pace = config.migration_precopy_mib_per_s << 20 if paced else 0
        share = config.migration_precopy_share if paced else 0.0
        sent = count_stage(
            self.result,
            await self._agent.call(
                self._send_blocks(
                    max_bytes_per_s=pace,
                    max_busy_share=share,
                    # A paced stage sends what it can in half a step deadline; later stages
                    # send the rest.
                    max_seconds=self._timeout / 2 if pace or share else 0.0,
                )
            ),
        )
        if sent.preempted:
            # Its blocks went back to vLLM during the stage: the next stage sends them again
            # from the same block, once the request has recomputed them.
            self._metrics.migration_stages_lost.inc()
            logger.info(
                "migration %s: %s was preempted during a pre-copy stage; sending it again",
                self.result.migration_id,
                self._request_id,
            )
        self._next_block = sent.next_block
        now = self._service.tokens_of(self._request_id)
        if now is None:
            raise _finished_first()
        left = now // self._block - self._next_block
        # The last stage runs before the stop: it is at most this small.
        if left > config.migration_last_stage_max_blocks and self.result.stages < config.migration_max_stages:
            return State.PRECOPY
        self._clock.mark("precopy")
        warm = (
            self._mode == pb.PRECOPY
            and self._next_block > self.result.target_cached_blocks  # staged blocks to take in
            and config.migration_warm
            and config.backend == "vllm"
        )
        return State.WARM if warm else State.TAIL

    async def _warm(self) -> State:
        """Have the target take the staged blocks into its prefix cache before the stop; the
        tokens it took, or 0 (then the commit loads them all, as without a warm-up). The token
        ids this service has seen can trail the KV vLLM wrote (its outputs reach this event loop
        later): then only the whole blocks of the ids at hand go, one token short of them."""
        self.result.warm_tokens = await self._warm_tokens()
        self._clock.mark("warm")
        return State.TAIL

    async def _warm_tokens(self) -> int:
        assert self._stub is not None
        migration_id = self.result.migration_id
        ids = self._service.token_ids_of(self._request_id)
        if ids is None:
            return 0
        kv_tokens = min(self._next_block, (len(ids) - 1) // self._block) * self._block
        if kv_tokens <= 0:
            return 0
        try:
            reply = await self._stub.WarmMigration(
                pb.WarmRequest(
                    migration_id=migration_id, token_ids=ids[: kv_tokens + 1], kv_tokens=kv_tokens
                ),
                timeout=self._timeout,
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

    async def _tail(self) -> State:
        """Send what is written of the last blocks, the partly filled one too, while the
        request still decodes (``_last_stage`` sends nothing more if little was written since)."""
        sent = count_stage(self.result, await self._agent.call(self._send_blocks(partial=True, running=True)))
        if not sent.preempted and sent.blocks:
            self._tail_sent = (sent.next_block, sent.tokens_written)
        self._clock.mark("tail")
        return State.STOP

    async def _stop(self) -> State:
        """Stop the request right after an output with its blocks held (vLLM frees them once
        the agent lets go, after the last stage)."""
        await self._agent.call(kv.Hold(request_id=self._request_id, hold_s=self._timeout))
        self._stop_wall = time.time()
        try:
            self._stopped = await self._service.stop_for_migration(
                self._request_id, align_s=self._timeout / 2
            )
            if self._stopped is None:
                raise _finished_first()
        except BaseException:
            await self._agent.call(kv.Release(request_id=self._request_id))
            raise
        self._clock.mark("stop")
        return State.LAST_STAGE

    async def _last_stage(self) -> State:
        """Send what is left (the last block partly filled) at once, unless the tail sent
        enough; the agent releases the blocks as the send ends, in the same call: with several
        moves stopped at once, each stalled stream waits for one call of each, not two."""
        tail = self._tail_tokens()
        if self._mode == pb.RECOMPUTE or tail:
            await self._agent.call(kv.Release(request_id=self._request_id))
            self.result.kv_tokens = tail
            self._clock.mark("last_stage")
            return State.COMMIT
        try:
            sent = await self._agent.call(self._send_blocks(partial=True, release=True))
        except BaseException:
            # The agent may not have had the call (a timeout, a cancel): release again.
            await self._agent.call(kv.Release(request_id=self._request_id))
            raise
        self._clock.mark("last_stage")
        self.result.kv_tokens = count_stage(self.result, sent).tokens_written
        return State.COMMIT

    async def _commit(self) -> State:
        """The target admits the request: prompt and outputs so far, the KV loaded."""
        assert self._stub is not None and self._stopped is not None
        stopped = self._stopped
        add = _continued(stopped)
        self.result.total_tokens = len(add.prompt_token_ids) + len(add.output_token_ids)
        committed = await self._stub.CommitMigration(
            pb.CommitRequest(
                migration_id=self.result.migration_id,
                add_request=_ENCODER.add(add)[1],
                kv_tokens=self.result.kv_tokens,
                last_output_at=stopped.last_output_at,
            ),
            timeout=self._timeout,
        )
        self._clock.mark("commit")
        if not committed.accepted:
            raise MigrationError(f"target refused the commit: {committed.detail}")
        # From the source's last token (or the stop, if none came) to the target taking over.
        self.result.downtime_ms = (time.time() - max(stopped.last_output_at, self._stop_wall)) * 1000
        self._add = add
        return State.HANDOVER

    async def _handover(self) -> State:
        """Tell the router where the request went (the hand-over piece), record the new owner."""
        assert self._add is not None
        self._service.hand_over(self._add, self._target_engine_id, self._add.generation)
        self._stopped = None  # it runs there now: nothing to resume here
        self._stub = None  # and nothing to cancel there
        await self._log.record_owner(self._add, self._target_engine_id)
        self._clock.mark("handover")
        await self._read_source_pace()
        self._metrics.migration_bytes.observe(self.result.bytes)
        self._metrics.migration_stages.observe(self.result.stages)
        self._metrics.migration_downtime.observe(self.result.downtime_ms / 1000)
        return State.DONE

    # ---- helpers ------------------------------------------------------------------------------

    def _send_blocks(
        self,
        *,
        partial: bool = False,
        running: bool = False,
        release: bool = False,
        max_bytes_per_s: int = 0,
        max_busy_share: float = 0.0,
        max_seconds: float = 0.0,
    ) -> kv.SendBlocks:
        """The KV agent's command to send this move's blocks from ``_next_block`` on to the
        target's staging area (the options are ``kv.SendBlocks``'s)."""
        return kv.SendBlocks(
            request_id=self._request_id,
            migration_id=self.result.migration_id,
            target=self._kv_address,
            first_block=self._next_block,
            partial=partial,
            running=running,
            release=release,
            max_bytes_per_s=max_bytes_per_s,
            max_busy_share=max_busy_share,
            max_seconds=max_seconds,
        )

    def _block_hashes(self) -> list[int]:
        """The request's full blocks as a prefix cache names them (``chain_hashes``), short of
        the last token: vLLM never takes that one from a cache, it computes it."""
        ids = self._service.token_ids_of(self._request_id) or []
        return chain_hashes(ids, self._block, limit=(len(ids) - 1) // self._block)

    def _tail_tokens(self) -> int:
        """The tokens the tail sent, if they do for the commit (the target computes the ones
        written since); 0: the last stage sends what is left."""
        assert self._stopped is not None
        if self._tail_sent is None:
            return 0
        reached, sent = self._tail_sent
        stopped = self._stopped
        # KV exists for every token but the last one sampled.
        written = len(stopped.add.prompt_token_ids) + len(stopped.output_ids) - 1
        if written <= reached * self._block and written - sent <= TAIL_TOKENS:
            return sent
        return 0

    async def _read_source_pace(self) -> None:
        """The source's pace while the move ran and in as long a window just before it
        (``source_step_ms``, ``source_step_ms_before``), from when the KV agent saw its forward
        passes end; left 0 when the agent cannot say. Not read while other moves leave this
        engine: the agent answers one call at a time, a paced stage of theirs would hold this
        move's answer up, and their copies would be in its windows anyway."""
        if self._others_moving():
            return
        began = self._began
        ended = time.monotonic()
        span = ended - began
        try:
            steps = await self._agent.call(kv.ReadSteps(since=began - span))
        except (MigrationError, zmq.ZMQError) as exc:
            logger.info("migration %s: no step times from the KV agent: %s", self.result.migration_id, exc)
            return
        if not isinstance(steps, kv.Steps):
            return
        self.result.source_step_ms_before = mean_step_ms(steps.ended, began - span, began)
        self.result.source_step_ms = mean_step_ms(steps.ended, began, ended)
        if self.result.source_step_ms and self.result.source_step_ms_before:
            self._metrics.migration_source_pace.observe(
                self.result.source_step_ms / self.result.source_step_ms_before
            )

    def _resume_here(self, stopped: StoppedRequest) -> None:
        """The target failed after the stop: run the request on here, after its tokens."""
        add = _continued(stopped)
        logger.warning("migration of %s failed after its stop; resuming it here", add.request_id)
        self._service.start(add)

    async def _cancel(self) -> None:
        assert self._stub is not None
        migration_id = self.result.migration_id
        try:
            await self._stub.CancelMigration(pb.CancelRequest(migration_id=migration_id), timeout=2.0)
        except grpc.aio.AioRpcError as exc:
            logger.info(
                "could not cancel migration %s on its target (%s); its staging expires",
                migration_id,
                exc.code(),
            )


def _continued(stopped: StoppedRequest) -> AddRequest:
    """The stopped request as it goes on (on the target, or here again): its outputs so far,
    one generation on."""
    return msgspec.structs.replace(
        stopped.add, output_token_ids=stopped.output_ids, generation=stopped.add.generation + 1
    )


def _refusal_code(code: str) -> MoveCode:
    """The target's own code for its refusal; ``target_refused`` where it gives none."""
    try:
        refusal = MoveCode(code)
    except ValueError:
        return MoveCode.TARGET_REFUSED
    return refusal if refusal.outcome == pb.REFUSED else MoveCode.TARGET_REFUSED


def _finished_first() -> MoveEndedError:
    return MoveEndedError(MoveCode.FINISHED_FIRST, "the request finished before it could move")
