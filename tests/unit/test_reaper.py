"""The engine's reaper with real processes: a stand-in for the engine service starts the reaper
and a process tree as vLLM's (a child with a child of its own); killed with SIGKILL, the
stand-in leaves nothing running. A stop the engine lives through leaves its processes alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

from tests.integration.support import wait_until

# The engine's stand-in: the reaper first, as the engine starts it, then a "core" that starts a
# "worker"; it prints the three pids and waits.
ENGINE = textwrap.dedent(
    """
    import subprocess, sys, time
    from shoal_engine import reaper
    watcher = reaper.start()
    sleeper = "import time; time.sleep(600)"
    core = subprocess.Popen([sys.executable, "-c",
        "import subprocess, sys, time; w = subprocess.Popen([sys.executable, '-c', %r]);"
        " print(w.pid, flush=True); time.sleep(600)" % sleeper], stdout=subprocess.PIPE, text=True)
    worker = core.stdout.readline().strip()
    print(watcher.pid, core.pid, worker, flush=True)
    time.sleep(600)
    """
)


def _start() -> tuple[subprocess.Popen[str], list[psutil.Process]]:
    """The stand-in and its processes (reaper, core, worker), once the reaper has seen them."""
    engine = subprocess.Popen([sys.executable, "-c", ENGINE], stdout=subprocess.PIPE, text=True)
    assert engine.stdout is not None
    lines = []
    pids: list[int] = []
    seen: set[int] = set()
    # The reaper's lines and the stand-in's share its output; the reaper names the processes it
    # sees whenever they change, the last time with the core and the worker.
    for line in engine.stdout:
        lines.append(line)
        if line.startswith("shoal-engine reaper:"):
            seen = {int(p) for p in line.split("processes")[1].split() if p.isdigit()}
        else:
            pids = [int(p) for p in line.split()]
        if pids and seen == set(pids[1:]):
            break
    assert len(pids) == 3, lines
    return engine, [psutil.Process(p) for p in pids]


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_processes_under_a_killed_engine_end_with_it() -> None:
    engine, (watcher, core, worker) = _start()
    try:
        os.kill(engine.pid, signal.SIGKILL)
        engine.wait(10)
        wait_until(lambda: not _running(core) and not _running(worker), 10, "the core and worker to end")
        wait_until(lambda: not _running(watcher), 10, "the reaper to exit")
    finally:
        for process in (core, worker, watcher):
            if _running(process):
                process.kill()


def test_the_reaper_leaves_a_living_engine_alone_through_a_stop_signal() -> None:
    engine, (watcher, core, worker) = _start()
    try:
        # A stop sent to the reaper (as to the engine's whole process group) is the engine's
        # business: the reaper stays, and kills nothing while the engine lives.
        watcher.send_signal(signal.SIGTERM)
        watcher.send_signal(signal.SIGINT)
        with pytest.raises(psutil.TimeoutExpired):
            watcher.wait(timeout=1.0)
        assert all(_running(p) for p in (watcher, core, worker))
    finally:
        engine.kill()
        engine.wait(10)
        wait_until(lambda: not _running(core) and not _running(worker), 10, "the core and worker to end")
