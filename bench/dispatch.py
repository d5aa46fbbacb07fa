"""Dispatch decision time: how long the router's scheduler takes to place one request.

Method
------
The router's own ``Scheduler`` picks among ``EngineView`` objects (the router's view of each
engine) for 16, 64 and 256 engines with load reports drawn at random (requests running and
waiting, KV blocks in use out of 4,096). Each decision is followed by what dispatch does to the
chosen view (a request and its prompt blocks counted as sent), and every 100 decisions fresh
reports replace the old ones, as the router's 100 ms poll would. Prompts are 20 to 2,000
token ids, a third of them sharing one of ten system prompts, each with one of 100 session ids.
Every profile runs in the same process, interleaved in rounds, beside ``round_robin`` (the
baseline: no load read at all). Time is ``perf_counter_ns`` around ``Scheduler.pick``, garbage
collector on, as in the router. Target: at most 100 us p99 with 256 engines.

Results go between ``<!-- dispatch:begin -->`` and ``<!-- dispatch:end -->`` of
``docs/benchmarks.md``. Run it with ``python -m bench.dispatch`` (``make bench-dispatch``).
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass, field

from bench.harness import publish, quantile, stamp, table
from shoal_protos.records import EngineRecord, LoadReport
from shoal_router.core.dispatch import EngineView
from shoal_router.core.scheduling import Ask, Scheduler

BEGIN, END = "<!-- dispatch:begin -->", "<!-- dispatch:end -->"
PROFILES = ("round_robin", "least_load", "prefix_affinity", "session_affinity")
BLOCKS = 4096


def _report(rng: random.Random, engine_id: str, seq: int) -> LoadReport:
    used = rng.randint(0, BLOCKS - 96)
    return LoadReport(
        engine_id=engine_id, seq=seq, time=0.0, num_running=rng.randint(0, 64),
        num_waiting=rng.randint(0, 4), kv_blocks_used=used, kv_blocks_free=BLOCKS - used,
    )  # fmt: skip


def engines(rng: random.Random, count: int) -> list[EngineView]:
    views = []
    for i in range(count):
        engine_id = f"engine-{i:03d}"
        record = EngineRecord(
            engine_id=engine_id, model="m", zmq_address=f"tcp://10.0.{i // 250}.{i % 250}:5600",
            http_address="http://h:8100", max_model_len=8192, protocol_version=1, started_at=0.0,
            kv_blocks_total=BLOCKS,
        )  # fmt: skip
        views.append(EngineView(record, _report(rng, engine_id, 1)))
    return views


def asks(rng: random.Random, count: int) -> list[Ask]:
    systems = [[rng.randrange(50_000) for _ in range(rng.randint(64, 512))] for _ in range(10)]
    out = []
    for _ in range(count):
        tail = [rng.randrange(50_000) for _ in range(rng.randint(20, 1500))]
        prompt = [*rng.choice(systems), *tail] if rng.random() < 1 / 3 else tail
        out.append(Ask("m", prompt, f"session-{rng.randrange(100)}"))
    return out


@dataclass
class Timing:
    profile: str
    engines: int
    ns: list[int] = field(default_factory=list)

    def us(self, q: float) -> float:
        """Quantile ``q`` of the decision times, in microseconds."""
        return quantile(self.ns, q) / 1000


def run(
    profile: str, views: list[EngineView], requests: list[Ask], rng: random.Random, timing: Timing, n: int
) -> None:
    scheduler = Scheduler(profile, rng=random.Random(0))
    clock = time.perf_counter_ns
    for k in range(n):
        if k % 100 == 0:
            for view in views:
                view.update_report(_report(rng, view.engine_id, (view.report.seq if view.report else 0) + 1))
        ask = requests[k % len(requests)]
        started = clock()
        chosen = scheduler.pick(ask, views)
        timing.ns.append(clock() - started)
        assert chosen is not None
        chosen.sent(ask.blocks_on(chosen))
        chosen.inflight = 0  # the bench's requests end at once: only the reports count them


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--decisions", type=int, default=20_000, help="per profile and fleet size")
    parser.add_argument("--rounds", type=int, default=4, help="profiles interleave in this many rounds")
    parser.add_argument("--no-docs", action="store_true", help="print only; leave docs/benchmarks.md")
    args = parser.parse_args()
    rng = random.Random(7)
    requests = asks(rng, 500)
    timings: list[Timing] = []
    for count in (16, 64, 256):
        views = engines(rng, count)
        by_profile = {p: Timing(p, count) for p in PROFILES}
        for round_ in range(args.rounds):
            for profile in PROFILES:
                run(profile, views, requests, rng, by_profile[profile], args.decisions // args.rounds)
            print(f"  {count} engines: round {round_ + 1}/{args.rounds} done", flush=True)
        for timing in by_profile.values():
            print(
                f"  {count:>3} engines, {timing.profile}: p50 {timing.us(0.5):.1f} us, "
                f"p99 {timing.us(0.99):.1f} us",
                flush=True,
            )
        timings += by_profile.values()
    rows = [
        (t.engines, t.profile, f"{t.us(0.5):.1f} us", f"{t.us(0.99):.1f} us", f"{t.us(0.999):.1f} us")
        for t in timings
    ]
    section = "\n".join(
        [
            BEGIN,
            "## Dispatch: time to place a request",
            "",
            f"`make bench-dispatch`: the router's `Scheduler.pick` over 16, 64 and 256 engines, "
            f"{args.decisions:,} decisions per row,",
            "profiles interleaved in one process with `round_robin` (reads no load) as the baseline;",
            "reports refreshed every 100 decisions, each decision counted on its engine as dispatch",
            "does. Target: at most 100 us p99 with 256 engines.",
            "",
            stamp(),
            "",
            *table(["engines", "scheduler", "p50", "p99", "p99.9"], "r-rrr", rows),
            END,
        ]
    )
    publish(section, BEGIN, END, args.no_docs)


if __name__ == "__main__":
    main()
