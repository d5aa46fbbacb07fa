"""Built-in engine autoscaling from the fleet's own load reports in Redis.

Every engine writes a load report to Redis each second (running and waiting requests, KV blocks
used and free). The autoscaler reads the reports of the cluster's ACTIVE engines, averages the
chosen metric (``kvUsage``: KV blocks used over all blocks; ``queueLength``: waiting requests per
engine), and sizes the fleet the way Kubernetes' HPA does: ``ceil(engines * metric / target)``,
left alone within 10 % of the target, clamped to ``minReplicas..maxReplicas``.

Scaling up goes straight to that size. Scaling down removes one engine at a time: each removal
is a drain (its requests migrate to the others), and the next one waits for the cool-down, so
the fleet never sheds more than it can absorb. Any change waits ``cooldownSeconds`` after the
previous one, which is kept in an annotation on the cluster (it survives operator restarts).
The change is a patch of ``spec.engine.replicas``; the reconciler does the rest (it picks the
least-loaded engine, drains it, then shrinks). Nothing changes while the engines roll over to a
new template. HPA or KEDA can drive the scale subresource instead, with ``autoscaling.enabled``
off.
"""

from __future__ import annotations

import base64
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import cast

import msgspec
import redis.asyncio as aioredis
from pydantic import ValidationError

from shoal_operator.children import REDIS_AUTH_KEY, REDIS_PORT, Cluster, redis_auth_secret_name
from shoal_operator.reconcile import CLUSTER_API_VERSION, Api, ApiError, Manifest
from shoal_operator.scale import EngineLoad
from shoal_operator.spec import KIND, AutoscalingSpec, EngineSpec, InferenceClusterSpec
from shoal_protos.records import Keys, engine_record_decoder, load_report_decoder

LAST_SCALE_ANNOTATION = "shoal.dev/last-scale-time"
TOLERANCE = 0.1
"""No change while the metric is within this fraction of the target (as HPA's default)."""
STALE_S = 10.0
"""Reports older than this are an engine that stopped reporting: left out."""


@dataclass(frozen=True)
class FleetLoad:
    """The mean load of the ACTIVE engines that reported recently."""

    engines: int
    kv_usage: float = 0.0
    queue_per_engine: float = 0.0


def desired_replicas(
    autoscaling: AutoscalingSpec,
    engine: EngineSpec,
    load: FleetLoad,
    current: int,
    last_scale: float | None,
    now: float,
) -> int:
    """The engine count to set now (``current`` when nothing should change)."""
    if not autoscaling.enabled or load.engines == 0:
        return current
    if last_scale is not None and now - last_scale < autoscaling.cooldown_seconds:
        return current
    metric = load.kv_usage if autoscaling.metric == "kvUsage" else load.queue_per_engine
    ratio = metric / autoscaling.target
    wanted = current if abs(ratio - 1.0) <= TOLERANCE else math.ceil(load.engines * ratio)
    wanted = max(engine.min_replicas, min(engine.max_replicas, wanted))
    if wanted < current:
        # One drain at a time, and none while engines are still starting (not reporting yet).
        return current - 1 if load.engines >= current else current
    return wanted


async def read_engine_loads(client: aioredis.Redis, cluster_id: str, now: float) -> dict[str, EngineLoad]:
    """Every registered engine of ``cluster_id`` with a recent report, by engine id (its pod
    name), whatever its state."""
    keys = Keys(cluster_id)
    members = cast(set[bytes], await client.smembers(keys.engines))  # bytes: no decode_responses
    ids = sorted(member.decode() for member in members)
    if not ids:
        return {}
    records = await client.mget([keys.engine(i) for i in ids])
    reports = await client.mget([keys.load(i) for i in ids])
    loads = {}
    for engine_id, record_raw, report_raw in zip(ids, records, reports, strict=True):
        if record_raw is None or report_raw is None:
            continue
        try:
            record, report = engine_record_decoder.decode(record_raw), load_report_decoder.decode(report_raw)
        except msgspec.DecodeError:
            continue
        if now - report.time > STALE_S:
            continue
        loads[engine_id] = EngineLoad(
            state=str(record.state),
            running=report.num_running,
            waiting=report.num_waiting,
            kv_blocks_used=report.kv_blocks_used,
            kv_blocks_free=report.kv_blocks_free,
        )
    return loads


def fleet_load(loads: dict[str, EngineLoad]) -> FleetLoad:
    """The mean load of the ACTIVE engines among ``loads``."""
    active = [load for load in loads.values() if load.state == "ACTIVE"]
    if not active:
        return FleetLoad(engines=0)
    used = sum(load.kv_blocks_used for load in active)
    total = used + sum(load.kv_blocks_free for load in active)
    waiting = sum(load.waiting for load in active)
    return FleetLoad(
        engines=len(active), kv_usage=used / total if total else 0.0, queue_per_engine=waiting / len(active)
    )


async def read_load(client: aioredis.Redis, cluster_id: str, now: float) -> FleetLoad:
    """The load of ``cluster_id``'s ACTIVE engines from their reports (stale ones left out)."""
    return fleet_load(await read_engine_loads(client, cluster_id, now))


class FleetRedis:
    """Each cluster's Redis, where its engines report their load: the managed Redis Service
    (password from its Secret), or the spec's URL or URL Secret. One client per URL."""

    def __init__(self, api: Api, redis_url: Callable[[Cluster], Awaitable[str]] | None = None) -> None:
        self._api = api
        self._redis_url = redis_url or self._cluster_redis_url
        self._clients: dict[str, aioredis.Redis] = {}

    async def client(self, cluster: Cluster) -> aioredis.Redis:
        url = await self._redis_url(cluster)
        client = self._clients.get(url)
        if client is None:
            client = self._clients[url] = aioredis.Redis.from_url(url, socket_timeout=5)
        return client

    async def engine_loads(self, cluster: Cluster) -> dict[str, EngineLoad]:
        """The cluster's engines with a recent load report, by pod name."""
        return await read_engine_loads(await self.client(cluster), cluster.cluster_id, time.time())

    async def _cluster_redis_url(self, cluster: Cluster) -> str:
        redis = cluster.spec.redis
        if redis.mode == "managed":
            password = await self._secret_value(cluster, redis_auth_secret_name(cluster), REDIS_AUTH_KEY)
            return f"redis://:{password}@{cluster.name}-redis.{cluster.namespace}.svc:{REDIS_PORT}/0"
        if redis.url_secret is None:
            return str(redis.url)
        return await self._secret_value(cluster, redis.url_secret.name, redis.url_secret.key)

    async def _secret_value(self, cluster: Cluster, name: str, key: str) -> str:
        secret = await self._api.get("v1", "Secret", cluster.namespace, name)
        encoded = ((secret or {}).get("data") or {}).get(key)
        if not encoded:
            raise ApiError(404, f"Secret {name} has no key {key}")
        return base64.b64decode(encoded).decode()

    async def close(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()


def _updating(body: Manifest) -> bool:
    """The cluster's engines are rolling over to a new template (its ``Updating`` condition)."""
    conditions = (body.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Updating" and c.get("status") == "True" for c in conditions)


class Autoscaler:
    """Sizes autoscaled clusters from their Redis load reports; patches ``spec.engine.replicas``."""

    def __init__(
        self,
        api: Api,
        redis_url: Callable[[Cluster], Awaitable[str]] | None = None,
        fleet: FleetRedis | None = None,
    ) -> None:
        self._api = api
        self._fleet = fleet or FleetRedis(api, redis_url)

    async def step(self, body: Manifest, now: float) -> int | None:
        """Resize the cluster in ``body`` if its load asks for it; returns the new engine count."""
        meta = body["metadata"]
        try:
            spec = InferenceClusterSpec.model_validate(body.get("spec") or {})
        except ValidationError:
            return None  # the reconciler reports it
        if not spec.autoscaling.enabled or _updating(body):
            return None  # a rollout's surge engines would read as spare capacity
        cluster = Cluster(name=meta["name"], namespace=meta["namespace"], uid=meta.get("uid", ""), spec=spec)
        load = await read_load(await self._fleet.client(cluster), cluster.cluster_id, now)
        last = (meta.get("annotations") or {}).get(LAST_SCALE_ANNOTATION)
        current = spec.engine.replicas
        wanted = desired_replicas(
            spec.autoscaling, spec.engine, load, current, float(last) if last else None, now
        )
        if wanted == current:
            return None
        patch = {
            "metadata": {"annotations": {LAST_SCALE_ANNOTATION: f"{now:.3f}"}},
            "spec": {"engine": {"replicas": wanted}},
        }
        await self._api.patch(CLUSTER_API_VERSION, KIND, cluster.namespace, cluster.name, patch)
        return wanted

    async def close(self) -> None:
        await self._fleet.close()
