"""Moves between tensor-parallel engines: each worker's KV shard goes to the same rank.

The fleet: two engines of the tiny model, each of two vLLM workers (tensor parallel size 2 on
vLLM's CPU build, a core per worker). Each worker holds half of every layer's KV heads and runs
its own KV agent; a move sends rank 0's shard to the target's rank 0 and rank 1's to its rank 1.
A shard sent to the wrong rank, or only one of them, would change the greedy tokens after the
move, and the bytes each rank of the target holds are compared with the source's.
"""

from __future__ import annotations

import pytest

from shoal_engine.migration.source import TAIL_TOKENS
from shoal_protos import engine_control_pb2 as pb
from shoal_protos import kv
from tests.integration.support import STALL_S, RunningFleet, wait_until
from tests.integration.test_migration import (
    TINY_LONG,
    TINY_PROMPT,
    Streamed,
    moved_back_to_back,
    stream,
)

pytestmark = pytest.mark.integration

RANKS = (0, 1)


def test_a_stream_moved_between_tensor_parallel_engines_matches_unmoved(own_tp_fleet: RunningFleet) -> None:
    fleet = own_tp_fleet
    # The same request never moved, on this fleet: sums over two workers' heads round apart
    # from a single worker's, so the reference is a tensor-parallel engine's own.
    reply = fleet.openai().completions.create(
        model=fleet.model,
        prompt=TINY_PROMPT,
        max_tokens=TINY_LONG,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    ref_ids = list(reply.choices[0].model_extra["token_ids"])  # type: ignore[index]

    def exact(got: Streamed) -> None:
        assert got.token_ids == ref_ids
        assert got.finish_reason == "length"

    got = moved_back_to_back(fleet, TINY_PROMPT, TINY_LONG, 3, check=exact)
    for move in got.moves:
        # Every token's KV but the last sampled one's (and the few written after the move's tail,
        # which the target computes) went over, from both workers.
        assert move.total_tokens - 1 - TAIL_TOKENS <= move.kv_tokens <= move.total_tokens - 1, move
        assert move.bytes > 0 and move.stages >= 1, move


class _CheckedError(Exception):
    """Raised by a stream hook once the test has what it needs: the client leaves."""


def test_each_rank_of_the_target_holds_the_same_ranks_shard_of_the_source(own_tp_fleet: RunningFleet) -> None:
    fleet = own_tp_fleet
    read: dict[str, dict[int, kv.AgentReply]] = {"source": {}, "target": {}}
    moved: list[pb.MigrationResult] = []

    def read_then_move(out: Streamed) -> None:
        if len(out.token_ids) < 300:
            return
        source, target = out.first_engine, "engine-1" if out.first_engine == "engine-0" else "engine-0"
        blocks = kv.ReadBlocks(request_id=out.request_id, first_block=0, num_blocks=2)
        for rank in RANKS:
            # Full blocks never change: what each worker holds now is what the move copies.
            read["source"][rank] = fleet.agent(source, blocks, rank)
        result = fleet.migrate(out.request_id, source, target)
        assert result.outcome == pb.MIGRATED, result
        moved.append(result)

        def injected() -> bool:
            # Each worker of the target knows the request's blocks once its first step ran.
            for rank in RANKS:
                read["target"][rank] = fleet.agent(target, blocks, rank)
            return all(isinstance(r, kv.BlockBytes) for r in read["target"].values())

        wait_until(injected, STALL_S, f"both workers of {target} to hold the request's blocks")
        raise _CheckedError

    # Far longer than the check takes: the request still decodes on the target when its blocks
    # are read; then the client leaves.
    with pytest.raises(_CheckedError):
        stream(fleet, [901, 902, 903, 904, 905], TINY_LONG, read_then_move)
    shards = {}
    for rank in RANKS:
        source, target = read["source"][rank], read["target"][rank]
        assert isinstance(source, kv.BlockBytes) and isinstance(target, kv.BlockBytes), (rank, source, target)
        assert len(source.data) > 0
        assert target.data == source.data, (
            f"rank {rank} of the target holds other bytes than rank {rank} of the source"
        )
        shards[rank] = source.data
    # Two shards of the same blocks: the two workers' halves of the heads, not one copy twice.
    assert shards[0] != shards[1]
    (result,) = moved
    # The move copied both shards.
    assert result.bytes >= sum(len(s) for s in shards.values())
