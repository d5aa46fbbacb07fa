"""What leaves the engines' prefix caches leaves the routers' index: blocks vLLM evicts (an
engine's cache kept small, so other prompts push a conversation's blocks out), and every block
of an engine that dies. A tiny fleet of the module's own (it kills an engine), its router on
``--scheduler prefix_cache``."""

from __future__ import annotations

import dataclasses
import os
import random
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from shoal_protos.prefix import chain_hashes, prefix_snapshot_decoder
from tests.integration.conftest import _fleet_config, _running
from tests.integration.support import STALL_S, RunningFleet, dispatched, fleet_state, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.destructive]

BLOCK = 128
CACHE_BLOCKS = 96
"""Each engine's KV blocks: 12,288 tokens, a little over the model's context, so a few prompts
fill the cache."""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningFleet]:
    run_dir = tmp_path_factory.mktemp("own-fleet")
    cfg = dataclasses.replace(
        _fleet_config("tiny", run_dir, "tiny-prefix", 5),
        engine_args=(f"--vllm-args=--num-gpu-blocks-override {CACHE_BLOCKS}",),
        router_args=("--scheduler", "prefix_cache"),
    )
    with _running({"tiny-prefix": cfg}) as running:
        yield running["tiny-prefix"]


def complete(fleet: RunningFleet, prompt: list[int], max_tokens: int = 2) -> None:
    body = {"model": fleet.model, "prompt": prompt, "max_tokens": max_tokens}
    response = httpx.post(fleet.base_url + "/v1/completions", json=body, timeout=60 * STALL_S)
    assert response.status_code == 200, response.text


def engine_blocks(fleet: RunningFleet, engine_id: str) -> set[int]:
    """The blocks the engine's last snapshot says it holds."""
    raw = fleet.redis.get(fleet.keys.prefix_snapshot(engine_id))
    return set(prefix_snapshot_decoder.decode(raw).blocks) if raw else set()


def cached_blocks(fleet: RunningFleet, engine_id: str) -> int:
    return next(
        int(e["cached_blocks"] or 0) for e in fleet_state(fleet.base_url)["engines"] if e["id"] == engine_id
    )


def test_evicted_blocks_and_a_dead_engines_blocks_leave_the_index(
    fleet: RunningFleet, tmp_path: Path
) -> None:
    rng = random.Random(7)
    prompt = [rng.randrange(3, 1000) for _ in range(6 * BLOCK)]
    hashes = set(chain_hashes(prompt, BLOCK))
    before = dispatched(fleet)
    complete(fleet, prompt)
    after = dispatched(fleet)
    engine = next(e for e in after if after[e] > before.get(e, 0.0))
    # The engine published the prompt's blocks (vLLM's BlockStored, through Redis).
    wait_until(
        lambda: hashes <= engine_blocks(fleet, engine), 30, "the engine to publish the prompt's blocks"
    )
    wait_until(lambda: cached_blocks(fleet, engine) >= len(hashes), 30, "the router to index them")
    # Other prompts fill both engines' caches (the router spreads them): vLLM evicts the first
    # prompt's blocks, and they leave the engine's snapshot and the router's index.
    for _ in range(8):
        complete(fleet, [rng.randrange(3, 1000) for _ in range(60 * BLOCK)], max_tokens=1)
    wait_until(
        lambda: not hashes & engine_blocks(fleet, engine), 30, "the evicted blocks to leave the snapshot"
    )
    # The router holds no more blocks of the engine than the engine itself does.
    wait_until(
        lambda: cached_blocks(fleet, engine) <= len(engine_blocks(fleet, engine)),
        30,
        "the router's index to follow the evictions",
    )
    # An engine dies: its blocks leave the index once the router counts it lost.
    state = fleet_state(fleet.base_url)["prefix_index"]
    assert sorted(state["engines"]) == ["engine-0", "engine-1"] and state["blocks"] > 0
    victim = "engine-1"
    held = cached_blocks(fleet, victim)
    assert held > 0
    os.kill(fleet.fleet.pids()[victim], signal.SIGKILL)
    wait_until(
        lambda: fleet_state(fleet.base_url)["prefix_index"]["engines"] == ["engine-0"],
        30,
        "the dead engine to leave the index",
    )
