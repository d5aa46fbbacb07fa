"""The Grafana dashboards against a real Prometheus (Debian's package) scraping the running tiny
fleet: after a short load (streams, a live migration, a refused request), every panel's query,
with the dashboard's variables filled in, returns at least one series. A query naming a series
nothing exports, or a label no series has, fails here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest

from shoal_operator import dashboards
from shoal_protos import engine_control_pb2 as pb
from shoal_protos.moves import MoveCode
from tests.integration.support import STALL_S, RunningFleet, prometheus_server, wait_until
from tests.integration.test_migration import TINY_LONG, TINY_PROMPT, moved_back_to_back

pytestmark = pytest.mark.integration

RATE_WINDOW = "1m"  # what Grafana's $__rate_interval becomes here (scrapes every second)


def _query(prometheus: str, expr: str) -> list[dict[str, Any]]:
    reply = httpx.get(prometheus + "/api/v1/query", params={"query": expr}, timeout=STALL_S)
    body = reply.json()
    assert reply.status_code == 200 and body["status"] == "success", (expr, body)
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def _filled(expr: str, model: str) -> str:
    """The query as Grafana sends it with "All" engines and the fleet's model selected."""
    return expr.replace("$__rate_interval", RATE_WINDOW).replace("$model", model).replace("$engine", ".*")


def _panel_queries() -> list[tuple[str, str, str]]:
    """(dashboard title, panel title, PromQL) for every query of every dashboard file."""
    out = []
    for path in sorted(Path(dashboards.DASHBOARDS_DIR).glob("*.json")):
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            out += [(board["title"], panel["title"], target["expr"]) for target in panel["targets"]]
    return out


def test_every_dashboard_query_returns_series_from_a_live_fleet(
    tiny_fleet: RunningFleet, tmp_path: Path
) -> None:
    engines = [tiny_fleet.cfg.engine_id(i) for i in range(tiny_fleet.cfg.engines)]
    records = [tiny_fleet.engine_record(e) for e in engines]
    assert all(records)
    jobs = {
        "router": [urlparse(tiny_fleet.base_url).netloc],
        "engines": [urlparse(r.http_address).netloc for r in records if r is not None],
    }
    with prometheus_server(tmp_path, jobs) as prometheus:
        # The load: a stream moved once mid-generation ...
        moved_back_to_back(tiny_fleet, TINY_PROMPT, TINY_LONG, 1)
        # ... a move of a request that is not running (it ends GONE, code not_running) ...
        gone = tiny_fleet.control(engines[0]).Migrate(
            pb.MigrateRequest(request_id="no-such-request", reason="admin"), timeout=STALL_S
        )
        assert (gone.outcome, gone.code) == (pb.GONE, MoveCode.NOT_RUNNING), gone
        # ... plain requests, and one refused (an unknown model: 404).
        client = tiny_fleet.openai()
        for i in range(4):
            client.completions.create(model=tiny_fleet.model, prompt=[5, 6, i], max_tokens=16)
        refused = httpx.post(
            tiny_fleet.base_url + "/v1/completions",
            json={"model": "no-such-model", "prompt": "x"},
            timeout=STALL_S,
        )
        assert refused.status_code == 404
        # Rates need two samples in their window: wait until the last of the load on each job
        # (the 404 on the router, the move that found nothing on the engine) has been scraped
        # twice; the jobs are scraped at times of their own.
        last_of_each_job = (
            f'count_over_time(shoal_router_requests_total{{status="404"}}[{RATE_WINDOW}]) >= 2',
            f'count_over_time(shoal_engine_migrations_total{{code="not_running"}}[{RATE_WINDOW}]) >= 2',
        )
        wait_until(
            lambda: all(_query(prometheus, expr) for expr in last_of_each_job),
            STALL_S,
            "Prometheus to scrape the load twice",
            every_s=0.5,
        )
        queries = _panel_queries()
        assert len(queries) >= 30
        empty = [
            (board, panel, expr)
            for board, panel, expr in queries
            if not _query(prometheus, _filled(expr, tiny_fleet.model))
        ]
    assert empty == [], empty
