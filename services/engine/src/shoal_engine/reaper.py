"""The engine's reaper: vLLM's processes end with the engine, however the engine ends.

vLLM runs the model in processes of its own: an engine core under the engine service, and a
worker per rank under the core. The workers watch the core (vLLM's death pipe), but the core
does not watch the service. Killed at once (SIGKILL, an OOM kill), the service leaves the core
and its workers running, reparented to init, polling a core and holding the KV cache's
memory, through the supervisor's restart (whose new engine then finds the memory taken) and
after the fleet stops. In a pod the container's end takes every process with it; under
supervisord (``make run``, the tests' fleets, the chaos bench) nothing did.

So the engine starts this small process beside vLLM's (``start``). Every ``POLL_S`` it notes
the engine's descendants (psutil keeps each one's start time, so a pid used again by another
process is never taken for one of them), and prints their pids when they change; once the
engine is gone (this process's parent changes) it kills those still running and exits. It
ignores SIGINT and SIGTERM: a Ctrl-C or a stop meant for the engine's process group is the
engine's to handle, and the reaper stays until the engine has ended.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil

POLL_S = 0.5
"""Between two looks at the engine's processes: how soon after the engine's death vLLM's go."""


def start() -> subprocess.Popen[bytes]:
    """Start the reaper for this process (the engine service), before vLLM's processes start."""
    return subprocess.Popen(
        [sys.executable, "-m", "shoal_engine.reaper", "--engine-pid", str(os.getpid())],
        stdin=subprocess.DEVNULL,
    )


def watch(engine_pid: int, poll_s: float = POLL_S) -> list[psutil.Process]:
    """Note the engine's descendants until it is gone, then kill them; returns those killed."""
    me = os.getpid()
    try:
        engine = psutil.Process(engine_pid)
    except psutil.NoSuchProcess:
        return []
    descendants: list[psutil.Process] = []
    while os.getppid() == engine_pid:
        try:
            now = [p for p in engine.children(recursive=True) if p.pid != me]
        except psutil.NoSuchProcess:
            break
        if os.getppid() != engine_pid:
            # The engine died during this look: its children (this process among them) went to
            # a new parent at once, so the look may have found none. The one before stands.
            break
        if {p.pid for p in now} != {p.pid for p in descendants}:
            pids = " ".join(str(p.pid) for p in sorted(now, key=lambda p: p.pid))
            print(f"shoal-engine reaper: engine {engine_pid} runs processes {pids or '(none)'}", flush=True)
        descendants = now
        time.sleep(poll_s)
    killed = []
    for process in descendants:
        with contextlib.suppress(psutil.NoSuchProcess):
            if process.is_running():  # False for a pid now used by another process
                process.kill()
                killed.append(process)
    return killed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="kill vLLM's processes once the engine is gone")
    parser.add_argument("--engine-pid", type=int, required=True)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    killed = watch(args.engine_pid)
    if killed:
        pids = " ".join(str(p.pid) for p in killed)
        print(f"shoal-engine reaper: engine {args.engine_pid} is gone; killed processes {pids}", flush=True)


if __name__ == "__main__":
    main()
