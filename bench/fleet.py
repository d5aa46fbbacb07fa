"""Fleet benchmark: least-load dispatch with and without the hold line and migration, simulated.

Method
------
Llumnix's question (OSDI'24: does live migration beat the best dispatch without it?) on Shoal's
own code, at a fleet size one machine cannot run for real: ``shoal_sim.fleet`` runs engines as
the simulated engine's ``SimBatch`` (vLLM's scheduler with chunked prefill, KV blocks,
recompute preemption, a step-time model) on simulated time, dispatch as the router's
``Scheduler`` over its ``EngineView`` objects fed 100 ms load reports, the router's hold line
(``core.hold``) and balancing as the router's ``Balancer``, with moves timed by the migration
protocol's stages and charged what clients of real moves see (``Fleet.move_load_ms``).

Engines model LLaMA-2-7B in fp16 on an A10-24GB (``llama2-7b-a10``: a roofline step-time
estimate, never checked on a GPU; 1,024 KV blocks of 16 tokens, about what the card holds
beside the weights), KV moved at ``--kv-gbps``. Every policy runs at the settings the router
ships (``RouterConfig``'s defaults), and gets the same requests:

* ``least_load``: the router's default dispatch, the hold line off;
* ``least_load+hold``: the same with the hold line, as the router ships (the baseline);
* ``+migration``: the same with balancing on, at the router's balancing defaults;
* ``+migration (eager)``: balancing every 0.2 s at threshold 0.01, patience 1, cooldown 1 s, 8
  moves at once (the settings this benchmark ran before it compared shipped settings).

Three workload shapes: ``sharegpt`` (Poisson arrivals, lognormal lengths of ShareGPT's shape),
``generated`` (Poisson, Pareto lengths with the same medians: Llumnix's generated heavy tails)
and ``bursty`` (ShareGPT's lengths, gamma-distributed gaps with a coefficient of variation of 2,
as BurstGPT fits real traces). Every swept rate runs ``--seeds`` seeds; each cell is the mean
over seeds with a 95 % t-interval. TTFT is arrival to first token, decode a request's mean time
per output token after its first, preemption loss the time preempted requests spent between
being preempted and their next token. A rate is sustained when every seed delivers, over the
second half of the arrival window, at least 95 % of the output tokens per second that the
requests arriving in it ask for; the knee of a shape is the highest rate the baseline sustains.

Results go between ``<!-- fleet:begin -->`` and ``<!-- fleet:end -->`` of ``docs/benchmarks.md``,
the plot to ``docs/img/fleet_policies.png``, every run's numbers to ``bench/results/``. Run it
with ``python -m bench.fleet`` (``make bench-fleet``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

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
from shoal_router.config import RouterConfig
from shoal_router.core.hold import HoldPolicy
from shoal_router.core.rebalance import BalancePolicy
from shoal_sim.engine import STEP_MODELS, SimConfig
from shoal_sim.fleet import Fleet, Simulation, Workload

BEGIN, END = "<!-- fleet:begin -->", "<!-- fleet:end -->"
SIM = SimConfig(
    model="llama2-7b-a10", kv_blocks=1024, max_num_seqs=256, max_batched_tokens=4096, max_model_len=4096
)
SHAPES: dict[str, dict[str, float]] = {
    "sharegpt": {},
    "generated": {"pareto_alpha": 1.5},
    "bursty": {"burstiness": 0.25},
}
RATES = {
    "sharegpt": "24,26,28,30,32",
    "generated": "14,16,18,20,22",
    "bursty": "22,24,26,28,30",
}
"""Requests/s swept per shape on 16 engines, around each shape's knee."""
BASELINE = "least_load+hold"
MIGRATION = "+migration"
EAGER = "+migration (eager)"
POLICIES = ("least_load", BASELINE, MIGRATION, EAGER)
MEASURES = (
    ("ttft_p99_s", "TTFT p99 (s)", 2),
    ("decode_p99_ms", "decode p99 (ms)", 1),
    ("preemption_loss_s", "preemption loss (s)", 0),
)
TARGETS = {"ttft_p99_s": 2.0, "decode_p99_ms": 1.3, "preemption_loss_s": 2.0}
"""Part 3's targets against the baseline at each shape's knee: P99 TTFT 2x better, P99 decode
1.3x, preemption loss halved."""


def add_simulation_args(parser: argparse.ArgumentParser) -> None:
    """The options the other simulated-fleet benchmarks share: seed, KV bandwidth, balancing
    (theirs move eagerly: every 0.2 s, threshold 0.01, patience 1, cooldown 1 s, 8 at once)."""
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


def policy_fleet(policy: str, engines: int, kv_gbps: float) -> Fleet:
    """The fleet ``policy`` names, at the router's shipped settings but for what it changes."""
    router = RouterConfig()
    hold = HoldPolicy(router.hold_below, router.hold_max_s) if policy != "least_load" else None
    shipped = BalancePolicy(threshold=router.balance_threshold, cooldown_s=router.balance_cooldown_s)
    eager = BalancePolicy(threshold=0.01, patience=1, cooldown_s=1.0, max_concurrent=8)
    return Fleet(
        engines=engines,
        sim=SIM,
        scheduler=router.scheduler,
        hold=hold,
        migrate=policy in (MIGRATION, EAGER),
        balance=eager if policy == EAGER else shipped,
        balance_interval_s=0.2 if policy == EAGER else router.balance_interval_s,
        kv_bandwidth_gbps=kv_gbps,
    )


@dataclass(frozen=True)
class Run:
    shape: str
    rate: float
    seed: int
    policy: str
    engines: int
    requests: int
    kv_gbps: float


def run(spec: Run) -> dict[str, Any]:
    """One simulation (in a worker process): its summary, with what it ran."""
    workload = Workload(rate=spec.rate, requests=spec.requests, seed=spec.seed, **SHAPES[spec.shape])
    started = time.monotonic()
    result = Simulation(policy_fleet(spec.policy, spec.engines, spec.kv_gbps), workload).run()
    row: dict[str, Any] = {**spec.__dict__, **result.summary()}
    row["sustained"] = row["steady_tokens_per_s"] >= 0.95 * row["asked_steady_tokens_per_s"]
    row["wall_s"] = time.monotonic() - started
    return row


def sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    specs = [
        Run(shape, float(rate), seed, policy, args.engines, args.requests, args.kv_gbps)
        for shape in args.shapes.split(",")
        for rate in (args.rates or RATES[shape]).split(",")
        for seed in range(args.seed, args.seed + args.seeds)
        for policy in POLICIES
    ]
    rows = []
    say(f"{len(specs)} simulations ({args.requests:,} requests each) on {args.workers} process(es)")
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        for i, row in enumerate(pool.map(run, specs), 1):
            rows.append(row)
            if i % len(POLICIES) == 0 and (i // len(POLICIES)) % args.seeds == 0:
                say(
                    f"  [{i}/{len(specs)}] {row['shape']} at {row['rate']:g} req/s, {args.seeds} seeds: "
                    f"{row['policy']} TTFT p99 {row['ttft_p99_s']:.2f} s (seed {row['seed']})"
                )
    return rows


# ---- statistics ---------------------------------------------------------------------------------

_T975 = {1: 12.71, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def interval(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95 % t-interval."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan
    return mean, _T975.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))


def cells(rows: list[dict[str, Any]]) -> dict[tuple[str, float, str], dict[str, Any]]:
    """Per (shape, rate, policy): each measure's mean and half-width, and whether every seed
    sustained the rate."""
    grouped: dict[tuple[str, float, str], list[dict[str, Any]]] = {}
    for row in rows:
        grouped.setdefault((row["shape"], row["rate"], row["policy"]), []).append(row)
    out = {}
    for key, runs in grouped.items():
        cell: dict[str, Any] = {"sustained": all(r["sustained"] for r in runs), "seeds": len(runs)}
        for measure in (*(m for m, _, _ in MEASURES), "decode_p50_ms"):
            cell[measure] = interval([float(r[measure]) for r in runs])
        cell["migrations"] = statistics.fmean(r["migrations"] for r in runs)
        out[key] = cell
    return out


def verdict(a: dict[str, Any], b: dict[str, Any]) -> str:
    """What ``a`` does against ``b`` (lower is better), measure by measure: ``+`` better beyond
    both intervals, ``-`` worse beyond them, ``=`` within them."""
    marks = []
    for measure, _, _ in MEASURES:
        (ma, ha), (mb, hb) = a[measure], b[measure]
        margin = (0.0 if math.isnan(ha) else ha) + (0.0 if math.isnan(hb) else hb)
        marks.append("+" if ma < mb - margin else "-" if ma > mb + margin else "=")
    return "".join(marks)


def knee(table_: dict[tuple[str, float, str], dict[str, Any]], shape: str) -> float | None:
    rates = sorted(rate for s, rate, policy in table_ if s == shape and policy == BASELINE)
    sustained = [rate for rate in rates if table_[(shape, rate, BASELINE)]["sustained"]]
    return max(sustained) if sustained else None


# ---- the report ---------------------------------------------------------------------------------


def plot(table_: dict[tuple[str, float, str], dict[str, Any]], shapes: list[str]) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(2, len(shapes), figsize=(4.2 * len(shapes), 7), squeeze=False)
    for column, shape in enumerate(shapes):
        for row, (measure, label, _) in enumerate(MEASURES[:2]):
            ax = axes[row][column]
            for policy, marker in zip(POLICIES, "os^D", strict=True):
                rates = sorted(r for s, r, p in table_ if s == shape and p == policy)
                means = [table_[(shape, r, policy)][measure][0] for r in rates]
                errors = [table_[(shape, r, policy)][measure][1] for r in rates]
                ax.errorbar(rates, means, yerr=errors, marker=marker, capsize=3, label=policy)
            if measure == "ttft_p99_s":
                ax.set_yscale("log")
                ax.set_title(shape)
            ax.set_xlabel("arrival rate (requests/s)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("16 simulated engines (LLaMA-2-7B on A10, roofline): mean and 95 % interval over seeds")
    fig.tight_layout()
    save_plot(fig, IMG / "fleet_policies.png")


def _mean(cell: dict[str, Any], measure: str, digits: int) -> str:
    mean, half = cell[measure]
    return f"{mean:.{digits}f}" if math.isnan(half) else f"{mean:.{digits}f}±{half:.{digits}f}"


def _shape_table(table_: dict[tuple[str, float, str], dict[str, Any]], shape: str) -> list[str]:
    header = ["req/s"]
    for _, label, _ in MEASURES:
        header.append(f"{label}: least-load / +hold / +migration / eager")
    header += ["migration vs +hold", "moves", "sustained"]
    rows = []
    for rate in sorted(r for s, r, p in table_ if s == shape and p == BASELINE):
        at = {policy: table_[(shape, rate, policy)] for policy in POLICIES}
        line = [f"{rate:g}"]
        for measure, _, digits in MEASURES:
            line.append(" / ".join(_mean(at[policy], measure, digits) for policy in POLICIES))
        line.append(f"{verdict(at[MIGRATION], at[BASELINE])}, eager {verdict(at[EAGER], at[BASELINE])}")
        line.append(f"{at[MIGRATION]['migrations']:.0f} / {at[EAGER]['migrations']:.0f}")
        line.append("yes" if at[BASELINE]["sustained"] else "no")
        rows.append(line)
    return table(header, "rrrrlrl", rows)


def ttft_floor(shape: str, rate: float, seeds: list[int], requests: int) -> float:
    """The mean over seeds of the P99 TTFT no policy can beat: each request's prompt computed
    alone the moment it arrives (its prefill steps on an idle engine)."""
    model, budget = STEP_MODELS[SIM.model], SIM.max_batched_tokens
    floors = []
    for seed in seeds:
        draw = Workload(rate=rate, requests=requests, seed=seed, **SHAPES[shape]).draw()
        alone = []
        for _, prompt, _ in draw:
            chunks = [(min(budget, prompt - done), done) for done in range(0, prompt, budget)]
            alone.append(sum(model.step_ms(0, [chunk], 0) for chunk in chunks) / 1000.0)
        floors.append(quantile(alone, 0.99))
    return statistics.fmean(floors)


def _targets(
    table_: dict[tuple[str, float, str], dict[str, Any]], shapes: list[str], args: argparse.Namespace
) -> list[str]:
    rows, met_shapes = [], 0
    seeds = list(range(args.seed, args.seed + args.seeds))
    for shape in shapes:
        rate = knee(table_, shape)
        if rate is None:
            rows.append([shape, "none sustained", *[""] * 7])
            continue
        base = table_[(shape, rate, BASELINE)]
        best = []
        for policy in (MIGRATION, EAGER):
            cell = table_[(shape, rate, policy)]
            gains = {m: base[m][0] / cell[m][0] if cell[m][0] else math.inf for m in TARGETS}
            best.append((all(gains[m] >= TARGETS[m] for m in TARGETS), policy, gains))
        met, policy, gains = max(best, key=lambda b: (b[0], min(b[2][m] / TARGETS[m] for m in TARGETS)))
        met_shapes += met
        floor = ttft_floor(shape, rate, seeds, args.requests)
        rows.append(
            [
                shape,
                f"{rate:g}",
                policy,
                *(f"{gains[m]:.2f}x" if gains[m] != math.inf else "all" for m in TARGETS),
                "met" if met else "not met",
                f"{floor:.2f} s: {base['ttft_p99_s'][0] / floor:.2f}x",
                f"{base['decode_p99_ms'][0] / base['decode_p50_ms'][0]:.2f}x",
            ]
        )
    header = ["shape", "knee (req/s)", "best migration", "TTFT p99 (target 2x)", "decode p99 (1.3x)",
              "preemption loss (2x)", "targets", "TTFT p99 floor: most any policy can cut",
              "decode p99 over p50"]  # fmt: skip
    return [
        *table(header, "lrlrrrlrr", rows),
        "",
        f"Targets met on {met_shapes} of {len(shapes)} shapes (part 3 asks for 2). The floor is the P99 "
        "TTFT of the same requests each computed alone on an idle engine the moment it arrives: no "
        "dispatch or migration can beat it, so the baseline's TTFT p99 over it bounds any policy's "
        "cut. Decode p99 over p50 is the baseline's spread: a policy that gave every request the "
        "median request's batches would cut the p99 by that much at most.",
    ]


def section(
    args: argparse.Namespace, table_: dict[tuple[str, float, str], dict[str, Any]], minutes: float
) -> str:
    shapes = args.shapes.split(",")
    model = STEP_MODELS[SIM.model]
    router = RouterConfig()
    lines = [
        BEGIN,
        "## Fleet: least-load, the hold line and migration on simulated engines",
        "",
        f"`make bench-fleet` ({minutes:.0f} min): {args.engines} simulated engines ({model.name}, a "
        f"roofline estimate never checked on a GPU; {SIM.kv_blocks:,} KV blocks of {SIM.block_size} "
        f"tokens, a token budget of {SIM.max_batched_tokens:,} per step, chunked prefill), "
        f"{args.requests:,} requests per run, {args.seeds} seeds per cell (mean ± 95 % t-interval). "
        "Dispatch, load reports, the hold line and balancing are the router's own code at its shipped "
        f"settings: least-load; hold below {router.hold_below:g} KV blocks per batch slot for "
        f"{router.hold_max_s:g} s at most; balancing every {router.balance_interval_s:g} s, threshold "
        f"{router.balance_threshold:g}, cooldown {router.balance_cooldown_s:g} s, patience and moves at "
        f"once {BalancePolicy().patience} and {BalancePolicy().max_concurrent}; 'eager' balances every "
        "0.2 s at threshold 0.01, patience 1, cooldown 1 s, 8 moves at once. A move is charged its "
        f"copies at {args.kv_gbps:g} GB/s and {Fleet().move_load_ms:g} ms of KV load on the target's "
        "first step (measured on CPU engines). Shapes: `sharegpt` (Poisson, lognormal lengths), "
        "`generated` (Poisson, Pareto lengths, index 1.5, same medians), `bursty` (ShareGPT lengths, "
        "gamma gaps with a coefficient of variation of 2). 'migration vs +hold' marks TTFT p99, decode "
        "p99 and preemption loss: `+` better beyond both intervals, `-` worse, `=` within them.",
        "",
        stamp(),
        "",
        "![policies against rate](img/fleet_policies.png)",
        "",
        "How far to trust the simulator: its CPU profile, fit to a real engine, against the real "
        "two-engine fleet on the same traces is in 'The fleet simulator against the real fleet' "
        "below; this A10 profile has no real counterpart here.",
        "",
        "At each shape's knee (the highest rate the baseline, least-load + hold, sustains on every "
        "seed), the better migration setting against the baseline:",
        "",
        *_targets(table_, shapes, args),
    ]
    for shape in shapes:
        lines += ["", f"`{shape}`:", "", *_shape_table(table_, shape)]
    return "\n".join([*lines, END])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", type=int, default=16)
    parser.add_argument("--shapes", default=",".join(SHAPES), help="workload shapes, comma-separated")
    parser.add_argument("--rates", default="", help="rates for every shape (default: each shape's own)")
    parser.add_argument("--requests", type=int, default=4000, help="requests per run")
    parser.add_argument("--seed", type=int, default=0, help="the first seed")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--kv-gbps", type=float, default=8.0, help="KV bandwidth between engines, GB/s")
    parser.add_argument("--workers", type=int, default=2, help="simulations run at once")
    parser.add_argument("--quick", action="store_true", help="4 engines, 2 rates, 2 seeds; docs untouched")
    parser.add_argument("--no-docs", action="store_true", help="print only; leave docs/benchmarks.md")
    parser.add_argument("--from-results", default="", help="report a saved run's simulations again")
    args = parser.parse_args()
    if args.quick:
        args.engines, args.rates, args.requests, args.seeds, args.no_docs = 4, "5,6", 600, 2, True
    unknown = set(args.shapes.split(",")) - set(SHAPES)
    if unknown:
        parser.error(f"unknown shape(s) {', '.join(sorted(unknown))} (known: {', '.join(SHAPES)})")
    started = time.monotonic()
    if args.from_results:
        rows = json.loads((ROOT / args.from_results).read_text())
    else:
        rows = sweep(args)
        save_results("fleet", rows)
    table_ = cells(rows)
    if not args.no_docs:
        plot(table_, args.shapes.split(","))
    publish(section(args, table_, (time.monotonic() - started) / 60), BEGIN, END, print_only=args.no_docs)


if __name__ == "__main__":
    main()
