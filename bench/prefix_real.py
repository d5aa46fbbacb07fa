"""Prefix-cache routing on the real two-engine fleet: the same multi-turn traces (one per seed,
``--seeds``) through least-load, prefix affinity and ``prefix_cache``, each on a fresh fleet
(cold caches).

Method
------
``shoal_sim.workloads.Conversations`` sized to this machine (SmolLM2-135M-Instruct, two CPU
engines of one core each as ``make run`` starts them, 2,048-token context): chat sessions under
8 shared system prompts of 384 tokens (4 turns on average, the whole history sent back each
turn, 2 s of thought), agent loops with growing contexts (a quarter of the sessions) and
one-off requests (a fifth), sessions starting at ``--rate`` per second for ``--duration``
seconds. Prompt ids are mapped into ordinary tokens; every request streams its drawn number of
tokens (``ignore_eos``). The trace is the same for every policy; each policy gets a fresh fleet,
its router started with ``--scheduler <policy>``, and the trace is sent open loop at its drawn
times. TTFT is measured at the client; the cache hit rate is vLLM's own (its
``prefix_cache_hits`` over ``prefix_cache_queries``, both engines, this trace only).

Target (issue 41): on the real fleet, ``prefix_cache`` better than both, the hit rate shown.

Results: ``bench/results/prefix-real-<time>.json`` and the section between
``<!-- prefix-real:begin -->`` and ``<!-- prefix-real:end -->`` of ``docs/benchmarks.md``
(``python -m bench.prefix_real``, ``make bench-prefix-real``).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time
from typing import Any

import httpx

from bench import stepfit
from bench.harness import ROOT, publish, quantile, save_results, say, stamp, table
from bench.serving import FLEET_PORTS, MODEL_NAME, TOKEN_ID_RANGE, RequestResult, send_trace
from shoal_fleet.cpu import cpu_flags, native_dtype
from shoal_fleet.launcher import Fleet, FleetConfig
from shoal_sim.workloads import Conversations

BEGIN, END = "<!-- prefix-real:begin -->", "<!-- prefix-real:end -->"
POLICIES = ("least_load", "prefix_affinity", "prefix_cache")
ENGINES = 2


def workload(rate: float, duration_s: float, seed: int) -> Conversations:
    return Conversations(
        rate=rate,
        duration_s=duration_s,
        system_tokens=384,
        chat_turns=4.0,
        agent_steps=6.0,
        tool_tokens=96,
        user_tokens=48,
        output_tokens=24,
        think_s=2.0,
        answer_s_per_token=0.05,
        max_model_len=stepfit.MAX_MODEL_LEN - 1,
        seed=seed,
    )


def prompts_of(trace: Conversations) -> list[list[int]]:
    low, high = TOKEN_ID_RANGE
    return [[low + token % (high - low) for token in prompt] for prompt in trace.prompts()]


def vllm_cache_counters(cfg: FleetConfig) -> tuple[float, float]:
    """(prompt tokens looked up, found) in vLLM's prefix caches, both engines."""
    queries = hits = 0.0
    for i in range(cfg.engines):
        text = httpx.get(f"http://127.0.0.1:{cfg.engine_http_base_port + i}/metrics", timeout=10).text
        queries += sum(
            float(v) for v in re.findall(r"^vllm:prefix_cache_queries_total\{[^}]*\} (\S+)$", text, re.M)
        )
        hits += sum(
            float(v) for v in re.findall(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)$", text, re.M)
        )
    return queries, hits


async def replay(url: str, trace: Conversations, label: str) -> list[RequestResult]:
    requests = [
        (at, prompt, output) for (at, _, output), prompt in zip(trace.draw(), prompts_of(trace), strict=True)
    ]
    return await send_trace(url, requests, label, every=25)


def run_policy(policy: str, trace: Conversations, dtype: str) -> dict[str, Any]:
    cfg = FleetConfig(
        model_path=stepfit.MODEL,
        served_model_name=MODEL_NAME,
        run_dir=ROOT / ".cache" / "bench" / "prefix-real",
        engines=ENGINES,
        cluster="bench-prefix",
        dtype=dtype,
        enforce_eager=True,
        router_args=("--scheduler", policy),
        **FLEET_PORTS,
    )
    fleet = Fleet(cfg, say=lambda line: say("  " + line.strip()))
    try:
        fleet.start()
        fleet.wait_ready(600.0)
        url = cfg.base_url + "/v1/completions"
        # Warm-up: prompts of their own, so no policy starts with the trace's blocks cached.
        warm = workload(1.0, 4.0, seed=10_000)
        asyncio.run(replay(url, warm, f"{policy}, warm-up"))
        before = vllm_cache_counters(cfg)
        results = asyncio.run(replay(url, trace, policy))
        after = vllm_cache_counters(cfg)
    finally:
        fleet.stop()
    failed = [r for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{policy}: {len(failed)} request(s) failed: {failed[0].error}")
    ttft = [(r.ttft_ms or 0.0) / 1000 for r in results]
    queries, hits = after[0] - before[0], after[1] - before[1]
    return {
        "policy": policy,
        "requests": len(results),
        "ttft_p50_s": quantile(ttft, 0.5),
        "ttft_p90_s": quantile(ttft, 0.9),
        "ttft_p99_s": quantile(ttft, 0.99),
        "tpot_p50_ms": quantile([r.tpot_ms for r in results if r.tpot_ms is not None], 0.5),
        "hit_rate": hits / queries if queries else 0.0,
        "prompt_tokens": queries,
        "cached_tokens": hits,
        "ttft_s": ttft,
        # Each request's prompt length and send time beside its TTFT, to read the tail by.
        "prompt_len": [length for _, length, _ in trace.draw()],
        "start_s": [r.start_s for r in results],
    }


def report(rows: list[dict[str, Any]], args: argparse.Namespace, traces: dict[int, Conversations]) -> str:
    seeds = list(traces)
    sizes = ", ".join(f"{trace.requests} (seed {seed})" for seed, trace in traces.items())
    shared = ", ".join(f"{trace.shared_tokens(128):.0%}" for trace in traces.values())
    lines = [
        BEGIN,
        "## Prefix-cache routing on the real fleet (`python -m bench.prefix_real`)",
        "",
        f"Two SmolLM2-135M-Instruct CPU engines (one core each, 128-token KV blocks, as `make run` starts "
        f"them); a trace of multi-turn sessions per seed (`Conversations` sized to the machine: "
        f"{args.rate:g} sessions/s for {args.duration:g} s; {sizes} requests; a perfect prefix cache would "
        f"skip {shared} of the prompt tokens in 128-token blocks), the same for each policy, each on a "
        "fresh fleet. TTFT at the client, in seconds; hits: vLLM's own prefix-cache hit rate over the "
        "trace.",
        "",
        stamp(),
        "",
        *table(
            ["seed", "scheduler", "TTFT p50", "TTFT p90", "TTFT p99", "TPOT p50", "prefix-cache hits"],
            "rlrrrrr",
            [
                [
                    r["seed"],
                    f"`{r['policy']}`",
                    f"{r['ttft_p50_s']:.2f}",
                    f"{r['ttft_p90_s']:.2f}",
                    f"{r['ttft_p99_s']:.2f}",
                    f"{r['tpot_p50_ms']:.0f} ms",
                    f"{r['hit_rate']:.0%}",
                ]
                for r in rows
            ],
        ),
        "",
    ]
    for seed in seeds:
        by = {row["policy"]: row for row in rows if row["seed"] == seed}
        ours = [row for row in rows if row["seed"] == seed][-1]
        if {"least_load", "prefix_affinity"} <= by.keys():
            lines.append(
                f"Seed {seed}: `{ours['policy']}` / least-load: TTFT p90 "
                f"{by['least_load']['ttft_p90_s'] / ours['ttft_p90_s']:.2f}x better, p99 "
                f"{by['least_load']['ttft_p99_s'] / ours['ttft_p99_s']:.2f}x; / `prefix_affinity`: p90 "
                f"{by['prefix_affinity']['ttft_p90_s'] / ours['ttft_p90_s']:.2f}x, p99 "
                f"{by['prefix_affinity']['ttft_p99_s'] / ours['ttft_p99_s']:.2f}x."
            )
    lines.append(END)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=0.6, help="sessions started per second")
    parser.add_argument("--duration", type=float, default=90.0, help="seconds over which sessions start")
    parser.add_argument("--seed", type=int, default=0, help="the first seed")
    parser.add_argument("--seeds", type=int, default=2, help="traces, one per seed from --seed")
    parser.add_argument(
        "--policies",
        default=";".join(POLICIES),
        help="schedulers to compare, ';'-separated (the last is ours)",
    )
    parser.add_argument("--no-docs", action="store_true", help="print only; leave docs/benchmarks.md")
    args = parser.parse_args()
    started = time.monotonic()
    dtype = native_dtype(cpu_flags())[0]
    traces = {
        seed: workload(args.rate, args.duration, seed) for seed in range(args.seed, args.seed + args.seeds)
    }
    policies = args.policies.split(";")
    rows = []
    for seed, trace in traces.items():
        say(f"seed {seed}: {trace.requests} requests per policy, {', '.join(policies)}")
        rows += [{"seed": seed, **run_policy(policy, trace, dtype)} for policy in policies]
    save_results("prefix-real", {"args": vars(args), "runs": rows})
    for row in rows:
        row.pop("ttft_s")
    publish(report(rows, args, traces), BEGIN, END, args.no_docs)
    say(f"done in {(time.monotonic() - started) / 60:.1f} min")


if __name__ == "__main__":
    main()
