"""Relay benchmark: the tokens per second routers relay, their CPU time per token, and the
inter-token gaps clients see; one router against two on the same engines.

Method
------
Everything runs on this machine: a Redis, ``--engines`` simulated engines (``shoal-engine
--backend sim``: the real engine service, its ZeroMQ frames and load reports, with the A100
step-time model run ``--sim-speed`` times faster, so they emit tokens as fast as this machine
lets them) and one or two routers (``shoal-router``, real processes). Prompts are token ids, so
no tokenizer is involved.

For each number of streams and each router count, this process opens that many streaming
``/v1/completions`` requests at once (one connection per stream, spread evenly over the routers),
each asking for ``--tokens`` tokens, and timestamps every SSE event. The client is a bare asyncio
protocol on uvloop that parses the responses with httptools (``--client lean``, 4.5-6 us of CPU
per event), so that it leaves more of the machine to the routers and engines than aiohttp does
(``--client aiohttp``, 10-14 us). It reports:

* tokens/s: tokens received over the time from the first to the last token of the round;
* router CPU per token: the routers' CPU time (user + system, from ``/proc`` through psutil)
  over the round divided by the tokens they relayed;
* inter-token gap p50/p99 at the client, beside the engines' step time from their load reports
  (the median of readings every 0.5 s in the first half of the round): a token cannot come
  faster than its engine's step.

On two cores the routers, the engines and this client share the CPU, so tokens/s here is a
floor set by the whole machine; CPU per token is the router's own cost. Results go between
``<!-- relay:begin -->`` and ``<!-- relay:end -->`` of ``docs/benchmarks.md``.

Paced rounds (first; ``--only-paces`` runs nothing else): one router and ``--pace-streams``
streams with the engines at each ``--paces`` speed, from a real A100's pace (x1) to this
machine's limit, for the delay the router adds to each token as the load grows
(``shoal_router_relay_delay_seconds``, its quantiles estimated within the buckets); after each,
``bench.fanout_floor`` at the same load: a server that only writes, the floor of that delay
for any single-threaded Python server. Results between ``<!-- relay-pace:begin -->`` and
``<!-- relay-pace:end -->``, and ``docs/img/relay_delay_by_load.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import aiohttp
import httptools
import httpx
import psutil
import redis
import uvloop
from prometheus_client.parser import text_string_to_metric_families

from bench.harness import (
    IMG,
    ROOT,
    Processes,
    free_port,
    histogram_quantile,
    publish,
    pyplot,
    quantiles,
    save_plot,
    stamp,
    table,
    vllm_router_binary,
)
from shoal_protos.records import Keys, load_report_decoder

BEGIN, END = "<!-- relay:begin -->", "<!-- relay:end -->"
CLUSTER, MODEL = "relay-bench", "sim-relay"


CGROUP_V1_CPU = Path("/sys/fs/cgroup/cpu")
CGROUP_V2 = Path("/sys/fs/cgroup")


@contextlib.contextmanager
def cpu_limits() -> Iterator[Callable[[int, str, float], None]]:
    """``limit(pid, name, cores)`` puts a process in a cgroup of its own whose CFS quota is
    ``cores`` CPUs, as Kubernetes enforces a container's CPU limit; the cgroups go when the block
    ends (needs root and the cpu controller, v1 or v2)."""
    made: list[Path] = []

    def limit(pid: int, name: str, cores: float) -> None:
        period = 100_000
        if (CGROUP_V1_CPU / "cpu.cfs_quota_us").exists():
            group = CGROUP_V1_CPU / f"shoal-relay-{name}-{pid}"
            group.mkdir()
            made.append(group)
            (group / "cpu.cfs_period_us").write_text(str(period))
            (group / "cpu.cfs_quota_us").write_text(str(round(cores * period)))
        elif "cpu" in (CGROUP_V2 / "cgroup.controllers").read_text().split():
            group = CGROUP_V2 / f"shoal-relay-{name}-{pid}"
            group.mkdir()
            made.append(group)
            (group / "cpu.max").write_text(f"{round(cores * period)} {period}")
        else:
            raise RuntimeError("no cgroup cpu controller here: --router-cpu cannot limit the routers")
        (group / "cgroup.procs").write_text(str(pid))

    try:
        yield limit
    finally:
        for group in made:
            with contextlib.suppress(OSError):  # still holds a process that did not exit
                group.rmdir()


@dataclass
class Running:
    # Where the clients go: the routers, or vllm-router in front of them.
    urls: list[str]
    router_urls: list[str]
    pids: list[int]
    engine_pids: list[int]
    redis: redis.Redis
    engines: int
    # vllm-router in front of the first router, when the round has one.
    front_pid: int | None = None
    step_samples: list[float] = field(default_factory=list)
    # The most requests the engines ran at once, as their load reports said.
    peak_running: int = 0

    def sample_engines(self) -> None:
        """Read the engines' latest load reports: their mean step time and the requests they
        run (the streams really in flight)."""
        steps, running = [], 0
        for i in range(self.engines):
            raw = self.redis.get(Keys(CLUSTER).load(f"sim-{i}"))
            if raw:
                report = load_report_decoder.decode(raw)
                running += report.num_running
                if report.step_time_ms > 0:  # an engine between batches reports 0
                    steps.append(report.step_time_ms)
        self.peak_running = max(self.peak_running, running)
        if steps:
            self.step_samples.append(statistics.mean(steps))


@contextlib.contextmanager
def fleet(
    args: argparse.Namespace,
    routers: int,
    folder: Path,
    router_src: str | None = None,
    front: bool = False,
) -> Iterator[Running]:
    """Redis, the simulated engines and ``routers`` routers, until the block ends; with
    ``router_src``, the routers run the router package found there (another checkout's
    ``services/router/src``) instead of the installed one; with ``front``, the clients talk to
    the Rust ``vllm-router`` (round robin) whose one worker is the first router."""
    procs = Processes(folder)
    limits = contextlib.ExitStack()
    limit = limits.enter_context(cpu_limits())
    redis_port = free_port()
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    binary = shutil.which("redis-server")
    assert binary, "redis-server is not installed; `make setup` installs it"
    procs.spawn("redis", [binary, "--port", str(redis_port), "--save", "", "--appendonly", "no"])
    try:
        client = redis.Redis(port=redis_port)

        def redis_up() -> bool:
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                return False

        procs.wait_for("Redis", redis_up, 10)
        engine_pids = []
        for i in range(args.engines):
            engine = procs.spawn(
                f"engine-{i}",
                [
                    sys.executable, "-m", "shoal_engine.main", "--backend", "sim",
                    "--model", "llama3-8b-a100", "--sim-speed", str(args.sim_speed),
                    "--sim-kv-blocks", "65536", "--max-model-len", "4096",
                    "--max-num-seqs", str(args.max_num_seqs), "--served-model-name", MODEL,
                    "--engine-id", f"sim-{i}", "--cluster", CLUSTER, "--redis-url", redis_url,
                    "--zmq-port", str(free_port()), "--http-port", str(free_port()),
                ],
            )  # fmt: skip
            engine_pids.append(engine.pid)
        urls, pids = [], []
        router_env = None
        if router_src is not None:
            router_env = {
                **os.environ,
                "PYTHONPATH": os.pathsep.join([router_src, os.environ.get("PYTHONPATH", "")]),
            }
        for r in range(routers):
            port = free_port()
            proc = procs.spawn(
                f"router-{r}",
                [
                    sys.executable, "-m", "shoal_router.main", "--model", MODEL, "--cluster", CLUSTER,
                    "--router-id", f"router-{r}", "--redis-url", redis_url,
                    "--tokenizer", "127.0.0.1:1", "--port", str(port), "--zmq-port", str(free_port()),
                ],
                env=router_env,
            )  # fmt: skip
            urls.append(f"http://127.0.0.1:{port}")
            pids.append(proc.pid)
            if args.router_cpu:
                limit(proc.pid, f"router-{r}", args.router_cpu)

        def all_see_engines() -> bool:
            for url in urls:
                try:
                    engines = httpx.get(url + "/health", timeout=2).json().get("engines", {})
                except (httpx.HTTPError, ValueError):
                    return False
                if len(engines) < args.engines:
                    return False
            return True

        procs.wait_for("the routers to see every engine", all_see_engines, 120)
        front_pid = None
        router_urls = urls
        if front:
            port = free_port()
            proc = procs.spawn(
                "vllm-router",
                [
                    vllm_router_binary(), "--host", "127.0.0.1", "--port", str(port),
                    "--worker-urls", urls[0], "--policy", "round_robin",
                    "--prometheus-port", str(free_port()), "--worker-startup-check-interval", "1",
                    "--log-level", "warning", "--max-concurrent-requests", "65536",
                    "--rate-limit-tokens-per-second", "65536", "--queue-size", "65536",
                ],
            )  # fmt: skip
            router_urls, urls, front_pid = urls, [f"http://127.0.0.1:{port}"], proc.pid

            def front_up() -> bool:
                try:
                    return httpx.get(urls[0] + "/health", timeout=2).status_code == 200
                except httpx.HTTPError:
                    return False

            procs.wait_for("vllm-router", front_up, 60)
        yield Running(urls, router_urls, pids, engine_pids, client, args.engines, front_pid)
    finally:
        procs.stop()
        limits.close()


@dataclass
class Stream:
    # When each SSE event with output arrived; one event may carry several tokens (the router
    # merges what piled up while a client's previous write was pending).
    times: list[float] = field(default_factory=list)
    # Output tokens, from the usage event at the end of the stream.
    tokens: int = 0
    error: str = ""


def request_body(prompt: list[int], tokens: int) -> dict[str, object]:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": tokens,
        "stream": True,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }


def take_event(out: Stream, event: bytes, now: float) -> None:
    """Count one SSE event (its ``data: ...`` line) that arrived at ``now``."""
    if not event.startswith(b"data: {"):
        return
    if b'"choices":[]' in event:
        out.tokens = json.loads(event[6:])["usage"]["completion_tokens"]
    else:
        out.times.append(now)


async def aiohttp_stream(session: aiohttp.ClientSession, url: str, prompt: list[int], tokens: int) -> Stream:
    body = request_body(prompt, tokens)
    out = Stream()
    clock = time.perf_counter
    try:
        async with session.post(url + "/v1/completions", json=body) as response:
            if response.status != 200:
                out.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return out
            async for line in response.content:
                take_event(out, line, clock())
    except aiohttp.ClientError as exc:
        out.error = repr(exc)
    if not out.error and out.tokens != tokens:
        out.error = f"{out.tokens} tokens arrived, {tokens} were asked for"
    return out


class SseClient(asyncio.Protocol):
    """One streaming completion over a connection of its own, read with httptools' parser (the
    router's own HTTP parser): a client light enough that the routers and engines get most of
    this machine. ``done`` resolves when the response ends or the connection drops."""

    def __init__(self, request: bytes, out: Stream) -> None:
        self._request = request
        self._out = out
        self._parser = httptools.HttpResponseParser(self)
        self._pending = b""  # the start of an event split across reads
        self._clock = time.perf_counter
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self._transport.write(self._request)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(f"bad HTTP from the router: {exc}")

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status != 200:
            self._fail(f"HTTP {status}")

    def on_body(self, body: bytes) -> None:
        now, out = self._clock(), self._out
        events = (self._pending + body).split(b"\n\n")
        self._pending = events.pop()
        for event in events:
            take_event(out, event, now)

    def on_message_complete(self) -> None:
        self._transport.close()
        if not self.done.done():
            self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self._fail(f"connection lost: {exc!r}")

    def _fail(self, error: str) -> None:
        self._out.error = self._out.error or error
        self._transport.close()
        if not self.done.done():
            self.done.set_result(None)


async def lean_stream(url: str, prompt: list[int], tokens: int) -> Stream:
    body = json.dumps(request_body(prompt, tokens)).encode()
    address = urllib.parse.urlsplit(url)
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {address.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body
    out = Stream()
    loop = asyncio.get_running_loop()
    try:
        _, client = await loop.create_connection(
            lambda: SseClient(request, out), address.hostname, address.port
        )
        await asyncio.wait_for(client.done, 600)
    except (OSError, TimeoutError) as exc:
        out.error = repr(exc)
    if not out.error and out.tokens != tokens:
        out.error = f"{out.tokens} tokens arrived, {tokens} were asked for"
    return out


async def round_of(
    urls: list[str], streams: int, tokens: int, client: str, running: Running | None = None
) -> list[Stream]:
    """``streams`` streams at once, read by ``client`` (``lean`` or ``aiohttp``); with
    ``running``, the engines' step time is read halfway."""
    async with contextlib.AsyncExitStack() as stack:
        if client == "aiohttp":
            connector = aiohttp.TCPConnector(limit=0)
            timeout = aiohttp.ClientTimeout(total=600)
            session = await stack.enter_async_context(
                aiohttp.ClientSession(connector=connector, timeout=timeout)
            )

            def start(url: str, prompt: list[int]) -> Awaitable[Stream]:
                return aiohttp_stream(session, url, prompt, tokens)
        else:

            def start(url: str, prompt: list[int]) -> Awaitable[Stream]:
                return lean_stream(url, prompt, tokens)

        jobs = [
            asyncio.ensure_future(start(urls[i % len(urls)], [100 + i % 997, 200 + i % 991, 300, 400]))
            for i in range(streams)
        ]
        if running is not None:
            while not all(job.done() for job in jobs):
                await asyncio.sleep(0.5)
                if sum(job.done() for job in jobs) < streams // 2:
                    await asyncio.to_thread(running.sample_engines)
        return await asyncio.gather(*jobs)


def relay_delay_buckets(router_urls: list[str]) -> dict[float, float]:
    """The routers' ``shoal_router_relay_delay_seconds`` histogram, summed: cumulative count of
    SSE events by bucket upper bound (seconds)."""
    buckets: dict[float, float] = {}
    for url in router_urls:
        text = httpx.get(url + "/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            if family.name != "shoal_router_relay_delay_seconds":
                continue
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    bound = float(sample.labels["le"])
                    buckets[bound] = buckets.get(bound, 0.0) + sample.value
    return buckets


def cpu_seconds(procs: list[psutil.Process]) -> float:
    return sum(t.user + t.system for t in (p.cpu_times() for p in procs))


def system_seconds(procs: list[psutil.Process]) -> float:
    """The kernel's share of ``cpu_seconds``: on loopback, a write's system call also runs the
    receiving side's TCP and wakes the reader."""
    return sum(p.cpu_times().system for p in procs)


def tokens_for(args: argparse.Namespace, streams: int) -> int:
    """Tokens each stream asks for: ``--tokens``, times streams / 1,024 beyond 1,024 streams, so
    that the first streams do not end before the last ones start and all of them run at once
    (the "most running" column). Until the router listened with several sockets it took in
    only a few hundred new streams a second while relaying, and 400 tokens a stream left 270-315
    of 512 running at once (``docs/benchmarks.md``, relay, seventh round)."""
    return args.tokens * max(1, streams // 1024)


def measure(
    args: argparse.Namespace,
    routers: int,
    streams: int,
    folder: Path,
    router_src: str | None = None,
    front: bool = False,
) -> dict[str, float]:
    tokens_each = tokens_for(args, streams)
    with fleet(args, routers, folder, router_src, front) as running:
        uvloop.run(round_of(running.urls, min(streams, 8), 32, args.client))  # warm-up: first steps
        router_procs = [psutil.Process(pid) for pid in running.pids]
        engine_procs = [psutil.Process(pid) for pid in running.engine_pids]
        front_procs = [psutil.Process(running.front_pid)] if running.front_pid else []
        router_before, engine_before = cpu_seconds(router_procs), cpu_seconds(engine_procs)
        router_system_before = system_seconds(router_procs)
        front_before = cpu_seconds(front_procs)
        delays_before = relay_delay_buckets(running.router_urls)
        started = time.perf_counter()
        client_before = cpu_seconds([psutil.Process()])
        results = uvloop.run(round_of(running.urls, streams, tokens_each, args.client, running))
        client_cpu = cpu_seconds([psutil.Process()]) - client_before
        wall = time.perf_counter() - started
        router_cpu = cpu_seconds(router_procs) - router_before
        router_system = system_seconds(router_procs) - router_system_before
        engine_cpu = cpu_seconds(engine_procs) - engine_before
        front_cpu = cpu_seconds(front_procs) - front_before
        delays_after = relay_delay_buckets(running.router_urls)
        step_ms = statistics.median(running.step_samples) if running.step_samples else float("nan")
        peak_running = running.peak_running
    errors = [r.error for r in results if r.error]
    times = [t for r in results for t in r.times]
    tokens = sum(r.tokens for r in results)
    events = len(times)
    window = (max(times) - min(times)) if times else wall
    gaps = [b - a for r in results for a, b in zip(r.times, r.times[1:], strict=False)]
    gap_p50, gap_p99 = quantiles(gaps, [0.5, 0.99]) if gaps else (float("nan"), float("nan"))
    row = {
        "routers": routers,
        "streams": streams,
        "tokens": tokens,
        "events": events,
        "errors": len(errors),
        "tokens_per_s": tokens / window if window else 0.0,
        "tokens_per_event": tokens / events if events else float("nan"),
        "router_cpu_us_per_token": router_cpu / tokens * 1e6 if tokens else float("nan"),
        "router_cpu_us_per_event": router_cpu / events * 1e6 if events else float("nan"),
        "engine_cpu_us_per_token": engine_cpu / tokens * 1e6 if tokens else float("nan"),
        "router_cpu_cores": router_cpu / wall,
        "router_system_share": router_system / router_cpu if router_cpu else float("nan"),
        "gap_p50_ms": gap_p50 * 1000,
        "gap_p99_ms": gap_p99 * 1000,
        "engine_step_ms": step_ms,
        "peak_running": peak_running,
        "relay_p50_ms": histogram_quantile(delays_before, delays_after, 0.5, interpolate=False),
        "relay_p99_ms": histogram_quantile(delays_before, delays_after, 0.99, interpolate=False),
        "relay_p50_est_ms": histogram_quantile(delays_before, delays_after, 0.5),
        "relay_p90_est_ms": histogram_quantile(delays_before, delays_after, 0.9),
        "relay_p99_est_ms": histogram_quantile(delays_before, delays_after, 0.99),
        "client_cpu_us_per_event": client_cpu / events * 1e6 if events else float("nan"),
        "front_cpu_us_per_token": front_cpu / tokens * 1e6 if tokens and front else float("nan"),
        "front_cpu_us_per_event": front_cpu / events * 1e6 if events and front else float("nan"),
    }
    label = "baseline " if router_src else "vllm-router + " if front else ""
    front_note = f", vllm-router CPU {row['front_cpu_us_per_event']:.1f} us/event" if front else ""
    print(
        f"  {label}{routers} router(s), {streams:>4} streams: "
        f"{row['tokens_per_s']:8.0f} tok/s "
        f"({row['tokens_per_event']:.2f} per event), router CPU {row['router_cpu_us_per_token']:5.1f} "
        f"us/token {row['router_cpu_us_per_event']:5.1f} us/event ({row['router_cpu_cores']:.2f} cores, "
        f"{row['router_system_share']:.0%} in the kernel), "
        f"engines {row['engine_cpu_us_per_token']:.1f} us/token, client {row['client_cpu_us_per_event']:.1f} "
        f"us/event, gap p50 {row['gap_p50_ms']:.2f} ms "
        f"p99 {row['gap_p99_ms']:.2f} ms, engine step {row['engine_step_ms']:.2f} ms, "
        f"at most {peak_running} running, router relay delay p50 <= {row['relay_p50_ms']:g} ms p99 <= "
        f"{row['relay_p99_ms']:g} ms, {len(errors)} errors"
        f"{front_note}",
        flush=True,
    )
    if errors:
        print(f"    first error: {errors[0]}", flush=True)
    return row


def _round_cells(r: dict[str, float]) -> list[str]:
    return [
        f"{r['routers']}", f"{r['streams']}", f"{r['peak_running']}", f"{r['tokens_per_s']:,.0f}",
        f"{r['tokens_per_event']:.2f}",
        f"{r['router_cpu_us_per_token']:.1f} us", f"{r['router_cpu_us_per_event']:.1f} us",
        f"{r['router_cpu_cores']:.2f}", f"<= {r['relay_p50_ms']:g} ms", f"<= {r['relay_p99_ms']:g} ms",
        f"{r['gap_p50_ms']:.2f} ms", f"{r['gap_p99_ms']:.2f} ms",
        f"{r['engine_step_ms']:.2f} ms", f"{r['errors']}",
    ]  # fmt: skip


def _front_cells(r: dict[str, float]) -> list[str]:
    return [
        f"{r['streams']}", f"{r['peak_running']}", f"{r['tokens_per_s']:,.0f}",
        f"{r['tokens_per_event']:.2f}",
        f"{r['front_cpu_us_per_event']:.1f} us", f"{r['router_cpu_us_per_event']:.1f} us",
        f"{r['router_cpu_us_per_event'] / r['front_cpu_us_per_event']:.2f}x",
        f"{r['gap_p50_ms']:.2f} ms", f"{r['gap_p99_ms']:.2f} ms", f"{r['errors']}",
    ]  # fmt: skip


def section(
    args: argparse.Namespace, rows: list[dict[str, float]], front_rows: list[dict[str, float]]
) -> str:
    lines = [
        BEGIN,
        "## Relay: tokens per second through the router, one router against two",
        "",
        f"`make bench-relay`: {args.engines} simulated engines (A100 step model at "
        f"x{args.sim_speed:g}), "
        f"every stream asks for {args.tokens:,} tokens (times streams / 1,024 beyond 1,024 streams, so "
        "that all of them run at once); routers, engines and the client share this "
        f"machine's {os.cpu_count()} cores, so tokens/s is bounded by the whole machine and CPU per "
        "token is the routers' own cost. Router delay: from the engine batch being read off the "
        "router's socket to the SSE event being handed to the client's connection "
        "(`shoal_router_relay_delay_seconds`, as its bucket bounds)."
        + (
            f" Each router is limited to {args.router_cpu:g} CPU (a cgroup quota, as a pod's CPU limit)."
            if args.router_cpu
            else ""
        ),
        "",
        stamp(),
        "",
    ]
    header = [
        "routers", "streams", "most running", "tokens/s", "tokens per SSE event", "router CPU per token",
        "per event", "router CPU (cores)", "router delay p50", "p99", "gap p50", "gap p99", "engine step",
        "errors",
    ]  # fmt: skip
    lines += table(header, "r" * len(header), (_round_cells(r) for r in rows))
    by = {(r["routers"], r["streams"]): r for r in rows}
    ratios = [
        f"{s} streams: {by[(2, s)]['tokens_per_s'] / by[(1, s)]['tokens_per_s']:.2f}x"
        for s in sorted({r["streams"] for r in rows})
        if (1, s) in by and (2, s) in by and by[(1, s)]["tokens_per_s"]
    ]
    if ratios:
        lines += ["", "Two routers against one (tokens/s): " + ", ".join(ratios) + "."]
    client = ", ".join(
        f"{row['client_cpu_us_per_event']:.1f} us ({row['routers']:.0f} router(s), "
        f"{row['streams']:.0f} streams)"
        for row in rows
    )
    lines += ["", f"The client (`--client {args.client}`), CPU per SSE event: {client}."]
    if front_rows:
        lines += [
            "",
            "The Rust `vllm-router` (round robin) in front of one Shoal router, in the same run: the "
            "clients talk to vllm-router, whose one worker is the Shoal router, so both relay the "
            "same SSE events and each one's CPU is measured on them, with the streams of the rounds "
            "above.",
            "",
        ]
        header = [
            "streams", "most running", "tokens/s", "tokens per SSE event", "vllm-router CPU per event",
            "Shoal router CPU per event", "Shoal / vllm-router", "gap p50", "gap p99", "errors",
        ]  # fmt: skip
        lines += table(header, "r" * len(header), (_front_cells(r) for r in front_rows))
    lines.append(END)
    return "\n".join(lines)


PACE_BEGIN, PACE_END = "<!-- relay-pace:begin -->", "<!-- relay-pace:end -->"
PACE_PLOT = IMG / "relay_delay_by_load.png"


def paced(args: argparse.Namespace, folder: Path) -> list[dict[str, float]]:
    """One router and ``--pace-streams`` streams with the engines at each ``--paces`` speed of the
    A100 step model: what the router adds to each token as the load grows from a real A100's
    pace (x1) to this machine's limit. Each stream asks for ``--pace-tokens`` times the speed,
    so that every round lasts about as long."""
    rows = []
    for speed in (float(p) for p in args.paces.split(",")):
        tokens = round(args.pace_tokens * speed)
        print(
            f"  paced round: engines at x{speed:g}, {args.pace_streams} streams of {tokens} tokens",
            flush=True,
        )
        at_pace = argparse.Namespace(**{**vars(args), "sim_speed": speed, "tokens": tokens})
        row = measure(
            at_pace, 1, args.pace_streams, Path(tempfile.mkdtemp(prefix=f"pace-{speed:g}-", dir=folder))
        )
        floor = fanout_floor(args, args.pace_streams, tokens, row["engine_step_ms"])
        rows.append({**row, "speed": speed, **{f"floor_{key}": value for key, value in floor.items()}})
    return rows


def fanout_floor(
    args: argparse.Namespace, streams: int, tokens: int, period_ms: float, threads: int = 1
) -> dict[str, float]:
    """``bench.fanout_floor`` (a bare server that only writes) at the paced round's load:
    ``streams`` streams of ``tokens`` events, a burst to all of them every engine step, read by
    the same client. Returns its delay quantiles (ms) and CPU per write."""
    port = free_port()
    command = [
        sys.executable, "-m", "bench.fanout_floor", "--port", str(port),
        "--streams", str(streams), "--tokens", str(tokens), "--period-ms", f"{period_ms:.3f}",
        "--threads", str(threads),
    ]  # fmt: skip
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=ROOT) as server:
        assert server.stdout is not None
        if server.stdout.readline().strip() != "ready":
            raise RuntimeError("the fan-out floor server did not start")
        results = uvloop.run(round_of([f"http://127.0.0.1:{port}"], streams, tokens, args.client))
        report = json.loads(server.stdout.readline())
    errors = [r.error for r in results if r.error]
    report["errors"] = len(errors)
    print(
        f"  bare fan-out ({threads} thread(s)), {streams} streams every {period_ms:.2f} ms: write delay p50 "
        f"{report['delay_p50_ms']:.2f} ms p99 {report['delay_p99_ms']:.2f} ms, "
        f"{report['cpu_us_per_write']:.1f} us per write ({report['system_share']:.0%} in the kernel), "
        f"{len(errors)} errors",
        flush=True,
    )
    return cast(dict[str, float], report)


def _pace_cells(r: dict[str, float]) -> list[str]:
    return [
        f"x{r['speed']:g}", f"{r['streams']}", f"{r['peak_running']}", f"{r['tokens_per_s']:,.0f}",
        f"{r['tokens_per_event']:.2f}", f"{r['engine_step_ms']:.2f} ms", f"{r['router_cpu_cores']:.2f}",
        f"{r['router_cpu_us_per_token']:.1f} us ({r['router_system_share']:.0%})",
        f"{r['relay_p50_est_ms']:.2f} ms", f"{r['relay_p90_est_ms']:.2f} ms",
        f"{r['relay_p99_est_ms']:.2f} ms", f"{r['floor_delay_p50_ms']:.2f} ms",
        f"{r['floor_delay_p90_ms']:.2f} ms", f"{r['floor_delay_p99_ms']:.2f} ms",
        f"{r['floor_cpu_us_per_write']:.1f} us ({r['floor_system_share']:.0%})",
        f"{r['gap_p50_ms']:.2f} ms", f"{r['gap_p99_ms']:.2f} ms", f"{r['errors'] + r['floor_errors']:g}",
    ]  # fmt: skip


def pace_section(args: argparse.Namespace, rows: list[dict[str, float]]) -> str:
    lines = [
        PACE_BEGIN,
        "### Relay: the delay one router adds, from a real A100's pace to this machine's limit",
        "",
        f"One router, {args.engines} simulated engines and {args.pace_streams} streams, the engines' "
        "step model at each speed below (x1: an A100 serving Llama-3-8B; x8: as fast as this "
        "machine runs the rest). Router delay: from the engine batch being read off the router's "
        "socket to the token's SSE event being handed to the client's connection "
        "(`shoal_router_relay_delay_seconds`), its quantiles estimated within the histogram's "
        "buckets as Prometheus' `histogram_quantile` does. Target: p99 at most 2 ms at 512 "
        "streams. Gap: between a stream's SSE events at the client (the engine's step, and "
        "everything after it). Bare fan-out, in the same run after each round: "
        "`bench.fanout_floor`, a uvloop server that only writes, one event of the same size to "
        "every stream once per engine step of that round, read by the same client; its delay is "
        "from the start of each burst to each write's return, measured exactly (the floor of any "
        "single-threaded Python server at this load; its CPU per write is nearly all the kernel's: "
        "on loopback the write runs the reader's TCP side and wakes it).",
        "",
        stamp(),
        "",
    ]
    header = [
        "engine pace", "streams", "most running", "tokens/s", "tokens per SSE event", "engine step",
        "router CPU (cores)", "router CPU per token (kernel share)", "router delay p50", "p90", "p99",
        "bare fan-out p50", "p90", "p99", "its CPU per write (kernel share)", "gap p50", "gap p99", "errors",
    ]  # fmt: skip
    lines += table(header, "r" * len(header), (_pace_cells(r) for r in rows))
    lines += ["", f"![router delay by load](img/{PACE_PLOT.name})", PACE_END]
    return "\n".join(lines)


def pace_plot(rows: list[dict[str, float]]) -> None:
    plt = pyplot()
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(7, 4.2))
    load = [r["tokens_per_s"] / 1000 for r in rows]
    for key, label, style in (
        ("relay_p50_est_ms", "p50", "o-"),
        ("relay_p90_est_ms", "p90", "s-"),
        ("relay_p99_est_ms", "p99", "^-"),
    ):
        ax.plot(load, [r[key] for r in rows], style, label=label)
    ax.plot(load, [r["floor_delay_p99_ms"] for r in rows], "k:", marker="x", label="bare fan-out p99 (floor)")
    for r, x in zip(rows, load, strict=True):
        ax.annotate(f"x{r['speed']:g}", (x, r["relay_p99_est_ms"]), textcoords="offset points", xytext=(4, 6))
    ax.axhline(2.0, color="grey", linestyle="--", linewidth=1, label="target p99: 2 ms")
    ax.set_xlabel("tokens/s relayed by one router (thousands)")
    ax.set_ylabel("router delay per token (ms)")
    ax.set_yscale("log")
    ax.set_yticks([1, 2, 5, 10, 20, 50])
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_title(f"What one router adds to each token, {int(rows[0]['streams'])} streams")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    save_plot(fig, PACE_PLOT)


GUARD_FILE = Path(__file__).with_name("relay_guard.json")
GUARD_NAME = str(GUARD_FILE.relative_to(ROOT))
# The guard fails when the router's cost relative to the engines' grows past this many times
# the recorded ratio: far above run-to-run noise, well below what a real regression costs
# (the BaseHTTPMiddleware layers this router once had cost 2.4-3.9x).
GUARD_LIMIT = 2.0


def guard(args: argparse.Namespace, record: bool) -> int:
    """One quick round (one router, 64 streams); the router's CPU per SSE event over the
    engines' CPU per token in the same round, against the ratio recorded in ``GUARD_FILE``.

    Both processes share the machine and the load, so the ratio holds from a slow machine to a
    fast one where absolute microseconds do not. Returns the exit status."""
    with tempfile.TemporaryDirectory(prefix="shoal-relay-guard-") as tmp:
        row = measure(args, routers=1, streams=args.guard_streams, folder=Path(tmp))
    ratio = row["router_cpu_us_per_event"] / row["engine_cpu_us_per_token"]
    if record:
        GUARD_FILE.write_text(json.dumps({"router_per_engine_cpu": round(ratio, 3)}, indent=2) + "\n")
        print(f"recorded router/engine CPU ratio {ratio:.2f} in {GUARD_FILE.name}")
        return 0
    baseline = json.loads(GUARD_FILE.read_text())["router_per_engine_cpu"]
    limit = GUARD_LIMIT * baseline
    verdict = "ok" if ratio <= limit and not row["errors"] else "REGRESSION"
    print(
        f"relay guard: router CPU per event / engine CPU per token = {ratio:.2f} "
        f"(recorded {baseline:.2f}, fails above {limit:.2f}); {row['errors']} stream errors: {verdict}"
    )
    return 0 if verdict == "ok" else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--streams", default="64,512,2048", help="streams per round, comma-separated")
    parser.add_argument("--routers", default="1,2")
    parser.add_argument("--tokens", type=int, default=1600, help="tokens each stream asks for")
    parser.add_argument("--sim-speed", type=float, default=8.0)
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument(
        "--client",
        choices=("lean", "aiohttp"),
        default="lean",
        help="how this process reads the streams: httptools' parser on a bare asyncio protocol, or aiohttp",
    )
    parser.add_argument("--no-docs", action="store_true", help="print only; leave docs/benchmarks.md")
    parser.add_argument("--guard", action="store_true", help=f"quick regression check against {GUARD_NAME}")
    parser.add_argument("--record-guard", action="store_true", help=f"measure, write {GUARD_NAME}")
    parser.add_argument("--guard-streams", type=int, default=64)
    parser.add_argument(
        "--baseline-src",
        help="also run every round with the router package at this path (another checkout's "
        "services/router/src), for a before/after in one run",
    )
    parser.add_argument("--no-vllm-router", action="store_true", help="skip the rounds through vllm-router")
    parser.add_argument(
        "--router-cpu",
        type=float,
        default=0.0,
        help="limit each router to this many CPUs (a cgroup quota, as a pod's CPU limit; needs root)",
    )
    parser.add_argument(
        "--paces",
        default="1,2,4,8",
        help="engine speeds of the paced rounds (one router, --pace-streams streams), comma-separated",
    )
    parser.add_argument("--pace-streams", type=int, default=512)
    parser.add_argument(
        "--pace-tokens", type=int, default=300, help="tokens each paced stream asks for, times the speed"
    )
    parser.add_argument("--no-paces", action="store_true", help="skip the paced rounds")
    parser.add_argument("--only-paces", action="store_true", help="run only the paced rounds")
    args = parser.parse_args()
    if args.guard or args.record_guard:
        sys.exit(guard(args, record=args.record_guard))
    if not args.no_paces:
        with tempfile.TemporaryDirectory(prefix="shoal-relay-pace-") as tmp:
            pace_rows = paced(args, Path(tmp))
        if not args.no_docs:
            pace_plot(pace_rows)
        publish(pace_section(args, pace_rows), PACE_BEGIN, PACE_END, print_only=args.no_docs)
    if args.only_paces:
        return
    rows, baseline_rows, front_rows = [], [], []
    with tempfile.TemporaryDirectory(prefix="shoal-relay-") as tmp:
        for streams in (int(s) for s in args.streams.split(",")):
            for routers in (int(r) for r in args.routers.split(",")):
                print(
                    f"  starting {args.engines} engines and {routers} router(s) for {streams} streams",
                    flush=True,
                )
                folder = Path(tempfile.mkdtemp(prefix=f"r{routers}-s{streams}-", dir=tmp))
                rows.append(measure(args, routers, streams, folder))
                if args.baseline_src:
                    folder = Path(tempfile.mkdtemp(prefix=f"baseline-r{routers}-s{streams}-", dir=tmp))
                    baseline_rows.append(measure(args, routers, streams, folder, args.baseline_src))
            if not args.no_vllm_router:
                print(f"  the same with vllm-router in front of one router, {streams} streams", flush=True)
                folder = Path(tempfile.mkdtemp(prefix=f"front-s{streams}-", dir=tmp))
                front_rows.append(measure(args, 1, streams, folder, front=True))
    if baseline_rows:
        print(compare(rows, baseline_rows))
    publish(section(args, rows, front_rows), BEGIN, END, print_only=args.no_docs)


def compare(rows: list[dict[str, float]], baseline_rows: list[dict[str, float]]) -> str:
    """A markdown table of the baseline router against this one, round by round."""
    header = [
        "routers",
        "streams",
        "CPU per event, baseline",
        "this router",
        "gap p99, baseline",
        "this router",
    ]
    cells = [
        [
            f"{new['routers']}",
            f"{new['streams']}",
            f"{old['router_cpu_us_per_event']:.1f} us",
            f"{new['router_cpu_us_per_event']:.1f} us",
            f"{old['gap_p99_ms']:.2f} ms",
            f"{new['gap_p99_ms']:.2f} ms",
        ]
        for new, old in zip(rows, baseline_rows, strict=True)
    ]
    return "\n".join(table(header, "rrrrrr", cells))


if __name__ == "__main__":
    main()
