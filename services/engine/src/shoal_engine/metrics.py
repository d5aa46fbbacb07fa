"""Prometheus metrics of one engine, in a registry of its own (served at ``/metrics``).

Every series carries the ``engine`` and ``model`` labels, so one Prometheus can scrape a fleet.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LABELS = ["engine", "model"]


class EngineMetrics:
    def __init__(self, engine_id: str, model: str) -> None:
        self.registry = registry = CollectorRegistry()
        self._labels = {"engine": engine_id, "model": model}

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, _LABELS, registry=registry).labels(**self._labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, _LABELS, registry=registry).labels(**self._labels)

        self.requests = Counter(
            "shoal_engine_requests",
            "Requests ended, by finish reason.",
            [*_LABELS, "finish_reason"],
            registry=registry,
        )
        self.output_tokens = counter("shoal_engine_output_tokens", "Output tokens generated.")
        self.prompt_tokens = counter("shoal_engine_prompt_tokens", "Prompt tokens admitted.")
        self.load_report_errors = counter(
            "shoal_engine_load_report_errors", "Load reports that could not be written to Redis."
        )
        self.running = gauge("shoal_engine_requests_running", "Requests vLLM is decoding.")
        self.waiting = gauge("shoal_engine_requests_waiting", "Requests queued in vLLM.")
        self.kv_blocks_used = gauge("shoal_engine_kv_blocks_used", "KV cache blocks in use.")
        self.kv_blocks_total = gauge("shoal_engine_kv_blocks_total", "KV cache blocks in all.")
        self.batch_pieces = Histogram(
            "shoal_engine_output_batch_pieces",
            "Request pieces per output batch sent to a router.",
            _LABELS,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=registry,
        ).labels(**self._labels)
        self._add_migration_metrics(registry)

    def _add_migration_metrics(self, registry: CollectorRegistry) -> None:
        """The series of moves of running requests between engines (``migration``)."""
        self.migrations = Counter(
            "shoal_engine_migrations",
            "Migrations this engine took part in, by role (source, target), reason, outcome and "
            "code (why it ended so: shoal_protos.moves.MoveCode).",
            [*_LABELS, "role", "reason", "outcome", "code"],
            registry=registry,
        )
        self.migration_bytes = Histogram(
            "shoal_engine_migration_bytes",
            "KV bytes a migration sent (source side).",
            _LABELS,
            buckets=tuple(float(1 << n) for n in range(16, 34, 2)),
            registry=registry,
        ).labels(**self._labels)
        self.migration_stages = Histogram(
            "shoal_engine_migration_stages",
            "Stages of KV copy per migration, the final one included (source side).",
            _LABELS,
            buckets=(1, 2, 3, 4, 6, 8, 12, 16),
            registry=registry,
        ).labels(**self._labels)
        self.migration_stages_lost = Counter(
            "shoal_engine_migration_stages_lost",
            "Pre-copy stages vLLM preempted their request during: their blocks went again later "
            "(source side).",
            _LABELS,
            registry=registry,
        ).labels(**self._labels)
        self.migration_downtime = Histogram(
            "shoal_engine_migration_downtime_seconds",
            "From a request's stop on the source to its admission on the target (source side).",
            _LABELS,
            buckets=(0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0),
            registry=registry,
        ).labels(**self._labels)
        self.migration_stall = Histogram(
            "shoal_engine_migration_stall_seconds",
            "Gap a migrated request's client saw: first token here minus last token on the source "
            "(target side).",
            _LABELS,
            buckets=(0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.0),
            registry=registry,
        ).labels(**self._labels)
        self.migration_source_pace = Histogram(
            "shoal_engine_migration_source_step_ratio",
            "The source's mean time between forward passes while a move ran, over the same in as "
            "long a window just before it: what the move cost the source's other requests "
            "(source side, moves that ended migrated).",
            _LABELS,
            buckets=(0.8, 0.9, 0.95, 0.98, 1.0, 1.02, 1.05, 1.1, 1.2, 1.5, 2.0, 3.0),
            registry=registry,
        ).labels(**self._labels)

        self._migration_phase = Histogram(
            "shoal_engine_migration_phase_seconds",
            "Wall time of each part of a move: on its source prepare, precopy, warm, tail, stop, "
            "last_stage, commit, handover; on its target admit, queue, first_step, output (the "
            "hand-over, from the commit to the moved request's first token there).",
            [*_LABELS, "phase"],
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0),
            registry=registry,
        )

    def migration_phase(self, phase: str, seconds: float) -> None:
        self._migration_phase.labels(**self._labels, phase=phase).observe(seconds)

    def migrated(self, role: str, reason: str, outcome: str, code: str) -> None:
        self.migrations.labels(**self._labels, role=role, reason=reason, outcome=outcome, code=code).inc()

    def finished(self, reason: str) -> None:
        self.requests.labels(**self._labels, finish_reason=reason).inc()
