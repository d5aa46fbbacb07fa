"""Live-migration benchmarks: KV transport bandwidth, and the stall a moved request's client sees.

Method
------
**Bandwidth** (no model): two KV agents (``shoal_engine.kv.agent.KvAgent``, the code that runs in
every vLLM worker) in this process, the source holding a synthetic bf16 KV cache in SmolLM2's
layout (30 layers, 32-token blocks, 3 KV heads of 64: 737,280 bytes per block). One request's
blocks, 8 MB to 1 GB, go through the source agent's control socket (``SendBlocks``) into the
target agent's staging area over loopback, exactly as in a migration, once per transport
(``tcp``, ``gloo``, and ``tcp`` over the fleet's mutual TLS). Beside them, in the same run, raw
loopback TCP: one ``sendall`` of the same number of random bytes into a ``recv_into`` loop over
one reused buffer. Each size runs ``--repeats`` times; the table shows the median.

**Stall** (SmolLM2-135M-Instruct, a fleet of two CPU engines): for each context length, a
streaming greedy request with a prompt of that many random token ids (fresh per request, so no
prefix cache) is moved to the other engine after ``--move-after`` output tokens, with each mode:

* ``precopy``: Shoal's protocol (full blocks copied while the request decodes, the target warms
  its prefix cache with them, then the rest);
* ``precopy_unwarmed``: the same without the warm-up (the commit loads every staged block);
* ``stop_and_copy``: the request is stopped first, then all of its KV is copied;
* ``recompute``: no KV is copied; the target prefills the whole sequence.

Two unmeasured moves of the longest context go first. The client (httpx) asks for each move
without waiting for it (a gRPC future on a channel made ready before the stream), timestamps
every SSE event and counts its token ids. The stall of a move is
the gap before the event that carries the target's first token (the source stopped after
``total_tokens`` of the migration's result), minus the median gap of that stream (its usual
inter-token time). Beside it: the same gap as the target engine recorded it (source's last token
to target's first, no router or client in it), and the longest gap of the move, from the call to
the target's second token (before the hand-over the request still decodes on the source, whose
core the pre-copy and the warm-up share). The results file also keeps, for each move, the same
gap minus the median of the target's next 8 gaps (``local_stall_ms``: a baseline from the
machine's speed at the switch, which swings by up to 2x over minutes here) and the raw gaps
from the call to then (``gaps_ms``).

**Slowdown** (same fleet): ``--bystanders`` long greedy streams decode on both engines; a request
of each ``--slowdown-contexts`` length joins and, after ``--move-after`` tokens, is moved with
``precopy`` back and forth between the engines ``--slowdown-moves`` times (one more first, not
measured). Each move is paired with the window just before it, as long as the move before took,
in which nothing moves: the same streams on the same engines, back to back, so the machine's
drift stays out of the pair. Slowdown = the mean over the pairs of (the bystanders' mean
inter-token gap on the source while moving / just before - 1), with a 95 % bootstrap interval;
the same on the target, whose moving window runs 250 ms past the move (it injects and admits at
the end, and takes the request on). A pair whose client was held up over ``CLIENT_HOLD_MS`` (its
own event loop, watched on a 20 ms tick) is left out. The same slowdown on the source's own
clock comes with each move (``source_step_ms`` over ``source_step_ms_before``: the mean time
between its forward passes during the move and in as long a window just before it, as its KV
agent saw them end); no router or client is in it, so no pair is left out. Each of
``--slowdown-paces`` (pre-copy MiB/s like ``64``, a share of the time like ``5%``, or ``0``:
unpaced) gets a fleet of its own; the stall runs on the first.

Every run's numbers go to ``bench/results/migration-<time>.json``; a part skipped with
``--skip-*`` is reported from the last run that measured it. Results go between
``<!-- migration:begin -->`` and ``<!-- migration:end -->`` of ``docs/benchmarks.md``, with
``docs/img/migration_bandwidth.png`` and ``docs/img/migration_stall.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import torch
import zmq

from bench.harness import (
    DOCS,
    IMG,
    RESULTS,
    ROOT,
    bootstrap_interval,
    pyplot,
    save_plot,
    save_results,
    say,
    stamp,
    table,
    update_section,
)
from shoal_engine.kv.agent import KvAgent, TableUpdate
from shoal_fleet.launcher import Fleet, FleetConfig, write_fleet_tls
from shoal_protos import engine_control_pb2 as pb
from shoal_protos import kv, tls
from shoal_protos.records import MIGRATION_PHASES as PHASES
from shoal_protos.records import TARGET_PHASES

BEGIN, END = "<!-- migration:begin -->", "<!-- migration:end -->"
SMOL_LAYERS, SMOL_BLOCK_BYTES = 30, 2 * 32 * 3 * 64 * 2  # per layer: K and V, 32 tokens, 3 heads of 64, bf16
TRANSPORTS = ("tcp", "gloo", "tls")
"""``tls``: ``tcp`` over the fleet's mutual TLS (``shoal_protos.tls``), as engines run it where
the fleet has its TLS files (the operator's fleets and ``make run`` by default)."""
MODES = {
    "precopy": pb.PRECOPY,
    "precopy_unwarmed": pb.PRECOPY_UNWARMED,
    "stop_and_copy": pb.STOP_AND_COPY,
    "recompute": pb.RECOMPUTE,
}


# ---- bandwidth -----------------------------------------------------------------------------


def raw_tcp_seconds(nbytes: int) -> float:
    # Random bytes in memory that has been written: an untouched zeroed buffer would be sent
    # from one shared zero page, out of the cache.
    payload = memoryview(torch.randint(0, 256, (nbytes,), dtype=torch.uint8).numpy())
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    sink = bytearray(min(nbytes, 64 << 20))
    done = threading.Event()

    def receive() -> None:
        conn, _ = server.accept()
        view, left = memoryview(sink), nbytes
        while left:
            got = conn.recv_into(view[: min(len(view), left)])
            left -= got
        conn.sendall(b"k")
        conn.close()
        done.set()

    thread = threading.Thread(target=receive)
    thread.start()
    with socket.create_connection(("127.0.0.1", port)) as conn:
        start = time.perf_counter()
        conn.sendall(payload)
        conn.recv(1)
        elapsed = time.perf_counter() - start
    thread.join()
    server.close()
    return elapsed


def agent_seconds(nbytes: int, repeats: int, transport: str) -> list[float]:
    blocks = max(1, nbytes // (SMOL_LAYERS * SMOL_BLOCK_BYTES))
    source_kv = {
        f"l{i}": torch.randn(blocks, SMOL_BLOCK_BYTES // 2).to(torch.bfloat16) for i in range(SMOL_LAYERS)
    }
    target_kv = {
        f"l{i}": torch.zeros(1, SMOL_BLOCK_BYTES // 2, dtype=torch.bfloat16) for i in range(SMOL_LAYERS)
    }
    fleet_tls = tls.write(Path(tempfile.mkdtemp()) / "tls") if transport == "tls" else None
    transport = "tcp" if transport == "tls" else transport
    src = KvAgent(
        source_kv, blocks, 32, "tcp://127.0.0.1:27101", "tcp://127.0.0.1:27102", transport, tls=fleet_tls
    )
    # A staging arena that holds the whole transfer (the engine's default is 1 GiB).
    dst = KvAgent(
        target_kv,
        1,
        32,
        "tcp://127.0.0.1:27103",
        "tcp://127.0.0.1:27104",
        transport,
        staging_bytes=nbytes + (64 << 20),
        tls=fleet_tls,
    )
    src.update_tables([TableUpdate("r", "r-v", list(range(blocks)), True, 0)], [])
    src.step_done([TableUpdate("r", "r-v", [], False, blocks * 32)])
    ctx = zmq.Context()
    control, target = ctx.socket(zmq.REQ), ctx.socket(zmq.REQ)
    control.connect("tcp://127.0.0.1:27101")
    target.connect("tcp://127.0.0.1:27103")
    times = []
    try:
        # The first run is the cold one: the connection is made and the target's arena pages
        # are touched for the first time. It is reported on its own.
        for i in range(repeats + 1):
            control.send(kv.encoder.encode(kv.SendBlocks("r", f"m{i}", "tcp://127.0.0.1:27104", 0)))
            reply = kv.agent_reply_decoder.decode(control.recv())
            assert isinstance(reply, kv.SentBlocks) and reply.blocks == blocks, reply
            times.append(reply.seconds)
            target.send(kv.encoder.encode(kv.FreeStaging(f"m{i}")))
            target.recv()
    finally:
        control.close(linger=0)
        target.close(linger=0)
        ctx.term()
        src.close()
        dst.close()
    return times


def bandwidth(sizes_mb: list[int], repeats: int) -> list[dict[str, Any]]:
    rows = []
    for size in sizes_mb:
        nbytes = size << 20
        say(f"bandwidth: {size} MB ({repeats} runs of each)")
        raw = statistics.median(raw_tcp_seconds(nbytes) for _ in range(repeats))
        row: dict[str, Any] = {"mb": size, "raw_gbps": nbytes / raw / 1e9}
        for transport in TRANSPORTS:
            cold, *warm = agent_seconds(nbytes, repeats, transport)
            seconds = statistics.median(warm)
            row[f"{transport}_gbps"] = nbytes / seconds / 1e9
            row[f"{transport}_ratio"] = raw / seconds
            row[f"{transport}_cold_gbps"] = nbytes / cold / 1e9
        rows.append(row)
        say(
            "  raw {:.2f} GB/s, ".format(row["raw_gbps"])
            + ", ".join(
                f"{t} {row[f'{t}_gbps']:.2f} GB/s ({100 * row[f'{t}_ratio']:.0f} %)" for t in TRANSPORTS
            )
        )
    return rows


# ---- stall ---------------------------------------------------------------------------------


_CONTROL: dict[str, Any] = {}
# A gap this short (or under a quarter of the stream's usual one) is tokens that waited for the
# client, not a step of the engine.
LAG_MS = 5.0


def _control_stubs(fleet_cfg: FleetConfig) -> dict[str, Any]:
    """EngineControl stubs of both engines, on channels made ready once: a channel made on the
    stamping thread mid-stream held it up for 0.3-3 s (the stamps then showed that as a gap,
    and the tokens after it back to back)."""
    import grpc
    import redis

    from shoal_protos import engine_control_pb2_grpc as pb_grpc
    from shoal_protos.records import Keys, engine_record_decoder

    if not _CONTROL:
        client = redis.Redis.from_url(fleet_cfg.redis_url)
        for engine_id in ("engine-0", "engine-1"):
            raw = client.get(Keys(fleet_cfg.cluster).engine(engine_id))
            address = engine_record_decoder.decode(raw).control_address
            channel = tls.channel(address, tls.load_optional(fleet_cfg.fleet_tls_dir))
            grpc.channel_ready_future(channel).result(timeout=60)
            _CONTROL[engine_id] = pb_grpc.EngineControlStub(channel)
    return _CONTROL


def stall_once(
    fleet_cfg: FleetConfig, context: int, mode: str, move_after: int, rng: random.Random
) -> dict[str, Any] | None:
    """One moved request's row, or None if it finished before the move reached it."""
    import redis

    from shoal_protos.records import Keys, migration_record_decoder

    stubs = _control_stubs(fleet_cfg)
    prompt = [rng.randrange(100, 40000) for _ in range(context)]
    body = {
        "model": fleet_cfg.served_model_name,
        "prompt": prompt,
        "max_tokens": move_after + 64,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    stamps: list[float] = []
    # Output tokens up to and with each event: the target's first token is found by its index.
    upto: list[int] = []
    received = 0
    moving: Any = None
    client = redis.Redis.from_url(fleet_cfg.redis_url)
    with httpx.stream("POST", fleet_cfg.base_url + "/v1/completions", json=body, timeout=600) as reply:
        reply.raise_for_status()
        request_id, engine = reply.headers["x-shoal-request-id"], reply.headers["x-shoal-engine"]
        other = "engine-1" if engine == "engine-0" else "engine-0"
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            stamps.append(time.perf_counter())
            received += len(json.loads(line[6:])["choices"][0]["token_ids"])
            upto.append(received)
            if len(stamps) == move_after:
                # Asked for without waiting (``Migrate`` returns when the move is done): this
                # thread goes on stamping tokens as they come.
                moving = stubs[engine].Migrate.future(
                    pb.MigrateRequest(request_id=request_id, target_engine_id=other, mode=MODES[mode]),
                    timeout=120,
                )
    result = moving.result() if moving is not None else None
    if result is None or result.outcome != pb.MIGRATED:
        return None  # it finished before the move reached it (the client lagged): try again
    gaps = [(b - a) * 1000 for a, b in itertools.pairwise(stamps)]
    # The hand-over: the gap before the event that carries the target's first token (the
    # source stopped after ``total_tokens`` - prompt outputs).
    first_there = result.total_tokens - context
    event = next((i for i, n in enumerate(upto) if n > first_there), len(upto))
    switch = min(max(event - 1, 0), len(gaps) - 1)
    usual = statistics.median(gaps[:switch] + gaps[switch + 1 :])
    # The longest gap while the move ran: from the call to the target's second token. Before the
    # hand-over the request still decodes on the source, whose core the pre-copy shares.
    window = gaps[move_after - 1 : max(switch + 2, move_after)]
    worst = max(window)
    # The target's own pace right after the hand-over: this machine's speed swings by up to 2x
    # over minutes (the usual gap of one 8k stream read 57-119 ms in one run), and a stream's
    # median mixes the phases its gaps fell in; the next gaps on the target share the switch's.
    after = gaps[switch + 1 : switch + 9]
    local = statistics.median(after) if len(after) >= 3 else usual
    raw_record = client.get(Keys(fleet_cfg.cluster).migration(result.migration_id))
    record = migration_record_decoder.decode(raw_record) if raw_record else None
    engine_stall = record.stall_ms if record else None
    return {
        "context": context,
        "mode": mode,
        "stall_ms": max(0.0, gaps[switch] - usual),
        "worst_ms": max(0.0, worst - usual),
        # Events that came back to back during the move (they waited for the client, or the
        # router wrote them at once): the client's stamps hide part of the move's gaps there.
        "lagged": min(window) < max(LAG_MS, usual / 4),
        # From the source's last token to the target's first, as the target recorded it.
        "engine_stall_ms": max(0.0, (engine_stall or 0.0) - usual),
        "gap_ms": gaps[switch],
        "itl_ms": usual,
        # The same gap minus the median of the target's next 8 gaps (the phase-local baseline),
        # and the raw gaps from the call to then, for reading single moves.
        "local_stall_ms": max(0.0, gaps[switch] - local),
        "local_itl_ms": local,
        "gaps_ms": gaps[move_after - 1 : switch + 9],
        "downtime_ms": result.downtime_ms,
        "bytes": result.bytes,
        "stages": result.stages,
        "warm_tokens": result.warm_tokens,
        "phase_ms": dict(result.phase_ms),
        # The hand-over's parts on the target, from the commit to the first token there.
        "target_phase_ms": dict(record.target_phase_ms) if record else {},
    }


def pace_of(text: str) -> tuple[int, float]:
    """A ``--slowdown-paces`` item as (MiB/s, share of the time): ``64`` or ``5%``; ``0``: unpaced."""
    if text.endswith("%"):
        return 0, float(text[:-1]) / 100
    return int(text), 0.0


def pace_label(text: str) -> str:
    mib, share = pace_of(str(text))
    return f"{mib} MiB/s" if mib else f"{100 * share:g} % of the time" if share else "none"


def bench_fleet(max_model_len: int, pace: str, block_size: int) -> FleetConfig:
    precopy_mib_per_s, precopy_share = pace_of(pace)
    return FleetConfig(
        model_path=ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct",
        served_model_name="SmolLM2-135M-Instruct",
        run_dir=ROOT / ".cache" / "bench" / "migration",
        engines=2,
        cluster="bench-migration",
        router_port=28100,
        router_zmq_port=28101,
        tokenizer_port=28102,
        redis_port=28103,
        engine_zmq_base_port=28110,
        engine_http_base_port=28120,
        engine_control_base_port=28130,
        engine_kv_base_port=28140,
        max_model_len=max_model_len,
        kv_cache_gib=2,
        restart=False,
        kv_block_size=block_size,
        migration_precopy_mib_per_s=precopy_mib_per_s,
        migration_precopy_share=precopy_share,
        # As `make run` and the operator's fleets: EngineControl and KV data over mutual TLS.
        fleet_tls_dir=write_fleet_tls(ROOT / ".cache" / "bench" / "migration" / "fleet-tls"),
    )


def stall(
    cfg: FleetConfig, contexts: list[int], repeats: int, move_after: int, modes: list[str]
) -> list[dict[str, Any]]:
    rows = []
    rng = random.Random(0)
    # Not measured: two moves of the longest context first, so that no measured move
    # pays for first use (the targets' staging memory faulted in, the KV links' first transfers).
    for _ in range(2):
        stall_once(cfg, max(contexts), "precopy", move_after, rng)
    for context in contexts:
        for mode in modes:
            for i in range(repeats):
                for _ in range(5):
                    row = stall_once(cfg, context, mode, move_after, rng)
                    if row is not None:
                        break
                    say(f"stall: context {context}, {mode}: the request was gone before the move; again")
                else:
                    raise RuntimeError(f"context {context}, {mode}: no request could be moved")
                rows.append(row)
                say(
                    f"stall: context {context}, {mode} #{i + 1}: {row['stall_ms']:.1f} ms "
                    f"(gap {row['gap_ms']:.1f}, usual {row['itl_ms']:.1f}, "
                    f"target's next {row['local_itl_ms']:.1f}; target's clock "
                    f"{row['engine_stall_ms']:.1f} ms; worst gap of the move {row['worst_ms']:.1f} ms; "
                    f"{row['bytes'] / 1e6:.1f} MB)"
                )
    return rows


# ---- slowdown of the other requests -------------------------------------------------------


async def _stream_stamps(client: httpx.AsyncClient, body: dict[str, Any], out: dict[str, Any]) -> None:
    """Stream one completion, time-stamping every token line into ``out['stamps']``."""
    async with client.stream("POST", "/v1/completions", json=body) as reply:
        reply.raise_for_status()
        out["engine"], out["request_id"] = (
            reply.headers["x-shoal-engine"],
            reply.headers["x-shoal-request-id"],
        )
        async for line in reply.aiter_lines():
            if line.startswith("data: {"):
                out["stamps"].append(time.perf_counter())


async def _until(check: Any, deadline_s: float, what: str) -> None:
    end = time.monotonic() + deadline_s
    while not check():
        if time.monotonic() > end:
            raise TimeoutError(f"waited {deadline_s:.0f} s for {what}")
        await asyncio.sleep(0.005)


def _window_gaps(stamps: list[float], start: float, end: float) -> list[float]:
    return [(b - a) * 1000 for a, b in itertools.pairwise(stamps) if start <= b <= end]


def _other(engine: str) -> str:
    return "engine-1" if engine == "engine-0" else "engine-0"


# A pair whose windows saw the client's own event loop held up longer than this is left out: its
# stamps then bunch tokens that came apart, and its next window is as long as the hold-up.
CLIENT_HOLD_MS = 50.0
# The target's moving window runs this long past the move: it injects, admits and takes the
# request on at the end.
TARGET_TAIL_S = 0.25


class _LoopWatch:
    """Wakes every ``tick_s`` and keeps how late each wake-up was: the longest hold-up of this
    event loop (by the machine, not by the engines) between two times."""

    def __init__(self, tick_s: float = 0.02) -> None:
        self._tick_s = tick_s
        self._late: list[tuple[float, float]] = []  # (when it woke, how late, ms)
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            due = time.perf_counter() + self._tick_s
            await asyncio.sleep(self._tick_s)
            now = time.perf_counter()
            self._late.append((now, (now - due) * 1000))

    def __enter__(self) -> _LoopWatch:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()

    def held_ms(self, start: float, end: float) -> float:
        return max((late for at, late in self._late if start <= at <= end), default=0.0)


async def slowdown_scene(
    cfg: FleetConfig,
    context: int,
    moves: int,
    move_after: int,
    bystanders: int,
    rng: random.Random,
) -> list[dict[str, Any]]:
    """``bystanders`` long streams decode on both engines; a request of ``context`` tokens joins
    and, after ``move_after`` tokens, is moved back and forth between the engines ``moves`` + 1
    times. Before each move comes a window with no move, as long as the move before it took on
    its source (the first move only sets that length): the same streams on the same engines, the
    moved request still on its source, just before. Returns one pair per measured move: the
    bystanders' inter-token gaps on the source and on the target in the window without a move and
    in the move (on the target, 250 ms past it: it injects and admits at the end), and the
    longest hold-up of this client's own event loop over both windows (``client_held_ms``)."""
    stubs = _control_stubs(cfg)

    def body(prompt: list[int], max_tokens: int) -> dict[str, Any]:
        return {
            "model": cfg.served_model_name,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }

    pairs: list[dict[str, Any]] = []
    others: list[dict[str, Any]] = [{"stamps": []} for _ in range(bystanders)]
    mover: dict[str, Any] = {"stamps": []}
    long_enough = cfg.max_model_len - 32
    async with httpx.AsyncClient(base_url=cfg.base_url, timeout=600) as client:
        tasks = [
            asyncio.create_task(
                _stream_stamps(client, body([rng.randrange(100, 40000) for _ in range(16)], long_enough), o)
            )
            for o in others
        ]
        try:
            with _LoopWatch() as watch:
                await _until(
                    lambda: all(len(o["stamps"]) >= 4 for o in others), 120, "the bystanders to decode"
                )
                prompt = [rng.randrange(100, 40000) for _ in range(context)]
                tasks.append(
                    asyncio.create_task(
                        _stream_stamps(client, body(prompt, cfg.max_model_len - context - 8), mover)
                    )
                )
                joined = time.perf_counter()
                await _until(lambda: len(mover["stamps"]) >= move_after, 300, "the request to decode")
                say(
                    f"slowdown: context {context}: {move_after} tokens in "
                    f"{time.perf_counter() - joined:.1f} s; moving it {moves + 1} times"
                )
                source, window = mover["engine"], 0.0
                for i in range(moves + 1):
                    target = _other(source)
                    still_start = time.perf_counter()
                    await asyncio.sleep(window)  # nothing moves: the baseline, just before the move
                    start = time.perf_counter()
                    request = pb.MigrateRequest(
                        request_id=mover["request_id"], target_engine_id=target, mode=pb.PRECOPY
                    )
                    result = await asyncio.to_thread(stubs[source].Migrate, request, timeout=120)
                    if result.outcome != pb.MIGRATED:
                        say(
                            f"slowdown: context {context}: move {i} ended "
                            f"{pb.Outcome.Name(result.outcome)} ({result.detail}); {len(pairs)} pairs"
                        )
                        break
                    end = time.perf_counter()
                    await asyncio.sleep(TARGET_TAIL_S)
                    if i:  # the first move only sets the window's length
                        pair = _slowdown_pair(others, source, target, still_start, start, end)
                        pair["context"] = context
                        pair["client_held_ms"] = watch.held_ms(still_start, end + TARGET_TAIL_S)
                        pair["phase_ms"] = dict(result.phase_ms)
                        # The source's own clock: its forward passes, as its KV agent saw them end.
                        pair["engine_moving_ms"] = result.source_step_ms
                        pair["engine_still_ms"] = result.source_step_ms_before
                        pairs.append(pair)
                        held, timed = pair["client_held_ms"], pair["phase_ms"]
                        say(
                            f"slowdown: context {context} #{i}: source gaps "
                            f"{_mean(pair['source_moving']):.1f} ms moving vs "
                            f"{_mean(pair['source_still']):.1f} ms just before, its steps "
                            f"{result.source_step_ms:.1f} vs {result.source_step_ms_before:.1f} ms "
                            f"({pair['window_s'] * 1000:.0f} ms windows"
                            + (f"; client held up {held:.0f} ms, left out" if held > CLIENT_HOLD_MS else "")
                            + "; "
                            + ", ".join(f"{k} {timed[k]:.0f}" for k in PHASES if k in timed)
                            + " ms)"
                        )
                    # The move's length on its source: a client held up during the call would
                    # otherwise make the next window as long as the hold-up.
                    window, source = result.duration_ms / 1000, target
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return pairs


def _slowdown_pair(
    others: list[dict[str, Any]], source: str, target: str, still_start: float, start: float, end: float
) -> dict[str, Any]:
    def gaps(engine: str, a: float, b: float) -> list[float]:
        return [g for o in others if o.get("engine") == engine for g in _window_gaps(o["stamps"], a, b)]

    return {
        "window_s": end - start,
        "source_moving": gaps(source, start, end),
        "source_still": gaps(source, still_start, start),
        "target_moving": gaps(target, start, end + TARGET_TAIL_S),
        "target_still": gaps(target, still_start, start),
    }


def slowdown(
    cfg: FleetConfig, contexts: list[int], moves: int, move_after: int, bystanders: int
) -> list[dict[str, Any]]:
    """One scene per context: ``moves`` measured moves, each paired with the window before it."""
    rng = random.Random(1)
    rows = []
    for context in contexts:
        pairs = asyncio.run(slowdown_scene(cfg, context, moves, move_after, bystanders, rng))
        if not pairs:
            say(f"slowdown: context {context}: no move could be measured")
        rows += pairs
    return rows


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def slowdown_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per context: the pooled mean gaps, and the slowdown as the mean over the pairs of (mean gap
    while moving / mean gap just before - 1), with its 95 % interval. Pairs leave the machine's
    drift out: their two windows are back to back. Pairs during which the client itself was held
    up (``held``) are left out."""
    out = []
    for context in sorted({r["context"] for r in rows}):
        pairs = [r for r in rows if r["context"] == context]
        held = sum(p.get("client_held_ms", 0.0) > CLIENT_HOLD_MS for p in pairs)
        pairs = [p for p in pairs if p.get("client_held_ms", 0.0) <= CLIENT_HOLD_MS]
        row: dict[str, Any] = {"context": context, "trials": len(pairs), "held": held}
        # The median time of each part of the moves on their source (rows of earlier runs have none).
        for phase in PHASES:
            times = [p["phase_ms"][phase] for p in pairs if phase in p.get("phase_ms", {})]
            row[f"{phase}_ms"] = statistics.median(times) if times else float("nan")
        # On the source's own clock every pair counts: a client held up does not move the
        # engine's stamps.
        clocked = [
            r
            for r in rows
            if r["context"] == context and r.get("engine_moving_ms") and r.get("engine_still_ms")
        ]
        row["engine_trials"] = len(clocked)
        row["engine_moving_ms"] = _mean([p["engine_moving_ms"] for p in clocked])
        row["engine_still_ms"] = _mean([p["engine_still_ms"] for p in clocked])
        _put_slowdown(row, "engine", [p["engine_moving_ms"] / p["engine_still_ms"] - 1 for p in clocked])
        for side in ("source", "target"):
            kept = [p for p in pairs if p[f"{side}_moving"] and p[f"{side}_still"]]
            row[f"{side}_moving_ms"] = _mean([g for p in kept for g in p[f"{side}_moving"]])
            row[f"{side}_still_ms"] = _mean([g for p in kept for g in p[f"{side}_still"]])
            ratios = [_mean(p[f"{side}_moving"]) / _mean(p[f"{side}_still"]) - 1 for p in kept]
            _put_slowdown(row, side, ratios)
        out.append(row)
    return out


def _put_slowdown(row: dict[str, Any], side: str, ratios: list[float]) -> None:
    """``row``'s slowdown on ``side``: the mean of the pairs' ratios - 1, with its 95 % interval."""
    row[f"{side}_slowdown"], row[f"{side}_low"], row[f"{side}_high"] = (
        bootstrap_interval(ratios, statistics.fmean) if ratios else (float("nan"),) * 3
    )


# ---- report --------------------------------------------------------------------------------

# Read on the client's clock: from requests whose client kept up during the move only (in the
# others, tokens waited for it and the stamps hide the move's gaps).
_CLIENT_CLOCK = ("stall_ms", "worst_ms")


def _client_fell_behind(row: dict[str, Any]) -> bool:
    """Tokens of the move came back to back (rows of earlier runs have no ``lagged``: a usual gap
    under ``LAG_MS`` says the same)."""
    return bool(row.get("lagged", False)) or row["itl_ms"] < LAG_MS


def stall_median(stalls: list[dict[str, Any]], mode: str, context: int, key: str) -> float | None:
    rows = [r for r in stalls if r["mode"] == mode and r["context"] == context]
    if key in _CLIENT_CLOCK:
        rows = [r for r in rows if not _client_fell_behind(r)]
    return statistics.median(r[key] for r in rows) if rows else None


def plots(bw: list[dict[str, Any]], stalls: list[dict[str, Any]]) -> None:
    plt = pyplot()
    if bw:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([r["mb"] for r in bw], [r["raw_gbps"] for r in bw], "o-", label="raw loopback TCP")
        for transport, marker in zip(TRANSPORTS, "s^D", strict=True):
            ax.plot(
                [r["mb"] for r in bw],
                [r[f"{transport}_gbps"] for r in bw],
                f"{marker}-",
                label=f"Shoal, {transport}",
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("transfer (MB)")
        ax.set_ylabel("GB/s")
        ax.set_title("KV transfer bandwidth")
        ax.legend()
        fig.tight_layout()
        save_plot(fig, IMG / "migration_bandwidth.png")
    if stalls:
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
        points = sorted({r["context"] for r in stalls})
        for ax, key, where in (
            (axes[0], "stall_ms", "client, hand-over gap"),
            (axes[1], "engine_stall_ms", "target engine's clock"),
        ):
            for mode in MODES:
                found = [(c, stall_median(stalls, mode, c, key)) for c in points]
                kept = [(c, m) for c, m in found if m is not None]
                ax.plot([c for c, _ in kept], [m for _, m in kept], "o-", label=mode)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("context (tokens)")
            ax.set_title(f"stall p50, {where}")
        axes[0].set_ylabel("stall (ms)")
        axes[0].legend()
        fig.suptitle("Stall of a migrated request, SmolLM2 on CPU")
        fig.tight_layout()
        save_plot(fig, IMG / "migration_stall.png")


def section(
    bw: list[dict[str, Any]],
    stalls: list[dict[str, Any]],
    slow: list[dict[str, Any]],
    args: argparse.Namespace,
    note: str,
    earlier: dict[str, str] | None = None,
) -> str:
    """The docs section; ``earlier`` holds, for each part taken from an earlier run, that run's
    note (its stamp), which the part's paragraph quotes."""

    def from_earlier(part: str) -> str:
        run = (earlier or {}).get(part)
        return f" (From an earlier run, not measured in this one: {run})" if run else ""

    lines = [
        BEGIN,
        "## Live migration: KV bandwidth and client-visible stall",
        "",
        "<!-- Written by bench.migration; `make bench-migration` rewrites this section. -->",
        "",
        f"**Run it:** `make bench-migration`. {note}",
        "",
    ]
    if bw:
        lines += [
            f"**Bandwidth.**{from_earlier('bandwidth')} "
            "One request's KV (synthetic, SmolLM2's layout: 30 layers, 737,280 bytes per "
            "32-token block) from one KV agent into another's staging area over loopback, beside one raw "
            f"`sendall` of the same random bytes into one reused buffer, median of {args.repeats} runs "
            "each (target: >= 80 % of raw from 64 MB). The cold columns are each transport's first "
            "transfer: the connection (and the gloo group) is made then and the target's staging arena "
            "is touched for the first time; later migrations find both ready.",
            "",
        ]
        header = [
            "size", "raw loopback TCP", "Shoal tcp", "share of raw", "Shoal gloo", "share of raw",
            "Shoal tcp, mutual TLS", "share of raw", "tcp, cold", "gloo, cold", "TLS, cold",
        ]  # fmt: skip
        lines += table(header, "r" * len(header), (_bandwidth_cells(r) for r in bw))
        lines += ["", "![bandwidth](img/migration_bandwidth.png)", ""]
    if stalls:
        lines += [
            f"**Stall.**{from_earlier('stall')} "
            "SmolLM2-135M-Instruct, two CPU engines (one core each, KV blocks of "
            f"{args.block_size} tokens, EngineControl and KV data over mutual TLS as in `make run`), "
            "a streaming greedy "
            f"request moved after {args.move_after} tokens; stall = the gap before the client's first "
            "token from the target, minus the stream's median inter-token gap; 'target's clock' = the "
            "same from the source's last token to the target's first, as the target recorded it (no "
            "client or router in it); 'worst' = the longest gap from the call to the target's second "
            "token, minus the same median (the pre-copy and warm-up share the source's core while the "
            f"request decodes there); {args.stall_repeats} requests per cell, median shown "
            "(targets: precopy p50 <= 30 ms, flat in context, >= 10x below recompute "
            "at the longest context). 'Precopy' has the target take the pre-copied context into its "
            "prefix cache before the stop (`WarmMigration`), so the commit loads only the last blocks; "
            "'unwarmed' is the same move with the whole KV loaded at the commit.",
            "",
        ]
        header = [
            "context", "precopy stall", "precopy, target's clock", "precopy, worst", "unwarmed stall",
            "unwarmed, target's clock", "stop-and-copy stall", "recompute stall", "precopy downtime",
            "KV moved", "usual ITL",
        ]  # fmt: skip
        contexts = sorted({r["context"] for r in stalls})
        lines += table(header, "r" * len(header), (_stall_cells(stalls, c) for c in contexts))
        lagged = sum(_client_fell_behind(r) for r in stalls)
        lines += [
            "",
            f"In {lagged} of the {len(stalls)} requests some tokens of the move came back to back "
            "(they waited for the client or the router): the client's stamps hide the move's gaps "
            "there, so the client-clock columns ('stall', 'worst') leave them out; the target's "
            "clock, downtime and ITL columns take every request.",
        ]
        lines += _target_phase_lines(stalls)
        lines += ["", "![stall](img/migration_stall.png)", ""]
    if slow:
        lines += [
            f"**Slowdown of the other requests.**{from_earlier('slowdown')} "
            f"{args.bystanders} other greedy streams decode on the "
            "two engines while a request of the given context moves back and forth between them "
            f"(precopy, first after {args.move_after} tokens); each move is paired with the window "
            "just before it, as long, in which nothing moves (the same streams on the same engines). "
            "Shown: the other streams' mean inter-token gap on the source during the moves and in the "
            "windows before, and on the target (its moving window runs 250 ms past the move: the "
            "target injects, admits and takes the request on at the end); slowdown = the mean over the "
            "pairs of each pair's ratio - 1, with its 95 % bootstrap interval in brackets "
            "(target: source slowdown <= 5 %). Pairs during which the measuring client's own event "
            f"loop was held up over {CLIENT_HOLD_MS:.0f} ms are left out (its stamps bunch the tokens "
            f"then); {sum(r.get('held', 0) for r in slow)} in this run. "
            "Each pre-copy pace runs on a fleet of its own "
            "(`--migration-precopy-mib-per-s`, or `--migration-precopy-share` for a share of the time). "
            "The source's own clock: the mean time between its forward passes during each move and "
            "in as long a window just before it, as its KV agent saw them end (`source_step_ms`, "
            "`source_step_ms_before` of each move; no router or client in it, so every pair counts).",
            "",
        ]
        header = [
            "pre-copy pace", "context", "pairs", "source, moving", "source, before", "source slowdown",
            "target, moving", "target, before", "target slowdown", "pairs, source's clock",
            "source's steps, moving", "before", "source slowdown, its clock",
        ]  # fmt: skip
        lines += table(header, "r" * len(header), (_slowdown_cells(r) for r in slow))
        timed = [r for r in slow if not math.isnan(r.get("precopy_ms", float("nan")))]
        if timed:
            lines += [
                "",
                "The same moves' parts on their source, median ms (`phase_ms` of each move: the "
                "pre-copy is paced, the rest runs at full speed):",
                "",
            ]
            cells = (
                [pace_label(r.get("pace", "0")), str(r["context"]), *(f"{r[f'{p}_ms']:.1f}" for p in PHASES)]
                for r in timed
            )
            lines += table(["pre-copy pace", "context", *PHASES], "rr" + "r" * len(PHASES), cells)
        lines.append("")
    lines.append(END)
    return "\n".join(lines)


def _target_phase_lines(stalls: list[dict[str, Any]]) -> list[str]:
    """A table of the pre-copy moves' hand-over on their target, median ms per context (rows of
    runs before the target timed it: none)."""
    timed = [r for r in stalls if r["mode"] == "precopy" and r.get("target_phase_ms")]
    if not timed:
        return []
    contexts = sorted({r["context"] for r in timed})
    lines = [
        "",
        "The pre-copy moves' hand-over on their target, median ms (`target_phase_ms` of each move, "
        "from the commit reaching the target to the first token back in its engine service; "
        "vLLM's own stamps split it), beside the target's usual gap (the median of its next 8):",
        "",
    ]
    cells = []
    for context in contexts:
        rows = [r for r in timed if r["context"] == context]
        parts = [statistics.median(r["target_phase_ms"].get(p, 0.0) for r in rows) for p in TARGET_PHASES]
        whole = statistics.median(sum(r["target_phase_ms"].values()) for r in rows)
        usual = statistics.median(r["local_itl_ms"] for r in rows)
        cells.append([str(context), *(f"{c:.1f}" for c in [*parts, whole, usual])])
    header = ["context", *TARGET_PHASES, "whole", "target's usual gap"]
    return lines + table(header, "r" * len(header), cells)


def _bandwidth_cells(r: dict[str, Any]) -> list[str]:
    return [
        f"{r['mb']} MB", f"{r['raw_gbps']:.2f} GB/s",
        f"{r['tcp_gbps']:.2f} GB/s", f"{100 * r['tcp_ratio']:.0f} %",
        f"{r['gloo_gbps']:.2f} GB/s", f"{100 * r['gloo_ratio']:.0f} %",
        f"{r['tls_gbps']:.2f} GB/s", f"{100 * r['tls_ratio']:.0f} %",
        f"{r['tcp_cold_gbps']:.2f} GB/s", f"{r['gloo_cold_gbps']:.2f} GB/s", f"{r['tls_cold_gbps']:.2f} GB/s",
    ]  # fmt: skip


def _stall_cells(stalls: list[dict[str, Any]], context: int) -> list[str]:
    def med(mode: str, key: str) -> str:
        value = stall_median(stalls, mode, context, key)
        return "n/a" if value is None else f"{value:.1f} ms"

    bytes_moved = stall_median(stalls, "precopy", context, "bytes") or 0.0
    return [
        str(context), med("precopy", "stall_ms"), med("precopy", "engine_stall_ms"),
        med("precopy", "worst_ms"), med("precopy_unwarmed", "stall_ms"),
        med("precopy_unwarmed", "engine_stall_ms"), med("stop_and_copy", "stall_ms"),
        med("recompute", "stall_ms"), med("precopy", "downtime_ms"),
        f"{bytes_moved / 1e6:.1f} MB", med("precopy", "itl_ms"),
    ]  # fmt: skip


def _slowdown_cells(r: dict[str, Any]) -> list[str]:
    cells = [
        pace_label(r.get("pace", "0")), str(r["context"]), str(r["trials"]),
        f"{r['source_moving_ms']:.1f} ms", f"{r['source_still_ms']:.1f} ms", _share(r, "source"),
        f"{r['target_moving_ms']:.1f} ms", f"{r['target_still_ms']:.1f} ms", _share(r, "target"),
    ]  # fmt: skip
    if not r.get("engine_trials"):
        return [*cells, "0", "n/a", "n/a", "n/a"]
    return [
        *cells, str(r["engine_trials"]), f"{r['engine_moving_ms']:.1f} ms",
        f"{r['engine_still_ms']:.1f} ms", _share(r, "engine"),
    ]  # fmt: skip


def _share(row: dict[str, Any], side: str) -> str:
    """A slowdown cell: ``+1.2 % [-0.8, +3.1]`` (rows of runs before the interval: no brackets)."""
    text = f"{100 * row[f'{side}_slowdown']:+.1f} %"
    if f"{side}_low" in row:
        text += f" [{100 * row[f'{side}_low']:+.1f}, {100 * row[f'{side}_high']:+.1f}]"
    return text


def last_results(part: str) -> tuple[list[dict[str, Any]], str]:
    """The rows of ``part`` from the last run that measured it, and that run's note (its stamp)."""
    for path in sorted(RESULTS.glob("migration-*.json"), reverse=True):
        saved = json.loads(path.read_text())
        rows: list[dict[str, Any]] = saved.get(part, [])
        if rows:
            say(f"{part}: numbers of {path.name} (not measured this time)")
            return rows, saved.get("note") or path.name
    return [], ""


def update_docs(text: str) -> None:
    update_section(text, BEGIN, END, DOCS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 2048, 4096, 8000])
    parser.add_argument("--stall-repeats", type=int, default=3)
    parser.add_argument(
        "--stall-modes",
        nargs="+",
        choices=list(MODES),
        default=list(MODES),
        help="the ways of moving the stall section measures (all of them by default)",
    )
    parser.add_argument("--move-after", type=int, default=16)
    parser.add_argument(
        "--block-size",
        type=int,
        default=FleetConfig.kv_block_size,
        help="the engines' KV block size in tokens (the fleet's default; the CPU build: multiples of 32)",
    )
    parser.add_argument("--slowdown-contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--slowdown-moves", type=int, default=24, help="measured moves per context and pace")
    parser.add_argument("--bystanders", type=int, default=4, help="other streams decoding during a move")
    parser.add_argument(
        "--slowdown-paces",
        nargs="+",
        default=["0", "64", "5%"],
        help="pre-copy paces: MiB/s (64), a share of the time (5%%), or 0 (unpaced)",
    )
    parser.add_argument("--skip-stall", action="store_true")
    parser.add_argument("--skip-slowdown", action="store_true")
    parser.add_argument("--skip-bandwidth", action="store_true")
    parser.add_argument("--no-docs", action="store_true", help="print the results, leave the docs alone")
    args = parser.parse_args()
    if set(args.stall_modes) != set(MODES) and not (args.no_docs or args.skip_stall):
        parser.error("--stall-modes with some of the modes needs --no-docs (the docs' table has them all)")
    started = time.monotonic()
    stalls: list[dict[str, Any]] = []
    slow: list[dict[str, Any]] = []
    slow_pairs: list[dict[str, Any]] = []
    ready = 0.0
    # One fleet per pre-copy pace; the stall runs on the first (unpaced by default).
    paces = ["0"] if args.skip_slowdown else args.slowdown_paces
    for index, pace in enumerate(paces if not (args.skip_stall and args.skip_slowdown) else []):
        # Room for the stall's longest request, and for the slowdown's moved request to decode
        # through all of its moves (SmolLM2 takes up to 8,192 positions).
        longest = max(max(args.contexts) + args.move_after + 160, max(args.slowdown_contexts) + 4000)
        cfg = bench_fleet(min(longest, 8192), pace, args.block_size)
        fleet = Fleet(cfg, say=say)
        began = time.monotonic()
        try:
            fleet.start()
            fleet.wait_ready(timeout_s=600)
            ready = ready or time.monotonic() - began
            if index == 0 and not args.skip_stall:
                stalls = stall(cfg, args.contexts, args.stall_repeats, args.move_after, args.stall_modes)
            if not args.skip_slowdown:
                say(f"slowdown: pre-copy pace {pace_label(pace)}")
                rows = slowdown(
                    cfg, args.slowdown_contexts, args.slowdown_moves, args.move_after, args.bystanders
                )
                slow += [{**row, "pace": pace} for row in slowdown_summary(rows)]
                slow_pairs += [{**row, "pace": pace} for row in rows]
        finally:
            fleet.stop()
    # Last: the bandwidth runs allocate and free several GiB, and engines started right after
    # them saw the client stall for a second at a time (the kernel reclaiming memory).
    bw = [] if args.skip_bandwidth else bandwidth(args.sizes_mb, args.repeats)
    note = (
        f"{stamp()} Machine: {torch.get_num_threads()} threads, torch {torch.__version__}; "
        f"fleet ready in {ready:.0f} s; whole run {(time.monotonic() - started) / 60:.1f} min."
    )
    results: dict[str, Any] = {
        "bandwidth": bw,
        "stall": stalls,
        "slowdown": slow,
        "slowdown_pairs": slow_pairs,
        "note": note,
    }
    save_results("migration", results)
    # A part skipped this time keeps its numbers (and their stamp) from the last run that measured it.
    earlier: dict[str, str] = {}
    for part in ("bandwidth", "stall", "slowdown"):
        if not results[part]:
            results[part], earlier[part] = last_results(part)
    text = section(results["bandwidth"], results["stall"], results["slowdown"], args, note, earlier)
    missing = [part for part in ("bandwidth", "stall", "slowdown") if not results[part]]
    if missing and not args.no_docs:
        # The section is written whole: writing it now would drop what the docs show of them.
        say(
            f"no run in {RESULTS.relative_to(ROOT)} measured {', '.join(missing)}: the docs keep "
            "their section (run those parts too to rewrite it); this run's section follows"
        )
    if args.no_docs or missing:
        print(text)
    else:
        plots(results["bandwidth"], results["stall"])
        update_docs(text)
        say(f"wrote {DOCS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
