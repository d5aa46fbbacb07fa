"""The simulated engine's step time, fit to a real vLLM CPU engine and checked on held-out batches.

Method
------
One vLLM engine as the fleet runs it (SmolLM2-135M-Instruct, the fleet's dtype, eager, 128-token
KV blocks, 2,048-token context, the engine service's ``max_num_seqs``, vLLM's token budget,
chunked prefill and prefix caching as vLLM defaults them, tcmalloc where installed) runs in a
process of its own, in process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) on one thread on core 0, as
each of the fleet's engines computes, so each ``step()`` call is one engine step, timed alone.
Batches of known make-up are built and stepped:

* ``decode``: B requests of C prompt tokens each, all past their prefill; the median of
  ``--steps`` decode steps;
* ``prefill``: one prompt of P new tokens alone, after a prefix-cache hit of H tokens (H = 0: a
  cold prompt; vLLM's ``num_cached_tokens`` confirms the hit);
* ``mixed``: B requests decoding while a prompt of P tokens joins them; when B + P is over the
  step's token budget, vLLM splits the prompt over steps (chunked prefill), each chunk attending
  to the ones before it.

Every step's make-up is checked against what vLLM reports (which requests produced a token,
the prefix-cache hit); a step that does not match is an error, not a sample. Every shape is
measured ``--repeats`` times (medians). ``shoal_sim.engine.step_features`` turns each batch into
the step model's terms; the coefficients are a least-squares fit on all shapes, and each shape's
error is read from a fit that never saw it (the shapes dealt into four groups by ``--seed``, each
predicted by the fit on the other three).

Results go between ``<!-- stepfit:begin -->`` and ``<!-- stepfit:end -->`` of
``docs/benchmarks.md``, the plot to ``docs/img/stepfit.png``, the raw batches to
``bench/results/``. Run it with ``python -m bench.stepfit`` (``make bench-stepfit``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.harness import IMG, ROOT, publish, pyplot, save_plot, save_results, say, stamp, table
from shoal_sim.engine import STEP_MODELS, StepModel, step_features

BEGIN, END = "<!-- stepfit:begin -->", "<!-- stepfit:end -->"
MODEL = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
BLOCK = 128
MAX_MODEL_LEN = 2048
TERMS = ("base_ms", "decode_ms", "chunk_ms", "prefill_ms", "context_us", "pair_us")
FOLDS = 4
TARGET = 0.10
"""Each shape's step, held out of the fit, within this share of the measured time."""


@dataclass
class Batch:
    """One measured step shape: what it computes and its median time over the repeats."""

    kind: str
    shape: str
    decoding: int
    context: int
    """Context tokens the decoding requests attend to, summed."""
    chunks: list[tuple[int, int]] = field(default_factory=list)
    """Prompt chunks computed: (tokens, tokens of context before them)."""
    ms: list[float] = field(default_factory=list)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.ms)

    @property
    def params(self) -> dict[str, int]:
        """The shape's numbers by name (``B``, ``C``, ``P``, ``H``), as its name spells them."""
        return {word.split("=")[0]: int(word.split("=")[1]) for word in self.shape.split()[1:]}


# ---- measuring, in a process of its own ----------------------------------------------------------


class _Engine:
    """vLLM's ``LLMEngine`` in this process, with the bookkeeping that names each step's make-up."""

    def __init__(self, dtype: str, seed: int) -> None:
        from vllm import EngineArgs, LLMEngine

        from shoal_engine.config import EngineConfig

        self.engine = LLMEngine.from_engine_args(
            EngineArgs(
                model=str(MODEL), dtype=dtype, block_size=BLOCK, max_model_len=MAX_MODEL_LEN,
                enforce_eager=True, seed=seed, max_num_seqs=EngineConfig.model_fields["max_num_seqs"].default,
            )
        )  # fmt: skip
        scheduler = self.engine.vllm_config.scheduler_config
        self.budget = scheduler.max_num_batched_tokens
        self.blocks = self.engine.vllm_config.cache_config.num_gpu_blocks or 0
        self.settings = {
            "kv_blocks": self.blocks,
            "max_num_batched_tokens": self.budget,
            "max_num_seqs": scheduler.max_num_seqs,
            "chunked_prefill": scheduler.enable_chunked_prefill,
            "prefix_caching": self.engine.vllm_config.cache_config.enable_prefix_caching,
        }
        self.rng = random.Random(seed)
        self.generated: dict[str, int] = {}
        self.prompts: dict[str, int] = {}
        self._ids = 0

    def fresh(self, n: int) -> list[int]:
        """Token ids no earlier prompt shares a block with."""
        return [self.rng.randrange(100, 40_000) for _ in range(n)]

    def add(self, prompt: list[int], max_tokens: int) -> str:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._ids += 1
        request_id = f"r{self._ids}"
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params)
        self.prompts[request_id] = len(prompt)
        self.generated[request_id] = 0
        return request_id

    def step(self) -> tuple[float, dict[str, Any]]:
        """One timed step: its milliseconds and the outputs by request."""
        started = time.perf_counter()
        outputs = self.engine.step()
        ms = (time.perf_counter() - started) * 1000.0
        by_id = {out.request_id: out for out in outputs}
        for request_id, out in by_id.items():
            self.generated[request_id] = len(out.outputs[0].token_ids)
        return ms, by_id

    def until_first(self, ids: list[str]) -> None:
        while any(self.generated[r] == 0 for r in ids):
            self.step()

    def drop(self, ids: list[str]) -> None:
        self.engine.abort_request(ids)
        while self.engine.has_unfinished_requests():
            self.step()
        for request_id in ids:
            self.generated.pop(request_id, None)
            self.prompts.pop(request_id, None)

    def context(self, ids: list[str]) -> int:
        return sum(self.prompts[r] + self.generated[r] for r in ids)


def _decode(engine: _Engine, batch: Batch, requests: int, prompt: int, steps: int) -> None:
    # Long enough that none finishes while the last ones are still prefilling.
    ids = [engine.add(engine.fresh(prompt), MAX_MODEL_LEN - prompt - 1) for _ in range(requests)]
    engine.until_first(ids)
    samples = []
    for _ in range(steps):
        context = engine.context(ids)
        ms, out = engine.step()
        if set(out) != set(ids):
            raise RuntimeError(f"{batch.shape}: a decode step produced tokens for {len(out)} of {requests}")
        samples.append(ms)
        batch.context = context
    batch.ms.append(statistics.median(samples))
    engine.drop(ids)


def _prefill(engine: _Engine, batch: Batch, prompt: int, cached: int) -> None:
    prefix = engine.fresh(cached)
    if cached:
        engine.until_first([engine.add(prefix, 1)])
    request_id = engine.add(prefix + engine.fresh(prompt), 1)
    ms, out = engine.step()
    if request_id not in out:
        raise RuntimeError(f"{batch.shape}: the prompt took more than one step")
    hit = out[request_id].num_cached_tokens or 0
    if hit != cached:
        raise RuntimeError(f"{batch.shape}: vLLM found {hit} cached tokens, not {cached}")
    batch.ms.append(ms)
    engine.drop([])


def _mixed(engine: _Engine, batch: Batch, requests: int, context: int, prompt: int) -> None:
    ids = [engine.add(engine.fresh(context), 64) for _ in range(requests)]
    engine.until_first(ids)
    engine.step()
    joining = engine.add(engine.fresh(prompt), 1)
    total, done, chunks, context_sum = 0.0, 0, [], 0
    while True:
        context_sum += engine.context(ids)
        ms, out = engine.step()
        if set(ids) - set(out):
            raise RuntimeError(f"{batch.shape}: a decoding request missed a step")
        chunk = min(prompt - done, engine.budget - requests)
        chunks.append((chunk, done))
        done += chunk
        total += ms
        if joining in out:
            break
        if done >= prompt:
            raise RuntimeError(f"{batch.shape}: the prompt was done but gave no token")
    if done != prompt:
        raise RuntimeError(f"{batch.shape}: vLLM finished the prompt after {done} of {prompt} tokens")
    # The steps of one shape are summed into one: the same terms, added.
    batch.chunks, batch.context = chunks, context_sum
    batch.ms.append(total)
    batch.decoding = requests * len(chunks)
    engine.drop(ids)


def shapes(quick: bool, kv_blocks: int) -> list[Batch]:
    """The grid: decode batches by size and context, prompts by length and cached prefix, and
    prompts joining a decoding batch (chunked where they do not fit one step). Decode batches
    that would fill the KV cache are left out: a preemption would change the batch mid-step."""
    out = []
    sizes = (1, 4, 16, 48) if not quick else (1, 8)
    contexts = (128, 512, 1536) if not quick else (128, 512)
    for b in sizes:
        for c in contexts:
            if b * -(-(c + 64) // BLOCK) <= 0.8 * kv_blocks:
                out.append(Batch("decode", f"decode B={b} C={c}", b, 0))
    for p in (16, 64, 256, 1024, 1900) if not quick else (64, 512):
        for h in (0, 512, 1024):
            if p + h < MAX_MODEL_LEN:
                kind = "cached prefill" if h else "prefill"
                out.append(Batch(kind, f"prefill P={p} H={h}", 0, 0, [(p, h)]))
    for b in (4, 16) if not quick else (4,):
        for p in (256, 1024, 2000) if not quick else (256,):
            out.append(Batch("mixed", f"mixed B={b} C=256 P={p}", b, 0))
    return out


def measure(args: argparse.Namespace) -> tuple[dict[str, Any], list[Batch]]:
    # In process, vLLM's CPU worker does not bind its threads (``VLLM_CPU_OMP_THREADS_BIND`` is
    # applied where a worker process starts): one thread (``OMP_NUM_THREADS``, set by the parent)
    # on core 0, as each of the fleet's engines computes.
    os.sched_setaffinity(0, {0})
    engine = _Engine(args.dtype, args.seed)
    import torch

    if torch.get_num_threads() != 1:
        raise RuntimeError(f"the engine computes on {torch.get_num_threads()} threads, not one")
    warm = [engine.add(engine.fresh(256), 8) for _ in range(4)]
    engine.until_first(warm)
    engine.drop(warm)
    batches = shapes(args.quick, engine.blocks)
    for repeat in range(args.repeats):
        for i, batch in enumerate(batches):
            print(
                f"repeat {repeat + 1}/{args.repeats}, {i + 1}/{len(batches)}: {batch.shape}", file=sys.stderr
            )
            values = batch.params
            if batch.kind == "decode":
                _decode(engine, batch, values["B"], values["C"], args.steps)
            elif batch.kind == "mixed":
                _mixed(engine, batch, values["B"], values["C"], values["P"])
            else:
                _prefill(engine, batch, values["P"], values["H"])
    return engine.settings, batches


# ---- the fit ------------------------------------------------------------------------------------


def load_batches(payload: dict[str, Any]) -> list[Batch]:
    """The batches of a measurement (``run_measurement``'s, or a saved run's JSON)."""
    return [Batch(**{**b, "chunks": [tuple(c) for c in b["chunks"]]}) for b in payload["batches"]]


def features(batch: Batch) -> list[float]:
    x = list(step_features(batch.decoding, batch.chunks, batch.context))
    if batch.kind == "mixed":  # its steps summed: each paid the base once
        x[0] = float(len(batch.chunks))
    return x


def fit(batches: list[Batch]) -> StepModel:
    """Least squares on relative error, so a short step weighs as much as a long one."""
    import numpy as np

    rows = [[v / b.median_ms for v in features(b)] for b in batches]
    coef, *_ = np.linalg.lstsq(np.array(rows), np.ones(len(rows)), rcond=None)
    values = dict(zip(TERMS, (float(c) for c in coef), strict=True))
    return StepModel(name="fit", source="bench.stepfit", **values)


def predict(model: StepModel, batch: Batch) -> float:
    return sum(c * f for c, f in zip(model.coefficients, features(batch), strict=True))


def cross_validate(batches: list[Batch], seed: int) -> dict[str, float]:
    """Each shape's error when the fit never saw it: the shapes are dealt into ``FOLDS`` groups
    (shuffled by ``seed``), and each group is predicted by the fit on the others."""
    order = sorted({b.shape for b in batches})
    random.Random(seed).shuffle(order)
    fold = {shape: i % FOLDS for i, shape in enumerate(order)}
    held: dict[str, float] = {}
    for k in range(FOLDS):
        model = fit([b for b in batches if fold[b.shape] != k])
        for b in batches:
            if fold[b.shape] == k:
                held[b.shape] = predict(model, b) / b.median_ms - 1.0
    return held


def errors(model: StepModel, batches: list[Batch], held: dict[str, float]) -> list[dict[str, Any]]:
    return [
        {
            "kind": b.kind,
            "shape": b.shape,
            "measured_ms": b.median_ms,
            "model_ms": predict(model, b),
            "error": predict(model, b) / b.median_ms - 1.0,
            "held_out_error": held[b.shape],
        }
        for b in batches
    ]


# ---- the report ---------------------------------------------------------------------------------


def plot(rows: list[dict[str, Any]]) -> None:
    """Each shape's measured step against the model fit without it, by kind."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for kind in sorted({r["kind"] for r in rows}):
        mine = [r for r in rows if r["kind"] == kind]
        measured = [r["measured_ms"] for r in mine]
        ax.scatter(
            measured, [m * (1 + r["held_out_error"]) for m, r in zip(measured, mine, strict=True)], label=kind
        )
    top = max(r["measured_ms"] for r in rows) * 1.2
    low = min(r["measured_ms"] for r in rows) * 0.8
    ax.plot([low, top], [low, top], color="black", linewidth=0.8)
    for factor in (1 + TARGET, 1 - TARGET):
        ax.plot([low, top], [low * factor, top * factor], color="grey", linewidth=0.6, linestyle="--")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured step (ms)")
    ax.set_ylabel("model fit without this shape (ms)")
    ax.set_title(f"SmolLM2-135M, one CPU core: step time, held out (dashed: +-{TARGET * 100:.0f} %)")
    ax.legend()
    fig.tight_layout()
    save_plot(fig, IMG / "stepfit.png")


def section(
    model: StepModel,
    rows: list[dict[str, Any]],
    settings: dict[str, Any],
    args: argparse.Namespace,
    minutes: float,
) -> str:
    def pct(value: float) -> str:
        return f"{value * 100:+.1f} %"

    worst = max(rows, key=lambda r: abs(r["held_out_error"]))
    summary = []
    for kind in sorted({r["kind"] for r in rows}):
        mine = [r for r in rows if r["kind"] == kind]
        far = max(mine, key=lambda r: abs(r["held_out_error"]))
        summary.append(
            [
                kind,
                len(mine),
                f"{min(r['measured_ms'] for r in mine):.0f}-{max(r['measured_ms'] for r in mine):.0f} ms",
                f"{statistics.median(abs(r['held_out_error']) for r in mine) * 100:.1f} %",
                f"{pct(far['held_out_error'])} ({far['shape'].split(' ', 1)[1]})",
                f"{max(abs(r['error']) for r in mine) * 100:.1f} %",
            ]
        )
    coefficients = [[term, f"{getattr(model, term):.4g}"] for term in TERMS]
    return "\n".join(
        [
            BEGIN,
            "## The simulated engine's step time, fit to a real engine",
            "",
            f"`make bench-stepfit` ({minutes:.0f} min): one vLLM engine as the fleet runs it "
            "(SmolLM2-135M-Instruct, eager, 128-token blocks, 2,048-token context, one core; "
            f"{settings['max_num_batched_tokens']} tokens per step, chunked prefill "
            f"{'on' if settings['chunked_prefill'] else 'off'}, prefix caching "
            f"{'on' if settings['prefix_caching'] else 'off'}), stepped in process so each step is "
            f"timed alone, over {len(rows)} batch shapes: decode batches (B requests of C tokens), "
            "prompts of P tokens after a prefix-cache hit of H, and prompts joining a decoding batch "
            f"(chunked where they do not fit one step); {args.repeats} times each (medians). The "
            "model (`shoal_sim.engine.StepModel`) is a least-squares fit on relative error; each "
            f"shape's held-out error is from the fit on the other shapes ({FOLDS}-fold, seed "
            f"{args.seed}). The fleet simulator's `smollm2-cpu` model is the fit on all shapes.",
            "",
            stamp(),
            "",
            f"Largest held-out error {pct(worst['held_out_error'])} ({worst['shape']}): "
            f"{'within' if abs(worst['held_out_error']) <= TARGET else 'outside'} the "
            f"{TARGET * 100:.0f} % target.",
            "",
            *table(
                ["shapes", "n", "measured", "held out: median", "largest", "fit on all: largest"],
                "lrrrrr",
                summary,
            ),
            "",
            *table(["coefficient", "fit"], "lr", coefficients),
            "",
            "![step fit](img/stepfit.png)",
            END,
        ]
    )


def run_measurement(args: argparse.Namespace) -> dict[str, Any]:
    from shoal_engine import tcmalloc
    from shoal_fleet.cpu import cpu_flags, native_dtype

    env = {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("LD_PRELOAD", None)
    tcmalloc.preload(env, tcmalloc.installed())
    dtype = args.dtype or native_dtype(cpu_flags())[0]
    command = [
        sys.executable, "-m", "bench.stepfit", "--measure", "--dtype", dtype, "--repeats", str(args.repeats),
        "--steps", str(args.steps), "--seed", str(args.seed), *(["--quick"] if args.quick else []),
    ]  # fmt: skip
    done = subprocess.run(
        command, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True, check=False, timeout=3600
    )
    if done.returncode != 0:
        raise RuntimeError(f"the measuring process failed ({done.returncode})")
    payload: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    payload["dtype"] = dtype
    return payload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="decode steps timed per decode shape")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="", help="the fleet's (bf16 where the CPU computes it natively)")
    parser.add_argument("--quick", action="store_true", help="a small grid, to try the bench")
    parser.add_argument("--from-results", type=str, default="", help="refit a saved run's batches")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-docs", action="store_true", help="print the results, leave the docs alone")
    args = parser.parse_args()
    if args.measure:  # in its own process: one JSON line on stdout
        settings, batches = measure(args)
        print(json.dumps({"settings": settings, "batches": [asdict(b) for b in batches]}))
        return
    started = time.monotonic()
    if args.from_results:
        payload = json.loads((ROOT / args.from_results).read_text())
    else:
        if not MODEL.exists():
            raise SystemExit(f"{MODEL} is missing: run `make models` first")
        say(f"measuring step shapes on one engine, {args.repeats} repeats (progress on stderr)")
        payload = run_measurement(args)
        save_results("stepfit", payload)
    batches = load_batches(payload)
    model = fit(batches)
    rows = errors(model, batches, cross_validate(batches, args.seed))
    for row in rows:
        say(
            f"  {row['shape']:<28} {row['measured_ms']:8.1f} ms, model {row['model_ms']:8.1f} ms "
            f"({row['error'] * 100:+5.1f} %), held out {row['held_out_error'] * 100:+5.1f} %"
        )
    say("fit: " + ", ".join(f"{term}={getattr(model, term):.4g}" for term in TERMS))
    current = STEP_MODELS["smollm2-cpu"]
    say("shipped smollm2-cpu: " + ", ".join(f"{term}={getattr(current, term):.4g}" for term in TERMS))
    if not args.no_docs:
        plot(rows)
    minutes = (time.monotonic() - started) / 60
    publish(section(model, rows, payload["settings"], args, minutes), BEGIN, END, print_only=args.no_docs)


if __name__ == "__main__":
    main()
