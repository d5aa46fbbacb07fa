"""The autoscaler reads the engines' load reports from a real Redis and resizes the cluster it
finds in kmock (an in-memory Kubernetes API over HTTP; no API server runs here)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import kmock as kmock_lib
import kopf
import pytest
import redis.asyncio as aioredis

from shoal_operator.autoscale import LAST_SCALE_ANNOTATION, STALE_S, Autoscaler, read_engine_loads, read_load
from shoal_operator.children import Cluster
from shoal_operator.kube import Kube
from shoal_operator.scale import EngineLoad
from shoal_operator.spec import GROUP, KIND, PLURAL, VERSION
from shoal_protos.records import EngineRecord, EngineState, Keys, LoadReport, json_encoder
from tests.integration.support import redis_server

pytestmark = pytest.mark.integration

PORT = 16391
NS, NAME = "serving", "auto"
CLUSTER_ID = f"{NS}.{NAME}"  # what the engines get as --cluster
CLUSTERS = f"{GROUP}/{VERSION}/{PLURAL}"


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with redis_server(PORT):
        yield f"redis://127.0.0.1:{PORT}/0"


async def _engine(
    redis_client: aioredis.Redis,
    engine_id: str,
    used: int,
    free: int,
    state: str = "ACTIVE",
    age_s: float = 0.0,
) -> None:
    """What a running engine keeps in Redis: its record, its index entry, its load report."""
    keys = Keys(CLUSTER_ID)
    record = EngineRecord(
        engine_id=engine_id, model="m", zmq_address="tcp://x:1", http_address="http://x:2",
        state=EngineState(state), max_model_len=2048, protocol_version=1, started_at=time.time(),
    )  # fmt: skip
    report = LoadReport(
        engine_id=engine_id, seq=1, time=time.time() - age_s, kv_blocks_used=used, kv_blocks_free=free,
        num_waiting=used // 100,
    )  # fmt: skip
    await redis_client.sadd(keys.engines, engine_id)
    await redis_client.set(keys.engine(engine_id), json_encoder.encode(record))
    await redis_client.set(keys.load(engine_id), json_encoder.encode(report))


async def test_load_counts_only_active_engines_with_fresh_reports(redis_client: aioredis.Redis) -> None:
    await _engine(redis_client, "e0", used=800, free=200)
    await _engine(redis_client, "e1", used=400, free=600)
    await _engine(redis_client, "e2", used=1000, free=0, state="DRAINING")  # leaving: not capacity
    await _engine(redis_client, "e3", used=1000, free=0, age_s=STALE_S + 5)  # stopped reporting
    load = await read_load(redis_client, CLUSTER_ID, time.time())
    assert load.engines == 2
    assert load.kv_usage == pytest.approx(1200 / 2000)
    assert load.queue_per_engine == pytest.approx((8 + 4) / 2)


async def test_engine_loads_name_each_engine_with_its_state(redis_client: aioredis.Redis) -> None:
    """What a scale-down chooses from: every engine with a fresh report, DRAINING ones too."""
    await _engine(redis_client, "e0", used=800, free=200)
    await _engine(redis_client, "e1", used=400, free=600, state="DRAINING")
    await _engine(redis_client, "e2", used=100, free=900, age_s=STALE_S + 5)  # stopped reporting
    loads = await read_engine_loads(redis_client, CLUSTER_ID, time.time())
    assert loads == {
        "e0": EngineLoad(state="ACTIVE", waiting=8, kv_blocks_used=800, kv_blocks_free=200),
        "e1": EngineLoad(state="DRAINING", waiting=4, kv_blocks_used=400, kv_blocks_free=600),
    }


def _cluster(replicas: int, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "metadata": {"name": NAME, "namespace": NS, "uid": "u", "annotations": annotations or {}},
        "spec": {
            "model": {"source": "m", "servedName": "m"},
            "engine": {"replicas": replicas, "minReplicas": 1, "maxReplicas": 8},
            "autoscaling": {"enabled": True, "metric": "kvUsage", "target": 0.5, "cooldownSeconds": 120},
        },
    }


async def test_busy_fleet_grows_then_waits_for_the_cool_down(
    redis_client: aioredis.Redis, redis_url: str, kmock: kmock_lib.KubernetesEmulator
) -> None:
    kmock.resources[CLUSTERS] = kmock_lib.ResourceInfo(kind=KIND, namespaced=True, verbs={"get", "patch"})
    kmock.objects[CLUSTERS, NS, NAME] = _cluster(replicas=2)
    for i in range(2):
        await _engine(redis_client, f"auto-engine-{i}", used=900, free=100)  # 90 % KV in use, target 50 %

    async def url(_cluster: Cluster) -> str:
        return redis_url

    kube = Kube(kopf.ConnectionInfo(server=str(kmock.url).rstrip("/"), insecure=True))
    autoscaler = Autoscaler(kube, url)
    try:
        now = time.time()
        assert await autoscaler.step(dict(kmock.objects[CLUSTERS, NS, NAME].raw), now) == 4  # ceil(2 * 1.8)
        cluster = kmock.objects[CLUSTERS, NS, NAME]
        assert cluster["spec"]["engine"]["replicas"] == 4
        assert float(cluster["metadata"]["annotations"][LAST_SCALE_ANNOTATION]) == pytest.approx(now)
        # Still busy a minute later, but within the cool-down: nothing changes.
        assert await autoscaler.step(dict(cluster.raw), now + 60) is None
        assert kmock.objects[CLUSTERS, NS, NAME]["spec"]["engine"]["replicas"] == 4
    finally:
        await autoscaler.close()
        await kube.close()
