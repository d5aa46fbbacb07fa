"""Simulated engines behind the real router: two ``shoal-engine --backend sim`` processes (the
engine service with vLLM replaced by the A100 step-time model, at 4x speed) register in a real
Redis, a real router places requests on them over ZeroMQ, and the official ``openai`` client
streams the answers. Every token arrives exactly once, the router spreads the load, a KV
cache too small for the batch preempts requests without losing or repeating a token, and a
request the engine has no KV room for waits at the router until it has."""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.integration.support import STALL_S, SimFleet, fleet_state, metric, wait_until
from tests.integration.support import sim_fleet as start_sim_fleet

pytestmark = pytest.mark.integration

CLUSTER, MODEL = "sim-test", "sim-llama"
ENGINES = 2
KV_BLOCKS, MAX_MODEL_LEN = 64, 1024  # 1,024 tokens of KV per engine: one long request fills it


@pytest.fixture(scope="module")
def sim_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimFleet]:
    """Redis, two simulated engines and a router."""
    engine_args = [
        "--model", "llama3-8b-a100", "--sim-speed", "4", "--sim-kv-blocks", str(KV_BLOCKS),
        "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "16",
    ]  # fmt: skip
    with start_sim_fleet(
        tmp_path_factory.mktemp("sim-fleet"), CLUSTER, MODEL, engine_args, engines=ENGINES
    ) as fleet:
        yield fleet


async def _stream(client: openai.AsyncOpenAI, prompt: list[int], max_tokens: int) -> tuple[str, list[int]]:
    response = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    engine = response.response.headers["x-shoal-engine"]
    ids: list[int] = []
    async for chunk in response:
        ids.extend(chunk.choices[0].model_extra["token_ids"])  # type: ignore[index]
    return engine, ids


async def test_streams_through_the_router_complete_once_on_both_engines(sim_fleet: SimFleet) -> None:
    client = openai.AsyncOpenAI(base_url=sim_fleet.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    prompts = [[7 + i, 100 + i, 3] for i in range(16)]
    got = await asyncio.gather(*(_stream(client, p, 60) for p in prompts))
    assert {engine for engine, _ in got} == {f"sim-{i}" for i in range(ENGINES)}  # least load spreads
    # Each request's tokens come from a generator seeded by its prompt: run alone, the same.
    alone = [await _stream(client, p, 60) for p in prompts[:4]]
    for (_, ids), (_, again) in zip(got[:4], alone, strict=True):
        assert len(ids) == 60 and ids == again
    assert all(len(ids) == 60 for _, ids in got)


def _preemptions(engine_urls: list[str]) -> float:
    return sum(metric(url, "shoal_sim_preemptions_total") for url in engine_urls)


async def test_a_full_kv_cache_preempts_and_no_token_is_lost_or_repeated(sim_fleet: SimFleet) -> None:
    client = openai.AsyncOpenAI(base_url=sim_fleet.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    before = _preemptions(sim_fleet.engine_urls)
    # Eight requests growing to 500 tokens (32 blocks) each, on engines of 64 blocks.
    prompts = [list(range(1000 + 200 * i, 1200 + 200 * i)) for i in range(8)]
    crowded = await asyncio.gather(*(_stream(client, p, 300) for p in prompts))
    assert _preemptions(sim_fleet.engine_urls) > before
    alone = [await _stream(client, p, 300) for p in prompts[:2]]
    assert all(len(ids) == 300 for _, ids in crowded)
    assert [ids for _, ids in crowded[:2]] == [ids for _, ids in alone]


@pytest.mark.parametrize("block_size", [16, 128])
async def test_a_request_waits_at_the_router_while_the_engine_is_short_of_kv(
    tmp_path: pathlib.Path, block_size: int
) -> None:
    """One engine of 1,152 tokens of KV (72 blocks of 16 tokens, or 9 of 128): a running request
    holding 600 of them leaves too little for a second 500-token prompt (the router's hold,
    ``core.hold``, counting it in the engine's own blocks), which waits at the router, not in
    the engine, and goes out once the first request ends and the engine reports its blocks free."""
    blocks = 1152 // block_size
    engine_args = [
        "--model", "llama3-8b-a100", "--sim-speed", "0.5", "--sim-kv-blocks", str(blocks),
        "--block-size", str(block_size), "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "16",
    ]  # fmt: skip
    with start_sim_fleet(
        tmp_path, "sim-hold", MODEL, engine_args, router_args=("--hold-max-s", "60"), engines=1
    ) as fleet:
        client = openai.AsyncOpenAI(base_url=fleet.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        first = asyncio.create_task(_stream(client, list(range(2000, 2600)), 400))

        def reported() -> bool:
            # The engine's load report shows the first request running, with its blocks.
            (engine,) = fleet_state(fleet.url)["engines"]
            assert (engine["block_size"], engine["kv_blocks"]) == (block_size, blocks)
            return bool(engine["running"] == 1 and engine["kv_usage"] >= -(-600 // block_size) / blocks)

        await asyncio.to_thread(wait_until, reported, STALL_S, "a load report with the first request")
        second = asyncio.create_task(_stream(client, list(range(3000, 3500)), 300))
        await asyncio.to_thread(
            wait_until,
            lambda: metric(fleet.url, "shoal_router_requests_held") == 1,
            STALL_S,
            "the second request to be held",
        )
        assert not first.done(), "the first request ended before the second was held"
        # Held at the router: the engine has only the first request.
        assert await asyncio.to_thread(_engine_requests, fleet.engine_urls[0]) == 1
        (_, first_ids), (_, second_ids) = await asyncio.wait_for(asyncio.gather(first, second), STALL_S)
        assert len(first_ids) == 400 and len(second_ids) == 300
        assert metric(fleet.url, "shoal_router_requests_held") == 0
        # It went out because the blocks came back, not because its wait ran out.
        assert metric(fleet.url, "shoal_router_hold_expired_total") == 0


async def test_a_prompt_that_fits_an_engine_of_large_blocks_is_not_held(tmp_path: pathlib.Path) -> None:
    """An engine of 32 blocks of 128 tokens (the CPU build's size): a 1,000-token prompt takes 8
    of them and goes out at once. (Counted in 16-token blocks it would take 63, more than the
    engine has: the router would hold it until its wait ran out.)"""
    engine_args = [
        "--model", "llama3-8b-a100", "--sim-speed", "4", "--sim-kv-blocks", "32", "--block-size", "128",
        "--max-model-len", "4096", "--max-num-seqs", "16",
    ]  # fmt: skip
    with start_sim_fleet(
        tmp_path, "sim-big-blocks", MODEL, engine_args, router_args=("--hold-max-s", "60"), engines=1
    ) as fleet:
        client = openai.AsyncOpenAI(base_url=fleet.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        engine, ids = await asyncio.wait_for(_stream(client, list(range(5000, 6000)), 20), 2 * STALL_S)
        assert (engine, len(ids)) == ("sim-0", 20)
        # Held, it would have gone out only once its wait ran out.
        assert metric(fleet.url, "shoal_router_hold_expired_total") == 0


def _engine_requests(url: str) -> int:
    return int(httpx.get(url + "/health", timeout=STALL_S).json()["requests"])
