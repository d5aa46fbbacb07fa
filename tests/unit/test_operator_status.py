"""The cluster status from its children's counts, and the drift check that decides writes."""

from __future__ import annotations

from typing import Any

import pytest

from shoal_operator import status
from shoal_operator.children import Cluster
from shoal_operator.reconcile import drifted
from shoal_operator.spec import InferenceClusterSpec


def _cluster(**spec: Any) -> Cluster:
    body = {"model": {"source": "/models/smol", "servedName": "smol"}, **spec}
    return Cluster(name="ic", namespace="ns", uid="u-1", spec=InferenceClusterSpec.model_validate(body))


def _workload(replicas: int, ready: int) -> dict[str, Any]:
    return {"status": {"replicas": replicas, "readyReplicas": ready}}


def _by_type(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in result["conditions"]}


def test_everything_ready_is_ready() -> None:
    cluster = _cluster(engine={"replicas": 2})
    result = status.compute(cluster, 3, _workload(2, 2), _workload(1, 1), _workload(1, 1), now="T1")
    conditions = _by_type(result)
    assert result["ready"] == "True" and conditions["Ready"]["reason"] == "Ready"
    assert (result["replicas"], result["readyEngines"], result["observedGeneration"]) == (2, 2, 3)
    assert result["selector"] == "app.kubernetes.io/instance=ic,app.kubernetes.io/component=engine"
    assert result["model"] == "smol"
    assert conditions["Draining"]["status"] == "False"
    assert all(c["lastTransitionTime"] == "T1" and c["observedGeneration"] == 3 for c in result["conditions"])


def test_starting_engines_hold_ready_back_with_a_reason() -> None:
    result = status.compute(
        _cluster(engine={"replicas": 3}), 1, _workload(3, 1), _workload(1, 1), _workload(1, 1)
    )
    conditions = _by_type(result)
    assert (conditions["EnginesReady"]["status"], conditions["EnginesReady"]["reason"]) == (
        "False",
        "Starting",
    )
    assert conditions["EnginesReady"]["message"] == "1/3 engines ready"
    assert conditions["Ready"]["reason"] == "EnginesNotReady"
    assert result["ready"] == "False"


def test_missing_children_are_reported_missing() -> None:
    result = status.compute(_cluster(), 1, None, None, None)
    conditions = _by_type(result)
    assert conditions["EnginesReady"]["reason"] == "Missing"
    assert conditions["RouterReady"]["reason"] == "Missing"
    assert conditions["RedisReady"]["reason"] == "Missing"


def test_external_redis_is_unknown_and_does_not_block_ready() -> None:
    cluster = _cluster(engine={"replicas": 1}, redis={"mode": "external", "url": "redis://r:6379/0"})
    result = status.compute(cluster, 1, _workload(1, 1), _workload(1, 1), None)
    conditions = _by_type(result)
    assert (
        conditions["RedisReady"]["status"] == "Unknown" and conditions["RedisReady"]["reason"] == "External"
    )
    assert result["ready"] == "True"


def test_engines_above_the_spec_are_draining() -> None:
    result = status.compute(
        _cluster(engine={"replicas": 1}), 2, _workload(3, 3), _workload(1, 1), _workload(1, 1)
    )
    draining = _by_type(result)["Draining"]
    assert draining["status"] == "True" and draining["reason"] == "ScaleDown"
    assert draining["message"].startswith("2 engine(s)")


def test_transition_time_moves_only_with_the_status() -> None:
    cluster = _cluster(engine={"replicas": 2})
    first = status.compute(cluster, 1, _workload(2, 1), _workload(1, 1), _workload(1, 1), now="T1")
    same = status.compute(
        cluster, 1, _workload(2, 1), _workload(1, 1), _workload(1, 1), previous=first, now="T2"
    )
    assert same == first  # nothing changed: nothing to write
    later = status.compute(
        cluster, 1, _workload(2, 2), _workload(1, 1), _workload(1, 1), previous=first, now="T3"
    )
    conditions = _by_type(later)
    assert conditions["EnginesReady"]["lastTransitionTime"] == "T3"
    assert conditions["RouterReady"]["lastTransitionTime"] == "T1"


def test_invalid_spec_keeps_counts_and_other_conditions() -> None:
    cluster = _cluster(engine={"replicas": 2})
    good = status.compute(cluster, 1, _workload(2, 2), _workload(1, 1), _workload(1, 1), now="T1")
    bad = status.invalid(2, "spec.engine: broken", previous=good, now="T2")
    conditions = _by_type(bad)
    assert (conditions["Ready"]["status"], conditions["Ready"]["reason"]) == ("False", "InvalidSpec")
    assert conditions["Ready"]["message"] == "spec.engine: broken"
    assert conditions["EnginesReady"] == {**_by_type(good)["EnginesReady"], "observedGeneration": 2}
    assert (bad["readyEngines"], bad["observedGeneration"], bad["ready"]) == (2, 2, "False")


@pytest.mark.parametrize(
    ("desired", "live", "expected"),
    [
        ({"a": 1}, {"a": 1, "defaulted": True}, False),  # extra live keys are not the operator's
        ({"a": 1}, {"a": 2}, True),
        ({"a": {"b": [1, 2]}}, {"a": {"b": [1, 2]}}, False),
        ({"a": [{"x": 1}]}, {"a": [{"x": 1, "y": 2}]}, False),  # list items: same test per item
        ({"a": [1, 2]}, {"a": [1]}, True),
        ({"port": 8000}, {"port": "8000"}, False),  # the API server's echo of a number
        ({"a": {"b": 1}}, {}, True),
        ({"a": None}, {}, False),
    ],
)
def test_drift(desired: Any, live: Any, expected: bool) -> None:
    assert drifted(desired, live) is expected
