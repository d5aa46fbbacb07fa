"""Prometheus metrics of one router, in a registry of its own (served at ``/metrics``).

Latency is measured where the client would see it (TTFT, inter-token gaps, TPOT, end to end),
plus what the router itself adds: time from arrival to dispatch, the time to handle each output
batch from the engines, and the process's CPU time (``process_cpu_seconds_total``), which over
requests or output tokens is the router's cost per request and per token.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from shoal_router.core.dispatch import EngineView

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
_QUEUE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
_BATCH_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2)
_RELAY_BUCKETS = (
    1e-4,
    2.5e-4,
    5e-4,
    7.5e-4,
    1e-3,
    1.5e-3,
    2e-3,
    3e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    1.0,
)
_STALL_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


C = TypeVar("C")


class LoopHistogramChild:
    """One series of a ``LoopHistogram``: counts per bucket (not cumulative) and the sum."""

    __slots__ = ("_bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound
        self.total = 0.0

    def observe(self, value: float) -> None:
        # A bucket holds values up to and including its bound (Prometheus's ``le``).
        self.counts[bisect_left(self._bounds, value)] += 1
        self.total += value


class LoopCounterChild:
    """One series of a ``LoopCounter``."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class _LoopFamily(Generic[C]):
    """A metric family updated only from the event loop's thread, for the series the request
    and stream paths touch on every request, SSE event or engine batch.

    prometheus_client's ``Histogram`` and ``Counter`` take a lock on every update (and a
    histogram scans its bounds and takes two), which the router, one thread, does not need:
    an observation here is a bisection and two additions. Scrapes run on the same thread
    (``/metrics`` is an async route), and the series read as prometheus_client's own would
    (names, ``le`` bounds, ``_total``), without their ``_created`` samples."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry,
        child: Callable[[], C],
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._child = child
        self._children: dict[tuple[str, ...], C] = {}
        registry.register(self)  # type: ignore[arg-type]  # a collector by its collect()
        if not labelnames:
            self._unlabelled = self.labels()

    def labels(self, *values: str) -> C:
        found = self._children.get(values)
        if found is None:
            found = self._children[values] = self._child()
        return found

    def describe(self) -> list[Metric]:
        return [self._family()]

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for values, child in self._children.items():
            self._add(family, list(values), child)
        yield family

    def _family(self) -> Metric:
        raise NotImplementedError

    def _add(self, family: Metric, values: list[str], child: C) -> None:
        raise NotImplementedError


class LoopHistogram(_LoopFamily[LoopHistogramChild]):
    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        bounds = tuple(sorted(buckets))
        self._bounds = [floatToGoString(bound) for bound in bounds] + ["+Inf"]
        super().__init__(name, documentation, labelnames, registry, lambda: LoopHistogramChild(bounds))

    def observe(self, value: float) -> None:
        self._unlabelled.observe(value)

    def _family(self) -> Metric:
        return HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def _add(self, family: Metric, values: list[str], child: LoopHistogramChild) -> None:
        assert isinstance(family, HistogramMetricFamily)
        cumulative, buckets = 0, []
        for bound, count in zip(self._bounds, child.counts, strict=True):
            cumulative += count
            buckets.append((bound, float(cumulative)))
        family.add_metric(values, buckets, child.total)


class LoopCounter(_LoopFamily[LoopCounterChild]):
    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str] = (), *, registry: CollectorRegistry
    ) -> None:
        super().__init__(name, documentation, labelnames, registry, LoopCounterChild)

    def inc(self, amount: float = 1.0) -> None:
        self._unlabelled.inc(amount)

    def _family(self) -> Metric:
        return CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def _add(self, family: Metric, values: list[str], child: LoopCounterChild) -> None:
        assert isinstance(family, CounterMetricFamily)
        family.add_metric(values, child.value)


@dataclass(frozen=True, slots=True)
class ModelMetrics:
    """One model's series of the per-request and per-token metrics, looked up once:
    ``labels()`` costs more than the observation itself, and the stream path observes every
    SSE event."""

    ttft: LoopHistogramChild
    token_gap: LoopHistogramChild
    output_tokens: LoopCounterChild
    tpot: LoopHistogramChild
    prompt_tokens: LoopCounterChild
    queue: LoopHistogramChild
    migrations: Counter
    migration_stall: Histogram


class RouterMetrics:
    """Every metric of one router, registered in its own ``registry`` in groups: requests and
    admission, the fleet as the leader steers it, latency and tokens per model, the relay of
    engine output, and each engine as its load reports say."""

    def __init__(self) -> None:
        self._models: dict[str, ModelMetrics] = {}
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)  # process_cpu_seconds_total, resident memory, open fds
        self._add_request_metrics(r)
        self._add_fleet_metrics(r)
        self._add_latency_metrics(r)
        self._add_relay_metrics(r)
        self._add_engine_metrics(r)

    def _add_request_metrics(self, r: CollectorRegistry) -> None:
        """HTTP answers, admission (in flight, queued, held for KV room), dispatch and retries."""
        self.requests = LoopCounter(
            "shoal_router_requests",
            "HTTP requests answered, by endpoint and status code.",
            ["endpoint", "status"],
            registry=r,
        )
        self.inflight = Gauge("shoal_router_requests_inflight", "Generation requests in flight.", registry=r)
        self.queued = Gauge(
            "shoal_router_requests_queued", "Requests waiting for a slot (the router is full).", registry=r
        )
        self.held = Gauge(
            "shoal_router_requests_held",
            "Requests waiting at the router for an engine with KV room (every engine is short of it).",
            registry=r,
        )
        self.hold_expired = Counter(
            "shoal_router_hold_expired",
            "Held requests sent after their longest wait, to an engine still short of KV room.",
            registry=r,
        )
        self.hold_spilled = Counter(
            "shoal_router_hold_spilled",
            "Requests sent to the engine with the most KV room because the one dispatch preferred "
            "(prefix or session affinity, round robin) was short of it.",
            registry=r,
        )
        self.dispatched = LoopCounter(
            "shoal_router_dispatched",
            "Requests sent to each engine, by the dispatch policy that chose it.",
            ["engine", "model", "policy"],
            registry=r,
        )
        self.dispatch_retries = Counter(
            "shoal_router_dispatch_retries",
            "Requests sent to another engine after theirs refused or lost them before a token.",
            registry=r,
        )
        self.rate_limited = Counter(
            "shoal_router_rate_limited",
            "Requests refused (429) because their API key is over its rate limits.",
            ["key"],
            registry=r,
        )
        self.resumed = Counter(
            "shoal_router_resumed_requests",
            "Requests continued on another engine, after the tokens already delivered, because "
            "their engine failed (code: engine_lost, engine_dead, engine_draining).",
            ["model", "code"],
            registry=r,
        )

    def _add_fleet_metrics(self, r: CollectorRegistry) -> None:
        """Engines' heartbeats, and the migrations this router asks for as the cluster's leader."""
        self.engine_silences = Counter(
            "shoal_router_engine_silences",
            "Engines whose heartbeat lapsed, by how it ended: back (a heartbeat within "
            "--engine-silence-grace, nothing moved) or lost (their requests went on elsewhere).",
            ["outcome"],
            registry=r,
        )
        self.balance_migrations = Counter(
            "shoal_router_balance_migrations",
            "Balancing migrations this router asked for as the cluster's leader, by outcome.",
            ["outcome"],
            registry=r,
        )
        self.consolidations = Counter(
            "shoal_router_consolidation_migrations",
            "Migrations emptying engines for consolidation this router asked for as the leader, by outcome.",
            ["outcome"],
            registry=r,
        )
        self.emptying = Gauge(
            "shoal_router_emptying_engines",
            "Engines this router, as the leader, is emptying for consolidation (no new requests).",
            registry=r,
        )
        self.leader = Gauge(
            "shoal_router_leader",
            "1 while this router holds the lease that lets it issue balancing migrations.",
            registry=r,
        )
        self.engines = Gauge(
            "shoal_router_engines",
            "Engines seen in Redis, by model and state (ACTIVE, DRAINING, EMPTYING, UNREACHABLE, SILENT).",
            ["model", "state"],
            registry=r,
        )

    def _add_latency_metrics(self, r: CollectorRegistry) -> None:
        """Latency as clients see it, and tokens, per model."""
        self.ttft = LoopHistogram(
            "shoal_router_time_to_first_token_seconds",
            "From request arrival to the first output token.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.token_gap = LoopHistogram(
            "shoal_router_inter_token_seconds",
            "Mean gap between output tokens of a request, observed per delta.",
            ["model"],
            buckets=_TOKEN_GAP_BUCKETS,
            registry=r,
        )
        self.e2e = LoopHistogram(
            "shoal_router_request_seconds",
            "From request arrival to its end.",
            ["model", "finish_reason"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = LoopCounter(
            "shoal_router_prompt_tokens", "Prompt tokens of requests.", ["model"], registry=r
        )
        self.output_tokens = LoopCounter(
            "shoal_router_output_tokens", "Output tokens delivered.", ["model"], registry=r
        )
        self.tpot = LoopHistogram(
            "shoal_router_time_per_output_token_seconds",
            "Per request: from its first output token to its last, over the tokens after the first.",
            ["model"],
            buckets=_TOKEN_GAP_BUCKETS,
            registry=r,
        )
        self.queue = LoopHistogram(
            "shoal_router_queue_seconds",
            "From request arrival to its dispatch to an engine (tokenizing, picking and any hold for KV room "
            "included).",
            ["model"],
            buckets=_QUEUE_BUCKETS,
            registry=r,
        )

    def _add_relay_metrics(self, r: CollectorRegistry) -> None:
        """The router's own work on engine output: batches, the relay delay, migrations seen mid-stream."""
        self.batch = LoopHistogram(
            "shoal_router_output_batch_seconds",
            "Router time to take in one output batch from an engine (decode, order, hand over).",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.relay_delay = LoopHistogram(
            "shoal_router_relay_delay_seconds",
            "What the router adds to a streamed token: from the engine batch that carried it being "
            "read off the socket to its SSE event being handed to the client's connection (for an "
            "event of several tokens, from the oldest).",
            buckets=_RELAY_BUCKETS,
            registry=r,
        )
        self.batch_pieces = LoopCounter(
            "shoal_router_output_pieces", "Request pieces taken in from engine output batches.", registry=r
        )
        self.migrations = Counter(
            "shoal_router_migrations",
            "Streams whose tokens started coming from another engine mid-request (a live migration).",
            ["model"],
            registry=r,
        )
        self.migration_stall = Histogram(
            "shoal_router_migration_stall_seconds",
            "Gap a client saw across a migration: first token from the new engine minus the last "
            "from the old one.",
            ["model"],
            buckets=_STALL_BUCKETS,
            registry=r,
        )

    def _add_engine_metrics(self, r: CollectorRegistry) -> None:
        """Each engine as its last load report and this router's counts say (set at scrape time)."""
        self.engine_requests = Gauge(
            "shoal_router_engine_requests",
            "Each engine's requests as its last load report says, by state (running, waiting).",
            ["engine", "model", "state"],
            registry=r,
        )
        self.engine_kv_usage = Gauge(
            "shoal_router_engine_kv_usage",
            "Each engine's KV cache use (0 to 1) as its last load report says.",
            ["engine", "model"],
            registry=r,
        )
        self.engine_step = Gauge(
            "shoal_router_engine_step_seconds",
            "Each engine's recent model step time as its last load report says.",
            ["engine", "model"],
            registry=r,
        )
        self.engine_inflight = Gauge(
            "shoal_router_engine_inflight",
            "This router's requests running on each engine.",
            ["engine", "model"],
            registry=r,
        )

    def for_model(self, model: str) -> ModelMetrics:
        found = self._models.get(model)
        if found is None:
            found = self._models[model] = ModelMetrics(
                self.ttft.labels(model),
                self.token_gap.labels(model),
                self.output_tokens.labels(model),
                self.tpot.labels(model),
                self.prompt_tokens.labels(model),
                self.queue.labels(model),
                self.migrations.labels(model),
                self.migration_stall.labels(model),
            )
        return found

    def set_fleet(self, views: Iterable[EngineView]) -> None:
        """Set the per-engine gauges from the router's view of the fleet (at scrape time)."""
        per_engine = (self.engine_requests, self.engine_kv_usage, self.engine_step, self.engine_inflight)
        for gauge in (self.engines, *per_engine):
            gauge.clear()  # engines that left take their series with them
        for view in views:
            record, report = view.record, view.report
            self.engines.labels(record.model, view.state).inc()
            self.engine_inflight.labels(record.engine_id, record.model).set(view.inflight)
            if report is None:
                continue
            requests = self.engine_requests
            requests.labels(record.engine_id, record.model, "running").set(report.num_running)
            requests.labels(record.engine_id, record.model, "waiting").set(report.num_waiting)
            self.engine_kv_usage.labels(record.engine_id, record.model).set(view.kv_usage)
            self.engine_step.labels(record.engine_id, record.model).set(report.step_time_ms / 1000)
