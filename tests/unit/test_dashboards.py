"""The Grafana dashboards: the checked-in files are what ``dashboards.py`` renders, and each is
well-formed dashboard JSON as Grafana loads it (schema version, unique panel ids, a grid that
fits 24 columns without overlaps, targets with ids, a Prometheus datasource variable, and every
``$variable`` a query uses defined). That the queries return data is checked against a real
Prometheus in ``tests/integration/test_observability.py``."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from shoal_operator import dashboards

FILES = dashboards.files()
BUILTIN = {"__rate_interval", "__interval", "__range"}


def _boards() -> list[dict[str, Any]]:
    return [json.loads(text) for text in FILES.values()]


def test_checked_in_dashboards_are_what_the_code_renders() -> None:
    # `make crd` writes them; a change to dashboards.py without it fails here.
    assert sorted(dashboards.DASHBOARDS_DIR.glob("*.json")) == sorted(FILES)
    for path, text in FILES.items():
        assert path.read_text() == text, f"{path.name} is out of date: run `make crd`"


def test_four_dashboards_with_distinct_uids() -> None:
    titles = {board["uid"]: board["title"] for board in _boards()}
    assert set(titles) == {"shoal-fleet", "shoal-engines", "shoal-migrations", "shoal-router"}
    assert len(set(titles.values())) == 4


@pytest.mark.parametrize("board", _boards(), ids=lambda b: b["uid"])
def test_dashboard_is_well_formed_grafana_json(board: dict[str, Any]) -> None:
    assert isinstance(board["schemaVersion"], int) and board["schemaVersion"] >= 36
    assert board["title"] and board["uid"] and len(board["uid"]) <= 40
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in board["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24 and grid["h"] > 0
        area = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not area & cells, f"panel {panel['title']!r} overlaps another"
        cells |= area
        assert panel["type"] == "timeseries" and panel["description"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["fieldConfig"]["defaults"]["unit"]
        refs = [target["refId"] for target in panel["targets"]]
        assert refs and len(refs) == len(set(refs))
        for target in panel["targets"]:
            used = set(re.findall(r"\$(\w+)", target["expr"]))
            assert used <= set(variables) | BUILTIN, (panel["title"], used)
            assert target["expr"].count("(") == target["expr"].count(")")
    for name, variable in variables.items():
        if name != "datasource":
            assert variable["type"] == "query" and variable["includeAll"] and variable["allValue"] == ".*"
