"""Prefix-cache routing on multi-turn workloads: least-load, prefix affinity and the engines' own
prefix caches (``prefix_cache``), on simulated fleets of 16 and 64 engines.

Method
------
The workload is ``shoal_sim.workloads.Conversations`` at its defaults: chat sessions under one of
8 shared system prompts of 1,024 tokens (5 turns on average, each sending the whole history back,
8 s of thought between an answer and the next turn), agent loops (a quarter of the sessions: 10
steps on average, each adding a tool's result of about 384 tokens to a growing context) and
one-off requests (a fifth), sessions starting as a Poisson process at each swept rate for
``--duration`` seconds. Engines are ``shoal_sim`` engines with the ``llama3-8b-a100`` step model
(a roofline estimate, not a measurement) and 262,144 tokens of KV each (16-token blocks), with a
prefix cache kept as vLLM keeps it (blocks of requests that ended stay cached in free blocks, least
recently used evicted first). Every policy is the router's own ``Scheduler`` with its shipped
hold line; ``prefix_cache`` reads the engines' cache changes through the router's
``PrefixIndex`` at each load report, as the engines' events would bring them. One run per rate,
policy and seed, every rate reported.

Measured per run: TTFT p50 / p90 / p99 (arrival to first token), the share of prompt tokens the
engines found in their prefix caches, and whether the fleet kept up (tokens delivered over the
second half of the window at least 95 % of those asked for). The *knee* is the highest rate
least-load keeps up with; *throughput at the SLO* is the output tokens per second of the highest
rate at which a policy keeps up with TTFT p90 within ``--slo`` seconds.

Beside the simulation, the router's index alone (``--index-only`` for it alone, in seconds): the
time to find where a 32k-token prompt's blocks are cached among 256 engines (its whole prefix
held by one engine, parts by others), with the block hashes the tokenizer sends along and with
the router hashing the prompt itself, and the index's memory per block.

Targets (issue 41): at the knee, TTFT p90 >= 5x better than least-load and >= 2x better than
``prefix_affinity`` on 16 and 64 engines; throughput at the SLO >= 1.5x least-load; a lookup
<= 1 ms p99 at 256 engines for 32k-token prompts.

Results: ``bench/results/prefix-<time>.json``, ``docs/img/prefix_routing.png`` and the sections
between ``<!-- prefix:begin -->`` and ``<!-- prefix:end -->`` and between
``<!-- prefix-index:begin -->`` and ``<!-- prefix-index:end -->`` of ``docs/benchmarks.md``
(``python -m bench.prefix``, ``make bench-prefix``).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import time
import tracemalloc
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import harness
from bench.harness import IMG, publish, pyplot, quantile, save_plot, save_results, say, stamp, table
from shoal_protos import tokenizer_pb2
from shoal_protos.prefix import PrefixSnapshot, chain_hashes, prefix_event_encoder, prefix_snapshot_decoder
from shoal_router.config import RouterConfig
from shoal_router.core.hold import HoldPolicy
from shoal_router.core.prefix_index import PrefixIndex
from shoal_sim.engine import STEP_MODELS, SimConfig
from shoal_sim.fleet import Fleet, Simulation
from shoal_sim.workloads import Conversations

BEGIN, END = "<!-- prefix:begin -->", "<!-- prefix:end -->"
INDEX_BEGIN, INDEX_END = "<!-- prefix-index:begin -->", "<!-- prefix-index:end -->"
SIM = SimConfig(
    model="llama3-8b-a100", kv_blocks=16384, block_size=16, max_num_seqs=256, max_batched_tokens=8192,
    max_model_len=16384,
)  # fmt: skip
POLICIES = ("least_load", "prefix_affinity", "prefix_cache")
RATES = {16: "4,6,8,10,12,14", 64: "16,24,28,32,40,48", 256: "80,96,112"}
"""Sessions started per second, swept per fleet size."""


@dataclass(frozen=True)
class Run:
    engines: int
    rate: float
    policy: str
    seed: int
    duration_s: float


def run(spec: Run) -> dict[str, Any]:
    """One simulation (in a worker process): its summary, with what it ran."""
    defaults = RouterConfig()
    fleet = Fleet(
        engines=spec.engines,
        sim=SIM,
        scheduler=spec.policy,
        hold=HoldPolicy(defaults.hold_below, defaults.hold_max_s),
    )
    workload = Conversations(rate=spec.rate, duration_s=spec.duration_s, seed=spec.seed)
    started = time.monotonic()
    result = Simulation(fleet, workload).run()
    row: dict[str, Any] = {**spec.__dict__, **result.summary(), "requests": workload.requests}
    row["sustained"] = row["steady_tokens_per_s"] >= 0.95 * row["asked_steady_tokens_per_s"]
    row["wall_s"] = time.monotonic() - started
    return row


def sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    specs = [
        Run(engines, float(rate), policy, seed, args.duration)
        for engines in (int(e) for e in args.engines.split(","))
        for rate in (args.rates or RATES.get(engines, RATES[16])).split(",")
        for seed in range(args.seed, args.seed + args.seeds)
        for policy in POLICIES
    ]
    say(f"{len(specs)} simulations on {args.workers} process(es)")
    rows = []
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        for i, row in enumerate(pool.map(run, specs), 1):
            rows.append(row)
            say(
                f"  [{i}/{len(specs)}] {row['engines']} engines, {row['rate']:g} sessions/s, "
                f"seed {row['seed']}: {row['policy']} TTFT p90 {row['ttft_p90_s']:.2f} s, "
                f"cache hits {row['cache_hit_rate']:.0%}"
                f"{'' if row['sustained'] else ', falls behind'} ({row['wall_s']:.0f} s)"
            )
    return rows


# ---- the floor -----------------------------------------------------------------------------------


@functools.cache
def ttft_floor(rate: float, duration_s: float, seed: int) -> dict[str, float]:
    """TTFT percentiles no placement can beat: each request alone on an idle engine whose prefix
    cache holds every block any earlier prompt had (a cache that never evicts, shared by all
    engines), its prompt's other tokens prefilled in steps of the engines' token budget."""
    model = STEP_MODELS[SIM.model]
    workload = Conversations(rate=rate, duration_s=duration_s, seed=seed)
    seen: set[int] = set()
    floors = []
    for (_, prompt, _), tokens in zip(workload.draw(), workload.prompts(), strict=True):
        hashes = chain_hashes(tokens, SIM.block_size)
        hit = next((i for i, block in enumerate(hashes) if block not in seen), len(hashes))
        seen.update(hashes)
        done = min(hit * SIM.block_size, prompt - 1)
        ms = 0.0
        while done < prompt:
            chunk = min(prompt - done, SIM.max_batched_tokens)
            ms += model.step_ms(0, [(chunk, done)], 0)
            done += chunk
        floors.append(ms / 1000)
    return {f"floor_p{q}_s": quantile(floors, q / 100) for q in (50, 90, 99)}


# ---- the index alone ---------------------------------------------------------------------------


def index_cost(engines: int = 256, prompt_tokens: int = 32_768, lookups: int = 500) -> list[dict[str, Any]]:
    """Lookup time and memory per block of the router's index, for 16- and 128-token blocks: a
    lookup with the prompt's block hashes from the tokenizer (text and chat prompts), one that
    hashes the prompt itself (prompts sent as token ids), and the hashing alone (what the
    tokenizer adds to a prompt), timed in turn so that they share the machine's moods."""
    rows = []
    for block_size in (16, 128):
        rng = random.Random(block_size)
        prompt = [rng.randrange(50_000) for _ in range(prompt_tokens)]
        hashes = chain_hashes(prompt, block_size)
        index = PrefixIndex()
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        for e in range(engines):
            own = chain_hashes([rng.randrange(50_000) for _ in range(4096)], block_size)
            held = hashes if e == 0 else hashes[: rng.randrange(len(hashes))]
            # Through JSON, as the router reads snapshots from Redis: the index holds ints of its
            # own, not the objects the prompt's hashes are, which a dict would find by identity.
            snapshot = PrefixSnapshot(epoch="a", seq=0, block_size=block_size, blocks=held + own)
            decoded = prefix_snapshot_decoder.decode(prefix_event_encoder.encode(snapshot))
            index.load(f"engine-{e:03d}", decoded)
        after = tracemalloc.take_snapshot()
        tracemalloc.stop()
        grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
        ids = index.engines()
        # The tokenizer's hashes as the router gets them, out of its gRPC reply.
        reply = tokenizer_pb2.TokenizeResponse.FromString(
            tokenizer_pb2.TokenizeResponse(
                block_hashes=[tokenizer_pb2.BlockHashes(block_size=block_size, hashes=hashes)]
            ).SerializeToString()
        )
        given_hashes = {b.block_size: list(b.hashes) for b in reply.block_hashes}
        given, hashing, hashed_here = [], [], []
        for _ in range(lookups):
            started = time.perf_counter()
            found = index.cached_tokens(prompt, ids, given_hashes)
            given.append(time.perf_counter() - started)
            started = time.perf_counter()
            found_here = index.cached_tokens(prompt, ids)
            hashed_here.append(time.perf_counter() - started)
            assert found_here == found
            started = time.perf_counter()
            chain_hashes(prompt, block_size)
            hashing.append(time.perf_counter() - started)
        assert found["engine-000"] == len(hashes) * block_size
        rows.append(
            {
                "block_size": block_size,
                "engines": engines,
                "prompt_tokens": prompt_tokens,
                "indexed_blocks": len(index),
                "bytes_per_block": grown / len(index),
                **{
                    f"{name}_p{q}_ms": quantile(times, q / 100) * 1000
                    for name, times in (
                        ("lookup", given),
                        ("hashed_lookup", hashed_here),
                        ("hashing", hashing),
                    )
                    for q in (50, 99)
                },
            }
        )
    return rows


def index_report(index_rows: list[dict[str, Any]]) -> str:
    first = index_rows[0]
    return "\n".join(
        [
            INDEX_BEGIN,
            "### The router's index alone (`python -m bench.prefix --index-only`)",
            "",
            f"`PrefixIndex.cached_tokens`: one {first['prompt_tokens']:,}-token prompt among "
            f"{first['engines']} engines, one holding all of it, the others a random part and 4,096 "
            "tokens of their own, in two block sizes. A text or chat prompt comes with its block "
            "hashes from the tokenizer, which hashes it in the block sizes of the router's engines; a "
            "prompt sent as token ids is hashed by the router. Hashing alone: what the tokenizer adds "
            "to a prompt. Target: lookup <= 1 ms p99.",
            "",
            stamp(),
            "",
            *table(
                [
                    "block size",
                    "blocks indexed",
                    "bytes per block",
                    "lookup p50",
                    "lookup p99",
                    "hashed by the router p50",
                    "p99",
                    "hashing alone p50",
                    "p99",
                ],
                "rrrrrrrrr",
                [
                    [
                        r["block_size"],
                        f"{r['indexed_blocks']:,}",
                        f"{r['bytes_per_block']:.0f}",
                        *(
                            f"{r[f'{name}_p{q}_ms']:.2f} ms"
                            for name in ("lookup", "hashed_lookup", "hashing")
                            for q in (50, 99)
                        ),
                    ]
                    for r in index_rows
                ],
            ),
            INDEX_END,
        ]
    )


# ---- the report ----------------------------------------------------------------------------------


def knee(rows: list[dict[str, Any]], engines: int, seed: int) -> float | None:
    """The highest rate least-load keeps up with."""
    kept = [
        r["rate"]
        for r in rows
        if (r["engines"], r["seed"], r["policy"], r["sustained"]) == (engines, seed, "least_load", True)
    ]
    return max(kept) if kept else None


def at_slo(
    rows: list[dict[str, Any]], engines: int, seed: int, policy: str, slo: float
) -> dict[str, Any] | None:
    """The run of the highest rate at which ``policy`` keeps up within the TTFT p90 SLO."""
    good = [
        r
        for r in rows
        if (r["engines"], r["seed"], r["policy"]) == (engines, seed, policy)
        and r["sustained"]
        and r["ttft_p90_s"] <= slo
    ]
    return max(good, key=lambda r: r["rate"]) if good else None


def _cell(rows: list[dict[str, Any]], engines: int, seed: int, rate: float, policy: str) -> dict[str, Any]:
    return next(
        r for r in rows if (r["engines"], r["seed"], r["rate"], r["policy"]) == (engines, seed, rate, policy)
    )


def report(rows: list[dict[str, Any]], args: argparse.Namespace, measured: str) -> str:
    lines = [
        BEGIN,
        "## Prefix-cache routing on multi-turn workloads "
        f"(`python -m bench.prefix --duration {args.duration:g}`)",
        "",
        "Simulated fleets (`shoal_sim`, `llama3-8b-a100` roofline step model, 262,144 tokens of KV per "
        "engine in 16-token blocks, vLLM's prefix cache modelled); the workload mixes chat sessions under "
        "8 shared system prompts, agent tool loops with growing contexts, and one-off requests "
        "(`shoal_sim.workloads.Conversations`, sessions per second swept). Every policy is the router's "
        f"`Scheduler` with its shipped hold line. TTFT in seconds; hits: the share of prompt tokens found "
        f"in the engines' prefix caches; `*`: the fleet falls behind (delivers under 95 % of the tokens "
        f"asked for). Knee: the highest rate least-load keeps up with. SLO: TTFT p90 <= {args.slo:g} s. "
        "Floor: what no placement can beat, each request alone on an idle engine whose cache holds "
        "every block any earlier prompt had.",
        "",
        measured,
        "",
    ]
    for engines in sorted({r["engines"] for r in rows}):
        for seed in sorted({r["seed"] for r in rows if r["engines"] == engines}):
            lines += [f"**{engines} engines, seed {seed}**", ""]
            body = []
            for rate in sorted({r["rate"] for r in rows if r["engines"] == engines}):
                cells = []
                for policy in POLICIES:
                    c = _cell(rows, engines, seed, rate, policy)
                    mark = "" if c["sustained"] else "*"
                    ttft = f"{c['ttft_p50_s']:.2f} / {c['ttft_p90_s']:.2f} / {c['ttft_p99_s']:.2f}{mark}"
                    cells.append(f"{ttft} ({c['cache_hit_rate']:.0%})")
                floor = ttft_floor(rate, args.duration, seed)
                body.append([f"{rate:g}", *cells, f"{floor['floor_p50_s']:.2f} / {floor['floor_p90_s']:.2f}"])
            lines += table(
                ["sessions/s", *(f"{p}: TTFT p50 / p90 / p99 (hits)" for p in POLICIES), "floor p50 / p90"],
                "rllll",
                body,
            )
            lines.append("")
            lines += verdict(rows, engines, seed, args.slo, args.duration)
            lines.append("")
    lines += [
        "![TTFT p90 and cache hits against the rate](img/prefix_routing.png)",
        END,
    ]
    return "\n".join(lines)


def verdict(rows: list[dict[str, Any]], engines: int, seed: int, slo: float, duration_s: float) -> list[str]:
    out = []
    rate = knee(rows, engines, seed)
    if rate is None:
        out.append("Least-load keeps up with none of the rates: no knee in this sweep.")
    else:
        base, aff, ours = (_cell(rows, engines, seed, rate, p)["ttft_p90_s"] for p in POLICIES)
        floor = ttft_floor(rate, duration_s, seed)["floor_p90_s"]
        out.append(
            f"At the knee ({rate:g} sessions/s) `prefix_cache` TTFT p90 is {base / ours:.1f}x better than "
            f"least-load (target 5x: {_met(base / ours >= 5)}) and {aff / ours:.1f}x better than "
            f"`prefix_affinity` (target 2x: {_met(aff / ours >= 2)}); its p90 is {ours / floor:.1f}x the "
            f"floor's ({floor:.2f} s), least-load's {base / floor:.1f}x, "
            f"`prefix_affinity`'s {aff / floor:.1f}x."
        )
    best = {p: at_slo(rows, engines, seed, p, slo) for p in POLICIES}
    parts = [
        f"{p} {b['steady_tokens_per_s']:,.0f} tokens/s ({b['rate']:g} sessions/s)" if b else f"{p} none"
        for p, b in best.items()
    ]
    line = f"Throughput at the SLO: {', '.join(parts)}"
    if best["least_load"] and best["prefix_cache"]:
        ratio = best["prefix_cache"]["steady_tokens_per_s"] / best["least_load"]["steady_tokens_per_s"]
        high = max(r["rate"] for r in rows if r["engines"] == engines)
        capped = (
            " (at the sweep's highest rate: a lower bound)" if best["prefix_cache"]["rate"] == high else ""
        )
        line += f"; `prefix_cache` / least-load {ratio:.2f}x{capped} (target 1.5x: {_met(ratio >= 1.5)})"
    out.append(line + ".")
    return out


def _met(met: bool) -> str:
    return "met" if met else "not met"


def plot(rows: list[dict[str, Any]]) -> None:
    plt = pyplot()
    sizes = sorted({r["engines"] for r in rows})
    seed = min(r["seed"] for r in rows)
    fig, axes = plt.subplots(2, len(sizes), figsize=(5 * len(sizes), 7), squeeze=False)
    for column, engines in enumerate(sizes):
        for policy, marker in zip(POLICIES, "os^", strict=True):
            runs = sorted(
                (r for r in rows if (r["engines"], r["policy"], r["seed"]) == (engines, policy, seed)),
                key=lambda r: r["rate"],
            )
            rates = [r["rate"] for r in runs]
            axes[0][column].plot(rates, [r["ttft_p90_s"] for r in runs], marker=marker, label=policy)
            axes[1][column].plot(
                rates, [100 * r["cache_hit_rate"] for r in runs], marker=marker, label=policy
            )
        axes[0][column].set_yscale("log")
        axes[0][column].set_title(f"{engines} engines")
        axes[0][column].set_ylabel("TTFT p90 (s)")
        axes[1][column].set_ylabel("prompt tokens cached (%)")
        for ax in axes[:, column]:
            ax.set_xlabel("sessions started per second")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"Multi-turn sessions on simulated engines (llama3-8b-a100 roofline), seed {seed}")
    fig.tight_layout()
    save_plot(fig, IMG / "prefix_routing.png")


def from_results(args: argparse.Namespace) -> tuple[list[dict[str, Any]], str]:
    """The runs of saved results (``--from-results``), each fleet size from one file, and the
    stamp line naming each file's commit and time. ``args`` takes the runs' duration."""
    rows: list[dict[str, Any]] = []
    stamps = []
    for name in args.from_results.split(","):
        payload = json.loads(Path(name).read_text())
        if "measured" not in payload:
            raise SystemExit(f"{name}: no 'measured' entry (commit and time): rerun it")
        if not payload["runs"]:
            raise SystemExit(f"{name}: no runs (an --index-only run's, or a rebuild's)")
        sizes = sorted({r["engines"] for r in payload["runs"]})
        taken = sorted({r["engines"] for r in rows} & set(sizes))
        if taken:
            raise SystemExit(f"{name}: {taken} engines come from another file already")
        if rows and payload["args"]["duration"] != args.duration:
            raise SystemExit(
                f"{name}: sessions start over {payload['args']['duration']} s, not {args.duration}"
            )
        args.duration, args.slo = payload["args"]["duration"], payload["args"]["slo"]
        rows += payload["runs"]
        m = payload["measured"]
        stamps.append(f"{' and '.join(map(str, sizes))} engines at commit {m['commit']}, {m['utc']} UTC")
    return rows, "Measured: " + "; ".join(stamps) + "."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="16,64", help="fleet sizes, comma-separated")
    parser.add_argument("--rates", default="", help="sessions/s to sweep (default: per fleet size)")
    parser.add_argument("--duration", type=float, default=240.0, help="seconds over which sessions start")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument(
        "--slo", type=float, default=1.0, help="TTFT p90 target (s) for throughput at the SLO"
    )
    parser.add_argument("--workers", type=int, default=2, help="simulations run at once")
    parser.add_argument("--no-docs", action="store_true", help="print only; leave docs/benchmarks.md")
    parser.add_argument("--index-only", action="store_true", help="only the router's index (seconds)")
    parser.add_argument(
        "--from-results",
        default="",
        help="rebuild the section from saved runs (bench/results/prefix-*.json, comma-separated; "
        "each fleet size from one run) instead of simulating; the index is measured anew",
    )
    args = parser.parse_args()
    started = time.monotonic()
    measured = {"commit": harness.git_commit(), "utc": harness.utc_now()}
    if args.from_results:
        rows, line = from_results(args)
    else:
        rows = [] if args.index_only else sweep(args)
        line = stamp(measured["utc"], measured["commit"])
    say("the router's index alone: 256 engines, 32k-token prompts")
    index_rows = index_cost()
    # A rebuild's runs stay in the files they came from, under their own commit and time.
    runs = [] if args.from_results else rows
    save_results("prefix", {"args": vars(args), "measured": measured, "runs": runs, "index": index_rows})
    if rows:
        if not args.no_docs:
            plot(rows)
        publish(report(rows, args, line), BEGIN, END, args.no_docs)
    publish(index_report(index_rows), INDEX_BEGIN, INDEX_END, args.no_docs)
    say(f"done in {(time.monotonic() - started) / 60:.1f} min")


if __name__ == "__main__":
    main()
