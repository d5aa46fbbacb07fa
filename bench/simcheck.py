"""The fleet simulator against the real fleet: one trace on both, their tails compared.

Method
------
The simulated engine's step model is fit in the same run (``bench.stepfit``'s measurement, on
this machine's CPU) or read from a saved fit (``--step-fit``). A trace of ``--requests``
requests per rate, Poisson arrivals at each of ``--rates`` requests/s, lognormal prompt and
output lengths (heavy-tailed, cut to the engines' 2,048-token context) of random token ids (no
prefix-cache hits), goes to both:

* **real**: ``shoal_fleet.launcher.Fleet`` with two SmolLM2-135M-Instruct engines as it ships
  (one core each, vLLM's CPU build; the router's least-load dispatch and hold line, balancing
  off), streamed ``/v1/completions`` from a client on the same machine;
* **simulated**: ``shoal_sim.fleet.Simulation`` of two engines with the fit, the real engines'
  KV blocks, block size, batch limits and token budget, and the router's same dispatch and hold
  line.

Per rate (``--requests`` requests each: a P99 of fewer is little more than the worst request's
luck): TTFT (sent to first token) and decode (a request's mean time per output token after
its first) at p50 and p99, simulated against real. Target (issue 40, part 1): P99 TTFT and P99
decode within 20 % of the real fleet's.

Then the same traces go to the real fleet again with its router balancing (``MIGRATION_ARGS``),
and to the simulation with the same balancing: whether migration helps on the real fleet, and
whether the simulator says the same (issue 40, part 4).

Results: ``bench/results/simcheck-<timestamp>.json`` and the section between
``<!-- simcheck:begin -->`` and ``<!-- simcheck:end -->`` of ``docs/benchmarks.md``, the plot
``docs/img/simcheck.png``. Run it with ``make bench-simcheck`` (``python -m bench.simcheck``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench import stepfit
from bench.harness import (
    IMG,
    ROOT,
    publish,
    pyplot,
    quantile,
    save_plot,
    save_results,
    say,
    stamp,
    table,
)
from bench.serving import (
    CLIENT_LIMITS,
    FLEET_PORTS,
    MODEL_NAME,
    TOKEN_ID_RANGE,
    RequestResult,
    completion_body,
    send_trace,
    sse_payloads,
)
from shoal_fleet.cpu import cpu_flags, native_dtype
from shoal_fleet.launcher import Fleet as RealFleet
from shoal_fleet.launcher import FleetConfig
from shoal_router.config import RouterConfig
from shoal_router.core.hold import HoldPolicy
from shoal_router.core.rebalance import BalancePolicy
from shoal_sim.engine import SimConfig, StepModel
from shoal_sim.fleet import Fleet, Simulation, Workload

BEGIN, END = "<!-- simcheck:begin -->", "<!-- simcheck:end -->"
TARGET = 0.20
"""Simulated P99 TTFT and P99 decode within this share of the real fleet's."""
ENGINES = 2
CALIBRATION = ((1, 128), (4, 128), (16, 128), (4, 1024))
"""Decode batches timed as served before the traces: (requests per engine, prompt tokens)."""
CALIBRATION_TOKENS = 48
PREFILL_CALIBRATION = (64, 512, 1500)
"""Prompts timed alone through the real fleet before the decode batches: tokens each."""
EAGER = {"balance_interval_s": 0.2, "balance_threshold": 0.01, "balance_cooldown_s": 1.0}
"""The migration arm's balancing, eager (the fleet benchmark's eager setting as far as the
router's flags go; patience and moves at once stay at their defaults): the real router's flags
and the simulated balancer both come from it."""
MIGRATION_ARGS = (
    "--balance",
    *(f for key, value in EAGER.items() for f in (f"--{key.replace('_', '-')}", f"{value:g}")),
)
SMOLLM2_KV_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 2
"""SmolLM2-135M's KV per token in bf16: 30 layers, 3 KV heads of 64, keys and values."""
KV_GBPS = 1.0
"""KV bandwidth between the two CPU engines in the simulated migration arm (loopback, mutual TLS)."""
MAX_PROMPT = 1536
Trace = list[tuple[float, int, int]]


def draw_trace(rate: float, requests: int, seed: int, prompt_median: float, output_median: float) -> Trace:
    """(arrival s, prompt tokens, output tokens) per request: Poisson arrivals, lognormal lengths."""
    rng = random.Random(seed)
    now, out = 0.0, []
    for _ in range(requests):
        now += rng.expovariate(rate)
        prompt = min(MAX_PROMPT, max(8, round(rng.lognormvariate(math.log(prompt_median), 1.0))))
        output = max(2, round(rng.lognormvariate(math.log(output_median), 0.7)))
        out.append((now, prompt, min(output, stepfit.MAX_MODEL_LEN - prompt - 1)))
    return out


# ---- the real fleet ----------------------------------------------------------------------------


async def replay(url: str, trace: Trace, seed: int, label: str) -> list[RequestResult]:
    rng = random.Random(seed + 7)
    low, high = TOKEN_ID_RANGE
    prompts = [[rng.randrange(low, high) for _ in range(p)] for _, p, _ in trace]
    return await send_trace(
        url, [(a, prompt, o) for (a, _, o), prompt in zip(trace, prompts, strict=True)], label
    )


async def _stamps(client: httpx.AsyncClient, url: str, prompt: list[int], tokens: int) -> list[float]:
    """When each token of one streamed completion arrived."""
    stamps = []
    async with client.stream("POST", url, json=completion_body(prompt, tokens)) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            payload = sse_payloads(line)
            if payload and payload.get("choices"):
                stamps.append(time.perf_counter())
    return stamps


async def calibrate(url: str, seed: int) -> list[dict[str, float]]:
    """Steps as served. First each prompt of ``PREFILL_CALIBRATION`` alone on the idle fleet
    (the median time to its first token at the client, over three); then each decode batch of
    ``CALIBRATION``: every engine decodes the same batch at once (least-load spreads the streams
    evenly), timed as the gaps between tokens at the client while every stream runs."""
    rng = random.Random(seed + 11)
    low, high = TOKEN_ID_RANGE
    rows: list[dict[str, float]] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=CLIENT_LIMITS) as client:
        for prompt in PREFILL_CALIBRATION:
            ttfts = []
            for _ in range(3):
                sent = time.perf_counter()
                stamps = await _stamps(client, url, [rng.randrange(low, high) for _ in range(prompt)], 2)
                ttfts.append((stamps[0] - sent) * 1000)
            rows.append({"prompt": prompt, "ttft_ms": statistics.median(ttfts)})
            say(f"  calibration: {prompt} prompt tokens alone, first token in {rows[-1]['ttft_ms']:.1f} ms")
        for per_engine, context in CALIBRATION:
            prompts = [
                [rng.randrange(low, high) for _ in range(context)] for _ in range(ENGINES * per_engine)
            ]
            streams = await asyncio.gather(*(_stamps(client, url, p, CALIBRATION_TOKENS) for p in prompts))
            start, end = max(s[0] for s in streams), min(s[-1] for s in streams)
            gaps = [b - a for s in streams for a, b in itertools.pairwise(s) if a >= start and b <= end]
            if len(gaps) < 8:
                raise RuntimeError(f"calibration {per_engine} x {context}: the streams barely overlapped")
            gap_ms = statistics.median(gaps) * 1000
            rows.append({"per_engine": per_engine, "context": context, "gap_ms": gap_ms})
            say(f"  calibration: {per_engine} x {context} tokens per engine, {gap_ms:.1f} ms a step")
    return rows


def served(model: StepModel, calibration: list[dict[str, float]]) -> StepModel:
    """``model`` (steps timed alone) plus what serving adds, fit to the calibration: per step
    and per request that gets a token, from the decode batches (the engine service's own
    process, the router and the client share the machine's cores with the engines' steps); per
    prompt and per prompt token, from the prompts alone (the way to the engine and the first
    token's way back)."""
    import numpy as np

    def line(points: list[tuple[float, float]]) -> tuple[float, float]:
        """Intercept and slope of the least-squares line through ``points``."""
        (intercept, slope), *_ = np.linalg.lstsq(
            np.array([[1.0, x] for x, _ in points]), np.array([y for _, y in points]), rcond=None
        )
        return float(intercept), float(slope)

    decode = []
    for row in calibration:
        if "gap_ms" in row:
            requests, context = int(row["per_engine"]), int(row["context"]) + CALIBRATION_TOKENS // 2
            decode.append((float(requests), row["gap_ms"] - model.step_ms(requests, [], requests * context)))
    per_step, per_request = line(decode)
    stepped = dataclasses.replace(
        model, base_ms=model.base_ms + per_step, decode_ms=model.decode_ms + per_request
    )
    prompts = [
        (row["prompt"], row["ttft_ms"] - stepped.step_ms(0, [(int(row["prompt"]), 0)], 0))
        for row in calibration
        if "ttft_ms" in row
    ]
    per_prompt, per_token = line(prompts) if len(prompts) >= 2 else (0.0, 0.0)
    return dataclasses.replace(
        stepped,
        name="served",
        chunk_ms=model.chunk_ms + per_prompt,
        prefill_ms=model.prefill_ms + per_token,
        source=f"{model.source}, plus {per_step:.2f} ms per step, {per_request:.2f} ms per request "
        f"decoding, {per_prompt:.2f} ms per prompt and {per_token * 1000:.1f} us per prompt token served",
    )


def balance_moves(base_url: str) -> dict[str, float]:
    """The router's balancing migrations so far, by outcome (``MIGRATED``, ``REFUSED``, ...)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base_url + "/metrics", timeout=10.0).text
    moves: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "shoal_router_balance_migrations":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    moves[sample.labels["outcome"]] = sample.value
    return moves


@dataclass
class RealRun:
    calibration: list[dict[str, float]] = field(default_factory=list)
    by_rate: dict[float, dict[str, list[float]]] = field(default_factory=dict)
    moves: dict[float, dict[str, float]] = field(default_factory=dict)
    """Balancing migrations during each rate's trace, by outcome."""


def run_real(
    args: argparse.Namespace, traces: dict[float, Trace], dtype: str, router_args: tuple[str, ...] = ()
) -> RealRun:
    """The traces through the real fleet (its router started with ``router_args``); the
    calibration batches first when the router does not balance."""
    cfg = FleetConfig(
        model_path=stepfit.MODEL,
        served_model_name=MODEL_NAME,
        run_dir=ROOT / ".cache" / "bench" / "simcheck",
        engines=ENGINES,
        cluster="bench-simcheck",
        dtype=dtype,
        enforce_eager=True,
        router_args=router_args,
        **FLEET_PORTS,
    )
    fleet = RealFleet(cfg, say=lambda line: say("  " + line.strip()))
    out = RealRun()
    try:
        fleet.start()
        fleet.wait_ready(600.0)
        url = cfg.base_url + "/v1/completions"
        warm = draw_trace(4.0, 8, args.seed + 99, 64, 8)
        asyncio.run(replay(url, warm, args.seed + 99, "warm-up"))
        if not router_args:
            out.calibration = asyncio.run(calibrate(url, args.seed))
        label = "real, migration" if router_args else "real"
        for rate, trace in traces.items():
            before = balance_moves(cfg.base_url)
            results = asyncio.run(replay(url, trace, args.seed, f"{label}, {rate:g} req/s"))
            after = balance_moves(cfg.base_url)
            failed = [r for r in results if not r.ok]
            if failed:
                raise RuntimeError(f"{len(failed)} request(s) failed at {rate:g} req/s: {failed[0].error}")
            out.by_rate[rate] = {
                "ttft": [(r.ttft_ms or 0.0) / 1000 for r in results],
                "decode": [(r.tpot_ms or 0.0) / 1000 for r in results if r.tpot_ms is not None],
            }
            out.moves[rate] = {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}
    finally:
        fleet.stop()
    return out


# ---- the simulated fleet -----------------------------------------------------------------------


def run_sim(
    model: StepModel, settings: dict[str, Any], trace: Trace, migrate: bool = False
) -> dict[str, Any]:
    router = RouterConfig()
    sim = SimConfig(
        model=model.name,
        step=model,
        kv_blocks=settings["kv_blocks"],
        block_size=stepfit.BLOCK,
        max_num_seqs=settings["max_num_seqs"],
        max_batched_tokens=settings["max_num_batched_tokens"],
        max_model_len=stepfit.MAX_MODEL_LEN,
    )
    fleet = Fleet(
        engines=ENGINES,
        sim=sim,
        scheduler=router.scheduler,
        hold=HoldPolicy(router.hold_below, router.hold_max_s) if router.hold_max_s > 0 else None,
        migrate=migrate,
        balance=BalancePolicy(threshold=EAGER["balance_threshold"], cooldown_s=EAGER["balance_cooldown_s"]),
        balance_interval_s=EAGER["balance_interval_s"],
        kv_bandwidth_gbps=KV_GBPS,
        block_bytes=stepfit.BLOCK * SMOLLM2_KV_BYTES_PER_TOKEN,
    )
    result = Simulation(fleet, Workload.replay(trace)).run()
    return {"ttft": result.ttft, "decode": result.decode, "migrations": result.migrations}


# ---- the comparison ----------------------------------------------------------------------------


def compare(real: dict[str, list[float]], sim: dict[str, list[float]]) -> dict[str, float]:
    row: dict[str, float] = {}
    for measure in ("ttft", "decode"):
        for q in (50, 99):
            a, b = quantile(real[measure], q / 100), quantile(sim[measure], q / 100)
            row[f"real_{measure}_p{q}"], row[f"sim_{measure}_p{q}"] = a, b
            row[f"{measure}_p{q}_error"] = b / a - 1.0
    return row


def plot(rows: dict[float, dict[str, float]]) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9.0, 3.8))
    rates = sorted(rows)
    for ax, (measure, unit, scale) in zip(axes, (("ttft", "s", 1.0), ("decode", "ms", 1000.0)), strict=True):
        for q, style in ((50, "--"), (99, "-")):
            ax.plot(
                rates,
                [rows[r][f"real_{measure}_p{q}"] * scale for r in rates],
                style,
                marker="o",
                label=f"real p{q}",
            )
            ax.plot(
                rates,
                [rows[r][f"sim_{measure}_p{q}"] * scale for r in rates],
                style,
                marker="x",
                label=f"simulated p{q}",
            )
        ax.set_xlabel("requests/s")
        ax.set_ylabel(f"{'TTFT' if measure == 'ttft' else 'decode, per token'} ({unit})")
        ax.legend(fontsize=8)
    fig.suptitle("Two SmolLM2 engines, one core each: the real fleet and its simulation, one trace")
    fig.tight_layout()
    save_plot(fig, IMG / "simcheck.png")


def _migration_table(
    rows: dict[float, dict[str, float]], migration: dict[float, dict[str, float]]
) -> list[str]:
    """Balancing against none, on the real fleet and in its simulation, per rate."""

    def arm(rate: float, who: str, measure: str, scale: float, unit: str) -> str:
        base, moved = rows[rate][f"{who}_{measure}_p99"], migration[rate][f"moved_{who}_{measure}_p99"]
        digits = 2 if unit == "s" else 0
        return f"{base * scale:.{digits}f} -> {moved * scale:.{digits}f} {unit} ({moved / base:.2f}x)"

    cells = []
    for rate in sorted(rows):
        m = migration[rate]
        cells.append(
            [
                f"{rate:g}",
                arm(rate, "real", "ttft", 1.0, "s"),
                arm(rate, "sim", "ttft", 1.0, "s"),
                arm(rate, "real", "decode", 1000.0, "ms"),
                arm(rate, "sim", "decode", 1000.0, "ms"),
                f"{m['real_moves']:.0f} ({m['real_refused']:.0f} not) / {m['sim_moves']:.0f}",
            ]
        )
    header = ["req/s", "TTFT p99, real", "TTFT p99, simulated", "decode p99, real", "decode p99, simulated",
              "moves: real (not moved) / simulated"]  # fmt: skip
    return table(header, "rrrrrr", cells)


def section(
    rows: dict[float, dict[str, float]],
    migration: dict[float, dict[str, float]],
    args: argparse.Namespace,
    model: StepModel,
    as_served: StepModel,
    minutes: float,
) -> str:
    def pct(value: float) -> str:
        return f"{value * 100:+.0f} %"

    cells = []
    for rate in sorted(rows):
        r = rows[rate]
        cells.append(
            [
                f"{rate:g}",
                f"{r['real_ttft_p50']:.2f} / {r['sim_ttft_p50']:.2f} s",
                f"{r['real_ttft_p99']:.2f} / {r['sim_ttft_p99']:.2f} s ({pct(r['ttft_p99_error'])})",
                f"{r['real_decode_p50'] * 1000:.0f} / {r['sim_decode_p50'] * 1000:.0f} ms",
                f"{r['real_decode_p99'] * 1000:.0f} / {r['sim_decode_p99'] * 1000:.0f} ms "
                f"({pct(r['decode_p99_error'])})",
                f"{pct(r['alone_ttft_p99_error'])}, {pct(r['alone_decode_p99_error'])}",
            ]
        )

    def worst(prefix: str) -> tuple[float, str, float]:
        return max(
            (abs(r[f"{prefix}{m}_p99_error"]), m, rate)
            for rate, r in rows.items()
            for m in ("ttft", "decode")
        )

    served_worst, alone_worst = worst(""), worst("alone_")
    names = {"ttft": "TTFT", "decode": "decode"}
    return "\n".join(
        [
            BEGIN,
            "## The fleet simulator against the real fleet",
            "",
            f"`make bench-simcheck` ({minutes:.0f} min): one trace per rate ({args.requests} requests, "
            f"Poisson arrivals, lognormal prompts of median {args.prompt_median} tokens and outputs of "
            f"median {args.output_median}, random token ids, seed {args.seed}) sent to the real fleet "
            "(two SmolLM2-135M-Instruct engines as `make run` starts them, one core each, the router's "
            "least-load dispatch and hold line, router, tokenizer, Redis and client on the same two "
            "cores) and replayed in the fleet simulator (two engines, the real engines' KV blocks, "
            "token budget and batch limits, the same dispatch and hold line). The simulated steps are "
            "the step model fit in the same run (`bench.stepfit`, steps timed alone) plus what serving "
            f"adds, fit to {len(PREFILL_CALIBRATION)} prompts alone and {len(CALIBRATION)} decode batches "
            f"timed through the real fleet before the traces ({as_served.base_ms - model.base_ms:+.1f} ms "
            f"per step, {as_served.decode_ms - model.decode_ms:+.2f} ms per request decoding, "
            f"{as_served.chunk_ms - model.chunk_ms:+.1f} ms per prompt, "
            f"{(as_served.prefill_ms - model.prefill_ms) * 1000:+.0f} us per prompt token). TTFT from "
            "send to first token at the client; decode is a request's mean time per token after its "
            "first. Real / simulated, the simulation's error in brackets; the last column is the P99 "
            f"errors of the steps-alone model. Target: P99s within {TARGET * 100:.0f} %.",
            "",
            stamp(),
            "",
            *table(
                ["req/s", "TTFT p50", "TTFT p99", "decode p50", "decode p99", "steps alone: P99 errors"],
                "rrrrrr",
                cells,
            ),
            "",
            f"Largest P99 error: {served_worst[0] * 100:.0f} % ({names[served_worst[1]]} at "
            f"{served_worst[2]:g} req/s), {'within' if served_worst[0] <= TARGET else 'outside'} the "
            f"target; with steps timed alone, {alone_worst[0] * 100:.0f} % ({names[alone_worst[1]]} at "
            f"{alone_worst[2]:g} req/s).",
            "",
            "![simulator against the real fleet](img/simcheck.png)",
            "",
            "Migration on the real fleet, and the simulator's verdict (issue 40, part 4): the same traces "
            f"with the router balancing (`{' '.join(MIGRATION_ARGS)}`), against the runs above; in the "
            f"simulation the same balancing, KV copied at {KV_GBPS:g} GB/s and each move charged its "
            "measured load on the target. Without -> with balancing (with over without):",
            "",
            *_migration_table(rows, migration),
            END,
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates", default="2,4,6", help="requests/s, comma-separated")
    parser.add_argument("--requests", type=int, default=300, help="requests per rate")
    parser.add_argument("--prompt-median", type=int, default=256)
    parser.add_argument("--output-median", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step-fit", type=Path, help="a saved bench.stepfit run, in place of measuring")
    parser.add_argument("--no-docs", action="store_true", help="print the results, leave the docs alone")
    args = parser.parse_args()
    if not stepfit.MODEL.exists():
        raise SystemExit(f"{stepfit.MODEL} is missing: run `make models` first")
    started = time.monotonic()
    dtype = native_dtype(cpu_flags())[0]
    if args.step_fit:
        payload = json.loads(args.step_fit.read_text())
    else:
        say("[1/3] fitting the step model on this machine (bench.stepfit's shapes)")
        fit_args = argparse.Namespace(repeats=3, steps=8, seed=args.seed, dtype=dtype, quick=False)
        payload = stepfit.run_measurement(fit_args)
    batches = stepfit.load_batches(payload)
    model = stepfit.fit(batches)
    say("  fit: " + ", ".join(f"{t}={getattr(model, t):.4g}" for t in stepfit.TERMS))
    rates = [float(r) for r in args.rates.split(",")]
    traces = {
        rate: draw_trace(rate, args.requests, args.seed + i, args.prompt_median, args.output_median)
        for i, rate in enumerate(rates)
    }
    say(f"[2/4] the real fleet: {len(rates)} rate(s), {args.requests} requests each")
    base = run_real(args, traces, dtype)
    as_served = served(model, base.calibration)
    say(f"  served: base_ms={as_served.base_ms:.4g}, decode_ms={as_served.decode_ms:.4g}")
    say(f"[3/4] the same traces, the real fleet balancing ({' '.join(MIGRATION_ARGS)})")
    moved = run_real(args, traces, dtype, MIGRATION_ARGS)
    say("[4/4] the same traces, simulated")
    rows, migration = {}, {}
    for rate in rates:
        rows[rate] = compare(base.by_rate[rate], run_sim(as_served, payload["settings"], traces[rate]))
        alone = compare(base.by_rate[rate], run_sim(model, payload["settings"], traces[rate]))
        rows[rate].update(
            {
                f"alone_{key}": value
                for key, value in alone.items()
                if key.startswith("sim_") or key.endswith("_error")
            }
        )
        sim_moved = run_sim(as_served, payload["settings"], traces[rate], migrate=True)
        migration[rate] = {
            **{f"moved_{k}": v for k, v in compare(moved.by_rate[rate], sim_moved).items()},
            "real_moves": moved.moves[rate].get("MIGRATED", 0.0),
            "real_refused": sum(v for k, v in moved.moves[rate].items() if k != "MIGRATED"),
            "sim_moves": sim_moved["migrations"],
        }
    for rate, r in rows.items():
        say(
            f"  {rate:g} req/s: TTFT p99 {r['real_ttft_p99']:.2f} real, {r['sim_ttft_p99']:.2f} simulated; "
            f"decode p99 {r['real_decode_p99'] * 1000:.0f} / {r['sim_decode_p99'] * 1000:.0f} ms"
        )
    save_results(
        "simcheck",
        {
            "fit": payload,
            "model": dataclasses.asdict(model),
            "served": dataclasses.asdict(as_served),
            "calibration": base.calibration,
            "traces": traces,
            "real": base.by_rate,
            "real_migration": moved.by_rate,
            "real_moves": moved.moves,
            "rows": rows,
            "migration": migration,
        },
    )
    if not args.no_docs:
        plot(rows)
    minutes = (time.monotonic() - started) / 60
    publish(section(rows, migration, args, model, as_served, minutes), BEGIN, END, print_only=args.no_docs)


if __name__ == "__main__":
    main()
