"""Engine rollouts that keep capacity: surge engines first, then replace old ones drained.

A plain StatefulSet rolling update deletes an engine, waits for its replacement, and goes on:
while a model loads (minutes) the fleet is one engine short, and the deleted engine's requests
have one engine fewer to migrate to. Shoal's operator drives the update itself, with the
StatefulSet's ``partition`` (pods with an ordinal at or above it run the new template, the
others keep theirs):

1. The pod template changes: the operator sets ``partition`` to the wanted engine count N and
   ``replicas`` to N + ``maxSurge``, in the same patch as the template. No old engine is touched;
   the surge engines start on the new template.
2. Once every pod is ready and those at or above the partition run the new template, the
   operator drains the next ``maxSurge`` old engines below the partition (their requests migrate
   to the rest of the fleet, the new engines included) and lowers the partition past them. The
   StatefulSet controller replaces them, already empty. This repeats down to partition 0.
3. With every engine on the new template (the controller then reports one revision), the fleet
   shrinks back to N: the surge engines are drained and removed as in any scale-down.

Capacity never falls below N ready engines (with ``maxSurge`` 0 the update goes one engine at a
time in place, drained first). Every decision is made from the StatefulSet as read now, so the
operator can restart at any point and carry on. A status the controller has not yet brought up
to date with the last change (``observedGeneration`` behind) changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shoal_operator.children import Cluster
from shoal_operator.drain import leaving

Manifest = dict[str, Any]


@dataclass(frozen=True)
class EnginePlan:
    """What the engine StatefulSet should be set to now, and which engines leave first."""

    replicas: int
    partition: int = 0
    drain: list[str] = field(default_factory=list)
    """Pods to drain before ``replicas`` and ``partition`` are written (highest ordinal first)."""
    updating: bool = False
    """A rollout is under way."""
    updated: int = 0
    """Engines running the new template (during a rollout)."""
    message: str = ""


def _pod(cluster: Cluster, ordinal: int) -> str:
    return f"{cluster.name}-engine-{ordinal}"


def plan(cluster: Cluster, desired: Manifest, live: Manifest | None, template_changed: bool) -> EnginePlan:
    """The next step for the engine StatefulSet ``live`` (None: not created yet), given the
    rendered one (``desired``) and whether its pod template differs from the live one."""
    wanted = cluster.spec.engine.replicas
    surge = cluster.spec.engine.max_surge
    if live is None:
        return EnginePlan(replicas=wanted)
    spec, status = live.get("spec") or {}, live.get("status") or {}
    present = int(spec.get("replicas") or 0)
    partition = int(((spec.get("updateStrategy") or {}).get("rollingUpdate") or {}).get("partition") or 0)
    generation = int((live.get("metadata") or {}).get("generation") or 0)
    if int(status.get("observedGeneration") or 0) < generation:
        # The controller has not acted on the last change yet: its counts describe the past.
        return EnginePlan(
            replicas=present,
            partition=partition,
            updating=partition > 0,
            message="waiting for the StatefulSet controller",
        )
    if template_changed:
        # Start (or restart, if the template changed again mid-way): nothing old is replaced yet.
        replicas = wanted + surge
        return EnginePlan(
            replicas=replicas,
            partition=wanted,
            drain=leaving(cluster, present, replicas),
            updating=True,
            message=f"rollout started: {surge} surge engine(s) on the new template",
        )
    revisions = status.get("currentRevision"), status.get("updateRevision")
    if not all(revisions) or revisions[0] == revisions[1]:
        # No rollout (or it just finished): surge engines, if any, leave like any scale-down.
        return EnginePlan(replicas=wanted, drain=leaving(cluster, present, wanted))
    replicas = wanted + surge
    # Lowering the partition replaces an old engine, so only a step does it (drained first); a
    # scale-down under way only keeps it within the engine count.
    partition = min(partition, replicas)
    updated = int(status.get("updatedReplicas") or 0)
    ready = int(status.get("readyReplicas") or 0)
    settled = ready >= present == replicas and updated >= present - partition
    drain = leaving(cluster, present, replicas)
    message = f"{updated}/{replicas} engines on the new template"
    if settled and partition > 0:
        step = max(1, surge)
        lower = max(0, partition - step)
        drain += [_pod(cluster, i) for i in range(partition - 1, lower - 1, -1)]
        partition = lower
        message += f"; replacing {', '.join(drain)}"
    return EnginePlan(
        replicas=replicas, partition=partition, drain=drain, updating=True, updated=updated, message=message
    )


def apply(desired: Manifest, engine_plan: EnginePlan) -> Manifest:
    """``desired`` (the rendered engine StatefulSet) with the plan's replicas and partition."""
    spec = dict(desired["spec"])
    spec["replicas"] = engine_plan.replicas
    spec["updateStrategy"] = {"type": "RollingUpdate", "rollingUpdate": {"partition": engine_plan.partition}}
    return {**desired, "spec": spec}
