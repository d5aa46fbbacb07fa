"""Consolidation benchmark: how many engines a lightly loaded fleet can hand to a scale-down, and
what packing their requests onto the others costs in latency, on simulated engines.

Method
------
The fleet benchmark's engines and workload (``bench.fleet``: LLaMA-2-7B on A10s, Poisson
arrivals, ShareGPT-shaped lengths) on 16 engines at rates from light to the fleet benchmark's
sustained range. Each rate runs twice with the same requests: least-load dispatch with balancing
migrations, then the same with consolidation (``BalancePolicy.consolidate_below``): the leader
marks the lightest engine emptying while the model's load over the engines left stays below the
mark, dispatch skips it, and its requests move to the fullest engines with room; above
``consolidate_release`` it goes back to dispatch.

"Empty engines" is the mean number of engines holding no request over the second half of the
arrival window, as their load reports say: what a scale-down could remove without moving
anything (the operator removes the least-loaded engines first). Results go between
``<!-- consolidate:begin -->`` and ``<!-- consolidate:end -->`` of ``docs/benchmarks.md``, the plot
to ``docs/img/consolidate.png``. Run it with ``python -m bench.consolidate`` (``make bench-consolidate``).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench.fleet import SIM, add_simulation_args, simulated_fleet
from bench.harness import IMG, publish, pyplot, save_plot, stamp, table
from shoal_sim.engine import STEP_MODELS
from shoal_sim.fleet import Simulation, Workload

BEGIN, END = "<!-- consolidate:begin -->", "<!-- consolidate:end -->"


def run(args: argparse.Namespace, rate: float, consolidate: bool) -> dict[str, Any]:
    fleet = simulated_fleet(
        args,
        args.engines,
        migrate=True,
        consolidate_below=args.below if consolidate else 0.0,
        consolidate_release=args.release,
    )
    started = time.monotonic()
    result = Simulation(fleet, Workload(rate=rate, requests=args.requests, seed=args.seed)).run()
    row: dict[str, Any] = {"rate": rate, "consolidate": consolidate, **result.summary()}
    row["sustained"] = row["steady_tokens_per_s"] >= 0.95 * row["offered_tokens_per_s"]
    print(
        f"  {rate:5.1f} req/s, {'consolidating' if consolidate else 'balancing only':<14} "
        f"empty engines {row['empty_engines']:5.2f}, TTFT p99 {row['ttft_p99_s']:6.2f} s, decode p50 "
        f"{row['decode_p50_ms']:5.1f} ms p99 {row['decode_p99_ms']:5.1f} ms, {row['migrations']:>5} moves "
        f"({time.monotonic() - started:.0f} s)",
        flush=True,
    )
    return row


def plot(rows: list[dict[str, Any]]) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for consolidate, label in ((False, "balancing only"), (True, "consolidating")):
        mine = [r for r in rows if r["consolidate"] == consolidate]
        rates = [r["rate"] for r in mine]
        left.plot(rates, [r["empty_engines"] for r in mine], marker="o", label=label)
        right.plot(rates, [r["decode_p99_ms"] for r in mine], marker="o", label=label)
    left.set(xlabel="requests/s", ylabel="engines holding no request (mean)", title="Engines freed")
    right.set(xlabel="requests/s", ylabel="ms", title="Decode latency p99")
    for axes in (left, right):
        axes.grid(alpha=0.3)
        axes.legend()
    fig.tight_layout()
    save_plot(fig, IMG / "consolidate.png")


def _cells(r: dict[str, Any]) -> list[str]:
    return [
        f"{r['rate']:g}", "consolidating" if r["consolidate"] else "balancing only",
        f"{r['empty_engines']:.2f}", f"{r['ttft_p50_s']:.2f}", f"{r['ttft_p99_s']:.2f}",
        f"{r['decode_p50_ms']:.1f}", f"{r['decode_p99_ms']:.1f}", f"{r['preemptions']:,}",
        f"{r['migrations']:,}", "yes" if r["sustained"] else "no",
    ]  # fmt: skip


def section(args: argparse.Namespace, rows: list[dict[str, Any]]) -> str:
    model = STEP_MODELS[SIM.model]
    lines = [
        BEGIN,
        "## Consolidation: engines freed for a scale-down, and what packing costs",
        "",
        f"`make bench-consolidate`: {args.engines} simulated engines ({model.name}, "
        f"{SIM.kv_blocks:,} KV blocks, {SIM.max_num_seqs} batch slots), {args.requests:,} requests "
        f"per run, seed {args.seed}; least-load dispatch and balancing as in the fleet benchmark, "
        f"alone and with consolidation (mark below {args.below} of the load over the engines left, "
        f"give back above {args.release}). Empty engines: the mean number holding no request over "
        "the second half of the run.",
        "",
        "![engines freed and decode latency against rate](img/consolidate.png)",
        "",
        stamp(),
        "",
    ]
    header = [
        "req/s", "policy", "empty engines", "TTFT p50 (s)", "TTFT p99 (s)", "decode p50 (ms)",
        "decode p99 (ms)", "preemptions", "moves", "sustained",
    ]  # fmt: skip
    lines += table(header, "r-rrrrrrr-", (_cells(r) for r in rows))
    lines.append(END)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", type=int, default=16)
    parser.add_argument("--rates", default="2,4,8,12,16,20", help="arrival rates swept, requests/s in all")
    parser.add_argument("--requests", type=int, default=3000, help="requests per run")
    parser.add_argument("--below", type=float, default=0.4, help="consolidate_below")
    parser.add_argument("--release", type=float, default=0.7, help="consolidate_release")
    add_simulation_args(parser)
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    rows = []
    for i, rate in enumerate(rates):
        print(f"  [{i + 1}/{len(rates)}] {args.engines} engines at {rate} req/s", flush=True)
        for consolidate in (False, True):
            rows.append(run(args, rate, consolidate))
    if not args.no_docs:
        plot(rows)
    publish(section(args, rows), BEGIN, END, print_only=args.no_docs)


if __name__ == "__main__":
    main()
