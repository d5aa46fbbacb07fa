"""The relay benchmark's quick mode as a regression guard: a real router relays 64 streams from
two simulated engines, and its CPU per SSE event, over the engines' CPU per token in the same
round, must stay within 2x of the ratio recorded in ``bench/relay_guard.json``. Only a large
regression of the streaming path fails it (the ratio varies by about 10% between runs here);
``make bench-relay`` measures the path in full."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.integration.support import ROOT

pytestmark = pytest.mark.integration


def test_router_cpu_per_event_has_not_regressed() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench.relay", "--guard", "--tokens", "200"],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    report = run.stdout + run.stderr
    assert "relay guard:" in report, report
    assert run.returncode == 0, report
