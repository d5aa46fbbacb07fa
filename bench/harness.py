"""What every benchmark shares: starting and stopping the processes it measures, quantiles, the
bootstrap interval, markdown tables stamped with the commit and date they were measured at,
plots, and writing a benchmark's section into the docs between its own markers.

A benchmark module keeps only what is its own: its load, its measures and its section's words.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "benchmarks.md"
IMG = ROOT / "docs" / "img"
RESULTS = ROOT / "bench" / "results"
"""Every run's raw numbers (git-ignored)."""


def say(line: str) -> None:
    """One progress line with the time of day, at once (``make`` pipes stdout)."""
    print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)


# ---- processes -----------------------------------------------------------------------------


def free_port() -> int:
    """A port nothing listens on now (the kernel's pick)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether nothing accepts connections on ``port`` (a fixed port another run may hold)."""
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) != 0


def http_ok(url: str) -> bool:
    """Whether ``url`` answers 200 within a second."""
    try:
        with urllib.request.urlopen(url, timeout=1.0) as reply:
            return bool(reply.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def tail(path: Path, lines: int = 20) -> str:
    """The last lines of a log, for an error message."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def launch(
    command: Sequence[str], log: Path, env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start ``command`` with its output in ``log``, in a process group of its own (in this
    session: see ``Fleet.start`` on why not a session of its own), so that ``stop_group`` ends it
    and everything it started."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        return subprocess.Popen(
            list(command),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(env) if env else None,
            process_group=0,
        )


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """``sig`` to the process group ``proc`` leads, or to ``proc`` alone when it leads none
    (started some other way than ``launch``)."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)


def stop_group(proc: subprocess.Popen[bytes] | None, timeout_s: float = 60.0) -> None:
    """SIGTERM a process started by ``launch`` and all it started; SIGKILL after ``timeout_s``."""
    if proc is None or proc.poll() is not None:
        return
    _signal_group(proc, signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        _signal_group(proc, signal.SIGKILL)
        proc.wait()


def vllm_router_binary() -> str:
    """The Rust ``vllm-router`` (the baseline in front of the engines) beside this interpreter,
    or on ``PATH``."""
    beside = Path(sys.executable).with_name("vllm-router")
    found = str(beside) if beside.exists() else shutil.which("vllm-router")
    assert found, "vllm-router is not installed; `make setup` installs it"
    return found


@dataclass
class Processes:
    """The processes of one measurement, each logging to ``folder/<name>.log``; ``stop`` ends
    them all, asking every one first, so that they wind down together."""

    folder: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    names: dict[int, str] = field(default_factory=dict)
    """Each process's name (its log's), by pid."""

    def spawn(
        self, name: str, command: list[str], env: Mapping[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        proc = launch(command, self.folder / f"{name}.log", env)
        self.procs.append(proc)
        self.names[proc.pid] = name
        return proc

    def check(self) -> None:
        """Raise if one of them exited."""
        for proc in self.procs:
            if proc.poll() is not None:
                name = self.names[proc.pid]
                raise RuntimeError(f"{name} exited ({proc.returncode}); logs in {self.folder}/{name}.log")

    def wait_for(self, what: str, ready: Callable[[], bool], timeout_s: float) -> None:
        """Poll ``ready`` until it holds; raise if a process exits or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            self.check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}; logs in {self.folder}")
            time.sleep(0.2)

    def stop(self, timeout_s: float = 30.0) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                _signal_group(proc, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()


# ---- statistics ----------------------------------------------------------------------------


def quantiles(values: Sequence[float], qs: Sequence[float], *, interpolate: bool = False) -> list[float]:
    """Quantiles ``qs`` (each 0 to 1) of ``values``, which must not be empty; one sort for all.

    By default the nearest rank at or below: the value at index ``int(q * n)`` of the sorted
    values (the median of an even count is the upper middle one), a value that was measured.
    With ``interpolate``, linear between the two closest ranks, as numpy's default (the serving
    benchmark's percentiles, comparable with vLLM's own benchmark's)."""
    if not values:
        raise ValueError("quantile of no values")
    if interpolate:
        import numpy as np

        return [float(np.quantile(values, q)) for q in qs]
    ordered = sorted(values)
    return [float(ordered[min(len(ordered) - 1, int(q * len(ordered)))]) for q in qs]


def quantile(values: Sequence[float], q: float, *, interpolate: bool = False) -> float:
    """Quantile ``q`` of ``values``, as ``quantiles`` reads it."""
    return quantiles(values, [q], interpolate=interpolate)[0]


def histogram_quantile(
    before: Mapping[float, float], after: Mapping[float, float], q: float, *, interpolate: bool = True
) -> float:
    """Quantile ``q`` (ms) of the events counted between two readings of a Prometheus
    histogram (cumulative counts by bucket upper bound, in seconds); nan when none were.

    With ``interpolate``, estimated linearly within the bucket that holds it, as Prometheus'
    ``histogram_quantile`` does (the highest finite bound when it falls in the last, unbounded
    bucket); without, the upper bound of that bucket (all the histogram says for sure)."""
    counts = sorted((bound, after[bound] - before.get(bound, 0.0)) for bound in after)
    total = counts[-1][1] if counts else 0.0
    if not total:
        return float("nan")
    rank, lower, below = q * total, 0.0, 0.0
    for bound, cumulative in counts:
        if cumulative >= rank:
            if not interpolate:
                return bound * 1000
            if math.isinf(bound):
                return lower * 1000
            share = (rank - below) / (cumulative - below) if cumulative > below else 1.0
            return (lower + (bound - lower) * share) * 1000
        lower, below = bound, cumulative
    return float("nan")


def bootstrap_interval(
    values: Sequence[float], statistic: Callable[[Sequence[float]], float], resamples: int = 4000
) -> tuple[float, float, float]:
    """``statistic`` of ``values`` and a 95 % bootstrap interval of it (percentiles of the
    statistic over ``resamples`` draws with replacement; a fixed seed, so a rerun of the report
    agrees)."""
    draw = random.Random(0)
    drawn = sorted(statistic(draw.choices(values, k=len(values))) for _ in range(resamples))
    return statistic(values), drawn[int(0.025 * resamples)], drawn[int(0.975 * resamples) - 1]


def save_results(name: str, payload: Any, folder: Path = RESULTS) -> Path:
    """Write a run's raw numbers to ``folder/<name>-<UTC time>.json`` and say where."""
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{name}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    out.write_text(json.dumps(payload, indent=1))
    say(f"results in {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return out


# ---- stamps, tables and plots ----------------------------------------------------------------


def utc_now(fmt: str = "%Y-%m-%d %H:%M") -> str:
    return dt.datetime.now(dt.UTC).strftime(fmt)


def git_commit() -> str:
    """The checkout's short commit, ``+dirty`` when the working tree has changes outside
    ``docs/`` (where benchmarks write their own results and plots)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", ".", ":!docs"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def stamp(date: str | None = None, commit: str | None = None) -> str:
    """The line above every section's tables: the commit and the time they were measured at
    (this checkout and now unless given)."""
    return f"Measured at commit {commit or git_commit()}, {date or utc_now()} UTC."


_ALIGN = {"r": "--:", "l": ":--", "-": "---"}


def table(header: Sequence[str], align: str, rows: Iterable[Sequence[object]]) -> list[str]:
    """A markdown table's lines. ``align`` has one letter per column: ``r`` right, ``l`` left,
    ``-`` the renderer's default."""
    if len(align) != len(header):
        raise ValueError(f"{len(header)} columns, {len(align)} alignments")
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(_ALIGN[a] for a in align) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend (no display here), imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_plot(fig: Figure, path: Path) -> None:
    """Write ``fig`` where the docs link it, and free it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


# ---- docs ----------------------------------------------------------------------------------


def update_section(section: str, begin: str, end: str, path: Path = DOCS) -> None:
    """Replace the text from ``begin`` to ``end`` with ``section`` (which carries both markers),
    append it when the file has no such section, or create the file."""
    if path.exists():
        text = path.read_text()
        if begin in text and end in text:
            head, rest = text.split(begin, 1)
            text = head + section + rest.split(end, 1)[1]
        else:
            text = text.rstrip("\n") + "\n\n" + section + "\n"
    else:
        text = "# Benchmarks\n\nMeasured on this repository's machines; each section names its command.\n\n"
        text += section + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def publish(section: str, begin: str, end: str, print_only: bool, path: Path = DOCS) -> None:
    """Print a benchmark's section and, unless ``print_only``, write it into the docs."""
    print(section)
    if not print_only:
        update_section(section, begin, end, path)
        print(f"wrote {path.relative_to(ROOT)}")
