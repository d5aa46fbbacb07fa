"""CPU engines: vLLM's model processes with glibc's allocator against tcmalloc, side by side.

Method
------
One engine (Shoal's ``VllmBackend``: vLLM's ``AsyncLLM``, SmolLM2-135M-Instruct, bf16, eager,
32-token KV blocks, one core: ``VLLM_CPU_OMP_THREADS_BIND=0``) is started in a fresh process per
round, with ``--no-tcmalloc`` (glibc) or with tcmalloc preloaded, the two alternating round by
round (the machine's speed drifts). In each round and for each context length, ``--repeats``
times: a fresh prompt of random token ids is prefilled ('prefill': the time to its first token),
decodes ``--tokens`` greedy tokens ('decode step': the median gap between them), and is then sent
again with its output as one new request whose context, all but its last token, is in vLLM's
prefix cache ('cached re-admission': the time to its first token, what a request arriving by
migration pays). Medians over all rounds and repeats.

Results go between ``<!-- allocator:begin -->`` and ``<!-- allocator:end -->`` of
``docs/benchmarks.md``, the plot to ``docs/img/allocator.png``. Run it with ``python -m bench.allocator``
(``make bench-allocator``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

from bench.harness import IMG, ROOT, publish, pyplot, save_plot, save_results, say, stamp, table

BEGIN, END = "<!-- allocator:begin -->", "<!-- allocator:end -->"
MODEL = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
BLOCK = 32
ALLOCATORS = ("glibc", "tcmalloc")
METRICS = {
    "prefill_ms": "prefill",
    "step_ms": "decode step",
    "readmit_ms": "cached re-admission",
}


# ---- one round, in a process of its own --------------------------------------------------------


async def _stream(
    backend: Any, request_id: str, ids: list[int], tokens: int
) -> tuple[float, list[float], list[int]]:
    from shoal_protos.messages import SamplingOptions

    sampling = SamplingOptions(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    started, stamps, out = time.perf_counter(), [], []
    async for piece in backend.generate(request_id, ids, sampling):
        if piece.token_ids:
            stamps.append(time.perf_counter())
            out += piece.token_ids
    return started, stamps, out


async def _round(
    tcmalloc: bool, contexts: list[int], repeats: int, tokens: int, seed: int
) -> list[dict[str, Any]]:
    from shoal_engine.config import EngineConfig
    from shoal_engine.vllm_backend import VllmBackend

    backend = VllmBackend(
        EngineConfig(
            model=str(MODEL),
            served_model_name="SmolLM2-135M-Instruct",
            engine_id="bench-allocator",
            max_model_len=max(contexts) + tokens + BLOCK,
            enforce_eager=True,
            block_size=BLOCK,
            tcmalloc=tcmalloc,
        )
    )
    await backend.start()
    rng = random.Random(seed)
    rows = []
    try:
        await _stream(backend, "warm-up", [rng.randrange(100, 40000) for _ in range(64)], 4)
        for context in contexts:
            for i in range(repeats):
                ids = [rng.randrange(100, 40000) for _ in range(context)]
                started, stamps, out = await _stream(backend, f"a-{context}-{i}", ids, tokens)
                gaps = [b - a for a, b in itertools.pairwise(stamps)]
                # All but the last token in whole blocks: the prefix cache holds everything
                # before it, as for a request that arrives by migration.
                full = ids + out
                again = full[: (len(full) - 1) // BLOCK * BLOCK + 1]
                readmitted, stamps2, _ = await _stream(backend, f"b-{context}-{i}", again, 2)
                rows.append(
                    {
                        "context": context,
                        "prefill_ms": (stamps[0] - started) * 1000,
                        "step_ms": statistics.median(gaps) * 1000,
                        "readmit_ms": (stamps2[0] - readmitted) * 1000,
                    }
                )
    finally:
        backend.shutdown()
    return rows


# ---- the comparison ----------------------------------------------------------------------------


def run_round(tcmalloc: bool, args: argparse.Namespace, seed: int) -> list[dict[str, Any]]:
    env = {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CPU_OMP_THREADS_BIND": "0",
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("LD_PRELOAD", None)
    command = [
        sys.executable, "-m", "bench.allocator", "--round", "tcmalloc" if tcmalloc else "glibc",
        "--contexts", *map(str, args.contexts), "--repeats", str(args.repeats),
        "--tokens", str(args.tokens), "--seed", str(seed),
    ]  # fmt: skip
    done = subprocess.run(
        command, env=env, cwd=ROOT, capture_output=True, text=True, check=False, timeout=1800
    )
    if done.returncode != 0:
        raise RuntimeError(f"round failed ({done.returncode}): {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarise(rounds: dict[str, list[dict[str, Any]]], contexts: list[int]) -> list[dict[str, Any]]:
    medians = []
    for context in contexts:
        row: dict[str, Any] = {"context": context}
        for allocator in ALLOCATORS:
            samples = [r for r in rounds[allocator] if r["context"] == context]
            for metric in METRICS:
                row[f"{allocator}_{metric}"] = statistics.median(r[metric] for r in samples)
        medians.append(row)
    return medians


def plot(medians: list[dict[str, Any]]) -> None:
    """tcmalloc's change against glibc, per context and measure (negative: faster)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    width = 0.8 / len(METRICS)
    for k, (metric, title) in enumerate(METRICS.items()):
        xs = [i + (k - (len(METRICS) - 1) / 2) * width for i in range(len(medians))]
        changes = [(row[f"tcmalloc_{metric}"] / row[f"glibc_{metric}"] - 1) * 100 for row in medians]
        ax.bar(xs, changes, width, label=title)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(medians)), [str(row["context"]) for row in medians])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("tcmalloc against glibc (%)")
    ax.set_title("SmolLM2-135M, one CPU core: tcmalloc against glibc's allocator")
    ax.legend()
    fig.tight_layout()
    save_plot(fig, IMG / "allocator.png")


def section(rows: list[dict[str, Any]], args: argparse.Namespace, minutes: float) -> str:
    header = ["context"]
    for title in METRICS.values():
        header += [f"{title}, glibc", f"{title}, tcmalloc", "change"]
    cells = []
    for row in rows:
        line = [str(row["context"])]
        for metric in METRICS:
            before, after = row[f"glibc_{metric}"], row[f"tcmalloc_{metric}"]
            line += [f"{before:.1f} ms", f"{after:.1f} ms", f"{(after / before - 1) * 100:+.1f} %"]
        cells.append(line)
    return "\n".join(
        [
            BEGIN,
            "## CPU engines: the allocator",
            "",
            f"`make bench-allocator` ({minutes:.0f} min): one engine (SmolLM2-135M-Instruct, bf16, eager, "
            "one core) in a fresh process per round, with glibc's allocator (`--no-tcmalloc`) or "
            f"with tcmalloc preloaded (the default where it is installed), alternating over {args.rounds} "
            f"rounds each; per round and context {args.repeats} fresh prompts: 'prefill' = the time to "
            f"the first token, 'decode step' = the median gap over {args.tokens} greedy tokens, "
            "'cached re-admission' = the time to the first token of the same context sent again as a "
            "new request with all but its last token in the prefix cache (what a request arriving by "
            "migration pays). Medians over all rounds.",
            "",
            stamp(),
            "",
            *table(header, "r" * len(header), cells),
            "",
            "![allocator](img/allocator.png)",
            END,
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 2048, 8000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32, help="decoded tokens per request")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per allocator, alternating")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--round", choices=ALLOCATORS, help=argparse.SUPPRESS)
    parser.add_argument("--no-docs", action="store_true", help="print the results, leave the docs alone")
    args = parser.parse_args()
    if args.round:  # a round, in its own process: one JSON line of rows on stdout
        rows = asyncio.run(
            _round(args.round == "tcmalloc", args.contexts, args.repeats, args.tokens, args.seed)
        )
        print(json.dumps(rows))
        return
    if not MODEL.exists():
        raise SystemExit(f"{MODEL} is missing: run `make models` first")
    started = time.monotonic()
    rounds: dict[str, list[dict[str, Any]]] = {allocator: [] for allocator in ALLOCATORS}
    order = [allocator for _ in range(args.rounds) for allocator in ALLOCATORS]
    for i, allocator in enumerate(order):
        say(f"round {i + 1}/{len(order)}: {allocator} (an engine starts, then {len(args.contexts)} contexts)")
        rows = run_round(allocator == "tcmalloc", args, args.seed + i // len(ALLOCATORS))
        rounds[allocator] += rows
        for context in args.contexts:
            mine = [r for r in rows if r["context"] == context]
            say(
                f"  {context:>5} tokens: prefill {statistics.median(r['prefill_ms'] for r in mine):6.1f} ms, "
                f"step {statistics.median(r['step_ms'] for r in mine):5.1f} ms, "
                f"re-admission {statistics.median(r['readmit_ms'] for r in mine):5.1f} ms"
            )
    medians = summarise(rounds, args.contexts)
    save_results("allocator", {"rounds": rounds, "table": medians})
    if not args.no_docs:
        plot(medians)
    publish(section(medians, args, (time.monotonic() - started) / 60), BEGIN, END, print_only=args.no_docs)


if __name__ == "__main__":
    main()
