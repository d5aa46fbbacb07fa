"""Shoal's Grafana dashboards, written as data and rendered to Grafana's dashboard JSON.

Four dashboards: the fleet as clients see it, the engines, live migrations (what a move costs a
client), and the router's own overhead. Each panel is a title, a unit and PromQL queries over
the series the router and engines export (``shoal_*``, and vLLM's own ``vllm:*`` that engines
pass through). ``make crd`` writes them into ``charts/shoal/dashboards/``, where the chart turns
each into a ConfigMap Grafana's dashboard sidecar picks up; a test runs every query against a
real Prometheus scraping a running fleet.

Queries never depend on scrape-time labels (job, pod, component): the router's own process
series are picked out with ``and on(instance) shoal_router_requests_inflight``, a series only
routers export, so the dashboards work with the operator's ServiceMonitors, the chart's
PodMonitor, or a hand-written scrape config alike.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DASHBOARDS_DIR = Path(__file__).resolve().parents[3] / "charts" / "shoal" / "dashboards"
RATE = "$__rate_interval"
MODEL = 'model=~"$model"'
ENGINE = 'engine=~"$engine"'
ERRORS = 'status=~"4..|5.."'
SOURCE = 'role="source"'
NOT_MOVED = 'role="source",outcome!="MIGRATED"'
ROUTER_ONLY = "and on(instance) shoal_router_requests_inflight"


def _rate(metric: str, selector: str = "") -> str:
    return f"rate({metric}{{{selector}}}[{RATE}])" if selector else f"rate({metric}[{RATE}])"


def _quantiles(metric: str, selector: str = MODEL, by: str = "") -> tuple[tuple[str, str], ...]:
    """p50 and p99 of a histogram over the rate window."""
    group = f"le, {by}" if by else "le"
    legend = f"{{{{{by}}}}} " if by else ""
    return tuple(
        (
            f"histogram_quantile({q}, sum by ({group}) ({_rate(metric + '_bucket', selector)}))",
            f"{legend}p{round(q * 100)}",
        )
        for q in (0.5, 0.99)
    )


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    queries: tuple[tuple[str, str], ...]
    """(PromQL, legend) pairs."""
    unit: str = "short"
    width: int = 12


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    panels: tuple[Panel, ...]
    variables: tuple[str, ...] = ("model",)
    tags: tuple[str, ...] = field(default=("shoal",))


FLEET = Dashboard(
    uid="shoal-fleet",
    title="Shoal / Fleet overview",
    description="The fleet as its clients see it: traffic, errors, latency and tokens.",
    panels=(
        Panel(
            "Requests per second",
            "OpenAI API requests answered, by status code.",
            (
                (
                    f'sum by (status) (rate(shoal_router_requests_total{{endpoint=~"/v1/.*"}}[{RATE}]))',
                    "{{status}}",
                ),
            ),
            "reqps",
        ),
        Panel(
            "Errors per second",
            "Answers with a 4xx or 5xx status, by endpoint and status.",
            (
                (
                    "sum by (endpoint, status) " + f"({_rate('shoal_router_requests_total', ERRORS)})",
                    "{{endpoint}} {{status}}",
                ),
            ),
            "reqps",
        ),
        Panel(
            "Tokens per second",
            "Output tokens delivered to clients and prompt tokens admitted.",
            (
                (f"sum(rate(shoal_router_output_tokens_total{{{MODEL}}}[{RATE}]))", "output"),
                (f"sum(rate(shoal_router_prompt_tokens_total{{{MODEL}}}[{RATE}]))", "prompt"),
            ),
        ),
        Panel(
            "Requests in flight",
            "Generation requests the routers are serving now, those waiting for a slot (the router "
            "is full) or for KV room (every engine is short of it), and engines by state.",
            (
                ("sum(shoal_router_requests_inflight)", "in flight"),
                ("sum(shoal_router_requests_queued)", "waiting for a slot"),
                ("sum(shoal_router_requests_held)", "held for KV room"),
                (f"max by (state) (shoal_router_engines{{{MODEL}}})", "engines {{state}}"),
            ),
        ),
        Panel(
            "Time to first token",
            "From request arrival at the router to the first output token, p50 and p99.",
            _quantiles("shoal_router_time_to_first_token_seconds"),
            "s",
        ),
        Panel(
            "Inter-token latency",
            "Gap between a request's output tokens as the router delivers them, p50 and p99.",
            _quantiles("shoal_router_inter_token_seconds"),
            "s",
        ),
        Panel(
            "Time per output token",
            "Per request: first to last output token over the tokens after the first, p50 and p99.",
            _quantiles("shoal_router_time_per_output_token_seconds"),
            "s",
        ),
        Panel(
            "End-to-end latency",
            "From request arrival to its last token, p50 and p99.",
            _quantiles("shoal_router_request_seconds"),
            "s",
        ),
    ),
)

ENGINES = Dashboard(
    uid="shoal-engines",
    title="Shoal / Engines",
    description="Each engine's KV cache, batch, queue and step time.",
    variables=("model", "engine"),
    panels=(
        Panel(
            "KV cache use",
            "KV blocks in use over all blocks, per engine.",
            (
                (
                    f"shoal_engine_kv_blocks_used{{{ENGINE}}} / shoal_engine_kv_blocks_total{{{ENGINE}}}",
                    "{{engine}}",
                ),
            ),
            "percentunit",
        ),
        Panel(
            "Running requests",
            "Requests each engine is decoding.",
            (('shoal_engine_requests_running{engine=~"$engine"}', "{{engine}}"),),
        ),
        Panel(
            "Waiting requests",
            "Requests queued in each engine.",
            (('shoal_engine_requests_waiting{engine=~"$engine"}', "{{engine}}"),),
        ),
        Panel(
            "Step time",
            "Each engine's recent model step time, from its load reports.",
            (('max by (engine) (shoal_router_engine_step_seconds{engine=~"$engine"})', "{{engine}}"),),
            "s",
        ),
        Panel(
            "Output tokens per second",
            "Tokens each engine generates.",
            (
                (
                    f'sum by (engine) (rate(shoal_engine_output_tokens_total{{engine=~"$engine"}}[{RATE}]))',
                    "{{engine}}",
                ),
            ),
        ),
        Panel(
            "Dispatch decisions",
            "Requests the routers send to each engine, by dispatch policy.",
            (
                (
                    "sum by (engine, policy) "
                    f"({_rate('shoal_router_dispatched_total', f'{MODEL}, {ENGINE}')})",
                    "{{engine}} {{policy}}",
                ),
            ),
            "reqps",
        ),
        Panel(
            "Preemptions (vLLM)",
            "Requests vLLM preempted for lack of KV cache, per engine process.",
            (
                (
                    f'sum by (instance) (rate(vllm:num_preemptions_total{{model_name=~"$model"}}[{RATE}]))',
                    "{{instance}}",
                ),
            ),
        ),
        Panel(
            "Requests ended",
            "Requests each engine ended, by finish reason.",
            (
                (
                    f"sum by (engine, finish_reason) ({_rate('shoal_engine_requests_total', ENGINE)})",
                    "{{engine}} {{finish_reason}}",
                ),
            ),
            "reqps",
        ),
    ),
)

MIGRATIONS = Dashboard(
    uid="shoal-migrations",
    title="Shoal / Migrations",
    description="Live request migrations between engines: how many, why, and what each cost its client.",
    panels=(
        Panel(
            "Migrations per second",
            "Moves started by source engines, by reason and outcome.",
            (
                (
                    f"sum by (reason, outcome) ({_rate('shoal_engine_migrations_total', SOURCE)})",
                    "{{reason}} {{outcome}}",
                ),
            ),
            "ops",
        ),
        Panel(
            "Moves that did not happen, by code",
            "Moves that ended otherwise than migrated, by why (shoal_protos.moves.MoveCode): the "
            "request was gone, the target refused (no_room, target_draining, layout_differs), or "
            "a step failed (step_timeout, target_unreachable, step_failed).",
            (
                (
                    f"sum by (code) ({_rate('shoal_engine_migrations_total', NOT_MOVED)})",
                    "{{code}}",
                ),
            ),
            "ops",
        ),
        Panel(
            "Client-visible stall",
            "Gap between a moved request's last token on the source and its first on the target "
            "(the target's record), p50 and p99.",
            _quantiles("shoal_engine_migration_stall_seconds", selector=""),
            "s",
        ),
        Panel(
            "Stall seen by clients at the router",
            "The same gap measured where the client's stream is, p50 and p99.",
            _quantiles("shoal_router_migration_stall_seconds"),
            "s",
        ),
        Panel(
            "KV bytes per second",
            "KV cache bytes the source engines sent.",
            ((f"sum(rate(shoal_engine_migration_bytes_sum[{RATE}]))", "bytes/s"),),
            "Bps",
        ),
        Panel(
            "Copy stages per migration",
            "Stages of KV copy per move, the last one included, p50 and p99.",
            _quantiles("shoal_engine_migration_stages", selector=""),
        ),
        Panel(
            "Source downtime",
            "From a request's stop on the source to its admission on the target, p50 and p99.",
            _quantiles("shoal_engine_migration_downtime_seconds", selector=""),
            "s",
        ),
        Panel(
            "Time per part of a move",
            "Wall time of each part of a move on its source (prepare, precopy, warm, tail, stop, "
            "last_stage, commit, handover) and of the hand-over on its target (admit, queue, "
            "first_step, output), p50 and p99: where a slow move spends it.",
            _quantiles("shoal_engine_migration_phase_seconds", selector="", by="phase"),
            "s",
        ),
        Panel(
            "What a move costs the source's other requests",
            "The source's mean time between forward passes while a move ran, over the same just "
            "before it (1.05: its other requests decoded 5 % slower during the move); mean, p50 "
            "and p99.",
            (
                (
                    f"sum(rate(shoal_engine_migration_source_step_ratio_sum[{RATE}])) / "
                    f"sum(rate(shoal_engine_migration_source_step_ratio_count[{RATE}]))",
                    "mean",
                ),
                *_quantiles("shoal_engine_migration_source_step_ratio", selector=""),
            ),
        ),
        Panel(
            "Pre-copy stages sent again",
            "Pre-copy stages during which the source's vLLM preempted the request (KV full): "
            "their blocks went again once it had recomputed them.",
            ((f"sum(rate(shoal_engine_migration_stages_lost_total[{RATE}]))", "stages/s"),),
        ),
    ),
)

ROUTER = Dashboard(
    uid="shoal-router",
    title="Shoal / Router overhead",
    description="What the routers add: CPU per request and per token, time before dispatch, "
    "relay work, and the router's TTFT beside vLLM's own.",
    panels=(
        Panel(
            "Router CPU per output token",
            "Router process CPU time over output tokens delivered.",
            (
                (
                    f"sum(rate(process_cpu_seconds_total[{RATE}]) {ROUTER_ONLY}) "
                    f"/ sum(rate(shoal_router_output_tokens_total[{RATE}]))",
                    "CPU per token",
                ),
            ),
            "s",
        ),
        Panel(
            "Router CPU per request",
            "Router process CPU time over requests answered.",
            (
                (
                    f"sum(rate(process_cpu_seconds_total[{RATE}]) {ROUTER_ONLY}) "
                    f"/ sum(rate(shoal_router_requests_total[{RATE}]))",
                    "CPU per request",
                ),
            ),
            "s",
        ),
        Panel(
            "Router CPU",
            "CPU cores each router process uses.",
            ((f"rate(process_cpu_seconds_total[{RATE}]) {ROUTER_ONLY}", "{{instance}}"),),
        ),
        Panel(
            "Router resident memory",
            "Resident memory of each router process.",
            ((f"process_resident_memory_bytes {ROUTER_ONLY}", "{{instance}}"),),
            "bytes",
        ),
        Panel(
            "Arrival to dispatch",
            "From request arrival to its dispatch to an engine (tokenizing and picking), p50 and p99.",
            _quantiles("shoal_router_queue_seconds"),
            "s",
        ),
        Panel(
            "Output batch handling",
            "Router time per engine output batch (decode, order, hand over), p50 and p99.",
            _quantiles("shoal_router_output_batch_seconds", selector=""),
            "s",
        ),
        Panel(
            "Delay added per token",
            "From the engine batch carrying a token being read off the router's socket to its SSE "
            "event being handed to the client's connection, p50 and p99.",
            _quantiles("shoal_router_relay_delay_seconds", selector=""),
            "s",
        ),
        Panel(
            "TTFT: router and vLLM",
            "Time to first token at the router beside vLLM's own inside the engines (p99); the "
            "difference is tokenizing, dispatch and relay.",
            (
                (
                    "histogram_quantile(0.99, sum by (le) "
                    f"({_rate('shoal_router_time_to_first_token_seconds_bucket', MODEL)}))",
                    "router p99",
                ),
                (
                    "histogram_quantile(0.99, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket"
                    f'{{model_name=~"$model"}}[{RATE}])))',
                    "vLLM p99",
                ),
            ),
            "s",
        ),
        Panel(
            "Pieces relayed per second",
            "Request pieces the routers take in from engine output batches.",
            ((f"sum(rate(shoal_router_output_pieces_total[{RATE}]))", "pieces/s"),),
        ),
    ),
)

ALL = (FLEET, ENGINES, MIGRATIONS, ROUTER)


def _variable(name: str) -> dict[str, Any]:
    query = {
        "model": "label_values(shoal_router_output_tokens_total, model)",
        "engine": 'label_values(shoal_engine_kv_blocks_total{model=~"$model"}, engine)',
    }[name]
    return {
        "name": name,
        "label": name.capitalize(),
        "type": "query",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "query": {"query": query, "refId": f"{name}-values"},
        "definition": query,
        "refresh": 2,
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
    }


def render(dashboard: Dashboard) -> dict[str, Any]:
    """Grafana's dashboard JSON (schema version 39) for ``dashboard``."""
    datasource = {"type": "prometheus", "uid": "${datasource}"}
    panels = []
    x = y = 0
    for number, panel in enumerate(dashboard.panels, start=1):
        if x + panel.width > 24:
            x, y = 0, y + 8
        panels.append(
            {
                "id": number,
                "type": "timeseries",
                "title": panel.title,
                "description": panel.description,
                "datasource": datasource,
                "gridPos": {"x": x, "y": y, "w": panel.width, "h": 8},
                "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}},
                "targets": [
                    {
                        "refId": chr(ord("A") + i),
                        "datasource": datasource,
                        "expr": expr,
                        "legendFormat": legend,
                    }
                    for i, (expr, legend) in enumerate(panel.queries)
                ],
            }
        )
        x += panel.width
    source = {
        "name": "datasource",
        "label": "Prometheus",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "hide": 0,
    }
    return {
        "uid": dashboard.uid,
        "title": dashboard.title,
        "description": dashboard.description,
        "tags": list(dashboard.tags),
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "time": {"from": "now-30m", "to": "now"},
        "refresh": "10s",
        "timezone": "browser",
        "templating": {"list": [source, *(_variable(v) for v in dashboard.variables)]},
        "annotations": {"list": []},
        "links": [],
        "panels": panels,
    }


def files() -> dict[Path, str]:
    """Each dashboard's file in the chart and its text."""
    return {DASHBOARDS_DIR / f"{d.uid}.json": json.dumps(render(d), indent=2) + "\n" for d in ALL}
