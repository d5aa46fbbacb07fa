"""Chaos run: many greedy streams for minutes while engines die, Redis restarts and an engine
drains; checks every token each stream got.

    make bench-chaos                       # 5 runs: 64 streams, 2 minutes, a kill every 30 s
    make bench-chaos BENCH_ARGS="--repeats 1 --streams 32 --duration 120 --kill-every 20"

A local fleet of three tiny-model engines (supervisord restarts a killed one) serves clients
that each run one streaming completion after another (seeded prompts, ``ignore_eos``, a random
``max_tokens`` of 64-512), so every stream must deliver exactly ``max_tokens`` token ids: fewer is
a lost token, more a duplicate. Meanwhile: SIGKILL a random engine every ``--kill-every`` seconds,
restart Redis once a third of the way in, and, two thirds of the way in, drain a serving engine
by migration as a scale-down does (no kill shortly before or after it, so that it measures moving
requests, not a fleet that is restarting). After the load, every completed stream's request runs
again on the quiet fleet and its token ids are compared with what the client got. Reported:
streams completed and failed, tokens lost and duplicated, streams whose token ids differ, the
requests the drain moved (and why the others did not move), client-visible stall (each stream's
longest gap between two tokens) p50/p99, and each process's memory over time (a plot). Requests
and time are bounded; the fleet stops by itself at the end. Results go to
``docs/reliability.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import cache

import grpc
import httpx
import psutil

from bench.harness import ROOT, pyplot, quantile, save_plot, stamp, table, update_section
from shoal_fleet.launcher import Fleet, FleetConfig
from shoal_protos import engine_control_pb2 as pb
from shoal_protos import engine_control_pb2_grpc as pb_grpc
from shoal_protos import tls

DOCS = ROOT / "docs" / "reliability.md"
PLOT = ROOT / "docs" / "images" / "chaos-memory.png"
BEGIN, END = "<!-- chaos:begin -->", "<!-- chaos:end -->"
MODEL = ROOT / ".cache" / "models" / "tiny-llama"
QUIET_BEFORE_DRAIN_S = 15.0
"""No engine is killed from this long before the drain until as long after it, so that the drain
measures moving requests, not a fleet that is restarting."""


@cache
def vocab_size() -> int:
    """The tiny model's vocabulary, read when the first prompt is drawn (not at import, so that
    ``--help`` works before ``make models``)."""
    size: int = json.loads((MODEL / "config.json").read_text())["vocab_size"]
    return size


@dataclass
class Tally:
    completed: int = 0
    failed: int = 0
    lost: int = 0
    duplicated: int = 0
    longest_gaps: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    events: list[tuple[float, str]] = field(default_factory=list)
    streams: list[Stream] = field(default_factory=list)
    """Every completed stream, for the comparison with an uninterrupted run."""
    mismatched: int = 0
    drained: Drained | None = None


@dataclass
class Stream:
    prompt: list[int]
    max_tokens: int
    token_ids: list[int]


@dataclass
class Drained:
    engine: str
    tried: int
    """Requests the drain found on the engine (each move tried at least once)."""
    moved: int
    remaining: int
    codes: Counter[str]

    @property
    def needed(self) -> int:
        """Requests still running here when their move came: the found ones less those that
        finished on their own first (``not_running``: before their move began;
        ``finished_first``: while it ran), which did not need one."""
        return self.tried - self.codes["not_running"] - self.codes["finished_first"]


def fleet_config(engines: int) -> FleetConfig:
    return FleetConfig(
        model_path=MODEL,
        served_model_name="tiny-llama",
        run_dir=ROOT / ".cache" / "bench" / "chaos",
        engines=engines,
        cluster="bench-chaos",
        router_port=28300,
        router_zmq_port=28301,
        tokenizer_port=28302,
        redis_port=28303,
        engine_zmq_base_port=28310,
        engine_http_base_port=28320,
        engine_control_base_port=28330,
        engine_kv_base_port=28340,
        max_model_len=2048,
        dtype="float32",
        restart=True,
    )


def greedy_body(prompt: list[int], max_tokens: int, stream: bool) -> dict[str, object]:
    """A greedy completion of exactly ``max_tokens`` token ids: the streams under chaos and
    their uninterrupted reruns ask for the same thing."""
    return {
        "model": "tiny-llama",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        "return_token_ids": True,
    }


async def client(
    http: httpx.AsyncClient, url: str, seed: int, stop_at: float, tally: Tally, say_every: int
) -> None:
    rng = random.Random(seed)
    while time.monotonic() < stop_at:
        max_tokens = rng.randint(64, 512)
        prompt = [rng.randrange(1, vocab_size()) for _ in range(rng.randint(4, 64))]
        body = greedy_body(prompt, max_tokens, stream=True)
        ids: list[int] = []
        longest, last, ended = 0.0, 0.0, ""
        try:
            async with http.stream("POST", url + "/v1/completions", json=body) as reply:
                if reply.status_code != 200:
                    await reply.aread()
                    code = reply.json().get("error", {}).get("code") or str(reply.status_code)
                    tally.errors[code] = tally.errors.get(code, 0) + 1
                    await asyncio.sleep(0.5)  # the fleet is short of engines for a moment
                    continue
                async for line in reply.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        ended = "done"
                        break
                    payload = json.loads(line.removeprefix("data: "))
                    if "error" in payload:
                        ended = payload["error"].get("code") or "error"
                        break
                    tokens = payload["choices"][0].get("token_ids") or []
                    now = time.monotonic()
                    if tokens and last:
                        longest = max(longest, now - last)
                    if tokens:
                        last = now
                    ids += tokens
        except httpx.HTTPError as exc:
            ended = type(exc).__name__
        if ended == "done":
            got = len(ids)
            tally.streams.append(Stream(prompt, max_tokens, ids))
            tally.completed += 1
            tally.lost += max(0, max_tokens - got)
            tally.duplicated += max(0, got - max_tokens)
            tally.longest_gaps.append(longest)
            if tally.completed % say_every == 0:
                print(f"  {tally.completed} streams completed", flush=True)
        else:
            tally.failed += 1
            tally.errors[ended] = tally.errors.get(ended, 0) + 1


def chaos(
    fleet: Fleet, cfg: FleetConfig, args: argparse.Namespace, started: float, tally: Tally, seed: int
) -> None:
    """The disruptions, on a thread: kills on a schedule, one Redis restart, one drain."""
    rng = random.Random(seed)
    next_kill = started + args.kill_every
    redis_at, drain_at = started + args.duration / 3, started + 2 * args.duration / 3
    redis_done = drain_done = False
    end = started + args.duration
    quiet_from = drain_at - QUIET_BEFORE_DRAIN_S
    while time.monotonic() < end:
        now = time.monotonic()
        if now >= next_kill and (drain_done or now < quiet_from):
            engine = f"engine-{rng.randrange(cfg.engines)}"
            pid = fleet.pids().get(engine)
            if pid:
                os.killpg(os.getpgid(pid), signal.SIGKILL)
                tally.events.append((now - started, f"killed {engine}"))
                print(f"  t={now - started:.0f}s: killed {engine} (supervisord restarts it)", flush=True)
            next_kill += args.kill_every
        if not redis_done and now >= redis_at:
            fleet.restart("redis")
            tally.events.append((now - started, "restarted Redis"))
            print(f"  t={now - started:.0f}s: restarted Redis", flush=True)
            redis_done = True
        if not drain_done and now >= drain_at:
            note = drain(cfg, rng, tally)
            tally.events.append((time.monotonic() - started, note))
            print(f"  t={time.monotonic() - started:.0f}s: {note}", flush=True)
            drain_done = True
            # The drained engine is out of the rotation until it rejoins: a kill before then
            # could leave no engine to continue streams on, which no scale-down does.
            next_kill = max(next_kill, time.monotonic() + QUIET_BEFORE_DRAIN_S)
        time.sleep(0.2)


def healthy_engines(cfg: FleetConfig, wait_s: float) -> list[int]:
    """The engines whose health check passes once every engine's does, or after ``wait_s``
    (a killed engine may still be loading): a drain of an engine that is starting moves
    nothing, and one whose peers are starting has nowhere to move to."""
    deadline = time.monotonic() + wait_s
    while True:
        up = []
        for engine in range(cfg.engines):
            try:
                reply = httpx.get(f"http://{cfg.host}:{cfg.engine_http_base_port + engine}/health", timeout=2)
                if reply.status_code == 200:
                    up.append(engine)
            except httpx.HTTPError:
                pass
        if len(up) == cfg.engines or time.monotonic() > deadline:
            return up
        time.sleep(0.5)


def drain(cfg: FleetConfig, rng: random.Random, tally: Tally) -> str:
    """Drain one serving engine as a scale-down does (it leaves the rotation first, and comes
    back a few seconds later since no shutdown follows); the event's note."""
    up = healthy_engines(cfg, wait_s=QUIET_BEFORE_DRAIN_S)
    if len(up) < 2:
        return f"no drain: {len(up)} engine(s) serving"
    engine = rng.choice(up)
    address = f"{cfg.host}:{cfg.engine_control_base_port + engine}"
    try:
        with tls.channel(address, tls.load_optional(cfg.fleet_tls_dir)) as channel:
            result = pb_grpc.EngineControlStub(channel).Drain(
                pb.DrainRequest(deadline_s=20, leave_rotation=True, rejoin_after_s=5), timeout=30
            )
    except grpc.RpcError as exc:
        return f"drain of engine-{engine} failed: {exc.code().name}"
    codes = Counter(move.code or pb.Outcome.Name(move.outcome) for move in result.migrations)
    tried = len({move.request_id for move in result.migrations})
    tally.drained = Drained(f"engine-{engine}", tried, result.migrated, result.remaining, codes)
    for move in result.migrations:
        if move.outcome != pb.MIGRATED:
            print(f"    {move.request_id}: {move.code}: {move.detail}", flush=True)
    why = ", ".join(f"{code} {count}" for code, count in codes.most_common())
    return f"drained engine-{engine}: {result.migrated} of {tried} moved, {result.remaining} left ({why})"


async def compare(url: str, tally: Tally, concurrency: int) -> None:
    """Run every completed stream's request again on the quiet fleet, one greedy completion
    each, and count the streams whose token ids differ from it."""
    limit = asyncio.Semaphore(concurrency)

    async def one(http: httpx.AsyncClient, stream: Stream) -> bool:
        body = greedy_body(stream.prompt, stream.max_tokens, stream=False)
        async with limit:
            reply = await http.post(url + "/v1/completions", json=body)
        reply.raise_for_status()
        return bool(reply.json()["choices"][0]["token_ids"] != stream.token_ids)

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=concurrency + 4)) as http:
        differ = await asyncio.gather(*(one(http, stream) for stream in tally.streams))
    tally.mismatched = sum(differ)


def sample_memory(
    fleet: Fleet, started: float, end: float, samples: dict[str, list[tuple[float, float]]]
) -> None:
    while time.monotonic() < end:
        for name, pid in fleet.pids().items():
            try:
                process = psutil.Process(pid)
                rss = process.memory_info().rss + sum(
                    child.memory_info().rss for child in process.children(recursive=True)
                )
            except psutil.Error:
                continue
            samples.setdefault(name, []).append((time.monotonic() - started, rss / 2**20))
        time.sleep(2.0)


def plot(samples: dict[str, list[tuple[float, float]]], events: list[tuple[float, str]]) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, points in sorted(samples.items()):
        xs: list[float] = []
        ys: list[float] = []
        for t, mib in points:
            if xs and t - xs[-1] > 5.0:  # the process was dead (killed, not yet back): a gap
                xs.append(xs[-1])
                ys.append(float("nan"))
            xs.append(t)
            ys.append(mib)
        ax.plot(xs, ys, label=name)
    top = ax.get_ylim()[1]
    for i, (t, what) in enumerate(events):
        ax.axvline(t, color="grey", linewidth=0.6, linestyle=":")
        ax.text(t, top * (0.98 - 0.12 * (i % 3)), what, rotation=90, fontsize=6, va="top", ha="right")
    ax.set_xlabel("seconds into the run")
    ax.set_ylabel("resident memory, MiB (process and its children)")
    ax.set_title("Chaos run: memory of each fleet process")
    ax.legend(fontsize=7, loc="center right")
    fig.tight_layout()
    save_plot(fig, PLOT)


def row(run: int, tally: Tally) -> list[str]:
    gaps = tally.longest_gaps or [0.0]
    drained = tally.drained
    moved = f"{drained.moved} of {drained.tried}" if drained else "no drain"
    needed = f"{drained.moved} of {drained.needed}" if drained else "no drain"
    return [
        str(run), str(tally.completed), str(tally.failed), str(tally.lost), str(tally.duplicated),
        f"{tally.mismatched} of {len(tally.streams)}", moved, needed,
        f"{statistics.median(gaps) * 1000:.0f} ms", f"{quantile(gaps, 0.99) * 1000:.0f} ms",
    ]  # fmt: skip


def report(
    args: argparse.Namespace, tallies: list[Tally], samples: dict[str, list[tuple[float, float]]]
) -> str:
    growth = {
        name: (points[-1][1] - points[0][1], max(m for _, m in points))
        for name, points in samples.items()
        if points
    }
    header = [
        "run",
        "streams completed",
        "streams failed",
        "tokens lost",
        "tokens duplicated",
        "token ids differing",
        "drain: requests moved",
        "drain: moved of those still running at their turn",
        "stall p50",
        "stall p99",
    ]
    errors: Counter[str] = Counter()
    for tally in tallies:
        errors.update(tally.errors)
    lines = [
        BEGIN,
        f"## Chaos run ({time.strftime('%Y-%m-%d')}, `make bench-chaos`)",
        "",
        f"{len(tallies)} runs, each on a fresh fleet: {args.streams} concurrent greedy streams for "
        f"{args.duration} s against three tiny-model engines;",
        f"an engine SIGKILLed every {args.kill_every} s (supervisord restarts it), Redis restarted once,",
        "one serving engine drained by migration as a scale-down does (no kill from "
        f"{QUIET_BEFORE_DRAIN_S:.0f} s before it to as long after); every completed stream's "
        "token ids then compared with the same request run again, uninterrupted, on the quiet "
        "fleet. Each run draws its own prompts, lengths and kills.",
        "",
        stamp(),
        "",
        *table(header, "----------", [row(run, tally) for run, tally in enumerate(tallies, 1)]),
        "",
        "Stall: each completed stream's longest gap between two tokens (a stream that moved or was",
        "continued after its engine died shows it there). Drain: the requests it moved of those it",
        "found on the engine, and of those still running when their move came (the others finished",
        "on their own first: `not_running`, `finished_first`); a move that failed or was refused",
        "counts against both (the events say which, by code).",
        "",
        "Refusals and failures by code: "
        + (", ".join(f"`{code}` {count}" for code, count in sorted(errors.items())) or "none"),
        "",
        *(
            f"Events of run {run}: " + "; ".join(f"{t:.0f} s {what}" for t, what in tally.events)
            for run, tally in enumerate(tallies, 1)
        ),
        "",
        f"Memory, run {len(tallies)}:",
        "",
        *table(
            ["process", "memory at the end minus at the start", "peak"],
            "---",
            (
                [name, f"{delta:+.0f} MiB", f"{peak:.0f} MiB"]
                for name, (delta, peak) in sorted(growth.items())
            ),
        ),
        "",
        "![Memory of each process over the chaos run](images/chaos-memory.png)",
        END,
    ]
    return "\n".join(lines)


def run_once(
    args: argparse.Namespace, cfg: FleetConfig, run: int
) -> tuple[Tally, dict[str, list[tuple[float, float]]]]:
    """One chaos run on a fresh fleet; its tally and the memory samples."""
    fleet = Fleet(cfg, say=lambda line: print("  " + line.strip(), flush=True))
    print(f"[run {run}/{args.repeats}: 1/4] starting {args.engines} tiny-model engines", flush=True)
    fleet.start()
    tally = Tally()
    samples: dict[str, list[tuple[float, float]]] = {}
    try:
        fleet.wait_ready(timeout_s=600)
        print(
            f"[run {run}/{args.repeats}: 2/4] {args.streams} streams for {args.duration} s under chaos",
            flush=True,
        )
        started = time.monotonic()
        end = started + args.duration
        threads = [
            threading.Thread(target=chaos, args=(fleet, cfg, args, started, tally, 7 + run), daemon=True),
            threading.Thread(target=sample_memory, args=(fleet, started, end, samples), daemon=True),
        ]
        for thread in threads:
            thread.start()
        seeds = range(run * 10_000, run * 10_000 + args.streams)

        async def load() -> None:
            limits = httpx.Limits(max_connections=args.streams + 8)
            async with httpx.AsyncClient(timeout=120, limits=limits) as http:
                await asyncio.gather(*(client(http, cfg.base_url, seed, end, tally, 250) for seed in seeds))

        asyncio.run(load())
        for thread in threads:
            thread.join(timeout=60)
        print(
            f"[run {run}/{args.repeats}: 3/4] comparing {len(tally.streams)} streams with a quiet rerun",
            flush=True,
        )
        healthy_engines(cfg, wait_s=120)
        asyncio.run(compare(cfg.base_url, tally, args.streams))
    finally:
        print(f"[run {run}/{args.repeats}: 4/4] stopping the fleet", flush=True)
        fleet.stop()
    print(
        f"run {run}: completed {tally.completed}, failed {tally.failed}, lost {tally.lost}, "
        f"duplicated {tally.duplicated}, token ids differing {tally.mismatched}",
        flush=True,
    )
    return tally, samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--duration", type=int, default=120, help="seconds of load")
    parser.add_argument("--kill-every", type=int, default=30, help="seconds between engine kills")
    parser.add_argument("--engines", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5, help="runs, each on a fresh fleet")
    args = parser.parse_args()
    cfg = fleet_config(args.engines)
    tallies, samples = [], {}
    for run in range(1, args.repeats + 1):
        tally, samples = run_once(args, cfg, run)
        tallies.append(tally)
    plot(samples, tallies[-1].events)
    update_section(report(args, tallies, samples), BEGIN, END, DOCS)
    print(f"wrote {DOCS.relative_to(ROOT)}", flush=True)


if __name__ == "__main__":
    main()
