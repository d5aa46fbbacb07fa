"""Prometheus metrics of one router, in a registry of its own (served at ``/metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "shoal_router_requests",
            "HTTP requests answered, by endpoint and status code.",
            ["endpoint", "status"],
            registry=r,
        )
        self.inflight = Gauge("shoal_router_requests_inflight", "Generation requests in flight.", registry=r)
        self.dispatched = Counter(
            "shoal_router_dispatched", "Requests sent to each engine.", ["engine", "model"], registry=r
        )
        self.dispatch_retries = Counter(
            "shoal_router_dispatch_retries", "Requests sent again after an engine refused them.", registry=r
        )
        self.engines = Gauge(
            "shoal_router_engines",
            "Engines seen in Redis, by model and state.",
            ["model", "state"],
            registry=r,
        )
        self.ttft = Histogram(
            "shoal_router_time_to_first_token_seconds",
            "From request arrival to the first output token.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.token_gap = Histogram(
            "shoal_router_inter_token_seconds",
            "Mean gap between output tokens of a request, observed per delta.",
            ["model"],
            buckets=_TOKEN_GAP_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "shoal_router_request_seconds",
            "From request arrival to its end.",
            ["model", "finish_reason"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "shoal_router_prompt_tokens", "Prompt tokens of requests.", ["model"], registry=r
        )
        self.output_tokens = Counter(
            "shoal_router_output_tokens", "Output tokens delivered.", ["model"], registry=r
        )
