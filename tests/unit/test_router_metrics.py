"""The router's loop-thread series read exactly as prometheus_client's own would."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from shoal_router.metrics import LoopCounter, LoopHistogram, RouterMetrics

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04)
# On a bound, just past one, under the first, past the last, and zero.
VALUES = (0.001, 0.0010001, 0.0005, 7.5, 0.0, 0.04, 0.02)


def _exposition(registry: CollectorRegistry) -> list[str]:
    """The text exposition without the ``_created`` series, which only the library's have."""
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if "_created" not in line]


@pytest.mark.parametrize("labelled", [True, False])
def test_loop_histogram_reads_as_prometheus_client_histogram(labelled: bool) -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    labels = ["model"] if labelled else []
    mine = LoopHistogram("gap_seconds", "A gap.", labels, buckets=BUCKETS, registry=ours)
    reference = Histogram("gap_seconds", "A gap.", labels, buckets=BUCKETS, registry=theirs)
    for value in VALUES:
        if labelled:
            mine.labels("m").observe(value)
            reference.labels("m").observe(value)
        else:
            mine.observe(value)
            reference.observe(value)
    assert _exposition(ours) == _exposition(theirs)
    assert any('le="0.001"' in line and line.endswith(" 3.0") for line in _exposition(ours))


def test_loop_counter_reads_as_prometheus_client_counter() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    mine = LoopCounter("tokens", "Tokens.", ["model"], registry=ours)
    reference = Counter("tokens", "Tokens.", ["model"], registry=theirs)
    for model, amount in (("a", 3), ("b", 1), ("a", 2)):
        mine.labels(model).inc(amount)
        reference.labels(model).inc(amount)
    assert _exposition(ours) == _exposition(theirs)
    assert 'tokens_total{model="a"} 5.0' in _exposition(ours)


def test_router_registry_refuses_a_second_series_of_the_same_name() -> None:
    metrics = RouterMetrics()
    with pytest.raises(ValueError, match="Duplicated"):
        LoopCounter("shoal_router_output_tokens", "Again.", registry=metrics.registry)
