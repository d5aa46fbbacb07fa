"""Balancing migrations with real parts: the leader lease in a real Redis, and two routers in
front of the two SmolLM2 engines, one of them piling requests on one engine (session affinity
with one session) and holding the lease: it moves requests to the other engine while every
stream, through either router, completes exactly once with its reference's tokens."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import httpx
import openai
import pytest
import redis.asyncio as aioredis

from shoal_router.core.rebalance import Lease
from tests.integration.support import (
    GREEDY_IDS,
    RunningFleet,
    extra_router,
    free_port,
    greedy_ids,
    redis_server,
)
from tests.integration.test_migration import _agree

pytestmark = pytest.mark.integration

STREAMS_B, STREAMS_A, MAX_TOKENS = 6, 2, 200


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
            deadline = time.monotonic() + 5
            while not await second.hold():
                assert time.monotonic() < deadline, "the lease never expired"
                await asyncio.sleep(0.05)
            assert not await first.hold()  # the old holder learns it lost it
            await second.release()
            assert await first.hold()
        finally:
            await client.aclose()


def _balance_counts(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=5).text
    return {
        o: float(n)
        for o, n in re.findall(r'shoal_router_balance_migrations_total\{outcome="(\w+)"\} (\S+)', text)
    }


async def test_two_routers_one_balancing_every_stream_exactly_once(
    smol_fleet: RunningFleet, tmp_path: Path
) -> None:
    cfg = smol_fleet.cfg
    assert cfg.zmq_curve_key_file is not None
    args = (
        "--scheduler", "session_affinity", "--balance", "--balance-interval", "0.3",
        "--balance-cooldown", "1", "--zmq-curve-key-file", cfg.zmq_curve_key_file,
    )  # fmt: skip
    prompts = [[1100 + 17 * i + j for j in range(6)] for i in range(STREAMS_A + STREAMS_B)]
    main = openai.AsyncOpenAI(
        base_url=smol_fleet.base_url + "/v1", api_key="unused", max_retries=0, timeout=300
    )
    references = await asyncio.gather(*(greedy_ids(main, smol_fleet.model, p, MAX_TOKENS) for p in prompts))
    with extra_router(smol_fleet, "router-balancer", tmp_path, *args) as (url, _):
        balancer = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)

        async def streamed(
            client: openai.AsyncOpenAI, prompt: list[int], session: str
        ) -> tuple[str, list[int]]:
            response = await client.completions.create(
                model=smol_fleet.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
                extra_body=GREEDY_IDS, extra_headers={"x-session-id": session},
            )  # fmt: skip
            ids: list[int] = []
            async for chunk in response:
                ids.extend(chunk.choices[0].model_extra["token_ids"])  # type: ignore[index]
            return response.response.headers["x-shoal-engine"], ids

        # One session through the balancing router piles its streams on one engine (its bound
        # on load lets it take most of them); two more streams go through the fleet's router.
        tasks = [streamed(balancer, p, "one-user") for p in prompts[:STREAMS_B]]
        tasks += [streamed(main, p, f"user-{i}") for i, p in enumerate(prompts[STREAMS_B:])]
        got = await asyncio.wait_for(asyncio.gather(*tasks), 300)
        counts = _balance_counts(url)
    firsts = [engine for engine, _ in got[:STREAMS_B]]
    assert max(firsts.count(e) for e in set(firsts)) >= 4, firsts  # the pile the balancer found
    assert counts.get("MIGRATED", 0) >= 1, counts
    listed = smol_fleet.redis.lrange(smol_fleet.keys.migrations, 0, 200)
    records = [smol_fleet.migration_record(m.decode()) for m in listed]
    assert any(r is not None and (r.reason, r.outcome) == ("balance", "MIGRATED") for r in records)
    # Every stream complete, once: its reference's tokens (up to a batch-shape tie, as in the
    # other SmolLM2 tests: a second reference run finds those).
    again = await asyncio.gather(*(greedy_ids(main, smol_fleet.model, p, MAX_TOKENS) for p in prompts))
    for i, (_, ids) in enumerate(got):
        stable = _agree(references[i], again[i])
        assert len(ids) == MAX_TOKENS and ids[:stable] == references[i][:stable], (i, stable)
