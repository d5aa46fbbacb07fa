"""Priority benchmark: how much faster priority requests decode when engines keep KV headroom
for them (Llumnix's virtual usage) and migrations move other requests away, on simulated engines.

Method
------
The fleet benchmark's engines and workload (``bench.fleet``) on 16 engines, with a share of
the requests marked as priority requests (priority below 0). Each rate runs twice with the same
requests, both with least-load dispatch and balancing migrations: once with no headroom (every
request alike), once with each engine counting ``--headroom`` of its KV cache as used per
priority request it holds. Dispatch then sends such an engine fewer requests and balancing moves
its other requests (never the priority one first) to freer engines, so priority requests decode
in smaller batches. The cost lands on the other requests. Results go between
``<!-- priority:begin -->`` and ``<!-- priority:end -->`` of ``docs/benchmarks.md``, the plot to
``docs/img/priority.png``. Run it with ``python -m bench.priority`` (``make bench-priority``).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench.fleet import SIM, add_simulation_args, simulated_fleet
from bench.harness import IMG, publish, pyplot, save_plot, stamp, table
from shoal_sim.engine import STEP_MODELS
from shoal_sim.fleet import Simulation, Workload

BEGIN, END = "<!-- priority:begin -->", "<!-- priority:end -->"


def run(args: argparse.Namespace, rate: float, headroom: float) -> dict[str, Any]:
    fleet = simulated_fleet(args, args.engines, migrate=True, priority_headroom=headroom)
    workload = Workload(rate=rate, requests=args.requests, seed=args.seed, priority_share=args.share)
    started = time.monotonic()
    row: dict[str, Any] = {"rate": rate, "headroom": headroom, **Simulation(fleet, workload).run().summary()}
    print(
        f"  {rate:5.1f} req/s, headroom {headroom:4.2f}: priority decode p50 "
        f"{row['priority_decode_p50_ms']:5.1f} ms p99 {row['priority_decode_p99_ms']:5.1f} ms; all "
        f"requests decode p50 {row['decode_p50_ms']:5.1f} ms, TTFT p99 {row['ttft_p99_s']:5.2f} s "
        f"({time.monotonic() - started:.0f} s)",
        flush=True,
    )
    return row


def plot(rows: list[dict[str, Any]]) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(figsize=(6, 4))
    for headroom in sorted({r["headroom"] for r in rows}):
        mine = [r for r in rows if r["headroom"] == headroom]
        rates = [r["rate"] for r in mine]
        label = f"headroom {headroom:g}"
        axes.plot(rates, [r["priority_decode_p50_ms"] for r in mine], marker="o", label=f"priority, {label}")
        axes.plot(
            rates, [r["decode_p50_ms"] for r in mine], marker="x", linestyle="--", label=f"all, {label}"
        )
    axes.set(xlabel="requests/s", ylabel="decode latency p50 (ms per token)", title="Priority requests")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    fig.tight_layout()
    save_plot(fig, IMG / "priority.png")


def _cells(r: dict[str, Any]) -> list[str]:
    return [
        f"{r['rate']:g}", f"{r['headroom']:g}", f"{r['priority_decode_p50_ms']:.1f}",
        f"{r['priority_decode_p99_ms']:.1f}", f"{r['priority_ttft_p99_s']:.2f}",
        f"{r['decode_p50_ms']:.1f}", f"{r['decode_p99_ms']:.1f}", f"{r['ttft_p99_s']:.2f}",
        f"{r['migrations']:,}",
    ]  # fmt: skip


def section(args: argparse.Namespace, rows: list[dict[str, Any]]) -> str:
    model = STEP_MODELS[SIM.model]
    lines = [
        BEGIN,
        "## Priority requests: KV headroom and migrations that make room for them",
        "",
        f"`make bench-priority`: {args.engines} simulated engines ({model.name}, {SIM.kv_blocks:,} KV "
        f"blocks), {args.requests:,} requests per run of which {args.share:.0%} are priority requests, "
        f"seed {args.seed}; least-load dispatch and balancing migrations as in the fleet benchmark, "
        f"without headroom and with {args.headroom:g} of an engine's KV cache counted as used per "
        "priority request it holds.",
        "",
        "![decode latency of priority requests against rate](img/priority.png)",
        "",
        stamp(),
        "",
    ]
    header = [
        "req/s", "headroom", "priority decode p50 (ms)", "priority decode p99 (ms)", "priority TTFT p99 (s)",
        "all decode p50 (ms)", "all decode p99 (ms)", "all TTFT p99 (s)", "moves",
    ]  # fmt: skip
    lines += table(header, "rrrrrrrrr", (_cells(r) for r in rows))
    lines.append(END)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", type=int, default=16)
    parser.add_argument("--rates", default="8,16,24", help="arrival rates swept, requests/s in all")
    parser.add_argument("--requests", type=int, default=4000, help="requests per run")
    parser.add_argument("--share", type=float, default=0.05, help="share of priority requests")
    parser.add_argument("--headroom", type=float, default=0.25, help="KV fraction per priority request")
    add_simulation_args(parser)
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    rows = []
    for i, rate in enumerate(rates):
        print(f"  [{i + 1}/{len(rates)}] {args.engines} engines at {rate} req/s", flush=True)
        for headroom in (0.0, args.headroom):
            rows.append(run(args, rate, headroom))
    if not args.no_docs:
        plot(rows)
    publish(section(args, rows), BEGIN, END, print_only=args.no_docs)


if __name__ == "__main__":
    main()
