"""The benchmarks' shared harness: quantiles, tables, stamps, docs sections and process stops."""

from __future__ import annotations

import json
import math
import random
import re
import statistics
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from bench.harness import (
    Processes,
    bootstrap_interval,
    histogram_quantile,
    launch,
    quantile,
    quantiles,
    save_results,
    stamp,
    stop_group,
    table,
    update_section,
)


def test_quantile_is_the_nearest_rank_at_or_below() -> None:
    values = [10, 1, 9, 2, 8, 3, 7, 4, 6, 5]
    assert quantile(values, 0.0) == 1
    assert quantile(values, 0.5) == 6  # an even count: the upper middle value, one that was measured
    assert quantile(values, 0.9) == 10
    assert quantile(values, 0.99) == 10
    assert quantile([4.2], 0.99) == 4.2
    # The index the benchmarks used before the harness: sorted[min(n - 1, int(q * n))].
    rng = random.Random(1)
    for n in (1, 2, 3, 99, 100, 101, 1000):
        drawn = [rng.random() for _ in range(n)]
        for q in (0.5, 0.9, 0.95, 0.99, 0.999):
            assert quantile(drawn, q) == sorted(drawn)[min(n - 1, int(q * n))]


def test_quantiles_read_several_at_once_as_quantile_does() -> None:
    rng = random.Random(3)
    drawn = [rng.random() for _ in range(501)]
    qs = [0.5, 0.9, 0.99]
    assert quantiles(drawn, qs) == [quantile(drawn, q) for q in qs]
    assert quantiles(drawn, qs, interpolate=True) == [quantile(drawn, q, interpolate=True) for q in qs]


def test_interpolated_quantile_is_numpys_percentile() -> None:
    rng = random.Random(2)
    for n in (1, 2, 7, 48):
        drawn = [rng.uniform(1, 5000) for _ in range(n)]
        for q in (50, 99):
            assert quantile(drawn, q / 100, interpolate=True) == float(np.percentile(drawn, q))
    assert quantile([1.0, 2.0], 0.5, interpolate=True) == 1.5


def test_quantile_of_nothing_is_an_error() -> None:
    with pytest.raises(ValueError, match="no values"):
        quantile([], 0.5)


def test_histogram_quantile_within_and_at_bucket_bounds() -> None:
    # Cumulative counts by upper bound (seconds): 10 events up to 1 ms, 10 more up to 2 ms.
    before = {0.001: 5.0, 0.002: 5.0, math.inf: 5.0}
    after = {0.001: 15.0, 0.002: 25.0, math.inf: 25.0}
    assert histogram_quantile(before, after, 0.5, interpolate=False) == 1.0
    assert histogram_quantile(before, after, 0.75, interpolate=False) == 2.0
    assert histogram_quantile(before, after, 0.25) == pytest.approx(0.5)
    assert histogram_quantile(before, after, 0.75) == pytest.approx(1.5)
    # Past the last finite bound: that bound, as Prometheus says.
    late = {0.001: 0.0, 0.002: 0.0, math.inf: 4.0}
    assert histogram_quantile({}, late, 0.5) == 2.0
    assert math.isnan(histogram_quantile(after, after, 0.5))


def test_bootstrap_interval_is_repeatable_and_holds_the_statistic() -> None:
    values = [float(v) for v in range(1, 31)]
    median, low, high = bootstrap_interval(values, statistics.median)
    assert median == statistics.median(values)
    assert low <= median <= high
    assert (median, low, high) == bootstrap_interval(values, statistics.median)


def test_table_renders_markdown_with_alignments() -> None:
    lines = table(["engines", "policy", "p99"], "r-l", [[16, "least_load", "2.0 us"]])
    assert lines == ["| engines | policy | p99 |", "|--:|---|:--|", "| 16 | least_load | 2.0 us |"]
    with pytest.raises(ValueError, match="alignments"):
        table(["a", "b"], "r", [])


def test_stamp_names_the_commit_and_the_date() -> None:
    assert stamp("2026-12-05 03:19", "56a4a47") == "Measured at commit 56a4a47, 2026-12-05 03:19 UTC."
    assert re.fullmatch(r"Measured at commit \S+, \d{4}-\d\d-\d\d \d\d:\d\d UTC\.", stamp())


def test_update_section_replaces_appends_and_creates(tmp_path: Path) -> None:
    docs = tmp_path / "docs" / "benchmarks.md"
    begin, end = "<!-- x:begin -->", "<!-- x:end -->"
    update_section(f"{begin}\none\n{end}", begin, end, docs)
    assert docs.read_text().startswith("# Benchmarks")
    docs.write_text(f"head\n\n{begin}\nold\n{end}\n\ntail\n")
    update_section(f"{begin}\nnew\n{end}", begin, end, docs)
    assert docs.read_text() == f"head\n\n{begin}\nnew\n{end}\n\ntail\n"
    update_section("<!-- y:begin -->\ny\n<!-- y:end -->", "<!-- y:begin -->", "<!-- y:end -->", docs)
    assert docs.read_text().endswith("tail\n\n<!-- y:begin -->\ny\n<!-- y:end -->\n")


def test_stop_group_ends_what_the_process_started(tmp_path: Path) -> None:
    # A shell that starts a child and waits for it: stopping the shell must end the child too.
    proc = launch(["sh", "-c", "sleep 60 & wait"], tmp_path / "shell.log")
    shell = psutil.Process(proc.pid)
    deadline = time.monotonic() + 10
    while not shell.children():  # the shell forks its child as soon as it runs
        assert time.monotonic() < deadline, "the shell started no child"
        time.sleep(0.01)
    (child,) = shell.children()
    stop_group(proc, timeout_s=10)
    assert proc.returncode is not None
    child.wait(timeout=10)  # raises TimeoutExpired if the child outlived its group's stop


def test_processes_report_one_that_exited(tmp_path: Path) -> None:
    procs = Processes(tmp_path)
    procs.spawn("quits", ["sh", "-c", "exit 3"])
    try:
        with pytest.raises(RuntimeError, match=r"quits exited \(3\)"):
            procs.wait_for("nothing", lambda: False, timeout_s=30)
    finally:
        procs.stop()
    assert (tmp_path / "quits.log").exists()


def test_save_results_writes_the_payload_under_a_stamped_name(tmp_path: Path) -> None:
    out = save_results("trial", {"rows": [1, 2]}, folder=tmp_path / "results")
    assert out.parent == tmp_path / "results"
    assert re.fullmatch(r"trial-\d{8}T\d{6}Z\.json", out.name)
    assert json.loads(out.read_text()) == {"rows": [1, 2]}
