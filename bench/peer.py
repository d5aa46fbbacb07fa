"""Two engines against two: the Shoal fleet beside the fleet users would deploy instead.

Method
------
Both fleets serve SmolLM2-135M-Instruct from two vLLM CPU engines, engine i bound to core i
(``VLLM_CPU_OMP_THREADS_BIND``), the same dtype, eager mode, ``max_model_len`` 2048,
``max_num_seqs`` 64, 1 GiB of KV cache each, tcmalloc preloaded where it is installed:

* **peer**: the Rust ``vllm-router`` (``power_of_two``) in front of two ``vllm serve`` (vLLM's
  OpenAI server, ``python -m vllm.entrypoints.openai.api_server``);
* **fleet**: ``shoal_fleet.launcher.Fleet`` with two engines and the settings it ships (router,
  tokenizer and Redis beside them; migration on).

Both fleets run at once and take turns: each round sends the same requests to one and then
the other (which goes first alternates by round), so a drift of the machine's speed between
rounds hits both. The load is ``vllm bench serve``'s random dataset: ``--prompt-len`` random
token ids in, ``--output-len`` tokens out (``ignore_eos``), ``--requests`` requests with at most
``--concurrency`` in flight, streamed ``/v1/completions``, a fresh seeded set of prompts per
round (no prefix cache hits). The client (``bench.serving``'s) measures TTFT, TPOT and
throughput per request where the user sees them.

Targets (issue 40, part 6), over all rounds' requests: throughput >= 1.0x the peer's, TTFT p99
<= 0.8x, TPOT p99 <= 1.0x.

Results: ``bench/results/peer-<timestamp>.json`` and the section between ``<!-- peer:begin -->``
and ``<!-- peer:end -->`` of ``docs/benchmarks.md``, with the plot ``docs/img/peer.png``.
Run it with ``make bench`` (``python -m bench.peer``; ``--quick`` is a smoke run that leaves the
docs alone).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.harness import (
    IMG,
    ROOT,
    http_ok,
    launch,
    port_free,
    publish,
    pyplot,
    save_plot,
    save_results,
    say,
    stamp,
    stop_group,
    table,
    utc_now,
    vllm_router_binary,
)
from bench.serving import (
    MODEL_NAME,
    BenchConfig,
    Progress,
    RequestResult,
    Scenario,
    Summary,
    VllmServer,
    heartbeat,
    random_prompts,
    run_by_concurrency,
    run_scenario,
    summarize,
)
from shoal_fleet.cpu import cpu_flags, native_dtype
from shoal_fleet.launcher import Fleet, FleetConfig

BEGIN, END = "<!-- peer:begin -->", "<!-- peer:end -->"
PLOT = IMG / "peer.png"
TARGETS = ("peer", "fleet")
PEER_SERVER_PORTS = (18820, 18822)
PEER_ROUTER_PORT = 18830
FLEET_PORTS = {
    "router_port": 18940,
    "redis_port": 16940,
    "tokenizer_port": 15940,
    "router_zmq_port": 15995,
    "engine_zmq_base_port": 15960,
    "engine_http_base_port": 16960,
    "engine_control_base_port": 16970,
    "engine_kv_base_port": 16980,
}
"""Away from ``make run``'s defaults and from ``bench.serving``'s."""
GOALS = {"throughput": 1.0, "ttft_p99": 0.8, "tpot_p99": 1.0}
"""Fleet / peer: at least the first, at most the others."""
LABELS = {"throughput": "throughput", "ttft_p99": "TTFT p99", "tpot_p99": "TPOT p99"}


class PeerFleet:
    """Two ``vllm serve``, engine i on core i, behind ``vllm-router`` with ``power_of_two``."""

    def __init__(self, cfg: BenchConfig, run_dir: Path, dtype: str) -> None:
        self.servers = [
            VllmServer(cfg, run_dir, port=port, core=core, dtype=dtype)
            for core, port in enumerate(PEER_SERVER_PORTS)
        ]
        self.base_url = f"http://127.0.0.1:{PEER_ROUTER_PORT}"
        self.log_path = run_dir / "peer-vllm-router.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float) -> None:
        for server in self.servers:
            server.start()
        for server in self.servers:
            server.wait_ready(timeout_s)
        command = [
            vllm_router_binary(), "--host", "127.0.0.1", "--port", str(PEER_ROUTER_PORT),
            "--worker-urls", *(s.base_url for s in self.servers), "--policy", "power_of_two",
            "--prometheus-port", str(PEER_ROUTER_PORT + 1), "--worker-startup-check-interval", "1",
            "--log-level", "warning",
        ]  # fmt: skip
        say(f"  command: {' '.join(command)} (log {self.log_path})")
        self._proc = launch(command, self.log_path)
        deadline = time.monotonic() + timeout_s
        while not http_ok(self.base_url + "/health"):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vllm-router did not come up; see {self.log_path}")
            time.sleep(0.2)

    def stop(self) -> None:
        stop_group(self._proc)
        for server in self.servers:
            server.stop()


def fleet_config(
    cfg: BenchConfig, run_dir: Path, dtype: str, engine_args: str = "", router_args: str = ""
) -> FleetConfig:
    """The fleet as the launcher ships it; ``engine_args`` and ``router_args`` (flags, as a
    shell would split them) try other settings."""
    return FleetConfig(
        model_path=cfg.model_path,
        served_model_name=MODEL_NAME,
        run_dir=run_dir / "fleet",
        engines=2,
        cluster="bench-peer",
        dtype=dtype,
        enforce_eager=True,
        engine_args=tuple(shlex.split(engine_args)),
        router_args=tuple(shlex.split(router_args)),
        **FLEET_PORTS,
    )


@dataclass
class Round:
    index: int
    order: list[str]
    summaries: dict[str, Summary]
    requests: dict[str, list[RequestResult]]


async def one_round(index: int, urls: dict[str, str], cfg: BenchConfig) -> Round:
    rng = random.Random(cfg.seed + index)
    scenario = Scenario(
        name="concurrency",
        label=f"concurrency {cfg.concurrency}, {cfg.requests} requests",
        prompts=random_prompts(rng, cfg.requests, cfg.prompt_len),
        concurrency=cfg.concurrency,
    )
    order = list(TARGETS) if index % 2 == 0 else list(reversed(TARGETS))
    done = Round(index, order, {}, {})
    # Idle connections expire before the servers' own 5 s keep-alive closes them under a request.
    limits = httpx.Limits(
        max_connections=cfg.requests + 8, max_keepalive_connections=cfg.requests + 8, keepalive_expiry=2.0
    )
    async with httpx.AsyncClient(
        limits=limits, timeout=httpx.Timeout(cfg.request_timeout_s, connect=10)
    ) as client:
        for target in order:
            summary, results = await run_scenario(
                client, urls[target] + "/v1/completions", target, scenario, cfg.output_len
            )
            done.summaries[target], done.requests[target] = summary, results
            say(
                f"  round {index + 1} {target}: {summary.requests / summary.wall_s:.3f} req/s, TTFT p50/p99 "
                f"{summary.ttft_p50_ms:.0f}/{summary.ttft_p99_ms:.0f} ms, TPOT p50/p99 "
                f"{summary.tpot_p50_ms:.0f}/{summary.tpot_p99_ms:.0f} ms, {summary.errors} error(s)"
            )
    return done


async def warm_up(urls: dict[str, str], cfg: BenchConfig) -> None:
    prompts = random_prompts(random.Random(cfg.seed - 1), 4, cfg.prompt_len)
    async with httpx.AsyncClient(timeout=cfg.request_timeout_s) as client:
        for target, url in urls.items():
            results = await run_by_concurrency(
                client,
                url + "/v1/completions",
                prompts,
                4,
                cfg.output_len,
                Progress(f"[{target} warm-up]", 4, every=4),
            )
            if not all(r.ok for r in results):
                raise RuntimeError(f"{target}'s warm-up failed: {[r.error for r in results if not r.ok]}")


def pooled(rounds: list[Round], target: str, cfg: BenchConfig) -> Summary:
    """One summary of every round's requests to ``target``; throughput over the rounds' walls."""
    results = [r for one in rounds for r in one.requests[target]]
    wall = sum(one.summaries[target].wall_s for one in rounds)
    scenario = Scenario("concurrency", f"{len(rounds)} rounds", [[0]] * len(results), cfg.concurrency)
    return summarize(target, scenario, results, wall)


def ratios(fleet: Summary, peer: Summary) -> dict[str, float]:
    def over(a: float | None, b: float | None) -> float:
        return a / b if a is not None and b else float("nan")

    return {
        "throughput": over(fleet.requests / fleet.wall_s, peer.requests / peer.wall_s),
        "ttft_p50": over(fleet.ttft_p50_ms, peer.ttft_p50_ms),
        "ttft_p99": over(fleet.ttft_p99_ms, peer.ttft_p99_ms),
        "tpot_p50": over(fleet.tpot_p50_ms, peer.tpot_p50_ms),
        "tpot_p99": over(fleet.tpot_p99_ms, peer.tpot_p99_ms),
    }


def met(ratio: dict[str, float]) -> dict[str, bool]:
    return {
        "throughput": ratio["throughput"] >= GOALS["throughput"],
        "ttft_p99": ratio["ttft_p99"] <= GOALS["ttft_p99"],
        "tpot_p99": ratio["tpot_p99"] <= GOALS["tpot_p99"],
    }


def row(label: str, s: Summary) -> list[object]:
    return [
        label,
        f"{s.requests / s.wall_s:.3f}",
        f"{s.output_tok_s:.1f}",
        f"{s.ttft_p50_ms:.0f}",
        f"{s.ttft_p99_ms:.0f}",
        f"{s.tpot_p50_ms:.0f}",
        f"{s.tpot_p99_ms:.0f}",
        s.errors,
    ]


def section(
    cfg: BenchConfig, rounds: list[Round], totals: dict[str, Summary], command: str, measured: str
) -> str:
    """The docs section; ``measured``: the stamp line of the run (its commit and time)."""
    ratio = ratios(totals["fleet"], totals["peer"])
    passed = met(ratio)
    rows = [row(f"{t}, all rounds", totals[t]) for t in TARGETS]
    per_round = "; ".join(
        f"round {r.index + 1} ({' first, '.join(r.order)} second): "
        + ", ".join(
            f"{LABELS[k]} {v:.2f}x"
            for k, v in ratios(r.summaries["fleet"], r.summaries["peer"]).items()
            if k in GOALS
        )
        for r in rounds
    )
    goal_rows = [
        [
            "throughput",
            f"{ratio['throughput']:.2f}x",
            ">= 1.0x",
            "met" if passed["throughput"] else "not met",
        ],
        ["TTFT p99", f"{ratio['ttft_p99']:.2f}x", "<= 0.8x", "met" if passed["ttft_p99"] else "not met"],
        ["TPOT p99", f"{ratio['tpot_p99']:.2f}x", "<= 1.0x", "met" if passed["tpot_p99"] else "not met"],
        ["TTFT p50", f"{ratio['ttft_p50']:.2f}x", "", ""],
        ["TPOT p50", f"{ratio['tpot_p50']:.2f}x", "", ""],
    ]
    lines = [
        BEGIN,
        "## Two engines against two: the fleet beside vllm-router and vllm serve "
        f"({utc_now('%Y-%m-%d')}, `{command}`)",
        "",
        "Both fleets serve SmolLM2-135M-Instruct from two vLLM CPU engines, engine i on core i, same "
        "dtype, eager, `max_num_seqs` 64, 1 GiB of KV each. **peer**: the Rust `vllm-router` "
        "(`power_of_two`) in front of two `vllm serve`; **fleet**: Shoal's two-engine fleet with the "
        "settings it ships (migration on). Both run at once and take turns, round by round (which "
        f"goes first alternates); each round: {cfg.requests} streamed completions of {cfg.prompt_len} "
        f"random prompt tokens and {cfg.output_len} output tokens, at most {cfg.concurrency} in flight, "
        f"fresh prompts per round (seed {cfg.seed} + round). Times at the client.",
        "",
        measured,
        "",
        *table(
            [
                "",
                "req/s",
                "output tok/s",
                "TTFT p50 ms",
                "TTFT p99 ms",
                "TPOT p50 ms",
                "TPOT p99 ms",
                "errors",
            ],
            "lrrrrrrr",
            rows,
        ),
        "",
        f"Fleet / peer round by round: {per_round}.",
        "",
        "Fleet / peer over all rounds, against the targets:",
        "",
        *table(["", "fleet / peer", "target", ""], "lrrl", goal_rows),
        "",
        "With a fixed output length, requests of one wave of this closed loop end together and "
        f"the next {cfg.concurrency} arrive together: each engine then prefills about "
        f"{cfg.concurrency // 2} prompts ({cfg.concurrency // 2 * cfg.prompt_len} tokens) at once, "
        "and that prefill is the TTFT both fleets show. Dispatch cannot shorten it (both split "
        "a wave evenly) and no move is worth making between two equally loaded engines, so "
        "neither Shoal's dispatch nor migration has room here to win TTFT p99 by 20 %.",
        "",
        f"![TTFT and TPOT percentiles, fleet and peer]({PLOT.relative_to(ROOT / 'docs')})",
        END,
    ]
    return "\n".join(lines)


def plot(totals: dict[str, Summary]) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, metric in zip(axes, ("ttft", "tpot"), strict=True):
        labels = ["p50", "p99"]
        for offset, target in ((-0.2, "peer"), (0.2, "fleet")):
            s = totals[target]
            values = [getattr(s, f"{metric}_p50_ms"), getattr(s, f"{metric}_p99_ms")]
            ax.bar([i + offset for i in range(2)], values, width=0.4, label=target)
        ax.set_xticks(range(2), labels)
        ax.set_ylabel("ms")
        ax.set_title(metric.upper())
        ax.legend(loc="lower center")
    fig.suptitle("Two engines against two, at the client (lower is better)")
    fig.tight_layout()
    save_plot(fig, PLOT)


def parse_args(argv: list[str] | None) -> tuple[BenchConfig, int, str, str, Path | None]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="one short round; the docs stay as they are")
    parser.add_argument("--fleet-engine-args", default="", help="extra engine flags (no docs)")
    parser.add_argument("--fleet-router-args", default="", help="extra router flags (no docs)")
    parser.add_argument("--from-results", type=Path, help="docs from a results file")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.requests, args.concurrency = 1, 8, 4
    cfg = BenchConfig(
        model_path=ROOT / ".cache" / "models" / MODEL_NAME,
        requests=args.requests,
        concurrency=args.concurrency,
        rate=0.0,
        warmup=4,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        seed=args.seed,
        start_timeout_s=600,
        request_timeout_s=600,
        fleet_first=False,
        write_docs=not (args.quick or args.fleet_engine_args or args.fleet_router_args),
        quick=args.quick,
    )
    return cfg, args.rounds, args.fleet_engine_args, args.fleet_router_args, args.from_results


def load_results(
    path: Path, cfg: BenchConfig
) -> tuple[BenchConfig, list[Round], dict[str, Summary], str, str]:
    """The load, rounds, totals and command of a run's results file (``--from-results``)."""
    data = json.loads(path.read_text())
    fields = ("requests", "concurrency", "prompt_len", "output_len", "seed")
    load = {k: int(data["config"][k]) for k in fields}
    rounds = [
        Round(i, r["order"], {t: Summary(**s) for t, s in r["summaries"].items()}, {})
        for i, r in enumerate(data["rounds"])
    ]
    totals = {t: Summary(**s) for t, s in data["totals"].items()}
    return dataclasses.replace(cfg, **load), rounds, totals, data["command"], data["measured"]


def main(argv: list[str] | None = None) -> None:
    cfg, rounds_wanted, engine_args, router_args, from_results = parse_args(argv)
    command = "python -m bench.peer " + " ".join(argv if argv is not None else sys.argv[1:])
    if from_results is not None:
        cfg, rounds, totals, command, measured = load_results(from_results, cfg)
        plot(totals)
        publish(section(cfg, rounds, totals, command.strip(), measured), BEGIN, END, print_only=False)
        return
    run_dir = ROOT / ".cache" / "bench" / "peer"
    dtype = native_dtype(cpu_flags())[0]
    taken = [p for p in [*PEER_SERVER_PORTS, PEER_ROUTER_PORT, *FLEET_PORTS.values()] if not port_free(p)]
    if taken:
        raise SystemExit(f"port(s) {taken} taken; is another benchmark running?")
    peer = PeerFleet(cfg, run_dir, dtype)
    fleet_cfg = fleet_config(cfg, run_dir, dtype, engine_args, router_args)
    fleet = Fleet(fleet_cfg, say=lambda line: say("  " + line.strip()))
    try:
        say("[1/3] starting both fleets")
        with heartbeat("starting the fleets"):
            peer.start(cfg.start_timeout_s)
            fleet.start()
            fleet.wait_ready(cfg.start_timeout_s)
        urls = {"peer": peer.base_url, "fleet": fleet.cfg.base_url}
        asyncio.run(warm_up(urls, cfg))
        say(f"[2/3] {rounds_wanted} round(s)")
        rounds = [asyncio.run(one_round(i, urls, cfg)) for i in range(rounds_wanted)]
    finally:
        say("stopping both fleets")
        fleet.stop()
        peer.stop()
    totals = {t: pooled(rounds, t, cfg) for t in TARGETS}
    measured = stamp()
    say("[3/3] results")
    payload: dict[str, Any] = {
        "config": {k: str(v) for k, v in dataclasses.asdict(cfg).items()},
        "dtype": dtype,
        "rounds": [
            {"order": r.order, "summaries": {t: dataclasses.asdict(s) for t, s in r.summaries.items()}}
            for r in rounds
        ],
        "totals": {t: dataclasses.asdict(s) for t, s in totals.items()},
        "ratios": ratios(totals["fleet"], totals["peer"]),
        "command": command,
        "measured": measured,
    }
    save_results("peer", payload)
    if cfg.write_docs:
        plot(totals)
    publish(section(cfg, rounds, totals, command, measured), BEGIN, END, print_only=not cfg.write_docs)


if __name__ == "__main__":
    main()
