"""The autoscaling policy: HPA's proportional rule, a tolerance band, bounds, one drain at a time,
and a cool-down between changes."""

from __future__ import annotations

from typing import Any

import pytest

from shoal_operator.autoscale import Autoscaler, FleetLoad, desired_replicas
from shoal_operator.children import Cluster
from shoal_operator.spec import AutoscalingSpec, EngineSpec


def _specs(**autoscaling: Any) -> tuple[AutoscalingSpec, EngineSpec]:
    scaling = AutoscalingSpec.model_validate(
        {"enabled": True, "metric": "kvUsage", "target": 0.5, "cooldownSeconds": 60, **autoscaling}
    )
    return scaling, EngineSpec.model_validate({"replicas": 4, "minReplicas": 2, "maxReplicas": 10})


@pytest.mark.parametrize(
    ("kv_usage", "engines", "expected", "why"),
    [
        (0.9, 4, 8, "busy: ceil(4 * 0.9 / 0.5) engines at once"),
        (0.99, 4, 8, "ceil(7.92)"),
        (0.53, 4, 4, "within 10 % of the target: no change"),
        (0.1, 4, 3, "idle: one engine fewer, not ceil(4 * 0.2) = 1"),
        (2.0, 4, 10, "capped at maxReplicas"),
        (0.1, 3, 4, "an engine not reporting yet (starting): no scale-down"),
    ],
)
def test_kv_usage_sizes_the_fleet(kv_usage: float, engines: int, expected: int, why: str) -> None:
    scaling, engine = _specs()
    load = FleetLoad(engines=engines, kv_usage=kv_usage)
    assert desired_replicas(scaling, engine, load, current=4, last_scale=None, now=1000.0) == expected, why


def test_scale_down_stops_at_min_replicas() -> None:
    scaling, engine = _specs()
    load = FleetLoad(engines=2, kv_usage=0.0)
    assert desired_replicas(scaling, engine, load, current=2, last_scale=None, now=1000.0) == 2


def test_queue_length_metric() -> None:
    scaling, engine = _specs(metric="queueLength", target=2)
    load = FleetLoad(engines=4, kv_usage=0.99, queue_per_engine=5.0)  # KV use is not the metric
    assert desired_replicas(scaling, engine, load, current=4, last_scale=None, now=1000.0) == 10


def test_cool_down_holds_any_change() -> None:
    scaling, engine = _specs()
    busy = FleetLoad(engines=4, kv_usage=0.9)
    assert desired_replicas(scaling, engine, busy, current=4, last_scale=950.0, now=1000.0) == 4
    assert desired_replicas(scaling, engine, busy, current=4, last_scale=930.0, now=1000.0) == 8


def test_disabled_or_no_reports_change_nothing() -> None:
    scaling, engine = _specs(enabled=False)
    assert desired_replicas(scaling, engine, FleetLoad(4, 0.9), current=4, last_scale=None, now=0.0) == 4
    scaling, engine = _specs()
    assert desired_replicas(scaling, engine, FleetLoad(0), current=4, last_scale=None, now=0.0) == 4


async def test_no_change_while_engines_roll_over() -> None:
    """A rollout's surge engines would read as spare capacity: the autoscaler waits it out
    without reading the load (a Redis lookup here would fail the test)."""

    async def no_redis(cluster: Cluster) -> str:
        raise AssertionError("the autoscaler read the load during a rollout")

    body = {
        "metadata": {"name": "ic", "namespace": "ns", "uid": "u-1"},
        "spec": {
            "model": {"source": "/models/smol", "servedName": "smol"},
            "autoscaling": {"enabled": True},
        },
        "status": {"conditions": [{"type": "Updating", "status": "True", "reason": "RollingUpdate"}]},
    }
    assert await Autoscaler(api=None, redis_url=no_redis).step(body, now=1000.0) is None  # type: ignore[arg-type]
