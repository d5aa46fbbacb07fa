"""``WorkerAgents``: the engine service's line to the KV agents of all its vLLM workers.

A tensor- or pipeline-parallel engine holds its KV cache in shards, one per worker, each served
by that worker's own agent (``shoal_engine.kv.ranks``). A move must send every shard, each to the
same rank on the target: rank ``r`` of the source reads its shard of the request's blocks and
writes them into rank ``r``'s staging on the target, and when the request arrives each of the
target's workers loads its own shard (vLLM hands every worker the same block table). So a
command that touches KV goes to every rank, with the target's address turned into that rank's:

* ``SendBlocks`` and ``Connect``: each rank to the same rank of the target. The replies combine
  into one: the blocks every rank sent (the fewest), the bytes of all of them, the slowest's
  time, the tokens every rank has written, preempted if any rank saw it. A stage that one rank
  got further in than another goes on from where the slowest stopped; the blocks a faster rank
  sends twice are staged twice and loaded once.
* ``Hold``, ``Release``, ``FreeStaging``: every rank (vLLM frees a request's blocks only once all
  its workers let them go). Every rank gets the command even when one fails; the first failure
  is raised after.
* ``AgentStatus``: every rank's, combined: the bytes of a block over all shards.
* ``ReadSteps``, ``ReadBlocks``, ``ReadStaged``: rank 0's (the pace of the engine's steps; the
  KV reads tests compare name their rank through ``call_rank``).

An engine of one worker has one agent and every command goes to it unchanged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import msgspec
import zmq.asyncio

from shoal_engine.kv.ranks import rank_address
from shoal_engine.migration.common import AgentCaller, AgentClient
from shoal_protos import kv


class WorkerAgents:
    def __init__(self, agents: Sequence[AgentCaller], tensor_parallel_size: int = 1) -> None:
        """``agents``: rank r's agent at index r; ``tensor_parallel_size``: the workers of one
        pipeline stage (their shards split heads; the stages split layers)."""
        if not agents or len(agents) % tensor_parallel_size:
            raise ValueError(f"{len(agents)} agents for tensor parallel size {tensor_parallel_size}")
        self._agents = list(agents)
        self._tp = tensor_parallel_size

    @classmethod
    def connect(
        cls,
        ctx: zmq.asyncio.Context,
        control_address: str,
        workers: int,
        tensor_parallel_size: int,
        timeout_s: float,
    ) -> WorkerAgents:
        """The lines to the agents of ``workers`` ranks, rank 0's at ``control_address``."""
        clients = [
            AgentClient(ctx, rank_address(control_address, rank), timeout_s) for rank in range(workers)
        ]
        return cls(clients, tensor_parallel_size)

    @property
    def workers(self) -> int:
        return len(self._agents)

    async def call(self, command: kv.AgentCommand) -> kv.AgentReply:
        if len(self._agents) == 1:
            return await self._agents[0].call(command)
        if isinstance(command, kv.SendBlocks):
            sent = await self._each(
                [msgspec.structs.replace(command, target=t) for t in self._targets(command.target)]
            )
            return _combined_send(sent)
        if isinstance(command, kv.Connect):
            await self._each([kv.Connect(target=t) for t in self._targets(command.target)])
            return None
        if isinstance(command, kv.Hold | kv.Release | kv.FreeStaging):
            await self._each([command] * len(self._agents))
            return None
        if isinstance(command, kv.AgentStatus):
            return self._combined_status(await self._each([command] * len(self._agents)))
        return await self._agents[0].call(command)

    async def call_rank(self, rank: int, command: kv.AgentCommand) -> kv.AgentReply:
        """One rank's reply, unchanged (its own shard's KV reads, its own status)."""
        return await self._agents[rank].call(command)

    def close(self) -> None:
        for agent in self._agents:
            close = getattr(agent, "close", None)
            if close is not None:
                close()

    def _targets(self, target: str) -> list[str]:
        return [rank_address(target, rank) for rank in range(len(self._agents))]

    async def _each(self, commands: list[kv.AgentCommand]) -> list[kv.AgentReply]:
        """Rank r's reply to ``commands[r]``, all at once; every rank runs its command to the end
        before the first failure is raised."""
        replies = await asyncio.gather(
            *(agent.call(c) for agent, c in zip(self._agents, commands, strict=True)), return_exceptions=True
        )
        for reply in replies:
            if isinstance(reply, BaseException):
                raise reply
        return replies  # type: ignore[return-value]  # no exception is left among them

    def _combined_status(self, replies: list[kv.AgentReply]) -> kv.Status:
        statuses = [r for r in replies if isinstance(r, kv.Status)]
        assert len(statuses) == len(replies), replies
        first = statuses[0]
        if any(s.block_size != first.block_size for s in statuses):
            raise ValueError(f"workers differ in block size: {[s.block_size for s in statuses]}")
        staged: dict[str, int] = {}
        for status in statuses:
            for migration_id, chunks in status.staging_areas.items():
                staged[migration_id] = max(staged.get(migration_id, 0), chunks)
        return kv.Status(
            block_size=first.block_size,
            # Each pipeline stage's layers once (the ranks of a stage hold the same layers).
            num_layers=sum(s.num_layers for s in statuses[:: self._tp]),
            bytes_per_block=sum(s.bytes_per_block for s in statuses),
            staging_areas=staged,
            staged_bytes=sum(s.staged_bytes for s in statuses),
            tracked_requests=first.tracked_requests,
            sources=sum(s.sources for s in statuses),
        )


def _combined_send(replies: list[kv.AgentReply]) -> kv.SentBlocks:
    sent = [r for r in replies if isinstance(r, kv.SentBlocks)]
    assert len(sent) == len(replies), replies
    fewest = min(sent, key=lambda s: s.next_block)
    return kv.SentBlocks(
        next_block=fewest.next_block,
        blocks=min(s.blocks for s in sent),
        bytes=sum(s.bytes for s in sent),
        seconds=max(s.seconds for s in sent),
        tokens_written=min(s.tokens_written for s in sent),
        preempted=any(s.preempted for s in sent),
    )
