"""Balancing migrations with real parts: the leader lease in a real Redis, and two routers in
front of the two SmolLM2 engines with every stream piled on one engine (the other out of the
rotation while they start). The router with ``--balance`` holds the lease and moves requests to
the idle engine while every stream, through either router, completes exactly once with its
reference's tokens."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
import redis.asyncio as aioredis

from shoal_protos.records import EngineState, engine_record_decoder, json_encoder
from shoal_router.core.rebalance import Lease
from tests.integration.support import (
    GREEDY_IDS,
    STALL_S,
    RunningFleet,
    extra_router,
    free_port,
    greedy_ids,
    redis_server,
    wait_until,
)
from tests.integration.test_migration import _agree

pytestmark = pytest.mark.integration

# Streams long enough to outlast a stall of the machine of several seconds (Redis reads time out,
# load reports go stale) and still leave the leader time to see the crowded engine and move.
STREAMS_B, STREAMS_A, MAX_TOKENS = 6, 2, 400


async def test_one_leader_at_a_time_and_a_successor_after_expiry() -> None:
    port = free_port()
    with redis_server(port):
        client = aioredis.Redis.from_url(f"redis://127.0.0.1:{port}/0")
        try:
            first = Lease(client, "lease", "router-a", ttl_s=0.5)
            second = Lease(client, "lease", "router-b", ttl_s=0.5)
            assert await first.hold() and not await second.hold()
            assert await first.hold() and not await second.hold()  # renewed by its holder only
            # The holder stops renewing (it died): the lease expires and the other takes it.
            deadline = time.monotonic() + STALL_S
            while not await second.hold():
                assert time.monotonic() < deadline, "the lease never expired"
                await asyncio.sleep(0.05)
            assert not await first.hold()  # the old holder learns it lost it
            await second.release()
            assert await first.hold()
        finally:
            await client.aclose()


def _balance_counts(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=STALL_S).text
    return {
        o: float(n)
        for o, n in re.findall(r'shoal_router_balance_migrations_total\{outcome="(\w+)"\} (\S+)', text)
    }


async def test_two_routers_one_balancing_every_stream_exactly_once(
    smol_fleet: RunningFleet, tmp_path: Path
) -> None:
    cfg = smol_fleet.cfg
    assert cfg.zmq_curve_key_file is not None and cfg.fleet_tls_dir is not None
    args = (
        "--balance", "--balance-interval-s", "0.3", "--balance-cooldown-s", "1",
        "--zmq-curve-key-file", cfg.zmq_curve_key_file, "--fleet-tls-dir", cfg.fleet_tls_dir,
    )  # fmt: skip
    crowded, idle = (cfg.engine_id(i) for i in range(2))
    prompts = [[1100 + 17 * i + j for j in range(6)] for i in range(STREAMS_A + STREAMS_B)]
    main = openai.AsyncOpenAI(
        base_url=smol_fleet.base_url + "/v1", api_key="unused", max_retries=0, timeout=300
    )
    references = await asyncio.gather(*(greedy_ids(main, smol_fleet.model, p, MAX_TOKENS) for p in prompts))
    with extra_router(smol_fleet, "router-balancer", tmp_path, *args) as (url, _):
        balancer = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        started = asyncio.Event()
        first_engines: list[str] = []

        async def streamed(client: openai.AsyncOpenAI, prompt: list[int]) -> list[int]:
            response = await client.completions.create(
                model=smol_fleet.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
                extra_body=GREEDY_IDS,
            )  # fmt: skip
            first_engines.append(response.response.headers["x-shoal-engine"])
            if len(first_engines) == len(prompts):
                started.set()
            ids: list[int] = []
            async for chunk in response:
                ids.extend(chunk.choices[0].model_extra["token_ids"])  # type: ignore[index]
            return ids

        # Pile every stream on one engine: the other's record says DRAINING while they start
        # (both routers then send nothing there), and ACTIVE again once all have begun.
        with _out_of_rotation(smol_fleet, idle, [smol_fleet.base_url, url]):
            tasks = [asyncio.create_task(streamed(balancer, p)) for p in prompts[:STREAMS_B]]
            tasks += [asyncio.create_task(streamed(main, p)) for p in prompts[STREAMS_B:]]
            await asyncio.wait_for(started.wait(), 120)
        got = await asyncio.wait_for(asyncio.gather(*tasks), 300)
        counts = _balance_counts(url)
    assert set(first_engines) == {crowded}, first_engines
    assert counts.get("MIGRATED", 0) >= 1, counts
    listed = smol_fleet.redis.lrange(smol_fleet.keys.migrations, 0, 200)
    records = [smol_fleet.migration_record(m.decode()) for m in listed]
    balanced = [r for r in records if r is not None and (r.reason, r.outcome) == ("balance", "MIGRATED")]
    # Moves relieve the crowded engine (later ones may go back once its own streams end).
    assert any((r.source, r.target) == (crowded, idle) for r in balanced), balanced
    # Every stream complete, once: its reference's tokens (up to a batch-shape tie, as in the
    # other SmolLM2 tests: a second reference run finds those).
    again = await asyncio.gather(*(greedy_ids(main, smol_fleet.model, p, MAX_TOKENS) for p in prompts))
    for i, ids in enumerate(got):
        stable = _agree(references[i], again[i])
        assert len(ids) == MAX_TOKENS and ids[:stable] == references[i][:stable], (i, stable)


@contextlib.contextmanager
def _out_of_rotation(fleet: RunningFleet, engine_id: str, routers: list[str]) -> Iterator[None]:
    """The engine's Redis record says DRAINING (the ``routers`` dispatch nothing to it; the
    engine itself runs on) until the block ends."""
    key = fleet.keys.engine(engine_id)
    raw = fleet.redis.get(key)
    assert raw is not None
    record = engine_record_decoder.decode(raw)
    leaving = msgspec.structs.replace(record, state=EngineState.DRAINING)
    fleet.redis.set(key, json_encoder.encode(leaving), keepttl=True)
    try:
        for router in routers:
            gone = functools.partial(lambda at: _state_at(at, engine_id) == "DRAINING", router)
            wait_until(gone, STALL_S, f"{router} to see {engine_id} go")
        yield
    finally:
        fleet.redis.set(key, raw, keepttl=True)


def _state_at(router: str, engine_id: str) -> str | None:
    engines: dict[str, str] = httpx.get(router + "/health", timeout=STALL_S).json()["engines"]
    return engines.get(engine_id)
