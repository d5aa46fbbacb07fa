"""Prometheus metrics of one engine, in a registry of its own (served at ``/metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class EngineMetrics:
    def __init__(self, engine_id: str, model: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"engine": engine_id, "model": model}
        self.requests = Counter(
            "shoal_engine_requests",
            "Requests ended, by finish reason.",
            ["engine", "model", "finish_reason"],
            registry=self.registry,
        )
        self._labels = labels
        self.output_tokens = Counter(
            "shoal_engine_output_tokens",
            "Output tokens generated.",
            list(labels),
            registry=self.registry,
        ).labels(**labels)
        self.prompt_tokens = Counter(
            "shoal_engine_prompt_tokens",
            "Prompt tokens admitted.",
            list(labels),
            registry=self.registry,
        ).labels(**labels)
        self.running = Gauge(
            "shoal_engine_requests_running",
            "Requests vLLM is decoding.",
            list(labels),
            registry=self.registry,
        ).labels(**labels)
        self.waiting = Gauge(
            "shoal_engine_requests_waiting",
            "Requests queued in vLLM.",
            list(labels),
            registry=self.registry,
        ).labels(**labels)
        self.kv_blocks_used = Gauge(
            "shoal_engine_kv_blocks_used",
            "KV cache blocks in use.",
            list(labels),
            registry=self.registry,
        ).labels(**labels)
        self.kv_blocks_total = Gauge(
            "shoal_engine_kv_blocks_total",
            "KV cache blocks in all.",
            list(labels),
            registry=self.registry,
        ).labels(**labels)
        self.batch_pieces = Histogram(
            "shoal_engine_output_batch_pieces",
            "Request pieces per output batch sent to a router.",
            list(labels),
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=self.registry,
        ).labels(**labels)
        self.load_report_errors = Counter(
            "shoal_engine_load_report_errors",
            "Load reports that could not be written to Redis.",
            list(labels),
            registry=self.registry,
        ).labels(**labels)

    def finished(self, reason: str) -> None:
        self.requests.labels(**self._labels, finish_reason=reason).inc()
