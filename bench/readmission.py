"""Readmission benchmark: how fast vLLM continues a context it already holds, two ways.

A migration's target must continue a request whose context (KV) it already has. Today it sends
the whole context again as a new request, and the prefix cache finds all but the last token
('cached re-admission'). vLLM's streaming-input requests offer another way: a request fed in
chunks keeps its KV blocks between chunks, so the target could take the context as a first
chunk before the stop (one dropped token) and the last token as a second chunk at the commit
('second chunk'). This measures both on one CPU engine (SmolLM2, greedy, bf16), side by side
for the same contexts.

For each context length and repeat: a request of random token ids (whole KV blocks) generates
16 tokens; its median inter-token gap is the 'usual gap'. The context plus its first output
token is then continued (a) as a new request, the prefix cache holding all but that token, and
(b) by a streaming-input request whose first chunk is the same tokens and whose second chunk is
the next output token (or the next ``--second-tokens``). Shown: the time to the first token of
(a), and from handing over the second chunk to its first token in (b), each minus the usual gap
(median over the repeats), and how often each went on with the same tokens as the first request
(greedy). Prints a markdown table.

vLLM's detokenizer is off, as on Shoal's engines, which make the text themselves from the last
few tokens of the context (``shoal_engine.detokenize``); ``--vllm-detokenize`` turns it on. On
its first output vLLM's detokenizer decodes the whole context: in a loop re-admitting one
8k-token context it added 10-16 ms to each re-admission (2026-12-04), which a Shoal engine
does not spend.

    .venv/bin/python -m bench.readmission [--contexts 256 2048 8000] [--repeats 5] [--second-tokens 1]
        [--vllm-detokenize]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import statistics
import time
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING

from bench.harness import ROOT, stamp, table

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

MODEL = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
BLOCK = 32  # the CPU attention backend wants multiples of 32


def _params(max_tokens: int, detokenize: bool) -> SamplingParams:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
        detokenize=detokenize,
    )


async def _plain(
    llm: AsyncLLM, request_id: str, ids: list[int], tokens: int, detokenize: bool
) -> tuple[float, list[float], list[int]]:
    """Time to the first token (s), the token time stamps, the tokens."""
    from vllm import TokensPrompt

    started = time.perf_counter()
    stamps: list[float] = []
    out: list[int] = []
    params = _params(tokens, detokenize)
    async for piece in llm.generate(TokensPrompt(prompt_token_ids=ids), params, request_id):
        if piece.outputs[0].token_ids:
            stamps.append(time.perf_counter())
            out += piece.outputs[0].token_ids
    return stamps[0] - started, stamps, out


async def _second_chunk(
    llm: AsyncLLM,
    request_id: str,
    first: list[int],
    second: list[int],
    tokens: int,
    detokenize: bool,
) -> tuple[float, list[int]]:
    """A streaming-input request: ``first`` for one dropped token, then ``second`` continues;
    the time from handing over ``second`` to its first token (s), and its tokens."""
    from vllm import TokensPrompt
    from vllm.engine.protocol import StreamingInput

    chunks: asyncio.Queue[StreamingInput | None] = asyncio.Queue()

    async def inputs() -> AsyncGenerator[StreamingInput]:
        while (chunk := await chunks.get()) is not None:
            yield chunk

    first_chunk = StreamingInput(
        prompt=TokensPrompt(prompt_token_ids=first), sampling_params=_params(1, detokenize)
    )
    await chunks.put(first_chunk)
    handed = 0.0
    first_token = 0.0
    out: list[int] = []
    async for piece in llm.generate(inputs(), _params(tokens, detokenize), request_id):
        new = piece.outputs[0].token_ids
        if not handed:
            if new:  # the first chunk's token (dropped): now the second chunk
                handed = time.perf_counter()
                second_chunk = TokensPrompt(prompt_token_ids=second)
                await chunks.put(
                    StreamingInput(prompt=second_chunk, sampling_params=_params(tokens, detokenize))
                )
            continue
        if new and not first_token:
            first_token = time.perf_counter()
        out += new
        if len(out) >= tokens:
            await chunks.put(None)
    return first_token - handed, out


async def run(
    contexts: list[int], repeats: int, seed: int, second_tokens: int, detokenize: bool
) -> list[dict[str, float]]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=str(MODEL),
            dtype="bfloat16",
            max_model_len=max(contexts) + 64,
            enforce_eager=True,
            block_size=BLOCK,
            enable_log_requests=False,
        )
    )
    rng = random.Random(seed)
    rows = []
    try:
        await _plain(llm, "warm-up", [rng.randrange(100, 40000) for _ in range(64)], 4, detokenize)
        for context in contexts:
            for i in range(repeats):
                # Whole blocks, so that the context plus the first output token has all but its
                # last token in whole blocks.
                ids = [rng.randrange(100, 40000) for _ in range(context // BLOCK * BLOCK)]
                _, stamps, out = await _plain(llm, f"a-{context}-{i}", ids, 16, detokenize)
                gap = statistics.median(b - a for a, b in itertools.pairwise(stamps))
                # Each computes one token over KV it holds exactly as the first request wrote it:
                # (a) the context and the first output as a new request, the prefix cache holding
                # all but that output; (b) the same as a first chunk (its last token computed, as a
                # migration's first chunk would be over KV loaded from staging), then the second
                # output as the second chunk. A first chunk that ends on a block boundary has its
                # whole last block computed again, and that KV differs from the first request's in
                # the last bits: greedy near-ties then flip.
                held = ids + out[:1]
                readmit, _, again = await _plain(llm, f"b-{context}-{i}", held, 6, detokenize)
                chunk = out[1 : 1 + second_tokens]
                second, got = await _second_chunk(
                    llm, f"c-{context}-{i}", held, chunk, 6 - second_tokens, detokenize
                )
                rows.append(
                    {
                        "context": context,
                        "gap_ms": gap * 1000,
                        "readmit_ms": (readmit - gap) * 1000,
                        "second_ms": (second - gap) * 1000,
                        "readmit_same": float(again == out[1:7]),
                        "second_same": float(got == out[1 + second_tokens : 7]),
                    }
                )
                row = rows[-1]
                print(
                    f"  {context:5d} tokens, #{i + 1}: usual gap {row['gap_ms']:5.1f} ms, re-admission "
                    f"+{row['readmit_ms']:5.1f} ms, second chunk +{row['second_ms']:5.1f} ms, "
                    f"tokens as unmoved: {bool(row['readmit_same'])}, {bool(row['second_same'])}",
                    flush=True,
                )
    finally:
        llm.shutdown()
    return rows


def readmission_table(rows: list[dict[str, float]], contexts: list[int]) -> str:
    """The markdown table, stamped with the commit and date it was measured at."""
    cells = []
    for context in contexts:
        mine = [r for r in rows if r["context"] == context]
        cells.append(
            [
                str(context),
                f"{statistics.median(r['gap_ms'] for r in mine):.1f} ms",
                f"{statistics.median(r['readmit_ms'] for r in mine):+.1f} ms",
                f"{statistics.median(r['second_ms'] for r in mine):+.1f} ms",
                f"{sum(int(r['readmit_same']) for r in mine)} of {len(mine)}",
                f"{sum(int(r['second_same']) for r in mine)} of {len(mine)}",
            ]
        )
    header = [
        "context", "usual gap", "cached re-admission, over the gap", "second chunk, over the gap",
        "as unmoved, re-admission", "as unmoved, second chunk",
    ]  # fmt: skip
    return "\n".join([stamp(), "", *table(header, "rrrrrr", cells)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 2048, 8000])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--second-tokens",
        type=int,
        default=1,
        choices=range(1, 6),
        help="tokens the second chunk brings (what the source decoded after the first chunk)",
    )
    parser.add_argument(
        "--vllm-detokenize",
        action="store_true",
        help="let vLLM make the text (Shoal's engines make their own and turn vLLM's off)",
    )
    args = parser.parse_args()
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    print(
        f"one SmolLM2 engine; contexts {args.contexts}, {args.repeats} repeats each; vLLM's "
        f"detokenizer {'on' if args.vllm_detokenize else 'off'}",
        flush=True,
    )
    rows = asyncio.run(run(args.contexts, args.repeats, args.seed, args.second_tokens, args.vllm_detokenize))
    print(readmission_table(rows, args.contexts))


if __name__ == "__main__":
    main()
