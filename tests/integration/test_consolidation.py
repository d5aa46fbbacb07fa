"""Consolidation through a real Redis: the balancing leader marks the lightest engine of a light
fleet as emptying, every router's fleet view reads the mark and dispatch stops sending it
requests, the leader asks the engine to move its requests away (reason ``consolidate``), and the
mark goes when the load climbs back or the leader stops.

The engines here are only their Redis records and load reports (what the routers read); their
control address answers nothing, so each consolidation move the leader asks for fails and is
counted as such. Moving requests for real is what ``test_rebalance`` shows with live engines."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest
import redis.asyncio as aioredis

from shoal_protos.records import EngineRecord, EngineState, Keys, LoadReport, json_encoder
from shoal_router.core.rebalance import BalancePolicy, Lease, Rebalancer
from shoal_router.core.scheduling import Ask, Scheduler
from shoal_router.ipc.fleet import FleetView
from shoal_router.metrics import RouterMetrics
from tests.integration.support import STALL_S, free_port, until

pytestmark = pytest.mark.integration

CLUSTER = "consolidate"
KEYS = Keys(CLUSTER)
TOTAL = 1000


_SEQ = itertools.count(1)


async def _engine(redis_client: aioredis.Redis, engine_id: str, running: int, used: int) -> None:
    """An engine's record, index entry and a fresh load report."""
    record = EngineRecord(
        engine_id=engine_id, model="m", zmq_address=f"tcp://127.0.0.1:{free_port()}",
        http_address="http://127.0.0.1:1", state=EngineState.ACTIVE, max_model_len=2048,
        protocol_version=1, started_at=time.time(), kv_blocks_total=TOTAL, max_num_seqs=64,
        control_address="127.0.0.1:1",
    )  # fmt: skip
    report = LoadReport(
        engine_id=engine_id, seq=next(_SEQ), time=time.time(), num_running=running, kv_blocks_used=used,
        kv_blocks_free=TOTAL - used,
    )  # fmt: skip
    await redis_client.sadd(KEYS.engines, engine_id)
    await redis_client.set(KEYS.engine(engine_id), json_encoder.encode(record))
    await redis_client.set(KEYS.load(engine_id), json_encoder.encode(report))


def _fleet(redis_client: aioredis.Redis) -> FleetView:
    return FleetView(redis_client, KEYS, lambda _: None, lambda *_: None)


async def test_the_leader_empties_the_lightest_engine_and_every_router_stops_dispatching_there(
    redis_client: aioredis.Redis,
) -> None:
    await _engine(redis_client, "a", running=2, used=300)
    await _engine(redis_client, "b", running=1, used=100)
    await _engine(redis_client, "c", running=2, used=200)
    leader_view, other_view = _fleet(redis_client), _fleet(redis_client)
    metrics = RouterMetrics()
    policy = BalancePolicy(threshold=0.1, patience=1, consolidate_below=0.5, consolidate_release=0.7)
    rebalancer = Rebalancer(
        Lease(redis_client, KEYS.leader, "router-0", ttl_s=5.0),
        leader_view.engines.values,
        metrics,
        policy,
        interval_s=0.1,
        timeout_s=2.0,
        client=redis_client,
        keys=KEYS,
    )
    tasks = [
        asyncio.create_task(leader_view.poll_forever(0.05)),
        asyncio.create_task(rebalancer.run_forever()),
    ]
    try:
        await until(lambda: redis_client.exists(KEYS.emptying("b")), STALL_S, "the emptying mark on b")
        assert 0 < await redis_client.pttl(KEYS.emptying("b")) <= 3000
        assert await redis_client.get(KEYS.emptying("b")) == b"router-0"
        assert not await redis_client.exists(KEYS.emptying("a"))
        assert not await redis_client.exists(KEYS.emptying("c"))

        # Another router reads the mark with the fleet, and dispatch leaves b alone.
        await other_view.refresh()
        views = other_view.engines
        assert views["b"].state == "EMPTYING" and views["a"].state == "ACTIVE"
        scheduler = Scheduler("least_load")
        picked = {scheduler.pick(Ask("m", [i, i + 1]), list(views.values())).engine_id for i in range(20)}  # type: ignore[union-attr]
        assert "b" not in picked

        # The leader asked b to move its request away (its control address answers nothing).
        def consolidations_failed() -> float:
            return metrics.consolidations.labels("FAILED")._value.get()

        async def asked() -> bool:
            return consolidations_failed() >= 1

        await until(asked, STALL_S, "a consolidation move")
        assert metrics.emptying._value.get() == 1

        # The load climbs past the release point over a and c: b goes back to dispatch.
        await _engine(redis_client, "a", running=6, used=700)
        await _engine(redis_client, "c", running=6, used=750)

        async def released() -> bool:
            return not await redis_client.exists(KEYS.emptying("b"))

        await until(released, STALL_S, "the mark to go")
        await other_view.refresh()
        assert other_view.engines["b"].state == "ACTIVE" and other_view.engines["b"].dispatchable
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_leader_that_stops_takes_its_marks_with_it(redis_client: aioredis.Redis) -> None:
    for name in "abcd":
        await _engine(redis_client, name, running=1, used=100)
    view = _fleet(redis_client)
    await view.refresh()
    rebalancer = Rebalancer(
        Lease(redis_client, KEYS.leader, "router-0", ttl_s=5.0),
        view.engines.values,
        RouterMetrics(),
        BalancePolicy(threshold=0.1, patience=1, consolidate_below=0.5, consolidate_release=0.7),
        interval_s=0.1,
        timeout_s=2.0,
        client=redis_client,
        keys=KEYS,
    )
    task = asyncio.create_task(rebalancer.run_forever())

    async def three_marked() -> bool:
        return len(await redis_client.keys(KEYS.emptying("*"))) == 3

    try:
        await until(three_marked, STALL_S, "three engines marked (the last one stays)")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert await redis_client.keys(KEYS.emptying("*")) == []
    assert not await redis_client.exists(KEYS.leader)
