"""The engine Deployment's size, and which engines leave when it shrinks (no IO).

Engines run in a Deployment. Two things about its pods are decided here:

* **Scale-down picks the least-loaded engines.** When the spec asks for fewer engines, the
  operator lists the engine pods, reads each one's load report from Redis, and chooses the
  engines that leave: pods not running or not ready first (they hold no requests), then engines
  already DRAINING, then the fewest running plus waiting requests, then the fewest KV blocks in
  use (name breaks ties, so a repeated pass chooses the same). Each chosen pod gets the
  annotation ``controller.kubernetes.io/pod-deletion-cost`` set far below the default 0, which is
  how a ReplicaSet is told which pods to delete first; the operator drains them (their requests
  migrate to the others, ``drain.py``) and only then lowers ``replicas``.
* **Rollouts keep capacity.** A changed pod template rolls with ``maxSurge`` extra engines and
  no engine unavailable (``maxSurge`` 0: one at a time): the new engines are ready before any old
  one is told to stop, and an old engine's preStop hook drains it, migrating its requests to
  the rest of the fleet, the new engines included, within the spec's drain deadline. A
  scale-down asked for during a rollout goes to the Deployment as it is (the controller then
  splits it between old and new pods; their preStop hooks drain them).

Every decision is made from the Deployment and pods as read now, so the operator can restart at
any point and carry on; a Deployment whose controller has not caught up with its last change
(``observedGeneration`` behind) is not shrunk until it has.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from shoal_operator.children import ENGINE_CONTROL_PORT, Cluster

Manifest = dict[str, Any]
DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
LEAVING_COST = str(-(2**31))
"""The lowest pod-deletion-cost there is: these pods go first when the ReplicaSet shrinks."""


@dataclass(frozen=True)
class EngineLoad:
    """One engine's load as its latest report and record in Redis give it."""

    state: str = "ACTIVE"
    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0


@dataclass(frozen=True)
class Leaving:
    """An engine pod chosen to leave: its name and its control API (empty: the pod has no
    address, so nothing runs there to drain)."""

    pod: str
    address: str = ""


@dataclass(frozen=True)
class EnginePlan:
    """What the engine Deployment should be set to now, and which engines leave first."""

    replicas: int
    drain: list[Leaving] = field(default_factory=list)
    """Pods to mark and drain before ``replicas`` is written (least loaded first)."""
    updating: bool = False
    """A rollout is under way."""
    updated: int = 0
    """Engines running the new template (during a rollout)."""
    message: str = ""


def caught_up(live: Manifest) -> bool:
    """The Deployment's controller has acted on its last change (its status describes it)."""
    generation = int((live.get("metadata") or {}).get("generation") or 0)
    return int((live.get("status") or {}).get("observedGeneration") or 0) >= generation


def rolling(live: Manifest) -> bool:
    """The Deployment's pods are moving to a new template, by its status: some of the pods it
    wants do not run the new template yet, or old pods are still there beside them."""
    spec, status = live.get("spec") or {}, live.get("status") or {}
    wanted = int(spec.get("replicas") or 0)
    updated, present = int(status.get("updatedReplicas") or 0), int(status.get("replicas") or 0)
    return updated < min(wanted, present) or present > max(updated, wanted)


def shrinking(cluster: Cluster, live: Manifest | None) -> bool:
    """A scale-down the operator carries out itself (pods chosen and drained first): fewer
    engines wanted than the Deployment has, its controller caught up, and no rollout under way."""
    if live is None:
        return False
    present = int((live.get("spec") or {}).get("replicas") or 0)
    return cluster.spec.engine.replicas < present and caught_up(live) and not rolling(live)


def _ready(pod: Manifest) -> bool:
    status = pod.get("status") or {}
    if status.get("phase") != "Running":
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def choose(pods: Iterable[Manifest], loads: Mapping[str, EngineLoad], count: int) -> list[Manifest]:
    """The ``count`` pods to remove: not ready first, then DRAINING engines, then the least
    loaded (running plus waiting requests, then KV blocks in use); a ready engine with no load
    report (Redis unreachable, or it stopped reporting) counts as loaded, after every reporting
    one. Pods already being deleted are not candidates."""

    def rank(pod: Manifest) -> tuple[bool, bool, bool, int, int, str]:
        name = pod["metadata"]["name"]
        load = loads.get(name)
        if load is None:
            return (_ready(pod), True, True, 0, 0, name)
        requests = load.running + load.waiting
        return (_ready(pod), load.state != "DRAINING", False, requests, load.kv_blocks_used, name)

    candidates = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    return sorted(candidates, key=rank)[: max(0, count)]


def control_address(pod: Manifest) -> str:
    """A pod's EngineControl address (its IP), or "" before it has one."""
    ip = (pod.get("status") or {}).get("podIP")
    return f"{ip}:{ENGINE_CONTROL_PORT}" if ip else ""


def plan(
    cluster: Cluster,
    live: Manifest | None,
    template_changed: bool,
    pods: Iterable[Manifest] = (),
    loads: Mapping[str, EngineLoad] | None = None,
) -> EnginePlan:
    """The next step for the engine Deployment ``live`` (None: not created yet), given whether
    the rendered pod template differs from the live one, and, when ``shrinking``, its pods and
    their engines' loads."""
    wanted = cluster.spec.engine.replicas
    if live is None:
        return EnginePlan(replicas=wanted)
    status = live.get("status") or {}
    present = int((live.get("spec") or {}).get("replicas") or 0)
    if template_changed or rolling(live):
        updated = int(status.get("updatedReplicas") or 0)
        total = max(wanted, int(status.get("replicas") or 0))
        message = f"{updated}/{total} engine pods on the new template"
        if template_changed:
            message = "rollout started"
        return EnginePlan(replicas=wanted, updating=True, updated=updated, message=message)
    if wanted < present and not caught_up(live):
        # Its counts describe the past: shrink once they are current (its next status update
        # brings the operator back).
        return EnginePlan(replicas=present, message="waiting for the Deployment controller")
    if not shrinking(cluster, live):
        return EnginePlan(replicas=wanted)
    chosen = choose(pods, loads or {}, present - wanted)
    drain = [Leaving(p["metadata"]["name"], control_address(p)) for p in chosen]
    return EnginePlan(replicas=wanted, drain=drain)


def apply(desired: Manifest, engine_plan: EnginePlan) -> Manifest:
    """``desired`` (the rendered engine Deployment) with the plan's replica count."""
    return {**desired, "spec": {**desired["spec"], "replicas": engine_plan.replicas}}


def leaving_mark() -> Manifest:
    """The patch that puts a pod first in line when its ReplicaSet shrinks."""
    return {"metadata": {"annotations": {DELETION_COST_ANNOTATION: LEAVING_COST}}}
