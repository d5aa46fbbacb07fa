"""The operator's logging (``shoal_operator.main.configure_logging``): kopf's per-object lines,
which kopf otherwise only posts as Kubernetes events, reach stderr with the cluster they are
about, as plain text or as JSON."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import kopf
import pytest

from shoal_operator.main import configure_logging

CLUSTER = {
    "apiVersion": "shoal.dev/v1alpha1",
    "kind": "InferenceCluster",
    "metadata": {"name": "smol", "namespace": "serving", "uid": "7d0c6a52-0b5e-4b1b-9a57-4c0e1f7b2c11"},
}


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    root, quiet = logging.getLogger(), logging.getLogger("asyncio")
    saved = (list(root.handlers), root.level, list(quiet.handlers), quiet.propagate)
    yield
    root.handlers[:], quiet.handlers[:] = saved[0], saved[2]
    root.setLevel(saved[1])
    quiet.propagate = saved[3]


def _cluster_logger() -> logging.LoggerAdapter[logging.Logger]:
    """The logger kopf hands a handler for this cluster (events off: no operator runs here)."""
    settings = kopf.OperatorSettings()
    settings.posting.enabled = False
    return kopf.ObjectLogger(body=kopf.Body(CLUSTER), settings=settings)


def test_without_configuring_a_per_object_warning_reaches_no_stream(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The defect this module's configuration fixes: kopf's object logger has its own handler
    # (events), so Python's last-resort stderr handler never fires.
    logging.getLogger().handlers[:] = []
    _cluster_logger().warning("reconcile of serving/smol failed")
    assert capsys.readouterr().err == ""


def test_plain_lines_reach_stderr_with_the_clusters_name(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("plain")
    _cluster_logger().warning("cannot autoscale: Redis unreachable")
    logging.getLogger("shoal_operator.leader").info("operator-a leads")
    lines = capsys.readouterr().err.splitlines()
    (warning,) = [line for line in lines if "autoscale" in line]
    assert "[WARNING ]" in warning and "[serving/smol] cannot autoscale: Redis unreachable" in warning
    assert any("operator-a leads" in line and "[INFO    ]" in line for line in lines)


def test_json_lines_carry_the_clusters_namespace_and_name(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("json")
    _cluster_logger().warning("cannot autoscale: Redis unreachable")
    (line,) = capsys.readouterr().err.splitlines()
    record = json.loads(line)
    assert record["message"] == "cannot autoscale: Redis unreachable"
    assert record["severity"] == "warn" and "timestamp" in record
    assert record["object"]["namespace"] == "serving" and record["object"]["name"] == "smol"
    assert record["object"]["kind"] == "InferenceCluster"


@pytest.mark.parametrize(("flags", "level"), [({}, logging.INFO), ({"verbose": True}, logging.DEBUG),
                                              ({"quiet": True}, logging.WARNING)])  # fmt: skip
def test_verbosity(flags: dict[str, bool], level: int) -> None:
    configure_logging("plain", **flags)
    assert logging.getLogger().level == level
