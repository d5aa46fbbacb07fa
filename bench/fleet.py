"""Fleet benchmark: round-robin vs least-load, with migration and holding, on simulated engines.

Method
------
Llumnix's experiment (OSDI'24) on Shoal's own code, at fleet sizes one machine cannot run for
real: ``shoal_sim.fleet`` runs engines as the simulated engine's ``SimBatch`` (batch, KV
blocks, recompute preemption, step-time model) on simulated time, dispatch as the router's
``Scheduler`` over its ``EngineView`` objects fed 100 ms load reports, and balancing as the
router's ``Balancer`` with moves timed by the migration protocol's stages (see the module), and
the router's hold line (``core.hold``) released at each load report.

Engines model LLaMA-2-7B in fp16 on an A10-24GB (``llama2-7b-a10``: a roofline step-time
estimate; 1,024 KV blocks of 16 tokens, about what the card holds beside the weights), KV moved
at ``--kv-gbps``. Requests arrive as a Poisson process; prompt and output lengths are lognormal
(heavy-tailed, ShareGPT's shape; the table lists the drawn percentiles). For each rate the four
policies get the same requests:

* ``round_robin``: the router's ``round_robin`` profile;
* ``least_load``: the ``least_load`` profile (Llumnix's freeness);
* ``least_load+migration``: the same, with the ``Balancer`` moving running requests;
* ``least_load+migration+hold``: the same, with new requests held at the router while every
  engine is short of KV (``--hold-below`` blocks per batch slot, at most ``--hold-max`` seconds),
  as the router does by default.

TTFT is arrival to first token; decode latency is a request's mean time per output token after
the first; preemption loss is the time preempted requests spent between being preempted and
their next token. The highest sustained rate is the highest swept rate at which the last policy
delivers, over the second half of the arrival window, at least 95% of the output
tokens per second the requests ask for (past it, requests queue without bound). The same rate
per engine then runs on 64 and 256 engines.

Results go between ``<!-- fleet:begin -->`` and ``<!-- fleet:end -->`` of ``docs/benchmarks.md``,
plots to ``docs/img/fleet_*.png``. Run it with ``python -m bench.fleet`` (``make bench-fleet``).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench.harness import IMG, publish, pyplot, quantile, save_plot, stamp, table
from shoal_router.core.hold import HoldPolicy
from shoal_router.core.rebalance import BalancePolicy
from shoal_sim.engine import STEP_MODELS, SimConfig
from shoal_sim.fleet import Fleet, Result, Simulation, Workload

BEGIN, END = "<!-- fleet:begin -->", "<!-- fleet:end -->"
POLICIES = {  # name: (scheduler, migration, hold)
    "round_robin": ("round_robin", False, False),
    "least_load": ("least_load", False, False),
    "least_load+migration": ("least_load", True, False),
    "least_load+migration+hold": ("least_load", True, True),
}
FULL = "least_load+migration+hold"
"""Shoal's policy: the one the targets and the highest sustained rate are read from."""
SIM = SimConfig(
    model="llama2-7b-a10", kv_blocks=1024, max_num_seqs=256, max_batched_tokens=4096, max_model_len=4096
)


def add_simulation_args(parser: argparse.ArgumentParser) -> None:
    """The options every simulated-fleet benchmark shares: seed, KV bandwidth, balancing."""
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-gbps", type=float, default=8.0, help="KV bandwidth between engines, GB/s")
    parser.add_argument("--balance-interval", type=float, default=0.2)
    parser.add_argument("--balance-threshold", type=float, default=0.01)
    parser.add_argument("--balance-patience", type=int, default=1)
    parser.add_argument("--balance-cooldown", type=float, default=1.0)
    parser.add_argument("--balance-max-concurrent", type=int, default=8)
    parser.add_argument("--no-docs", action="store_true", help="print only; leave docs/benchmarks.md")


def simulated_fleet(args: argparse.Namespace, engines: int, **fleet: Any) -> Fleet:
    """``engines`` engines of ``SIM`` balanced as ``args`` say; ``fleet`` sets other ``Fleet``
    fields, and ``consolidate_below`` / ``consolidate_release`` go to the balancing policy."""
    policy = {key: fleet.pop(key) for key in ("consolidate_below", "consolidate_release") if key in fleet}
    return Fleet(
        engines=engines,
        sim=SIM,
        balance=BalancePolicy(
            threshold=args.balance_threshold,
            patience=args.balance_patience,
            cooldown_s=args.balance_cooldown,
            max_concurrent=args.balance_max_concurrent,
            **policy,
        ),
        balance_interval_s=args.balance_interval,
        kv_bandwidth_gbps=args.kv_gbps,
        **fleet,
    )


def run(args: argparse.Namespace, engines: int, rate: float, requests: int, policy: str) -> dict[str, Any]:
    scheduler, migrate, hold = POLICIES[policy]
    held = HoldPolicy(args.hold_below, args.hold_max) if hold else None
    fleet = simulated_fleet(args, engines, scheduler=scheduler, migrate=migrate, hold=held)
    workload = Workload(rate=rate, requests=requests, seed=args.seed)
    step = max(1, requests // 4)

    def progress(done: int) -> None:
        if done % step == 0 and done < requests:
            print(f"      {done:,}/{requests:,} requests done", flush=True)

    started = time.monotonic()
    result: Result = Simulation(fleet, workload, progress).run()
    row: dict[str, Any] = {"engines": engines, "rate": rate, "policy": policy, **result.summary()}
    row["sustained"] = row["steady_tokens_per_s"] >= 0.95 * row["offered_tokens_per_s"]
    row["wall_s"] = time.monotonic() - started
    print(
        f"  {engines:>3} engines, {rate:6.1f} req/s, {policy:<21} TTFT p99 {row['ttft_p99_s']:7.2f} s, "
        f"decode p99 {row['decode_p99_ms']:6.1f} ms, preemptions {row['preemptions']:>5}, "
        f"{row['steady_tokens_per_s']:6.0f}/{row['offered_tokens_per_s']:.0f} tok/s, "
        f"{row['migrations']:>5} moves, {row['held']:>5} held ({row['wall_s']:.0f} s)",
        flush=True,
    )
    return row


def sweep(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rows = []
    rates = [float(r) for r in args.rates.split(",")]
    total = len(rates) * len(POLICIES)
    for i, rate in enumerate(rates):
        for j, policy in enumerate(POLICIES):
            print(f"  [{i * len(POLICIES) + j + 1}/{total}] {args.engines} engines at {rate} req/s, {policy}")
            rows.append(run(args, args.engines, rate, args.requests, policy))
    sustained = [r["rate"] for r in rows if r["policy"] == FULL and r["sustained"]]
    scale_rows = []
    if sustained and args.scale:
        per_engine = max(sustained) / args.engines
        for engines in (int(e) for e in args.scale.split(",")):
            requests = args.requests * engines // args.engines
            for policy in POLICIES:
                print(f"  {engines} engines at {per_engine * engines:.0f} req/s, {policy}")
                scale_rows.append(run(args, engines, per_engine * engines, requests, policy))
    return rows, scale_rows


def plots(rows: list[dict[str, Any]], engines: int) -> None:
    plt = pyplot()
    metrics = [
        ("ttft_p99_s", "TTFT p99 (s)", True),
        ("decode_p99_ms", "decode latency p99 (ms per token)", False),
        ("preemptions", "preemptions", False),
        ("steady_tokens_per_s", "output tokens/s delivered (steady)", False),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, label, log) in zip(axes.flat, metrics, strict=True):
        for policy, marker in zip(POLICIES, "os^D", strict=True):
            points = [r for r in rows if r["policy"] == policy]
            ax.plot([r["rate"] for r in points], [r[key] for r in points], f"{marker}-", label=policy)
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes.flat[0].legend()
    fig.suptitle(f"{engines} simulated engines (LLaMA-2-7B on A10), Poisson arrivals, ShareGPT-like lengths")
    fig.tight_layout()
    save_plot(fig, IMG / "fleet_policies.png")


HEADER = [
    "engines", "req/s", "policy", "TTFT p50 (s)", "TTFT p99 (s)", "decode p50 (ms)", "decode p99 (ms)",
    "preemptions", "preemption loss (s)", "tokens/s delivered / asked", "moves", "held", "held p99 (s)",
    "sustained",
]  # fmt: skip


def _cells(r: dict[str, Any]) -> list[str]:
    return [
        str(r["engines"]), f"{r['rate']:.1f}", r["policy"],
        f"{r['ttft_p50_s']:.2f}", f"{r['ttft_p99_s']:.2f}",
        f"{r['decode_p50_ms']:.1f}", f"{r['decode_p99_ms']:.1f}",
        f"{r['preemptions']:,}", f"{r['preemption_loss_s']:.0f}",
        f"{r['steady_tokens_per_s']:,.0f} / {r['offered_tokens_per_s']:,.0f}",
        f"{r['migrations']:,}", f"{r['held']:,}", f"{r['held_p99_s']:.2f}",
        "yes" if r["sustained"] else "no",
    ]  # fmt: skip


def _policies_table(rows: list[dict[str, Any]]) -> list[str]:
    return table(HEADER, "rr-rrrrrrrrrr-", (_cells(r) for r in rows))


def _target_cells(engines: int, rate: float, at: dict[str, dict[str, Any]]) -> list[str]:
    rr, full = at["round_robin"], at[FULL]

    def each(key: str, digits: int) -> str:
        return " / ".join(f"{at[policy][key]:.{digits}f}" for policy in POLICIES)

    def ratio(key: str) -> str:
        return f"{rr[key] / full[key]:.1f}x" if full[key] else "all"

    loss = rr["preemption_loss_s"]
    cut = f"{1 - full['preemption_loss_s'] / loss:.0%}" if loss else "none to cut"
    return [
        str(engines), f"{rate:g}", each("ttft_p99_s", 2), ratio("ttft_p99_s"), each("decode_p99_ms", 1),
        ratio("decode_p99_ms"), each("preemption_loss_s", 0), cut,
    ]  # fmt: skip


def _targets(rows: list[dict[str, Any]], scale_rows: list[dict[str, Any]]) -> list[str]:
    sustained = [r["rate"] for r in rows if r["policy"] == FULL and r["sustained"]]
    if not sustained:
        return ["No swept rate was sustained; no target row."]
    rate = max(sustained)
    points = [(rows[0]["engines"], rate), *sorted({(r["engines"], r["rate"]) for r in scale_rows})]
    lines = [
        f"Targets at {rate:.1f} req/s, the highest swept rate least-load plus migration and holding "
        f"sustains on {rows[0]['engines']} engines, and at the same rate per engine on larger fleets; "
        "each cell reads round-robin / least-load / least-load + migration / least-load + migration "
        "+ holding, and the cut is round-robin's against the last one's:",
        "",
    ]
    cells = []
    for engines, at_rate in points:
        at = {r["policy"]: r for r in rows + scale_rows if (r["engines"], r["rate"]) == (engines, at_rate)}
        cells.append(_target_cells(engines, at_rate, at))
    header = [
        "engines", "req/s", "TTFT p99 (s)", "cut (target 10x)", "decode p99 (ms)", "cut (target 1.5x)",
        "preemption loss (s)", "cut (target 70%)",
    ]  # fmt: skip
    return lines + table(header, "rrrrrrrr", cells)


def section(args: argparse.Namespace, rows: list[dict[str, Any]], scale_rows: list[dict[str, Any]]) -> str:
    draw = Workload(rate=1.0, requests=20_000, seed=args.seed).draw()
    prompts = sorted(p for _, p, _ in draw)
    outputs = sorted(o for _, _, o in draw)

    model = STEP_MODELS[SIM.model]

    def pct(values: list[int], q: float) -> str:
        return f"{quantile(values, q):.0f}"

    return "\n".join(
        [
            BEGIN,
            "## Fleet: dispatch and migration policies on simulated engines",
            "",
            f"`make bench-fleet`: {args.engines} simulated engines ({model.name}: {model.source}; "
            f"{SIM.kv_blocks:,} KV blocks of {SIM.block_size} tokens each), {args.requests:,} requests "
            f"per run, Poisson arrivals, seed {args.seed}. Dispatch, load reports and balancing are the "
            "router's own "
            "code on simulated time (`shoal_sim.fleet`); the four policies get the same requests. "
            f"Balancing: check every {args.balance_interval} s, threshold {args.balance_threshold}, "
            f"patience {args.balance_patience}, cooldown {args.balance_cooldown} s, at most "
            f"{args.balance_max_concurrent} moves at once; KV moves at {args.kv_gbps} GB/s. Holding: a new "
            f"request waits at the router while the engine it would go to has under {args.hold_below:g} "
            f"KV blocks per batch slot left, for {args.hold_max:g} s at most (held: requests that "
            "waited; held p99: the 99th percentile of every request's wait, most of them 0). Left out: the "
            "network between router and engines, the router's own CPU time and tokenization; engines "
            "prefill a long prompt in one step (vLLM would chunk it).",
            "",
            stamp(),
            "",
            f"Lengths drawn (tokens): prompt p50 {pct(prompts, 0.5)}, p90 {pct(prompts, 0.9)}, "
            f"p99 {pct(prompts, 0.99)}, mean {sum(prompts) / len(prompts):.0f}; "
            f"output p50 {pct(outputs, 0.5)}, "
            f"p90 {pct(outputs, 0.9)}, p99 {pct(outputs, 0.99)}, mean {sum(outputs) / len(outputs):.0f}.",
            "",
            "![policies against rate](img/fleet_policies.png)",
            "",
            *_targets(rows, scale_rows),
            "",
            *_policies_table(rows),
            "",
            f"The same rate per engine on larger fleets ({args.requests:,} requests per "
            f"{args.engines} engines):"
            if scale_rows
            else "",
            "",
            *(_policies_table(scale_rows) if scale_rows else []),
            END,
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", type=int, default=16)
    parser.add_argument("--rates", default="16,20,24,26,28,30", help="arrival rates swept, requests/s in all")
    parser.add_argument("--requests", type=int, default=6000, help="requests per run")
    parser.add_argument(
        "--scale", default="64,256", help="larger fleets run at the highest sustained rate per engine"
    )
    add_simulation_args(parser)
    parser.add_argument(
        "--hold-below", type=float, default=2.0, help="KV blocks per slot under which to hold"
    )
    parser.add_argument("--hold-max", type=float, default=1.0, help="longest hold, seconds")
    parser.add_argument(
        "--quick", action="store_true", help="a short run: 4 engines, 2 rates, no larger fleets"
    )
    args = parser.parse_args()
    if args.quick:
        args.engines, args.rates, args.requests, args.scale = 4, "5,6.5", 800, ""
    rows, scale_rows = sweep(args)
    if not args.no_docs:
        plots(rows, args.engines)
    publish(section(args, rows, scale_rows), BEGIN, END, print_only=args.no_docs)


if __name__ == "__main__":
    main()
