"""Prefix-cache routing on the real tiny fleet (128-token KV blocks, the fleet's default): the
engines publish what vLLM's prefix cache holds (vLLM's KV events, through Redis), and a router
with ``--scheduler prefix_cache`` sends a conversation's next turn to the engine that holds its
first, with no session header, whether its prompt is token ids (hashed by the router) or text
(hashed by the tokenizer); vLLM's own prefix-cache counters on that engine confirm the hit.
A router started afterwards, as after a restart, builds the same index from Redis; a request
moved with its KV is announced by its target, and a move to an engine that holds the request's
first blocks sends only the rest."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import httpx
import pytest

from shoal_protos import engine_control_pb2 as pb
from shoal_protos.prefix import chain_hashes, prefix_snapshot_decoder
from tests.integration.support import (
    STALL_S,
    RunningFleet,
    dispatched_at,
    extra_router,
    fleet_state,
    in_flight,
    wait_until,
)

pytestmark = pytest.mark.integration

PROMPT_BLOCKS = 5
BLOCK = 128


def prefix_hits(fleet: RunningFleet, engine_id: str) -> float:
    """Prompt tokens vLLM's prefix cache served on the engine (its own counter)."""
    text = fleet.engine_metrics(engine_id)
    return sum(
        float(value) for value in re.findall(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)$", text, re.M)
    )


def complete(url: str, model: str, prompt: list[int] | str) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": 4}
    response = httpx.post(url + "/v1/completions", json=body, timeout=60 * STALL_S)
    assert response.status_code == 200, response.text


def served_by(url: str, before: dict[str, float]) -> str:
    after = dispatched_at(url)
    grew = [engine for engine, count in after.items() if count > before.get(engine, 0.0)]
    assert len(grew) == 1, (before, after)
    return grew[0]


def cached_blocks(url: str, engine_id: str) -> int:
    for engine in fleet_state(url)["engines"]:
        if engine["id"] == engine_id:
            return int(engine["cached_blocks"] or 0)
    return 0


def test_next_turns_land_where_their_prefix_is_cached_and_vllm_counts_the_hit(
    tiny_fleet: RunningFleet, tmp_path: Path
) -> None:
    fleet, rng = tiny_fleet, random.Random(41)
    engines = [f"engine-{i}" for i in range(fleet.cfg.engines)]
    conversations = [[rng.randrange(3, 1000) for _ in range(PROMPT_BLOCKS * BLOCK + 40)] for _ in range(6)]
    first_engines: list[str] = []
    with extra_router(fleet, "prefix-router", tmp_path, "--scheduler", "prefix_cache") as (url, _):
        wait_until(
            lambda: all(engine["cached_blocks"] is not None for engine in fleet_state(url)["engines"]),
            30,
            "the router to read the engines' prefix caches",
        )
        for prompt in conversations:
            held = {engine: cached_blocks(url, engine) for engine in engines}
            before = dispatched_at(url)
            complete(url, fleet.model, prompt)
            engine = served_by(url, before)
            first_engines.append(engine)
            # The first turn's blocks, new to the engine, reach the router's index (the engine's
            # vLLM events, through Redis).
            wait_until(
                lambda engine=engine, held=held: cached_blocks(url, engine) >= held[engine] + PROMPT_BLOCKS,
                30,
                "the router to learn the first turn's blocks",
            )
            hits = prefix_hits(fleet, engine)
            before = dispatched_at(url)
            complete(url, fleet.model, [*prompt, *(rng.randrange(3, 1000) for _ in range(60))])
            assert served_by(url, before) == engine
            # vLLM served the whole first turn's blocks from its cache.
            assert prefix_hits(fleet, engine) - hits >= PROMPT_BLOCKS * BLOCK
        # Text: the router looks up the block hashes the tokenizer sent with the token ids.
        words = ["river", "stone", "lamp", "garden", "window", "paper", "cloud", "bridge"]
        for _ in range(3):
            text = " ".join(rng.choice(words) for _ in range(PROMPT_BLOCKS * BLOCK + 40))
            held = {engine: cached_blocks(url, engine) for engine in engines}
            before = dispatched_at(url)
            complete(url, fleet.model, text)
            engine = served_by(url, before)
            wait_until(
                lambda engine=engine, held=held: cached_blocks(url, engine) >= held[engine] + PROMPT_BLOCKS,
                30,
                "the router to learn the text's blocks",
            )
            before = dispatched_at(url)
            complete(url, fleet.model, text + " and then the lamp went out")
            assert served_by(url, before) == engine
    # A router started now (as after a restart) reads the same caches from Redis.
    with extra_router(fleet, "prefix-router-2", tmp_path, "--scheduler", "prefix_cache") as (url, _):
        wait_until(
            lambda: all(cached_blocks(url, e) >= PROMPT_BLOCKS for e in set(first_engines)),
            30,
            "the restarted router to read the snapshots",
        )
        for prompt, engine in zip(conversations, first_engines, strict=True):
            before = dispatched_at(url)
            complete(url, fleet.model, [*prompt, 7, 7, 7])
            assert served_by(url, before) == engine


def test_a_moved_requests_blocks_are_announced_by_its_target(tiny_fleet: RunningFleet) -> None:
    """A request moved with its KV: the target's vLLM caches the blocks it loaded, and its
    prefix-cache events say so, so the next turn of that conversation can follow it there."""
    fleet, rng = tiny_fleet, random.Random(43)
    prompt = [rng.randrange(3, 1000) for _ in range(3 * BLOCK + 10)]
    hashes = set(chain_hashes(prompt, BLOCK))
    body = {"model": fleet.model, "prompt": prompt, "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", fleet.base_url + "/v1/completions", json=body, timeout=60 * STALL_S) as reply:
        assert reply.status_code == 200
        request_id = reply.headers["x-shoal-request-id"]
        lines = reply.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        source = next(r["engine"] for r in in_flight(fleet) if r["id"] == request_id)
        target = next(e for e in ("engine-0", "engine-1") if e != source)
        result = fleet.migrate(request_id, source, target)
        assert result.outcome == pb.MIGRATED, result
        wait_until(
            lambda: hashes <= snapshot_blocks(fleet, target), 30, "the target to announce the moved blocks"
        )
        reply.close()


def moved_stream(
    fleet: RunningFleet, prompt: list[int], max_tokens: int
) -> tuple[list[int], pb.MigrationResult]:
    """A greedy stream of ``prompt``, moved to the other engine after its first piece: its token
    ids and the move's result."""
    body = {
        "model": fleet.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "return_token_ids": True,
    }  # fmt: skip
    token_ids: list[int] = []
    with httpx.stream("POST", fleet.base_url + "/v1/completions", json=body, timeout=60 * STALL_S) as reply:
        assert reply.status_code == 200
        request_id = reply.headers["x-shoal-request-id"]
        source = reply.headers["x-shoal-engine"]
        result: pb.MigrationResult | None = None
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            token_ids += json.loads(line[6:])["choices"][0]["token_ids"]
            if result is None:
                target = next(e for e in ("engine-0", "engine-1") if e != source)
                result = fleet.migrate(request_id, source, target)
                assert result.outcome == pb.MIGRATED, result
    assert result is not None
    return token_ids, result


def test_a_move_sends_none_of_the_blocks_its_target_holds(tiny_fleet: RunningFleet) -> None:
    """A move asks its target how much of the request its prefix cache holds and sends only
    the rest: the second of two greedy streams of one prompt, each moved, finds the prompt's
    blocks on either engine (the first left them on both), sends fewer, and comes out the same."""
    fleet, rng = tiny_fleet, random.Random(44)
    prompt = [rng.randrange(3, 1000) for _ in range(3 * BLOCK + 10)]
    hashes = set(chain_hashes(prompt, BLOCK))
    first, cold = moved_stream(fleet, prompt, 48)
    assert cold.target_cached_blocks == 0, cold
    for engine_id in ("engine-0", "engine-1"):
        wait_until(
            lambda e=engine_id: hashes <= snapshot_blocks(fleet, e), 30, f"{engine_id} to hold the prompt"
        )
    second, warm = moved_stream(fleet, prompt, 48)
    assert second == first
    assert warm.target_cached_blocks >= 3, warm
    # Block 3, the partly filled one, went (with the tail, and again at the stop if it filled
    # meanwhile); blocks 0-2 went only for the cold move.
    assert warm.blocks <= 2 and cold.blocks >= 4, (warm, cold)


def snapshot_blocks(fleet: RunningFleet, engine_id: str) -> set[int]:
    raw = fleet.redis.get(fleet.keys.prefix_snapshot(engine_id))
    return set(prefix_snapshot_decoder.decode(raw).blocks) if raw else set()
