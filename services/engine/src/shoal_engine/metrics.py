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

    def finished(self, reason: str) -> None:
        self.requests.labels(**self._labels, finish_reason=reason).inc()
