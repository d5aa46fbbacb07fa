"""An InferenceCluster's status, computed from what its children report (no IO).

The operator reads the engine Deployment, the router Deployment and the managed Redis
StatefulSet, and turns their replica counts into the status the CRD declares: counts for
``kubectl get ic`` and the scale subresource, and conditions with reasons, following the
Kubernetes convention (a condition's ``lastTransitionTime`` moves only when its status does).

``Ready`` holds when engines, router and Redis are ready. ``Draining`` holds while engine pods
that the spec no longer wants are still there: they are migrating their requests away.
``Updating`` holds while the engines roll over to a new pod template (``scale.py``).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from shoal_operator.children import Cluster, engine_selector
from shoal_operator.scale import EnginePlan

Manifest = dict[str, Any]
CONDITION_TYPES = ("Ready", "EnginesReady", "RouterReady", "RedisReady", "Draining", "Updating")


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _ready_replicas(workload: Manifest | None) -> int:
    return int(((workload or {}).get("status") or {}).get("readyReplicas") or 0)


def _replicas(workload: Manifest | None) -> int:
    return int(((workload or {}).get("status") or {}).get("replicas") or 0)


def _condition(kind: str, holds: bool | None, reason: str, message: str) -> dict[str, str]:
    status = "Unknown" if holds is None else ("True" if holds else "False")
    return {"type": kind, "status": status, "reason": reason, "message": message}


def _component_conditions(
    cluster: Cluster, engines: Manifest | None, router: Manifest | None, redis: Manifest | None
) -> list[dict[str, str]]:
    """``EnginesReady``, ``RouterReady`` and ``RedisReady``, from the workloads' ready counts."""
    spec = cluster.spec
    wanted, ready = spec.engine.replicas, _ready_replicas(engines)
    engines_ok = ready >= wanted
    conditions = [
        _condition(
            "EnginesReady",
            engines_ok,
            "AllReady" if engines_ok else ("Missing" if engines is None else "Starting"),
            f"{ready}/{wanted} engines ready",
        )
    ]
    routers_wanted, routers_ready = spec.router.replicas, _ready_replicas(router)
    conditions.append(
        _condition(
            "RouterReady",
            routers_ready >= 1,
            "Available" if routers_ready >= 1 else ("Missing" if router is None else "Starting"),
            f"{routers_ready}/{routers_wanted} routers ready",
        )
    )
    if spec.redis.mode == "managed":
        redis_ok = _ready_replicas(redis) >= 1
        conditions.append(
            _condition(
                "RedisReady",
                redis_ok,
                "Available" if redis_ok else ("Missing" if redis is None else "Starting"),
                "managed Redis ready" if redis_ok else "managed Redis not ready",
            )
        )
    else:
        conditions.append(
            _condition(
                "RedisReady", None, "External", "an external Redis: its health is the engines' to report"
            )
        )
    return conditions


def _engine_change_conditions(
    wanted: int, present: int, engine_plan: EnginePlan | None
) -> list[dict[str, str]]:
    """``Draining`` and ``Updating``: engine pods on their way out, a rollout under way."""
    kept = engine_plan.replicas if engine_plan is not None else wanted
    # In a rollout the extra pods are surge engines and old ones on their way out, not a drain.
    draining = present > kept and not (engine_plan is not None and engine_plan.updating)
    updating = engine_plan is not None and engine_plan.updating
    return [
        _condition(
            "Draining",
            draining,
            "ScaleDown" if draining else "Steady",
            f"{present - kept} engine(s) migrating their requests away"
            if draining
            else "no engine is leaving",
        ),
        _condition(
            "Updating",
            updating,
            "RollingUpdate" if updating else "UpToDate",
            engine_plan.message
            if engine_plan is not None and updating
            else "engines run the current template",
        ),
    ]


def compute(
    cluster: Cluster,
    generation: int,
    engines: Manifest | None,
    router: Manifest | None,
    redis: Manifest | None,
    previous: Manifest | None = None,
    now: str | None = None,
    engine_plan: EnginePlan | None = None,
) -> Manifest:
    """The status for ``cluster`` at ``generation`` given its live children (None: absent) and
    the engine Deployment's last plan (during a rollout its pod count includes surge engines)."""
    present = _replicas(engines)
    conditions = _component_conditions(cluster, engines, router, redis)
    conditions += _engine_change_conditions(cluster.spec.engine.replicas, present, engine_plan)
    blocking = [c for c in conditions[:3] if c["status"] == "False"]
    conditions.insert(
        0,
        _condition(
            "Ready",
            not blocking,
            "Ready" if not blocking else f"{blocking[0]['type'][: -len('Ready')]}NotReady",
            "engines, router and Redis are ready" if not blocking else blocking[0]["message"],
        ),
    )
    return {
        "observedGeneration": generation,
        "replicas": present,
        "readyEngines": _ready_replicas(engines),
        "selector": engine_selector(cluster),
        "model": cluster.spec.model.served_name,
        "ready": conditions[0]["status"],
        "conditions": stamp(conditions, generation, previous, now),
    }


def invalid(
    generation: int, message: str, previous: Manifest | None = None, now: str | None = None
) -> Manifest:
    """The status of a cluster whose spec does not parse: ``Ready=False, InvalidSpec``.

    The counts and other conditions stay as they were: the children are left running as they
    are, and the spec's last valid generation keeps describing them.
    """
    ready = _condition("Ready", False, "InvalidSpec", message[:4000])
    return {
        **_with_condition(previous or {}, ready, generation, now),
        "observedGeneration": generation,
        "ready": "False",
    }


def draining(
    previous: Manifest, pods: list[str], reason: str = "ScaleDown", now: str | None = None
) -> Manifest:
    """``previous`` with ``Draining=True``: ``pods`` are moving their requests away before the
    engine Deployment removes them; the rest of the status is recomputed after the change."""
    condition = _condition(
        "Draining", True, reason, f"{', '.join(pods)} migrating their requests away before removal"
    )
    return _with_condition(previous, condition, int(previous.get("observedGeneration") or 0), now)


def _with_condition(
    previous: Manifest, condition: dict[str, str], generation: int, now: str | None
) -> Manifest:
    """``previous`` with ``condition`` instead of its condition of that type (or with it added),
    stamped."""
    conditions = [c for c in previous.get("conditions", []) if c.get("type") != condition["type"]]
    return {**previous, "conditions": stamp([*conditions, condition], generation, previous, now)}


def stamp(
    conditions: list[dict[str, str]], generation: int, previous: Manifest | None, now: str | None
) -> list[dict[str, Any]]:
    """Add ``lastTransitionTime`` (kept from ``previous`` while the status holds) and the
    generation each condition was computed for."""
    before = {c.get("type"): c for c in (previous or {}).get("conditions", [])}
    moment = now or now_rfc3339()
    stamped = []
    for condition in conditions:
        old = before.get(condition["type"])
        same = old is not None and old.get("status") == condition["status"]
        stamped.append(
            {
                **condition,
                "lastTransitionTime": old.get("lastTransitionTime", moment) if same and old else moment,
                "observedGeneration": generation,
            }
        )
    return stamped
