"""Moves that overlap: the stall clients see when several requests move at once.

Method
------
A fleet of two SmolLM2-135M-Instruct CPU engines with the settings the launcher ships (128-token
blocks, pre-copy paced to 5 % of the time, mutual TLS on the KV links). Each scene starts
``--streams`` greedy streams (``--prompt-len`` random prompt ids, fresh per stream, so no prefix
cache hits; ``ignore_eos``), which the router spreads over both engines, and once every stream
has ``--move-after`` tokens it asks for moves, all at once, without waiting for any:

* ``one``: one stream moves (the baseline: a move alone);
* ``one_way``: every stream on engine-0 moves to engine-1 (a drain's burst);
* ``both_ways``: half of the moves go each way, at once (a balancing round in both directions);
* ``one_way_shared``: as ``one_way``, the streams' prompts the same ``--shared-tokens`` (a system
  prompt) and ``SHARED_OWN_TOKENS`` of their own, so both engines' prefix caches hold the shared
  blocks: a move sends none of them (the target says it holds them); the same run's ``one_way``
  is its baseline.

The client (asyncio, httpx) stamps every SSE event of every stream. A moved stream's stall is the
gap before the event that carries the target's first token (the source stopped after the move's
``total_tokens``) minus the stream's usual gap (the median of its other gaps), reported in ms and
in usual gaps; beside it, the stall the target engine recorded (source's last token to target's
first, no router or client in it) and how long the ``Migrate`` call took. Scenes repeat
``--repeats`` times on one fleet; two unmeasured moves go first.

Target (issue 40, part 5): with 8 moves at once, client-visible stall p99 <= 2 usual gaps.

Results: ``bench/results/overlap-<time>.json`` and the section between ``<!-- overlap:begin -->``
and ``<!-- overlap:end -->`` of ``docs/benchmarks.md`` (``python -m bench.overlap``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import redis

from bench.harness import publish, quantile, save_results, say, stamp, table, utc_now
from bench.migration import _control_stubs, bench_fleet
from shoal_fleet.launcher import Fleet, FleetConfig
from shoal_protos import engine_control_pb2 as pb
from shoal_protos.records import Keys, migration_record_decoder

BEGIN, END = "<!-- overlap:begin -->", "<!-- overlap:end -->"
SCENES = ("one", "one_way", "both_ways", "one_way_shared")
MEASURED = ("one_way", "both_ways")
SHARED_OWN_TOKENS = 16
"""The scenes the target is read on."""
GOAL_GAPS = 2.0


@dataclass
class Stream:
    prompt_len: int
    request_id: str = ""
    engine: str = ""
    stamps: list[float] = field(default_factory=list)
    upto: list[int] = field(default_factory=list)
    """Output tokens received up to and with each event."""


async def read(client: httpx.AsyncClient, body: dict[str, Any], out: Stream) -> None:
    async with client.stream("POST", "/v1/completions", json=body) as reply:
        reply.raise_for_status()
        out.request_id, out.engine = reply.headers["x-shoal-request-id"], reply.headers["x-shoal-engine"]
        received = 0
        async for line in reply.aiter_lines():
            if line.startswith("data: {"):
                out.stamps.append(time.perf_counter())
                received += len(json.loads(line[6:])["choices"][0]["token_ids"])
                out.upto.append(received)


def pick_moves(streams: list[Stream], scene: str, moves: int, rng: random.Random) -> list[tuple[Stream, str]]:
    """(stream, target) for each move of the scene: at most ``moves`` of them."""
    on = {e: [s for s in streams if s.engine == e] for e in ("engine-0", "engine-1")}
    if scene == "one":
        return [(rng.choice(streams), "")]
    if scene in ("one_way", "one_way_shared"):
        return [(s, "engine-1") for s in on["engine-0"][:moves]]
    half = min(len(on["engine-0"]), len(on["engine-1"]), moves // 2)
    return [(s, "engine-1") for s in on["engine-0"][:half]] + [(s, "engine-0") for s in on["engine-1"][:half]]


async def scene_once(
    cfg: FleetConfig, args: argparse.Namespace, scene: str, rng: random.Random
) -> list[dict[str, Any]] | None:
    """One scene's moves, measured; None when a stream ended before all reached the move."""
    stubs = _control_stubs(cfg)
    shared = (
        [rng.randrange(100, 40000) for _ in range(args.shared_tokens)] if scene.endswith("_shared") else []
    )
    own = SHARED_OWN_TOKENS if shared else args.prompt_len  # tokens of each stream's own
    streams = [Stream(len(shared) + own) for _ in range(args.streams)]
    async with httpx.AsyncClient(base_url=cfg.base_url, timeout=600) as client:
        bodies = [
            {
                "model": cfg.served_model_name,
                "prompt": shared + [rng.randrange(100, 40000) for _ in range(own)],
                "max_tokens": args.move_after + args.tokens_after,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "return_token_ids": True,
            }
            for _ in streams
        ]
        reading = [asyncio.create_task(read(client, b, s)) for b, s in zip(bodies, streams, strict=True)]
        deadline = time.monotonic() + 300
        while any(not s.upto or s.upto[-1] < args.move_after for s in streams):
            failed = [t.exception() for t in reading if t.done() and t.exception()]
            if time.monotonic() > deadline or failed:
                raise RuntimeError(f"the streams did not all reach the move: {failed}")
            if any(t.done() for t in reading):
                # One stream ended before the last began to decode (the engines' prefills of
                # sixteen prompts at once queue some of them for seconds): no scene to measure.
                for task in reading:
                    task.cancel()
                await asyncio.gather(*reading, return_exceptions=True)
                return None
            await asyncio.sleep(0.005)
        moves = pick_moves(streams, scene, args.moves, rng)
        called = time.perf_counter()
        futures = [
            (
                stream,
                stubs[stream.engine].Migrate.future(
                    pb.MigrateRequest(
                        request_id=stream.request_id,
                        target_engine_id=target,
                        reason="admin",
                        mode=pb.Mode.Value(args.mode.upper()),
                    ),
                    timeout=120,
                ),
            )
            for stream, target in moves
        ]
        await asyncio.gather(*reading)
    store = redis.Redis.from_url(cfg.redis_url)
    rows = []
    for stream, future in futures:
        result = future.result()
        if result.outcome != pb.MIGRATED:
            say(f"    {scene}: a move ended {result.code}: {result.detail}")
            continue
        raw = store.get(Keys(cfg.cluster).migration(result.migration_id))
        record = migration_record_decoder.decode(raw) if raw else None
        gaps = [(b - a) * 1000 for a, b in itertools.pairwise(stream.stamps)]
        first_there = result.total_tokens - stream.prompt_len
        event = next((i for i, n in enumerate(stream.upto) if n > first_there), len(stream.upto))
        switch = min(max(event - 1, 0), len(gaps) - 1)
        usual = statistics.median(gaps[:switch] + gaps[switch + 1 :])
        rows.append(
            {
                "scene": scene,
                "moves": len(moves),
                "stall_ms": max(0.0, gaps[switch] - usual),
                "stall_gaps": max(0.0, gaps[switch] - usual) / usual,
                "usual_ms": usual,
                "gap_ms": gaps[switch],
                "engine_stall_ms": record.stall_ms if record and record.stall_ms else None,
                "downtime_ms": result.downtime_ms,
                "kv_bytes": result.bytes,
                # The request's first blocks the target's prefix cache held: none of them sent.
                "target_cached_blocks": result.target_cached_blocks,
                "call_ms": (stream.stamps[switch + 1] - called) * 1000
                if switch + 1 < len(stream.stamps)
                else None,
                "phase_ms": dict(result.phase_ms),
                # The hand-over's parts on the target, from the commit to the first token there.
                "target_phase_ms": dict(record.target_phase_ms) if record else {},
            }
        )
    return rows


def summary_rows(rows: list[dict[str, Any]]) -> list[list[object]]:
    out: list[list[object]] = []
    for scene in SCENES:
        mine = [r for r in rows if r["scene"] == scene]
        if not mine:
            continue
        stall = [r["stall_ms"] for r in mine]
        gaps = [r["stall_gaps"] for r in mine]
        engine = [r["engine_stall_ms"] for r in mine if r["engine_stall_ms"] is not None]
        client = [r["gap_ms"] for r in mine]
        out.append(
            [
                scene,
                f"{statistics.median(r['moves'] for r in mine):.0f}",
                len(mine),
                f"{statistics.median(r['usual_ms'] for r in mine):.0f}",
                f"{quantile(stall, 0.5):.0f}",
                f"{quantile(stall, 0.99):.0f}",
                f"{quantile(gaps, 0.5):.1f}",
                f"{quantile(gaps, 0.99):.1f}",
                f"{quantile(client, 0.5):.0f} / {quantile(client, 0.99):.0f}",
                f"{quantile(engine, 0.5):.0f}" if engine else "n/a",
                f"{quantile(engine, 0.99):.0f}" if engine else "n/a",
                f"{statistics.median(r.get('kv_bytes', 0) for r in mine) / 1e6:.1f}",
                f"{statistics.median(r.get('target_cached_blocks', 0) for r in mine):.0f}",
            ]
        )
    return out


def verdict(rows: list[dict[str, Any]]) -> str:
    """The target, scene by scene (the scenes of several moves at once)."""
    parts = []
    for scene in MEASURED:
        gaps = [r["stall_gaps"] for r in rows if r["scene"] == scene]
        if gaps:
            p99 = quantile(gaps, 0.99)
            parts.append(f"`{scene}` {p99:.1f} usual gaps, {'met' if p99 <= GOAL_GAPS else 'not met'}")
    return f"Target, stall p99 <= {GOAL_GAPS:g} usual gaps: " + "; ".join(parts) + "."


def section(args: argparse.Namespace, rows: list[dict[str, Any]], measured: str, command: str) -> str:
    return "\n".join(
        [
            BEGIN,
            f"## Moves that overlap: the stall clients see ({utc_now('%Y-%m-%d')}, `{command}`)",
            "",
            f"Two SmolLM2 CPU engines with the launcher's settings; {args.streams} greedy streams of "
            f"{args.prompt_len} random prompt tokens spread over both; once all have {args.move_after} "
            "tokens, moves are asked for at once: `one` (a move alone), `one_way` (every stream on "
            f"engine-0 to engine-1, at most {args.moves}, as a drain does), `both_ways` (half of "
            f"{args.moves} each way), `one_way_shared` (as `one_way`, each prompt the same "
            f"{args.shared_tokens} tokens and {SHARED_OWN_TOKENS} of its own: both engines' prefix caches "
            f"hold the shared blocks, and the moves send none of them), in mode `{args.mode}`. Stall: the "
            "client's gap at the hand-over minus the stream's usual gap, in ms and in usual gaps; "
            "the hand-over gap itself beside the one the target engine recorded (the source's last "
            f"token to the target's first, no router or client in it). {args.repeats} scenes each; target: "
            f"p99 <= {GOAL_GAPS:g} usual gaps with 8 moves at once.",
            "",
            measured,
            "",
            *table(
                [
                    "scene",
                    "moves at once",
                    "moves measured",
                    "usual gap ms",
                    "stall p50 ms",
                    "stall p99 ms",
                    "stall p50, gaps",
                    "stall p99, gaps",
                    "hand-over gap at the client p50 / p99 ms",
                    "as the target recorded it p50 ms",
                    "p99 ms",
                    "KV sent per move, MB p50",
                    "blocks the target held p50",
                ],
                "lrrrrrrrrrrrr",
                summary_rows(rows),
            ),
            "",
            verdict(rows),
            END,
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--move-after", type=int, default=24)
    parser.add_argument(
        "--tokens-after", type=int, default=64, help="tokens each stream asks for after the move"
    )
    parser.add_argument(
        "--moves", type=int, default=8, help="moves at once in the one_way and both_ways scenes"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--shared-tokens", type=int, default=256, help="prompt tokens the one_way_shared streams share"
    )
    parser.add_argument(
        "--mode", default="precopy", choices=["precopy", "precopy_unwarmed", "stop_and_copy", "recompute"]
    )
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args(argv)
    command = "python -m bench.overlap " + " ".join(argv if argv is not None else sys.argv[1:])
    cfg = bench_fleet(2048, "5%", 128)
    fleet = Fleet(cfg, say=lambda line: say("  " + line.strip()))
    rng = random.Random(0)
    rows: list[dict[str, Any]] = []
    try:
        fleet.start()
        fleet.wait_ready(600)
        say("two unmeasured moves first")
        for _ in range(2):
            asyncio.run(scene_once(cfg, args, "one", rng))
        for repeat in range(args.repeats):
            for scene in SCENES:
                got = None
                for _ in range(3):
                    got = asyncio.run(scene_once(cfg, args, scene, rng))
                    if got is not None:
                        break
                    say(f"    {scene}: a stream ended before all reached the move; again")
                if got is None:
                    raise RuntimeError(f"{scene}: three tries, each with a stream ended before the move")
                rows += got
                stalls = ", ".join(f"{r['stall_ms']:.0f}" for r in got)
                say(f"[{repeat + 1}/{args.repeats}] {scene}: {len(got)} moves, stalls {stalls} ms")
    finally:
        fleet.stop()
    measured = stamp()
    save_results("overlap", {"args": vars(args), "rows": rows, "measured": measured, "command": command})
    publish(section(args, rows, measured, command.strip()), BEGIN, END, print_only=args.no_docs)


if __name__ == "__main__":
    main()
