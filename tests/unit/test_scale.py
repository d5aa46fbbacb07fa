"""The engine Deployment plan: scale-down chooses the least-loaded engines (not-ready pods and
DRAINING engines first), rollouts are left to the Deployment's surge, and nothing shrinks on a
status its controller has not caught up with."""

from __future__ import annotations

from typing import Any

import pytest

from shoal_operator import scale, status
from shoal_operator.children import ENGINE_CONTROL_PORT, Cluster, engine_deployment
from shoal_operator.scale import EngineLoad, Leaving
from shoal_operator.spec import InferenceClusterSpec


def _cluster(replicas: int = 3, max_surge: int = 1) -> Cluster:
    body = {
        "model": {"source": "/models/smol", "servedName": "smol"},
        "engine": {"replicas": replicas, "maxSurge": max_surge},
    }
    return Cluster(name="ic", namespace="ns", uid="u-1", spec=InferenceClusterSpec.model_validate(body))


def _live(
    replicas: int,
    present: int | None = None,
    updated: int | None = None,
    generation: int = 5,
    observed: int = 5,
) -> dict[str, Any]:
    """An engine Deployment as the API server returns it, with its controller's status."""
    present = replicas if present is None else present
    return {
        "metadata": {"generation": generation},
        "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": observed,
            "replicas": present,
            "readyReplicas": present,
            "updatedReplicas": present if updated is None else updated,
        },
    }


def _pod(
    name: str, ready: bool = True, ip: str | None = "10.0.0.1", deleting: bool = False
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    pod_status: dict[str, Any] = {
        "phase": "Running" if ip else "Pending",
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
    }
    if ip:
        pod_status["podIP"] = ip
    return {"metadata": meta, "status": pod_status}


def _names(pods: list[dict[str, Any]]) -> list[str]:
    return [p["metadata"]["name"] for p in pods]


def test_the_least_loaded_engines_leave() -> None:
    pods = [_pod("e-a"), _pod("e-b"), _pod("e-c"), _pod("e-d")]
    loads = {
        "e-a": EngineLoad(running=5, waiting=2),
        "e-b": EngineLoad(running=1),
        "e-c": EngineLoad(running=3),
        "e-d": EngineLoad(running=1, kv_blocks_used=900),
    }
    # Fewest requests first; between equals (b, d), fewer KV blocks in use.
    assert _names(scale.choose(pods, loads, 1)) == ["e-b"]
    assert _names(scale.choose(pods, loads, 3)) == ["e-b", "e-d", "e-c"]


def test_pods_holding_nothing_and_draining_engines_go_before_any_loaded_one() -> None:
    pods = [_pod("e-busy"), _pod("e-idle"), _pod("e-draining"), _pod("e-starting", ready=False)]
    loads = {
        "e-busy": EngineLoad(running=8),
        "e-idle": EngineLoad(),
        "e-draining": EngineLoad(state="DRAINING", running=4),
    }
    assert _names(scale.choose(pods, loads, 3)) == ["e-starting", "e-draining", "e-idle"]


def test_an_engine_with_no_load_report_counts_as_loaded_and_deleted_pods_are_not_candidates() -> None:
    pods = [_pod("e-silent"), _pod("e-busy"), _pod("e-gone", deleting=True)]
    loads = {"e-busy": EngineLoad(running=30), "e-gone": EngineLoad()}
    assert _names(scale.choose(pods, loads, 2)) == ["e-busy", "e-silent"]
    # Redis unreachable: no reports at all; the choice is still made, by name.
    assert _names(scale.choose(pods, {}, 1)) == ["e-busy"]


def test_a_scale_down_drains_the_chosen_engines_at_their_pod_address() -> None:
    pods = [_pod("e-a", ip="10.0.0.1"), _pod("e-b", ip="10.0.0.2"), _pod("e-c", ip=None, ready=False)]
    loads = {"e-a": EngineLoad(running=3), "e-b": EngineLoad(running=1)}
    engine_plan = scale.plan(_cluster(replicas=1), _live(3), False, pods, loads)
    assert engine_plan.replicas == 1 and not engine_plan.updating
    assert engine_plan.drain == [Leaving("e-c", ""), Leaving("e-b", f"10.0.0.2:{ENGINE_CONTROL_PORT}")]


def test_no_drain_when_growing_or_steady() -> None:
    assert scale.plan(_cluster(replicas=3), _live(3), False) == scale.EnginePlan(replicas=3)
    assert scale.plan(_cluster(replicas=5), _live(3), False) == scale.EnginePlan(replicas=5)
    assert scale.plan(_cluster(replicas=5), None, False) == scale.EnginePlan(replicas=5)
    assert not scale.shrinking(_cluster(replicas=3), _live(3))


def test_nothing_shrinks_on_a_status_the_controller_has_not_caught_up_with() -> None:
    live = _live(3, generation=6, observed=5)
    assert not scale.shrinking(_cluster(replicas=2), live)
    engine_plan = scale.plan(_cluster(replicas=2), live, False, [_pod("e-a")], {})
    assert (engine_plan.replicas, engine_plan.drain) == (3, [])


@pytest.mark.parametrize(
    ("live", "rolling"),
    [
        (_live(3, present=3, updated=3), False),
        (_live(3, present=4, updated=1), True),  # a surge engine up, three old ones left
        (_live(3, present=4, updated=3), True),  # new ones all up, an old one still there
        (_live(3, present=3, updated=2), True),
        (_live(2, present=3, updated=3), False),  # a scale-down the controller is carrying out
        (_live(4, present=3, updated=3), False),  # a scale-up starting
    ],
)
def test_a_rollout_is_read_from_the_deployment_status(live: dict[str, Any], rolling: bool) -> None:
    assert scale.rolling(live) is rolling


def test_during_a_rollout_the_deployment_is_given_the_spec_count_and_nothing_is_drained_here() -> None:
    """The Deployment surges; old engines drain in their preStop hooks."""
    cluster = _cluster(replicas=2)
    engine_plan = scale.plan(cluster, _live(3, present=4, updated=1), False, [_pod("e-a")], {})
    assert (engine_plan.replicas, engine_plan.drain, engine_plan.updating) == (2, [], True)
    assert engine_plan.message == "1/4 engine pods on the new template"
    started = scale.plan(cluster, _live(2), template_changed=True)
    assert started.updating and started.drain == []


def test_the_deployment_surges_and_never_takes_an_engine_away_first() -> None:
    rolling = engine_deployment(_cluster(max_surge=2))["spec"]["strategy"]["rollingUpdate"]
    assert rolling == {"maxSurge": 2, "maxUnavailable": 0}
    in_place = engine_deployment(_cluster(max_surge=0))["spec"]["strategy"]["rollingUpdate"]
    assert in_place == {"maxSurge": 0, "maxUnavailable": 1}  # Kubernetes refuses 0 and 0


def test_status_draining_only_for_a_scale_down_not_for_a_rollout() -> None:
    cluster = _cluster(replicas=2)
    surge = _live(2, present=3, updated=1)

    def conditions(live: dict[str, Any], engine_plan: scale.EnginePlan) -> dict[str, str]:
        computed = status.compute(cluster, 5, live, None, None, engine_plan=engine_plan)
        return {c["type"]: c["status"] for c in computed["conditions"]}

    surge = _live(2, present=3, updated=1)
    found = conditions(surge, scale.plan(cluster, surge, False))
    assert (found["Draining"], found["Updating"]) == ("False", "True")
    shrink = _live(2, present=3, updated=3)
    found = conditions(shrink, scale.EnginePlan(replicas=2))
    assert (found["Draining"], found["Updating"]) == ("True", "False")
