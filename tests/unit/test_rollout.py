"""The engine rollout plan: surge first, then drained replacements down the partition, then the
surge engines leave; nothing moves on a status the StatefulSet controller has not caught up with."""

from __future__ import annotations

from typing import Any

from shoal_operator import rollout, status
from shoal_operator.children import Cluster, engine_statefulset
from shoal_operator.spec import InferenceClusterSpec


def _cluster(replicas: int = 3, max_surge: int = 1) -> Cluster:
    body = {
        "model": {"source": "/models/smol", "servedName": "smol"},
        "engine": {"replicas": replicas, "maxSurge": max_surge},
    }
    return Cluster(name="ic", namespace="ns", uid="u-1", spec=InferenceClusterSpec.model_validate(body))


def _live(
    replicas: int,
    partition: int = 0,
    updated: int | None = None,
    ready: int | None = None,
    revisions: tuple[str, str] = ("r1", "r1"),
    generation: int = 5,
    observed: int = 5,
) -> dict[str, Any]:
    """An engine StatefulSet as the API server returns it, with its controller's status."""
    return {
        "metadata": {"generation": generation},
        "spec": {
            "replicas": replicas,
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"partition": partition}},
        },
        "status": {
            "observedGeneration": observed,
            "replicas": replicas,
            "readyReplicas": replicas if ready is None else ready,
            "updatedReplicas": replicas if updated is None else updated,
            "currentRevision": revisions[0],
            "updateRevision": revisions[1],
        },
    }


def _plan(
    cluster: Cluster, live: dict[str, Any] | None, template_changed: bool = False
) -> rollout.EnginePlan:
    return rollout.plan(cluster, engine_statefulset(cluster), live, template_changed)


def test_a_new_template_starts_surge_engines_and_touches_no_old_one() -> None:
    engine_plan = _plan(_cluster(replicas=3, max_surge=1), _live(3), template_changed=True)
    assert (engine_plan.replicas, engine_plan.partition, engine_plan.drain) == (4, 3, [])
    assert engine_plan.updating


def test_each_step_drains_the_next_old_engine_before_the_partition_passes_it() -> None:
    cluster = _cluster(replicas=3, max_surge=1)
    rolling = ("r1", "r2")
    # The surge engine (ordinal 3) is up on the new template: engine 2 goes next.
    step = _plan(cluster, _live(4, partition=3, updated=1, revisions=rolling))
    assert (step.replicas, step.partition, step.drain) == (4, 2, ["ic-engine-2"])
    # Engine 2 replaced and ready: engine 1.
    step = _plan(cluster, _live(4, partition=2, updated=2, revisions=rolling))
    assert (step.partition, step.drain) == (1, ["ic-engine-1"])
    step = _plan(cluster, _live(4, partition=1, updated=3, revisions=rolling))
    assert (step.partition, step.drain) == (0, ["ic-engine-0"])


def test_a_step_waits_while_a_replacement_is_not_ready_or_not_updated() -> None:
    cluster = _cluster(replicas=3, max_surge=1)
    rolling = ("r1", "r2")
    for live in (
        _live(4, partition=2, updated=1, revisions=rolling),  # engine 2 still the old one
        _live(4, partition=2, updated=2, ready=3, revisions=rolling),  # engine 2 loading its model
    ):
        step = _plan(cluster, live)
        assert (step.replicas, step.partition, step.drain) == (4, 2, [])
        assert step.updating


def test_a_status_behind_the_last_change_changes_nothing() -> None:
    # The partition was just lowered (generation 6); the controller still reports generation 5.
    live = _live(4, partition=2, updated=2, revisions=("r1", "r2"), generation=6, observed=5)
    step = _plan(_cluster(replicas=3, max_surge=1), live)
    assert (step.replicas, step.partition, step.drain) == (4, 2, [])
    # Even a template change waits: a status from before it cannot say what is safe.
    step = _plan(_cluster(replicas=3, max_surge=1), live, template_changed=True)
    assert (step.replicas, step.partition, step.drain) == (4, 2, [])


def test_when_every_engine_is_updated_the_surge_engines_leave_drained() -> None:
    step = _plan(_cluster(replicas=3, max_surge=1), _live(4, revisions=("r2", "r2")))
    assert (step.replicas, step.partition, step.drain) == (3, 0, ["ic-engine-3"])
    assert not step.updating


def test_a_larger_surge_replaces_that_many_at_a_time() -> None:
    cluster = _cluster(replicas=4, max_surge=2)
    start = _plan(cluster, _live(4), template_changed=True)
    assert (start.replicas, start.partition) == (6, 4)
    step = _plan(cluster, _live(6, partition=4, updated=2, revisions=("r1", "r2")))
    assert (step.partition, step.drain) == (2, ["ic-engine-3", "ic-engine-2"])


def test_no_surge_replaces_in_place_one_at_a_time() -> None:
    cluster = _cluster(replicas=2, max_surge=0)
    start = _plan(cluster, _live(2), template_changed=True)
    assert (start.replicas, start.partition, start.drain) == (2, 2, [])
    step = _plan(cluster, _live(2, partition=2, updated=0, revisions=("r1", "r2")))
    assert (step.partition, step.drain) == (1, ["ic-engine-1"])


def test_a_scale_down_during_a_rollout_drains_what_leaves() -> None:
    # Four engines wanted, then two, in the middle of a rollout: engines 4 and 3 leave, drained;
    # the old engines below the partition stay until a step drains them.
    step = _plan(_cluster(replicas=2, max_surge=1), _live(5, partition=3, updated=2, revisions=("r1", "r2")))
    assert (step.replicas, step.partition) == (3, 3)
    assert step.drain == ["ic-engine-4", "ic-engine-3"]


def test_steady_state_and_creation() -> None:
    cluster = _cluster(replicas=3)
    assert _plan(cluster, None) == rollout.EnginePlan(replicas=3)
    steady = _plan(cluster, _live(3))
    assert (steady.replicas, steady.partition, steady.drain, steady.updating) == (3, 0, [], False)


def test_status_counts_surge_engines_as_kept_and_says_updating() -> None:
    cluster = _cluster(replicas=3, max_surge=1)
    engines = _live(4, partition=2, updated=2, revisions=("r1", "r2"))
    step = _plan(cluster, engines)
    result = status.compute(cluster, 2, engines, None, None, engine_plan=step, now="T")
    conditions = {c["type"]: c for c in result["conditions"]}
    assert conditions["Draining"]["status"] == "False"  # the surge engine is wanted while it lasts
    assert (conditions["Updating"]["status"], conditions["Updating"]["reason"]) == ("True", "RollingUpdate")
    assert "2/4 engines on the new template" in conditions["Updating"]["message"]
    done = _plan(cluster, _live(4, revisions=("r2", "r2")))
    result = status.compute(
        cluster, 2, _live(4, revisions=("r2", "r2")), None, None, engine_plan=done, now="T"
    )
    conditions = {c["type"]: c for c in result["conditions"]}
    assert (conditions["Draining"]["reason"], conditions["Updating"]["status"]) == ("ScaleDown", "False")
