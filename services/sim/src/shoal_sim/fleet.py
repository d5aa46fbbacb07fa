"""A fleet of simulated engines on simulated time, driven by the router's own scheduling code.

Llumnix's result (dispatch by load plus live migration against round-robin) shows at fleet
sizes one machine cannot run for real, so this runs the experiment as a discrete-event
simulation in which every part that decides is Shoal's own code:

* each engine is a ``SimBatch``: the simulated engine's batch, KV blocks, recompute preemption
  and step-time model (``shoal_sim.engine``), the same bookkeeping a ``--backend sim``
  engine process runs;
* dispatch is the router's ``Scheduler`` over its ``EngineView`` objects, fed load reports every
  ``report_interval_s`` (the engines' report period) and told of each request sent in between,
  as the router's fleet poll and dispatch do;
* with ``Fleet.hold``, a new request waits in the router's ``HoldLine`` while the engine it
  would go to, and the engine with the most room, are short of KV, released at each load report
  as the router releases it after each fleet poll;
* balancing is the router's ``Balancer`` policy, checked every ``balance_interval_s``; the source
  engine picks the request to move as ``EngineService.cheapest_to_move`` does, and the move is
  timed as the migration protocol runs it: a prepare call (the target reserves the blocks or
  refuses), pre-copy stages of the full blocks while the request keeps decoding on the source,
  then a stop for the blocks filled since and the partial one, and a commit, after which the
  request decodes on the target. Copies take ``blocks x block_bytes / kv_bandwidth``.

What it leaves out: the network between router and engines (dispatch is instantaneous), the
router's CPU, and tokenization. Every random draw comes from ``seed``: a run is the same for the
same arguments.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from shoal_engine.migration import MIN_TOKENS_LEFT
from shoal_protos.prefix import PrefixEvent, PrefixSnapshot, chain_hashes
from shoal_protos.records import EngineRecord, LoadReport
from shoal_router.core.dispatch import EngineView
from shoal_router.core.hold import HoldLine, HoldPolicy
from shoal_router.core.rebalance import BalancePolicy, Balancer, Move
from shoal_router.core.scheduling import Ask, Scheduler
from shoal_sim.engine import SimBatch, SimConfig, SimRequest, Step

ROUTER = "sim-router"
"""The simulated router's output address, which engines count its requests by."""


@dataclass(frozen=True)
class Workload:
    """Arrivals at ``rate`` with heavy-tailed prompt and output lengths.

    The defaults follow ShareGPT's shape, Poisson arrivals and lognormal lengths: most prompts
    short, a long tail of long ones; outputs of a few hundred tokens, a tail past a thousand.
    ``burstiness`` below 1 makes arrivals come in bursts (gamma-distributed gaps, as BurstGPT
    fits real traces); ``pareto_alpha`` draws power-law lengths instead (Llumnix's generated
    workloads), with the same medians."""

    rate: float
    """Requests per second, all engines together."""
    requests: int
    prompt_median: float = 128
    prompt_sigma: float = 1.1
    output_median: float = 256
    output_sigma: float = 0.8
    max_model_len: int = 4096
    seed: int = 0
    priority_share: float = 0.0
    """The share of requests that are priority requests (priority below 0)."""
    burstiness: float = 1.0
    """The shape of the gamma distribution of the gaps between arrivals: 1 is a Poisson
    process; below 1 the gaps vary more (their coefficient of variation is 1/sqrt(shape))."""
    pareto_alpha: float = 0.0
    """Above 0: prompt and output lengths follow a Pareto law of this index (smaller: heavier
    tail) instead of a lognormal one."""

    trace: tuple[tuple[float, int, int], ...] = ()
    """Requests to replay in place of the drawn ones: (arrival time, prompt tokens, output
    tokens) each, by arrival."""

    @classmethod
    def replay(cls, trace: Sequence[tuple[float, int, int]]) -> Workload:
        """The requests of ``trace`` (another run's, a real fleet's) instead of drawn ones."""
        if not trace:
            raise ValueError("an empty trace")
        return cls(rate=len(trace) / max(trace[-1][0], 1e-9), requests=len(trace), trace=tuple(trace))

    def prompts(self) -> list[list[int]] | None:
        """Each request's prompt token ids, where the workload has them (prompts that share
        prefixes); None: distinct ids per request."""
        return None

    def priorities(self) -> list[bool]:
        """Whether each request (by arrival) is a priority request; drawn apart from the lengths,
        so the same seed gives the same requests with any share."""
        rng = random.Random(self.seed + 1)
        return [rng.random() < self.priority_share for _ in range(self.requests)]

    def draw(self) -> list[tuple[float, int, int]]:
        """(arrival time, prompt tokens, output tokens) of each request, by arrival."""
        if self.trace:
            return list(self.trace)
        rng = random.Random(self.seed)
        now, out = 0.0, []
        for _ in range(self.requests):
            if self.burstiness == 1.0:
                now += rng.expovariate(self.rate)
            else:
                now += rng.gammavariate(self.burstiness, 1.0 / (self.burstiness * self.rate))
            prompt = min(max(4, round(self._length(rng, self.prompt_median, self.prompt_sigma))), 3072)
            output = max(4, round(self._length(rng, self.output_median, self.output_sigma)))
            out.append((now, prompt, min(output, self.max_model_len - prompt)))
        return out

    def _length(self, rng: random.Random, median: float, sigma: float) -> float:
        if self.pareto_alpha > 0:
            # A Pareto law's median is its scale times 2 ** (1 / alpha).
            return median / 2 ** (1 / self.pareto_alpha) * rng.paretovariate(self.pareto_alpha)
        return rng.lognormvariate(math.log(median), sigma)


class Arrivals(Protocol):
    """What a simulation runs: ``Workload``, or ``shoal_sim.workloads.Conversations``."""

    @property
    def requests(self) -> int: ...

    @property
    def seed(self) -> int: ...

    def draw(self) -> list[tuple[float, int, int]]: ...

    def prompts(self) -> list[list[int]] | None: ...

    def priorities(self) -> list[bool]: ...


@dataclass(frozen=True)
class Fleet:
    engines: int = 16
    sim: SimConfig = field(default_factory=SimConfig)
    scheduler: str = "least_load"
    migrate: bool = False
    balance: BalancePolicy = field(default_factory=BalancePolicy)
    balance_interval_s: float = 1.0
    report_interval_s: float = 0.1
    report_read_delay_s: float = 0.0
    """The router reads each round of load reports this long after the engines wrote it, at
    most (drawn per round, uniformly; the router polls Redis on its own clock): 0 reads them at
    once. Sends in between are what ``LoadReport.received`` is for."""
    count_received: bool = True
    """Reports carry the requests each engine took in (``LoadReport.received``), so the router
    counts its sends past them; False: a report read covers every send before it (the router
    before it had the counts)."""
    kv_bandwidth_gbps: float = 8.0
    """Gigabytes per second between two engines' KV caches."""
    block_bytes: int = 16 * 512 * 1024
    """Bytes of one KV block (LLaMA-2-7B in fp16: 512 KiB per token, 16 tokens)."""
    priority_headroom: float = 0.0
    """Fraction of an engine's KV cache counted as used per priority request it holds (the
    engines' ``--priority-headroom``)."""
    rpc_ms: float = 2.0
    """One control call (prepare, commit) between engines."""
    hold: HoldPolicy | None = None
    """Hold new requests at the router while every engine is short of KV (``core.hold``);
    None sends each at once."""
    max_stages: int = 3
    last_stage_blocks: int = 2
    """Pre-copy stages go on while more blocks than this filled during the last one."""
    move_load_ms: float = 10.0
    """What a moved request adds to its first step on the target: admitting it and loading its
    staged blocks into the KV cache. Measured on CPU engines (``bench.migration``'s hand-over:
    admission, and the first step over the target's usual one, together 7-12 ms across
    contexts); the GPU profiles are charged the same, which no GPU run has checked."""


@dataclass(eq=False)
class _Tracked:
    arrival: float
    sent: float
    """When the router sent it to an engine: its arrival, unless it was held."""
    request: SimRequest
    engine: int
    first: float = -1.0
    last: float = -1.0
    preempted_at: float = -1.0
    preemption_loss: float = 0.0
    moving: bool = False
    priority: bool = False
    handed_over: float = -1.0
    """While a move's first token on the target is awaited: the request's last token on the
    source, from which the client's gap is counted."""
    usual_gap: float = 0.0
    """Its mean gap between tokens before the move."""


@dataclass
class Result:
    ttft: list[float]
    decode: list[float]
    """Mean time per output token after the first, per request."""
    preemptions: int
    preemption_loss_s: float
    """Time preempted requests spent between being preempted and their next token, summed."""
    tokens: int
    offered_tokens_per_s: float
    """Output tokens asked for per second: all requests' outputs over the arrival window."""
    steady_tokens_per_s: float
    """Tokens per second delivered over the second half of the arrival window: equal to the
    offered rate while the fleet keeps up, less once requests queue without bound."""
    asked_steady_tokens_per_s: float
    """Output tokens asked for per second by the requests arriving in the second half of the
    arrival window: what ``steady_tokens_per_s`` keeps up with when arrivals come in bursts."""
    migrations: int
    migration_refused: int
    stall_ms: list[float]
    """Per move: the client's gap at the hand-over (its last token on the source to its first
    on the target) minus its usual gap before the move."""
    empty_engines: float = 0.0
    """Engines holding no request, on average over the second half of the arrival window (load
    reports' view): what a scale-down could remove without moving anything."""
    held_s: list[float] = field(default_factory=list)
    """Per request: how long the router held it before sending it (0 for most)."""
    priority_ttft: list[float] = field(default_factory=list)
    priority_decode: list[float] = field(default_factory=list)
    """The same as ``ttft`` and ``decode``, for the priority requests alone (in both lists)."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens admitted, and of those found in the engines' prefix caches."""

    @staticmethod
    def percentile(values: list[float], q: float) -> float:
        if not values:
            return float("nan")
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]

    def summary(self) -> dict[str, float]:
        p = self.percentile
        return {
            "ttft_p50_s": p(self.ttft, 50),
            "ttft_p99_s": p(self.ttft, 99),
            "decode_p50_ms": p(self.decode, 50) * 1000,
            "decode_p99_ms": p(self.decode, 99) * 1000,
            "preemptions": self.preemptions,
            "preemption_loss_s": self.preemption_loss_s,
            "offered_tokens_per_s": self.offered_tokens_per_s,
            "steady_tokens_per_s": self.steady_tokens_per_s,
            "asked_steady_tokens_per_s": self.asked_steady_tokens_per_s,
            "migrations": self.migrations,
            "stall_p99_ms": p(self.stall_ms, 99),
            "empty_engines": self.empty_engines,
            "held": sum(1 for h in self.held_s if h > 0),
            "held_p99_s": p(self.held_s, 99),
            "ttft_p90_s": p(self.ttft, 90),
            "cache_hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            **(
                {
                    "priority_ttft_p99_s": p(self.priority_ttft, 99),
                    "priority_decode_p50_ms": p(self.priority_decode, 50) * 1000,
                    "priority_decode_p99_ms": p(self.priority_decode, 99) * 1000,
                }
                if self.priority_ttft
                else {}
            ),
        }


def _cannot_fail(exc: Exception) -> None:
    raise AssertionError("the simulated fleet always has an engine") from exc


def _decode(tracked: list[_Tracked]) -> list[float]:
    return [(t.last - t.first) / (t.request.generated - 1) for t in tracked if t.request.generated > 1]


class Simulation:
    """One run: ``Simulation(fleet, workload).run()``."""

    def __init__(self, fleet: Fleet, workload: Arrivals, progress: Callable[[int], None] | None = None):
        self.fleet = fleet
        self.workload = workload
        self.progress = progress
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.batches = [SimBatch(fleet.sim) for _ in range(fleet.engines)]
        self._steps: list[Step | None] = [None] * fleet.engines
        reply_to = ROUTER if fleet.count_received else ""
        self.views = [EngineView(self._record(i), reply_to=reply_to) for i in range(fleet.engines)]
        self._received = [0] * fleet.engines
        self._read_delay = random.Random(workload.seed + 2)
        self._by_id = {view.engine_id: i for i, view in enumerate(self.views)}
        self.scheduler = Scheduler(fleet.scheduler, rng=random.Random(workload.seed))
        # The engines' prefix-cache events, as the router's index reads them (each report).
        self._index = self.scheduler.prefix_cache.index if self.scheduler.prefix_cache else None
        self._event_seq = 0
        if self._index is not None:
            for view in self.views:
                self._index.load(
                    view.engine_id, PrefixSnapshot(epoch="sim", seq=0, block_size=fleet.sim.block_size)
                )
        self._prompts = workload.prompts()
        self.balancer = Balancer(fleet.balance)
        self._report_seq = 0
        self._tracked: dict[str, _Tracked] = {}
        self._arrived = 0
        self.held = (
            HoldLine(fleet.hold, self._pick, lambda ask: self.scheduler.roomiest(ask, self.views))
            if fleet.hold is not None
            else None
        )
        self._left = workload.requests
        self.migrations = self.refused = 0
        self.stalls: list[float] = []
        # Engines found empty at each report within ``_empty_window``, and the reports counted.
        self._empty_window = (0.0, 0.0)
        self._empty_seen = self._empty_reports = 0

    def _record(self, index: int) -> EngineRecord:
        return EngineRecord(
            engine_id=f"engine-{index:03d}", model="m", zmq_address="", http_address="",
            max_model_len=self.fleet.sim.max_model_len, protocol_version=1, started_at=0.0,
            kv_blocks_total=self.fleet.sim.kv_blocks, kv_block_size=self.fleet.sim.block_size,
            control_address="sim",
            max_num_seqs=self.fleet.sim.max_num_seqs,
        )  # fmt: skip

    # ---- the event queue ------------------------------------------------------------------

    def at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (when, next(self._seq), action))

    def run(self) -> Result:
        draw = self.workload.draw()
        for (arrival, prompt, output), priority in zip(draw, self.workload.priorities(), strict=True):
            self.at(arrival, functools.partial(self._arrive, prompt, output, priority))

        window = draw[-1][0]
        self._empty_window = (window / 2, window)
        emitted: list[int] = []
        for when in (window / 2, window):
            self.at(when, lambda: emitted.append(sum(t.request.generated for t in self._tracked.values())))
        self.at(0.0, self._report)
        if self.fleet.migrate:
            self.at(self.fleet.balance_interval_s, self._balance)
        while self._events and self._left:
            self.now, _, action = heapq.heappop(self._events)
            action()
        tracked = list(self._tracked.values())
        urgent = [t for t in tracked if t.priority]
        return Result(
            ttft=[t.first - t.arrival for t in tracked],
            decode=_decode(tracked),
            preemptions=sum(b.preemptions for b in self.batches),
            preemption_loss_s=sum(t.preemption_loss for t in tracked),
            tokens=sum(t.request.generated for t in tracked),
            offered_tokens_per_s=sum(output for _, _, output in draw) / window,
            steady_tokens_per_s=(emitted[1] - emitted[0]) / (window / 2),
            asked_steady_tokens_per_s=sum(o for a, _, o in draw if a >= window / 2) / (window / 2),
            migrations=self.migrations,
            migration_refused=self.refused,
            stall_ms=self.stalls,
            empty_engines=self._empty_seen / self._empty_reports if self._empty_reports else 0.0,
            held_s=[t.sent - t.arrival for t in tracked],
            priority_ttft=[t.first - t.arrival for t in urgent],
            priority_decode=_decode(urgent),
            prompt_tokens=sum(b.cache_queries for b in self.batches),
            cached_tokens=sum(b.cache_hits for b in self.batches),
        )

    # ---- requests and engines ---------------------------------------------------------------

    def _pick(self, ask: Ask) -> EngineView:
        view = self.scheduler.pick(ask, self.views)
        assert view is not None
        return view

    def _arrive(self, prompt: int, output: int, priority: bool = False) -> None:
        number, arrival = self._arrived, self.now
        self._arrived += 1
        prefix: Sequence[int] = ()
        if self._prompts is not None:
            tokens: Sequence[int] = self._prompts[number]
            prefix = chain_hashes(tokens, self.fleet.sim.block_size)
        else:
            # Prompt ids only feed affinity scorers' hashes; distinct per request.
            tokens = range(number * 8192, number * 8192 + prompt)
        ask = Ask("m", tokens)

        def send(view: EngineView) -> None:
            engine = self._by_id[view.engine_id]
            view.sent(ask.blocks_on(view), now=self.now)
            self._received[engine] += 1  # dispatch is instantaneous: the engine has it now
            request = SimRequest(f"r{number}", prompt, output, prefix=prefix)
            self._tracked[request.request_id] = _Tracked(
                arrival, self.now, request, engine, priority=priority
            )
            self.batches[engine].add(request)
            self._wake(engine)

        if self.held is None or priority:  # priority requests have their headroom; never held
            send(self._pick(ask))
        else:
            self.held.offer(ask, self.now, send, fail=_cannot_fail)

    def _wake(self, engine: int) -> None:
        if self._steps[engine] is None:
            self._start_step(engine)

    def _start_step(self, engine: int) -> None:
        batch = self.batches[engine]
        before = batch.preemptions
        step = batch.plan()
        self._steps[engine] = step
        if step is None:
            return
        if batch.preemptions != before:
            for request in batch.waiting:
                tracked = self._tracked[request.request_id]
                if request.blocks == 0 and tracked.first >= 0 and tracked.preempted_at < 0:
                    tracked.preempted_at = self.now
        self.at(self.now + step.ms / 1000.0, lambda: self._end_step(engine))

    def _end_step(self, engine: int) -> None:
        step = self._steps[engine]
        assert step is not None
        for request, _ in self.batches[engine].finish(step):
            tracked = self._tracked[request.request_id]
            if tracked.first < 0:
                tracked.first = self.now
            if tracked.preempted_at >= 0:
                tracked.preemption_loss += self.now - tracked.preempted_at
                tracked.preempted_at = -1.0
            if tracked.handed_over >= 0:
                # The client's stall: the hand-over gap minus the request's usual gap.
                self.stalls.append((self.now - tracked.handed_over - tracked.usual_gap) * 1000.0)
                tracked.handed_over = -1.0
            tracked.last = self.now
            if request.finish is not None:
                view = self.views[tracked.engine]
                view.inflight = max(0, view.inflight - 1)
                self._left -= 1
                if self.progress is not None:
                    self.progress(self.workload.requests - self._left)
        self._start_step(engine)

    def _report(self) -> None:
        self._report_seq += 1
        if self._empty_window[0] <= self.now <= self._empty_window[1]:
            self._empty_reports += 1
            self._empty_seen += sum(1 for b in self.batches if not b.running and not b.waiting)
        headroom = self.fleet.priority_headroom * self.fleet.sim.kv_blocks
        reports = []
        for engine, (batch, view) in enumerate(zip(self.batches, self.views, strict=True)):
            used = batch.config.kv_blocks - batch.free
            urgent = (
                sum(1 for r in (*batch.running, *batch.waiting) if self._tracked[r.request_id].priority)
                if headroom
                else 0
            )
            reports.append(
                LoadReport(
                    engine_id=view.engine_id,
                    seq=self._report_seq,
                    time=self.now,
                    num_running=len(batch.running),
                    num_waiting=len(batch.waiting),
                    kv_blocks_used=used,
                    kv_blocks_free=batch.free,
                    kv_blocks_reserved=min(batch.config.kv_blocks, round(headroom * urgent)),
                    received={ROUTER: self._received[engine]} if self.fleet.count_received else {},
                )
            )
        self._publish_prefix_caches()
        if self.fleet.report_read_delay_s:
            delay = self._read_delay.uniform(0.0, self.fleet.report_read_delay_s)
            self.at(self.now + delay, lambda: self._read(reports))
        else:
            self._read(reports)
        self.at(self.now + self.fleet.report_interval_s, self._report)

    def _publish_prefix_caches(self) -> None:
        """Each engine's prefix-cache changes since the last report, into the router's index
        as its events would bring them."""
        if self._index is None:
            return
        self._event_seq += 1
        for view, batch in zip(self.views, self.batches, strict=True):
            stored, removed = batch.take_changes()
            event = PrefixEvent(epoch="sim", seq=self._event_seq, stored=stored, removed=removed)
            applied = self._index.apply(view.engine_id, event, "")
            assert applied, "the simulated engines' events come in order"

    def _read(self, reports: list[LoadReport]) -> None:
        """The router reads a round of load reports (and sends what it held, if it has room)."""
        for view, report in zip(self.views, reports, strict=True):
            view.update_report(report, now=self.now)
        if self.held is not None:
            self.held.release(self.now)

    # ---- balancing migrations -----------------------------------------------------------------

    def _balance(self) -> None:
        for move in self.balancer.decide(self.views, self.now):
            self.balancer.started(move)
            self._move(move)
        # The leader's emptying marks, as every router reads them from Redis.
        for view in self.views:
            emptying = view.engine_id in self.balancer.emptying
            if view.emptying != emptying:
                view.emptying = emptying
        self.at(self.now + self.fleet.balance_interval_s, self._balance)

    def _copy_s(self, blocks: int) -> float:
        return blocks * self.fleet.block_bytes / (self.fleet.kv_bandwidth_gbps * 1e9)

    def _move(self, move: Move) -> None:
        source, target = move.source, move.target
        src, dst = self._by_id[source.engine_id], self._by_id[target.engine_id]
        fleet, batch = self.fleet, self.batches[src]
        candidates = [
            r for r in batch.running
            if r.generated >= 1 and r.left >= MIN_TOKENS_LEFT and not self._tracked[r.request_id].moving
        ]  # fmt: skip
        if not candidates:
            self.balancer.ended(move, self.now)
            return
        # As ``EngineService.cheapest_to_move``: other requests before priority ones, then the
        # least KV to copy.
        request = min(candidates, key=lambda r: (self._tracked[r.request_id].priority, r.context))
        tracked = self._tracked[request.request_id]
        reserved = self.batches[dst].blocks(request.context + 1)
        if not self.batches[dst].reserve(reserved):
            self.refused += 1
            self.balancer.ended(move, self.now)
            return
        tracked.moving = True

        def abandon() -> None:
            tracked.moving = False
            self.batches[dst].unreserve(reserved)
            self.balancer.ended(move, self.now)

        def stage(number: int, copied: int) -> None:
            if request not in batch.running:  # finished or preempted during the copy
                abandon()
                return
            full = request.context // fleet.sim.block_size
            fresh = full - copied
            if number < fleet.max_stages and fresh > fleet.last_stage_blocks:
                self.at(self.now + self._copy_s(fresh), lambda: stage(number + 1, full))
                return
            # Stop: the request leaves the source's batch (a token of the step in progress is
            # lost); the rest and the partial block go.
            batch.drop(request)
            tracked.handed_over = tracked.last
            tracked.usual_gap = (tracked.last - tracked.first) / max(1, request.generated - 1)
            self._wake(src)
            self.at(self.now + self._copy_s(fresh + 1) + fleet.rpc_ms / 1000.0, commit)

        def commit() -> None:
            request.load_ms = fleet.move_load_ms
            self.batches[dst].admit_moved(request, reserved)
            tracked.engine, tracked.moving = dst, False
            self.views[src].inflight = max(0, self.views[src].inflight - 1)
            self.views[dst].inflight += 1
            self.migrations += 1
            self.balancer.ended(move, self.now)
            self._wake(dst)

        self.at(self.now + fleet.rpc_ms / 1000.0, lambda: stage(1, 0))
