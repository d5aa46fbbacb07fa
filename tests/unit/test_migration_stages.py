"""The source's side of a move (``MigrationManager.migrate``): which blocks the pre-copy stages
ask the KV agent for, and what a stage during which vLLM preempted the request does to the move.

The KV agent, the engine service and the target's control API are played by the test (Shoal's
own seams); the engine records and the owner record live in a real Redis."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import pytest_asyncio
import redis.asyncio as aioredis
import zmq

from shoal_engine.backend import EngineTimes
from shoal_engine.config import EngineConfig
from shoal_engine.kv.params import KvLoad
from shoal_engine.metrics import EngineMetrics
from shoal_engine.migration import (
    MAX_CHANNELS,
    MigrationError,
    MigrationManager,
    mean_step_ms,
    target_phases_ms,
)
from shoal_engine.migration.source import TAIL_TOKENS
from shoal_engine.migration.workers import WorkerAgents
from shoal_engine.serving import StoppedRequest
from shoal_protos import engine_control_pb2 as pb
from shoal_protos import kv
from shoal_protos.messages import PROTOCOL_VERSION, AddRequest, RouterRequestEncoder, SamplingOptions
from shoal_protos.moves import MoveCode
from shoal_protos.prefix import PrefixSnapshot, chain_hashes, prefix_event_encoder
from shoal_protos.records import (
    TARGET_PHASES,
    EngineRecord,
    Keys,
    LoadReport,
    json_encoder,
    migration_record_decoder,
    owner_record_decoder,
)
from shoal_sim.kv_agent import SimKvAgent, SimStaging
from tests.integration.support import free_port, redis_server

BLOCK, BYTES_PER_BLOCK = 16, 4096
PROMPT = list(range(100, 100 + 10 * BLOCK))  # ten full blocks
STEP_S = 0.0001  # the played source's forward passes end this often


@dataclass
class PlayedAgent:
    """The source's KV agent: answers each ``SendBlocks`` from ``stages`` (in order, then the
    final send after the stop; the tail's, while the request runs, with ``tail``: by default it
    had nothing to send), and keeps every command it got."""

    stages: list[kv.SentBlocks]
    final: kv.SentBlocks
    commands: list[kv.AgentCommand] = field(default_factory=list)
    tail: kv.SentBlocks | None = None

    async def call(self, command: kv.AgentCommand) -> kv.AgentReply:
        self.commands.append(command)
        if isinstance(command, kv.AgentStatus):
            return kv.Status(BLOCK, 2, BYTES_PER_BLOCK, {}, 0, 1)
        if isinstance(command, kv.ReadSteps):
            # A steady pace: a forward pass ended every STEP_S since then, up to now.
            count = int((time.monotonic() - command.since) / STEP_S)
            return kv.steps_since([command.since + i * STEP_S for i in range(count + 1)], command.since)
        if isinstance(command, kv.SendBlocks):
            if command.running:
                return self.tail or kv.SentBlocks(command.first_block, 0, 0, 0.0, 0)
            return self.final if command.partial else self.stages.pop(0)
        return None

    def close(self) -> None:
        pass

    def sends(self) -> list[tuple[int, bool]]:
        """(first block, partial) of each send but the tail's."""
        return [
            (c.first_block, c.partial)
            for c in self.commands
            if isinstance(c, kv.SendBlocks) and not c.running
        ]

    def tails(self) -> list[int]:
        """The first block of each tail send (the partly filled block, the request running)."""
        return [c.first_block for c in self.commands if isinstance(c, kv.SendBlocks) and c.running]


@dataclass
class PlayedService:
    """The engine service, with one running request that has written ``PROMPT`` and decodes on."""

    request_id: str
    outputs: list[int] = field(default_factory=lambda: [7, 8, 9])
    handed_over: list[tuple[str, int]] = field(default_factory=list)
    resumed: list[AddRequest] = field(default_factory=list)

    def tokens_of(self, request_id: str) -> int | None:
        return len(PROMPT) + len(self.outputs) if request_id == self.request_id else None

    def max_tokens_of(self, request_id: str) -> int | None:
        return len(PROMPT) + 64

    def token_ids_of(self, request_id: str) -> list[int] | None:
        return PROMPT + self.outputs

    def moved_to(self, request_id: str) -> str | None:
        return None

    async def wait_output_here(self, request_id: str, timeout_s: float) -> None:
        return None

    async def stop_for_migration(self, request_id: str, align_s: float) -> StoppedRequest:
        add = AddRequest(request_id, PROMPT, SamplingOptions(max_tokens=64), "tcp://127.0.0.1:1")
        return StoppedRequest(add, list(self.outputs), time.time())

    def hand_over(self, add: AddRequest, engine_id: str, generation: int) -> None:
        self.handed_over.append((engine_id, generation))

    def start(self, add: AddRequest) -> None:
        self.resumed.append(add)


@dataclass
class PlayedTarget:
    """The target's control API: takes every prepare and commit (``timeout`` as grpc.aio's
    stubs take it)."""

    commits: list[pb.CommitRequest] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)

    async def PrepareMigration(self, request: pb.PrepareRequest, timeout: float) -> pb.PrepareReply:  # noqa: N802, ASYNC109
        return pb.PrepareReply(accepted=True, kv_address="tcp://127.0.0.1:2", staging_ttl_s=60)

    async def CommitMigration(self, request: pb.CommitRequest, timeout: float) -> pb.CommitReply:  # noqa: N802, ASYNC109
        self.commits.append(request)
        return pb.CommitReply(accepted=True)

    async def CancelMigration(self, request: pb.CancelRequest, timeout: float) -> pb.CancelReply:  # noqa: N802, ASYNC109
        self.cancels.append(request.migration_id)
        return pb.CancelReply()


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    port = free_port()
    with redis_server(port):
        yield f"redis://127.0.0.1:{port}/0"


@pytest_asyncio.fixture
async def redis_client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    await client.flushdb()
    yield client
    await client.aclose()


def _engine_record(engine_id: str, control_address: str) -> EngineRecord:
    """Another engine's record in Redis, as a source of moves reads it."""
    return EngineRecord(
        engine_id=engine_id,
        model="m",
        zmq_address="tcp://127.0.0.1:3",
        http_address="http://127.0.0.1:4",
        max_model_len=4096,
        protocol_version=PROTOCOL_VERSION,
        started_at=time.time(),
        control_address=control_address,
    )


def _sent(first: int, count: int, written: int, preempted: bool = False) -> kv.SentBlocks:
    return kv.SentBlocks(first + count, count, count * BYTES_PER_BLOCK, 0.001, written, preempted)


async def _move(
    redis_client: aioredis.Redis,
    agent: PlayedAgent,
    service: PlayedService,
    target: PlayedTarget,
    metrics: EngineMetrics | None = None,
    reason: str = "admin",
    **settings: Any,
) -> pb.MigrationResult:
    config = EngineConfig(
        model="m",
        served_model_name="m",
        engine_id="source",
        cluster="stages",
        backend="sim",
        migration_max_stages=4,
        migration_last_stage_max_blocks=2,
        **settings,
    )
    keys = Keys(config.cluster)
    record = _engine_record("target", "127.0.0.1:5")
    await redis_client.set(keys.engine("target"), json_encoder.encode(record))
    metrics = metrics or EngineMetrics("source", "m")
    manager = MigrationManager(
        config,
        service,  # type: ignore[arg-type]
        lambda: 100,
        redis_client,
        keys,
        metrics,
        agent=agent,
        control_stub=lambda address: target,  # type: ignore[arg-type,return-value]
    )
    try:
        result = await manager.migrate(service.request_id, "target", reason)
        # The move's record, written to Redis after it ended, says how it went.
        deadline = time.monotonic() + 5
        while (raw := await redis_client.get(keys.migration(result.migration_id))) is None:
            assert time.monotonic() < deadline, "no migration record"
            await asyncio.sleep(0.01)
        record = migration_record_decoder.decode(raw)
        assert (
            record.outcome,
            record.stages,
            record.kv_tokens,
            record.phase_ms,
            record.source_step_ms,
            record.source_step_ms_before,
        ) == (
            pb.Outcome.Name(result.outcome),
            result.stages,
            result.kv_tokens,
            dict(result.phase_ms),
            result.source_step_ms,
            result.source_step_ms_before,
        )
        return result
    finally:
        await manager.aclose()


@pytest.mark.asyncio
async def test_a_stage_the_request_was_preempted_during_is_sent_again_from_the_same_block(
    redis_client: aioredis.Redis,
) -> None:
    written = len(PROMPT) + 2
    agent = PlayedAgent(
        stages=[
            _sent(0, 4, written),
            # vLLM preempted the request while blocks 4.. were on their way: none of them count.
            _sent(4, 0, 0, preempted=True),
            # Resumed (recomputed), it has its blocks again: they go from block 4.
            _sent(4, 6, written),
        ],
        final=_sent(10, 1, written),
    )
    service, target, metrics = PlayedService("r1"), PlayedTarget(), EngineMetrics("source", "m")
    result = await _move(redis_client, agent, service, target, metrics)
    assert (result.outcome, result.code) == (pb.MIGRATED, MoveCode.MOVED), result.detail
    assert agent.sends() == [(0, False), (4, False), (4, False), (10, True)]
    # The tail (sent nothing here: the played agent had no partly filled block) is a stage too.
    assert agent.tails() == [10]
    assert (result.stages, result.blocks, result.kv_tokens) == (5, 11, written)
    labels = {"engine": "source", "model": "m"}
    assert metrics.registry.get_sample_value("shoal_engine_migration_stages_lost_total", labels) == 1
    # Each part of the move timed once, within the move's whole time (no warm-up: the
    # simulated backend has no prefix cache to warm).
    phases = ["prepare", "precopy", "tail", "stop", "last_stage", "commit", "handover"]
    assert set(result.phase_ms) == set(phases)
    assert all(ms >= 0 for ms in result.phase_ms.values())
    assert sum(result.phase_ms.values()) <= result.duration_ms
    for phase in phases:
        count = metrics.registry.get_sample_value(
            "shoal_engine_migration_phase_seconds_count", {**labels, "phase": phase}
        )
        assert count == 1, phase
    # The source's pace during the move and just before it, from the agent's step ends: steady.
    assert result.source_step_ms == pytest.approx(STEP_S * 1000)
    assert result.source_step_ms_before == pytest.approx(STEP_S * 1000)
    ratio = ("shoal_engine_migration_source_step_ratio_count", "shoal_engine_migration_source_step_ratio_sum")
    assert [metrics.registry.get_sample_value(name, labels) for name in ratio] == [1, pytest.approx(1.0)]
    assert service.handed_over == [("target", 1)] and not service.resumed and not target.cancels
    assert len(target.commits) == 1 and target.commits[0].kv_tokens == written
    owner = owner_record_decoder.decode(await redis_client.get(Keys("stages").owner("r1")))
    assert (owner.engine_id, owner.generation) == ("target", 1)


@pytest.mark.asyncio
@pytest.mark.parametrize("since", [1, 15, 16])
async def test_the_tail_spares_the_last_stage_when_few_tokens_came_after_it(
    redis_client: aioredis.Redis, since: int
) -> None:
    """The tail sends the partly filled last block while the request decodes. Stopped with the
    tokens written since still in that block (and at most ``TAIL_TOKENS`` of them), the move
    sends nothing more: the commit loads what the tail sent and the target computes the rest.
    Once they spill into the next block (16 here), the last stage sends from the partly filled
    block on, as without a tail."""
    service = PlayedService("r4", outputs=list(range(7, 7 + since + 2)))
    written = len(PROMPT) + len(service.outputs) - 1  # at the stop: all but the last sampled
    agent = PlayedAgent(
        stages=[_sent(0, 10, len(PROMPT))],
        final=_sent(10, 1, written),
        tail=_sent(10, 1, written - since),
    )
    target = PlayedTarget()
    result = await _move(redis_client, agent, service, target)
    assert (result.outcome, result.code) == (pb.MIGRATED, MoveCode.MOVED), result.detail
    assert agent.tails() == [10]
    if written <= 11 * BLOCK and since <= TAIL_TOKENS:
        assert agent.sends() == [(0, False)]
        assert result.kv_tokens == target.commits[0].kv_tokens == written - since
        assert [type(c).__name__ for c in agent.commands if isinstance(c, kv.Release)] == ["Release"]
    else:
        assert agent.sends() == [(0, False), (10, True)]
        assert result.kv_tokens == target.commits[0].kv_tokens == written


@dataclass
class HoldingTarget(PlayedTarget):
    """A target whose prefix cache holds the request's first ``held`` blocks."""

    held: int = 0
    prepares: list[pb.PrepareRequest] = field(default_factory=list)

    async def PrepareMigration(self, request: pb.PrepareRequest, timeout: float) -> pb.PrepareReply:  # noqa: N802, ASYNC109
        self.prepares.append(request)
        reply = await super().PrepareMigration(request, timeout)
        reply.cached_blocks = self.held
        return reply


@pytest.mark.asyncio
async def test_blocks_the_target_holds_in_its_prefix_cache_are_not_sent(redis_client: aioredis.Redis) -> None:
    """The prepare names the request's full blocks by their chained hashes; the target answers
    how many of the first it holds, and the pre-copy starts after them."""
    service = PlayedService("r5")
    written = len(PROMPT) + len(service.outputs) - 1
    agent = PlayedAgent(stages=[_sent(6, 4, written)], final=_sent(10, 1, written))
    target = HoldingTarget(held=6)
    result = await _move(redis_client, agent, service, target)
    assert (result.outcome, result.code) == (pb.MIGRATED, MoveCode.MOVED), result.detail
    (prepare,) = target.prepares
    assert list(prepare.block_hashes) == chain_hashes(PROMPT + service.outputs, BLOCK, limit=10)
    assert agent.sends() == [(6, False), (10, True)]
    assert (result.target_cached_blocks, result.blocks) == (6, 5)
    record = migration_record_decoder.decode(
        await redis_client.get(Keys("stages").migration(result.migration_id))
    )
    assert record.target_cached_blocks == 6


@pytest.mark.asyncio
async def test_the_target_answers_how_much_of_the_request_its_cache_holds(
    redis_client: aioredis.Redis,
) -> None:
    """``PrepareMigration`` carries the answer of the engine's prefix cache, unless the move
    sends no KV (recompute)."""
    config = EngineConfig(model="m", served_model_name="m", engine_id="t", backend="sim")
    agent = PlayedAgent(stages=[], final=_sent(0, 0, 0))
    manager = MigrationManager(
        config,
        ArrivingService(),
        lambda: 100,
        redis_client,
        Keys("c"),
        EngineMetrics("t", "m"),
        agent=agent,  # type: ignore[arg-type]
    )
    manager.target.held_prefix = lambda hashes: sum(1 for h in hashes if h % 2 == 0)
    try:
        asked = pb.PrepareRequest(
            migration_id="m1",
            request_id="r",
            num_blocks=4,
            bytes_per_block=BYTES_PER_BLOCK,
            block_hashes=[2, 4, 5, 6],
        )
        reply = await manager.prepare(asked)
        assert reply.accepted and reply.cached_blocks == 3
        asked.migration_id, asked.recompute = "m2", True
        assert (await manager.prepare(asked)).cached_blocks == 0
    finally:
        await manager.aclose()


@pytest.mark.asyncio
async def test_a_request_still_preempted_at_the_stop_moves_with_the_blocks_it_has_again(
    redis_client: aioredis.Redis,
) -> None:
    """Preempted in every stage it gets (it waits for room to resume): the stages end at their
    bound and the stop sends from the last block that counted; the target recomputes the rest."""
    agent = PlayedAgent(
        stages=[_sent(0, 3, 3 * BLOCK + 5)] + [_sent(3, 0, 0, preempted=True)] * 3,
        final=_sent(3, 0, 0),
    )
    service, target = PlayedService("r2"), PlayedTarget()
    result = await _move(redis_client, agent, service, target)
    assert (result.outcome, result.code) == (pb.MIGRATED, MoveCode.MOVED), result.detail
    assert agent.sends() == [(0, False), (3, False), (3, False), (3, False), (3, True)]
    # No KV written when it stopped: the commit says so, and the target computes it all.
    assert result.kv_tokens == 0 and target.commits[0].kv_tokens == 0
    assert service.handed_over == [("target", 1)]


@pytest.mark.asyncio
async def test_a_send_after_the_stop_that_loses_its_blocks_leaves_the_request_on_the_source(
    redis_client: aioredis.Redis,
) -> None:
    class LosingAgent(PlayedAgent):
        async def call(self, command: kv.AgentCommand) -> kv.AgentReply:
            reply = await super().call(command)
            if isinstance(command, kv.SendBlocks) and command.partial and not command.running:
                raise MigrationError("KV agent: request r3 lost its blocks while they were sent")
            return reply

    agent = LosingAgent(stages=[_sent(0, 10, len(PROMPT) + 2)], final=_sent(10, 1, len(PROMPT) + 2))
    service, target = PlayedService("r3"), PlayedTarget()
    result = await _move(redis_client, agent, service, target)
    assert (result.outcome, result.code) == (pb.FAILED, MoveCode.STEP_FAILED), result
    assert "lost its blocks" in result.detail
    # It runs on here after the tokens it had; the target's staging is cancelled.
    assert [add.output_token_ids for add in service.resumed] == [service.outputs]
    assert not service.handed_over and len(target.cancels) == 1 and not target.commits


class _PreemptedOnce:
    """A simulated backend as the simulated KV agent reads it: a request with five blocks
    written, preempted during the next send when ``preempt`` is set."""

    def __init__(self) -> None:
        self.staging = SimStaging()
        self.preempt, self._times = False, 0

    def tokens_written(self, request_id: str) -> int:
        return 5 * BLOCK

    def times_preempted(self, request_id: str) -> int:
        if self.preempt:  # read before and after the send: it grows in between
            self._times += 1
        return self._times


@contextlib.contextmanager
def sim_agent(backend: object) -> Iterator[tuple[Callable[[kv.AgentCommand], kv.AgentReply], str]]:
    """A simulated KV agent over ``backend``: a call on its control socket, and its data address."""
    control, data = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    agent = SimKvAgent(backend, control, data, BLOCK, BYTES_PER_BLOCK, bytes_per_s=1e9)  # type: ignore[arg-type]
    agent.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.connect(control)

    def call(command: kv.AgentCommand) -> kv.AgentReply:
        sock.send(kv.encoder.encode(command))
        assert sock.poll(5000), "the simulated agent did not answer"
        return kv.agent_reply_decoder.decode(sock.recv())

    try:
        yield call, data
    finally:
        sock.close(linger=0)
        ctx.term()
        agent.close()


def test_the_simulated_agent_stages_nothing_of_a_send_its_request_was_preempted_during() -> None:
    backend = _PreemptedOnce()
    with sim_agent(backend) as (call, data):
        # Sent to its own data socket: its staging counts what arrives.
        backend.preempt = True
        lost = call(kv.SendBlocks("r", "m", data, 0))
        assert isinstance(lost, kv.SentBlocks) and lost.preempted and (lost.next_block, lost.blocks) == (0, 0)
        lost_last = call(kv.SendBlocks("r", "m", data, 0, partial=True))
        assert isinstance(lost_last, kv.AgentError) and "lost its blocks" in lost_last.message
        backend.preempt = False
        sent = call(kv.SendBlocks("r", "m", data, 0))
        assert isinstance(sent, kv.SentBlocks) and not sent.preempted and sent.next_block == 5
        deadline = time.monotonic() + 5
        while backend.staging.blocks("m") < 5:
            assert time.monotonic() < deadline, "the staged blocks never arrived"
            time.sleep(0.01)
        assert backend.staging.blocks("m") == 5  # the lost sends staged nothing


class _Stopped:
    """A simulated backend with a held request of five full blocks and three tokens more."""

    def __init__(self) -> None:
        self.staging = SimStaging()
        self.released: list[str] = []

    def tokens_written(self, request_id: str) -> int:
        return 5 * BLOCK + 3

    def times_preempted(self, request_id: str) -> int:
        return 0

    def release(self, request_id: str) -> None:
        self.released.append(request_id)


def test_the_simulated_agent_lets_a_held_request_go_with_its_last_send() -> None:
    """As the real agent: ``release`` lets the held request's blocks go with the send."""
    backend = _Stopped()
    with sim_agent(backend) as (call, data):
        sent = call(kv.SendBlocks("r", "m", data, 4, partial=True, release=True))
        assert isinstance(sent, kv.SentBlocks) and (sent.next_block, sent.blocks) == (6, 2)
        assert sent.bytes == 2 * BYTES_PER_BLOCK
        assert backend.released == ["r"]


def test_the_source_pace_is_the_mean_time_between_the_steps_that_ended_in_a_window() -> None:
    # Steps every 10 ms up to t = 1.0 s, then every 12 ms (a move slowed them by a fifth).
    ends = [i * 0.010 for i in range(101)] + [1.0 + i * 0.012 for i in range(1, 51)]
    assert mean_step_ms(ends, 0.5, 1.0) == pytest.approx(10.0)
    assert mean_step_ms(ends, 1.0, 1.6) == pytest.approx(12.0)
    # A window holding one step end (or none) says nothing about the pace.
    assert mean_step_ms(ends, 0.501, 0.509) == 0.0
    assert mean_step_ms(ends, 0.5, 0.505) == 0.0
    assert mean_step_ms([], 0.0, 1.0) == 0.0


def test_the_target_times_the_hand_over_from_the_commit_to_the_first_token_in_four_parts() -> None:
    # The commit reached the target at 10.000 s; its engine took the request in 3 ms later,
    # scheduled it 1 ms after that, sampled its first token 40 ms later; the token reached the
    # engine service 2 ms after.
    times = EngineTimes(queued=10.003, scheduled=10.004, first_token=10.044)
    phases = target_phases_ms(10.0, times, 10.046)
    assert list(phases) == list(TARGET_PHASES)
    assert phases == pytest.approx({"admit": 3.0, "queue": 1.0, "first_step": 40.0, "output": 2.0})
    # The parts add up to the whole hand-over on the target.
    assert sum(phases.values()) == pytest.approx(46.0)
    # A stamp read before the one it follows (another process's clock read) counts 0, and the
    # parts after it are timed from the latest mark, so none is negative and none counted twice.
    skewed = target_phases_ms(10.0, EngineTimes(9.999, 10.004, 10.044), 10.046)
    assert skewed == pytest.approx({"admit": 0.0, "queue": 4.0, "first_step": 40.0, "output": 2.0})
    # An engine that keeps no stamps: no parts, rather than made-up ones.
    assert target_phases_ms(10.0, None, 10.046) == {}


@dataclass
class RankedTarget(PlayedTarget):
    """A target that keeps every prepare it got (to read the layout the source declared)."""

    prepares: list[pb.PrepareRequest] = field(default_factory=list)

    async def PrepareMigration(self, request: pb.PrepareRequest, timeout: float) -> pb.PrepareReply:  # noqa: N802, ASYNC109
        self.prepares.append(request)
        return await super().PrepareMigration(request, timeout)


@pytest.mark.asyncio
@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
async def test_an_engine_of_two_workers_sends_each_shard_to_the_same_rank_on_the_target(
    redis_client: aioredis.Redis, parallel: dict[str, int]
) -> None:
    """Each worker's agent holds one shard of the KV: every send and hold goes to every rank
    (the last stage's send releasing the blocks), each rank's send to the same rank of the
    target (its ports two past rank 0's), and the move counts the bytes of both shards. The
    target learns how the source splits it."""
    ranks = [
        PlayedAgent(stages=[_sent(0, 8, 130)], final=_sent(8, 3, 163)),
        PlayedAgent(stages=[_sent(0, 8, 130)], final=_sent(8, 3, 163)),
    ]
    agents = WorkerAgents(ranks, parallel.get("tensor_parallel_size", 1))
    service, target = PlayedService("r1"), RankedTarget()
    result = await _move(redis_client, agents, service, target, **parallel)  # type: ignore[arg-type]
    assert (result.outcome, result.code) == (pb.MIGRATED, MoveCode.MOVED), result
    for rank, agent in enumerate(ranks):
        targets = {c.target for c in agent.commands if isinstance(c, kv.SendBlocks)}
        assert targets == {f"tcp://127.0.0.1:{2 + 2 * rank}"}, (rank, targets)
        assert agent.sends() == [(0, False), (8, True)]
        kinds = [type(c).__name__ for c in agent.commands if isinstance(c, kv.Hold | kv.Release)]
        assert kinds == ["Hold"], (rank, kinds)
        last = [c for c in agent.commands if isinstance(c, kv.SendBlocks) and c.partial and not c.running]
        assert [c.release for c in last] == [True], rank
    # Both shards' bytes, each rank's blocks once.
    assert (result.blocks, result.bytes, result.kv_tokens) == (11, 2 * 11 * BYTES_PER_BLOCK, 163)
    (prepare,) = target.prepares
    layout = (prepare.tensor_parallel_size, prepare.pipeline_parallel_size)
    assert layout == (parallel.get("tensor_parallel_size", 1), parallel.get("pipeline_parallel_size", 1))
    assert prepare.bytes_per_block == 2 * BYTES_PER_BLOCK


@pytest.mark.asyncio
async def test_a_stage_goes_on_from_the_rank_that_sent_fewest_blocks(redis_client: aioredis.Redis) -> None:
    """One rank had written a step more than the other when the stage read its table: the next
    stage starts where the slower rank stopped, and the commit loads what both ranks have."""
    ranks = [
        PlayedAgent(stages=[_sent(0, 8, 130), _sent(8, 1, 147)], final=_sent(9, 2, 163)),
        PlayedAgent(stages=[_sent(0, 7, 120), _sent(7, 2, 147)], final=_sent(9, 2, 162)),
    ]
    service, target = PlayedService("r1"), PlayedTarget()
    result = await _move(redis_client, WorkerAgents(ranks, 2), service, target, tensor_parallel_size=2)  # type: ignore[arg-type]
    assert (result.outcome, result.code) == (pb.MIGRATED, MoveCode.MOVED), result
    assert ranks[0].sends() == ranks[1].sends() == [(0, False), (7, False), (9, True)]
    assert result.kv_tokens == 162


@pytest.mark.asyncio
async def test_a_release_reaches_every_rank_when_one_rank_fails() -> None:
    """vLLM frees a request's blocks only when all its workers let go: a rank whose agent fails
    a release must not keep the others from getting it; the failure is raised after."""

    @dataclass
    class Failing(PlayedAgent):
        async def call(self, command: kv.AgentCommand) -> kv.AgentReply:
            self.commands.append(command)
            raise MigrationError("KV agent did not answer within 1 s")

    ok, failing = PlayedAgent(stages=[], final=_sent(0, 0, 0)), Failing(stages=[], final=_sent(0, 0, 0))
    agents = WorkerAgents([failing, ok])
    with pytest.raises(MigrationError, match="did not answer"):
        await agents.call(kv.Release(request_id="r1"))
    assert ok.commands == [kv.Release(request_id="r1")] == failing.commands


@pytest.mark.asyncio
async def test_the_status_of_a_sharded_engine_counts_a_block_over_all_shards() -> None:
    def status(layers: int, width: int) -> kv.Status:
        return kv.Status(BLOCK, layers, width, {"m": 1}, width, 1, 1)

    class Fixed:
        def __init__(self, reply: kv.Status) -> None:
            self.reply = reply

        async def call(self, command: kv.AgentCommand) -> kv.AgentReply:
            return self.reply

    # TP 2 x PP 2: the ranks of one stage hold the same 3 layers, each half their heads.
    agents = WorkerAgents([Fixed(status(3, 100)) for _ in range(4)], tensor_parallel_size=2)
    combined = await agents.call(kv.AgentStatus())
    assert isinstance(combined, kv.Status)
    assert (combined.num_layers, combined.bytes_per_block, combined.staged_bytes) == (6, 400, 400)


@pytest.mark.asyncio
async def test_a_target_split_otherwise_takes_a_move_without_kv(redis_client: aioredis.Redis) -> None:
    config = EngineConfig(
        model="m", served_model_name="m", engine_id="t", backend="sim", tensor_parallel_size=2
    )
    service = PlayedService("r1")
    service.draining = False  # type: ignore[attr-defined]
    agent = PlayedAgent(stages=[], final=_sent(0, 0, 0))
    manager = MigrationManager(
        config, service, lambda: 100, redis_client, Keys("c"), EngineMetrics("t", "m"), agent=agent
    )  # type: ignore[arg-type]
    try:
        reply = await manager.prepare(
            pb.PrepareRequest(
                migration_id="m", request_id="r1", num_blocks=1, bytes_per_block=7, recompute=True
            )
        )
    finally:
        await manager.aclose()
    assert reply.accepted, reply


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("source", "here"),
    [((1, 1), {"tensor_parallel_size": 2}), ((2, 1), {}), ((2, 1), {"pipeline_parallel_size": 2})],
)
async def test_a_target_split_otherwise_refuses_the_move_with_both_layouts(
    redis_client: aioredis.Redis, source: tuple[int, int], here: dict[str, int]
) -> None:
    config = EngineConfig(model="m", served_model_name="m", engine_id="t", backend="sim", **here)
    service = PlayedService("r1")
    service.draining = False  # type: ignore[attr-defined]
    metrics = EngineMetrics("t", "m")
    agent = PlayedAgent(stages=[], final=_sent(0, 0, 0))
    manager = MigrationManager(config, service, lambda: 100, redis_client, Keys("c"), metrics, agent=agent)  # type: ignore[arg-type]
    try:
        reply = await manager.prepare(
            pb.PrepareRequest(
                migration_id="m",
                request_id="r1",
                num_blocks=1,
                bytes_per_block=BYTES_PER_BLOCK,
                tensor_parallel_size=source[0],
                pipeline_parallel_size=source[1],
            )
        )
    finally:
        await manager.aclose()
    assert (reply.accepted, reply.code) == (False, MoveCode.SHARDED), reply
    assert f"TP {source[0]} x PP {source[1]}" in reply.detail and "same rank" in reply.detail


@dataclass
class OtherSplitTarget(RankedTarget):
    """A target split over TP 2 x PP 1: it refuses a move of KV from a TP 1 engine, and takes one
    without KV."""

    async def PrepareMigration(self, request: pb.PrepareRequest, timeout: float) -> pb.PrepareReply:  # noqa: N802, ASYNC109
        self.prepares.append(request)
        if not request.recompute:
            detail = "the source splits its KV cache over TP 1 x PP 1 workers, this engine over TP 2 x PP 1"
            return pb.PrepareReply(accepted=False, detail=detail, code=MoveCode.SHARDED.value)
        return pb.PrepareReply(accepted=True, kv_address="tcp://127.0.0.1:2", staging_ttl_s=60)


@pytest.mark.asyncio
async def test_a_drain_moves_to_an_engine_split_otherwise_without_the_kv(
    redis_client: aioredis.Redis,
) -> None:
    """A rollout that changes tensorParallelSize drains old engines into new ones, which cannot
    take their KV: the move goes on without it (the target computes the context again) rather
    than leave the request to its engine's end."""
    agent = PlayedAgent(stages=[_sent(0, 8, 130)], final=_sent(8, 3, 163))
    service, target = PlayedService("r1"), OtherSplitTarget()
    result = await _move(redis_client, agent, service, target, reason="drain")
    assert (result.outcome, result.code) == (pb.MIGRATED, MoveCode.MOVED), result
    assert [p.recompute for p in target.prepares] == [False, True]
    # No KV went, and the target was told to compute it all.
    assert agent.sends() == [] and (result.bytes, result.kv_tokens) == (0, 0)
    (commit,) = target.commits
    assert commit.kv_tokens == 0 and service.handed_over == [("target", 1)]


@pytest.mark.asyncio
async def test_a_balancing_move_to_an_engine_split_otherwise_ends_refused(
    redis_client: aioredis.Redis,
) -> None:
    agent = PlayedAgent(stages=[_sent(0, 8, 130)], final=_sent(8, 3, 163))
    service, target = PlayedService("r1"), OtherSplitTarget()
    result = await _move(redis_client, agent, service, target, reason="balance")
    assert (result.outcome, result.code) == (pb.REFUSED, MoveCode.SHARDED), result
    assert len(target.prepares) == 1 and not target.commits and agent.sends() == []


class ArrivingService:
    """The target's engine service: requests it was handed run until the test ends them."""

    draining = False

    def __init__(self) -> None:
        self.running: set[str] = set()

    def tokens_of(self, request_id: str) -> int | None:
        return len(PROMPT) if request_id in self.running else None

    def start(self, add: AddRequest, kv_load: KvLoad | None = None) -> None:
        self.running.add(add.request_id)


@pytest.mark.asyncio
async def test_the_target_forgets_moves_whose_requests_end_before_their_first_output(
    redis_client: aioredis.Redis,
) -> None:
    """A moved request the target counts until its first output (for the stall it measures)
    and that ends before it (aborted as it arrived) is not kept for ever: a hundred such
    moves leave one entry, the newest."""
    config = EngineConfig(model="m", served_model_name="m", engine_id="t", backend="sim")
    service = ArrivingService()
    manager = MigrationManager(config, service, lambda: 100, redis_client, Keys("c"), EngineMetrics("t", "m"))  # type: ignore[arg-type]
    encoder = RouterRequestEncoder()
    try:
        for i in range(100):
            add = AddRequest(f"r{i}", PROMPT, SamplingOptions(max_tokens=8), "tcp://127.0.0.1:1")
            commit = pb.CommitRequest(migration_id=f"m{i}", add_request=encoder.add(add)[1])
            assert (await manager.commit(commit)).accepted
            service.running.discard(add.request_id)  # aborted before its first output
        assert len(manager.target.arriving) == 1
        # What the request socket refuses, a commit refuses too: outputs to anything but a
        # router's tcp://host:port.
        add = AddRequest("r-bad", PROMPT, SamplingOptions(max_tokens=8), "ipc:///tmp/elsewhere")
        reply = await manager.commit(pb.CommitRequest(migration_id="m-bad", add_request=encoder.add(add)[1]))
        assert not reply.accepted and "tcp://host:port" in reply.detail
        assert "r-bad" not in service.running
    finally:
        await manager.aclose()


@pytest.mark.asyncio
async def test_channels_to_engines_not_met_for_longest_are_closed(redis_client: aioredis.Redis) -> None:
    config = EngineConfig(model="m", served_model_name="m", engine_id="t", backend="sim")
    manager = MigrationManager(
        config, ArrivingService(), lambda: 100, redis_client, Keys("c"), EngineMetrics("t", "m")
    )  # type: ignore[arg-type]
    try:
        peers = manager.peers
        peers.stub("127.0.0.1:1")
        for port in range(2, 3 * MAX_CHANNELS):
            peers.stub(f"127.0.0.1:{port}")
            peers.stub("127.0.0.1:1")  # used all along: kept
        assert len(peers.channels) == MAX_CHANNELS
        assert "127.0.0.1:1" in peers.channels and "127.0.0.1:2" not in peers.channels
    finally:
        await manager.aclose()


@pytest.mark.asyncio
async def test_a_target_left_to_the_source_is_one_with_room_that_holds_the_prefix(
    redis_client: aioredis.Redis,
) -> None:
    """A drain's target: of the engines with nearly the most free KV blocks, the one whose
    prefix cache (its snapshot in Redis) holds most of the request's first blocks; a cached
    engine far fuller than the freest loses to it."""
    keys = Keys("pick")
    hashes = chain_hashes(PROMPT, BLOCK)

    async def engine(engine_id: str, free: int, held: int) -> None:
        record = _engine_record(engine_id, f"{engine_id}:5")
        load = LoadReport(engine_id=engine_id, seq=1, time=time.time(), kv_blocks_free=free)
        snapshot = PrefixSnapshot(epoch="e", seq=1, block_size=BLOCK, blocks=[*hashes[:held], 99])
        await redis_client.sadd(keys.engines, engine_id)
        await redis_client.set(keys.engine(engine_id), json_encoder.encode(record))
        await redis_client.set(keys.load(engine_id), json_encoder.encode(load))
        await redis_client.set(keys.prefix_snapshot(engine_id), prefix_event_encoder.encode(snapshot))

    config = EngineConfig(model="m", served_model_name="m", engine_id="source", cluster="pick", backend="sim")
    manager = MigrationManager(
        config, ArrivingService(), lambda: 100, redis_client, keys, EngineMetrics("source", "m")
    )  # type: ignore[arg-type]
    try:
        await engine("freest", free=110, held=0)
        await engine("holder", free=100, held=3)
        await engine("full-holder", free=40, held=10)
        picked = await manager.peers.pick_target("", hashes)
        assert picked is not None and picked.engine_id == "holder"
        assert (await manager.peers.pick_target("", [])).engine_id == "freest"  # type: ignore[union-attr]
        await engine("holder", free=80, held=3)  # below three quarters of the freest
        assert (await manager.peers.pick_target("", hashes)).engine_id == "freest"  # type: ignore[union-attr]
    finally:
        await manager.aclose()
