"""The live fleet page (``GET /fleet``): engines with their load, the requests this router is
serving, and migrations as they happen, refreshed every second from ``GET /fleet/state``.

One self-contained HTML page (no external assets, so it works in a cluster without internet);
its script fills the page with ``textContent`` only, so nothing from the fleet is ever parsed as
HTML.
"""

from __future__ import annotations

import time
from typing import Any

from shoal_router.core.prefix_index import PrefixIndex
from shoal_router.ipc.engines import EngineClient
from shoal_router.ipc.fleet import FleetView


async def fleet_state(
    router_id: str, fleet: FleetView, engines: EngineClient, prefix_index: PrefixIndex | None = None
) -> dict[str, Any]:
    """What the page shows, as JSON; ``cached_blocks``, each engine's prefix-cache blocks as this
    router's index holds them, where it keeps one (``--scheduler prefix_cache``)."""
    now = time.time()
    engine_rows = []
    for view in sorted(fleet.engines.values(), key=lambda v: v.engine_id):
        report = view.report
        engine_rows.append(
            {
                "id": view.engine_id,
                "model": view.record.model,
                "state": view.state,
                "running": report.num_running if report else 0,
                "waiting": report.num_waiting if report else 0,
                "kv_usage": view.kv_usage,
                "kv_blocks": view.record.kv_blocks_total,
                "block_size": view.block_size,
                # What dispatch weighs: KV blocks left per batch slot, free blocks not yet
                # claimed by prompts sent since the last report, and requests held.
                "freeness": round(view.free, 2),
                "room": view.room,
                "held": view.held,
                "step_ms": report.step_time_ms if report else 0.0,
                "inflight_here": view.inflight,
                "cached_blocks": prefix_index.held(view.engine_id) if prefix_index is not None else None,
            }
        )
    requests = [
        {
            "id": request.request_id,
            "engine": request.engine_id,
            "tokens": request.tokens,
            "age_s": round(now - request.started, 1),
            "moves": request.moves,
        }
        for request in engines.in_flight()
    ]
    migrations = [
        {
            "id": record.migration_id,
            "request": record.request_id,
            "source": record.source,
            "target": record.target,
            "reason": record.reason,
            "outcome": record.outcome,
            "stall_ms": record.stall_ms,
            "bytes": record.bytes,
            "stages": record.stages,
            "ago_s": round(now - record.finished_at, 1) if record.finished_at else None,
        }
        for record in await fleet.recent_migrations()
    ]
    return {
        "router": router_id,
        "redis": fleet.redis_ok,
        "time": now,
        # The index's engines and distinct blocks; None without one.
        "prefix_index": (
            {"engines": sorted(prefix_index.engines()), "blocks": len(prefix_index)}
            if prefix_index is not None
            else None
        ),
        "engines": engine_rows,
        "requests": requests,
        "migrations": migrations,
    }


PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Shoal fleet</title>
<style>
  body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #1d2433; background: #f6f7fb; }
  h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 24px 0 8px; }
  #status { color: #5b6478; }
  .engines { display: flex; flex-wrap: wrap; gap: 12px; }
  .engine { background: #fff; border-radius: 8px; padding: 12px 16px; min-width: 220px;
            box-shadow: 0 1px 3px rgba(0,0,0,.12); }
  .engine .name { font-weight: 600; } .engine .state { float: right; font-size: 12px; }
  .ACTIVE { color: #137333; } .DRAINING, .EMPTYING { color: #b06000; }
  .UNREACHABLE, .SILENT, .STARTING { color: #a50e0e; }
  .bar { height: 8px; background: #e3e6ee; border-radius: 4px; margin: 6px 0; }
  .bar div { height: 8px; background: #3b6fe0; border-radius: 4px; }
  table { border-collapse: collapse; background: #fff; box-shadow: 0 1px 3px rgba(0,0,0,.12); }
  th, td { padding: 4px 10px; text-align: left; border-bottom: 1px solid #eceef3; font-size: 13px; }
  th { background: #eef1f7; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
  .fresh { background: #fff6d6; } .empty { color: #8a93a6; padding: 8px 0; }
</style>
</head>
<body>
<h1>Shoal fleet</h1>
<div id="status">connecting&hellip;</div>
<h2>Engines</h2>
<div class="engines" id="engines"></div>
<h2>Requests in flight on this router</h2>
<div id="requests"></div>
<h2>Migrations</h2>
<div id="migrations"></div>
<script>
"use strict";
function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}
function table(columns, rows, empty) {
  if (!rows.length) return el("div", empty, "empty");
  const t = el("table"), head = el("tr");
  columns.forEach(([title]) => head.appendChild(el("th", title)));
  t.appendChild(head);
  rows.forEach(row => {
    const tr = el("tr", null, row.fresh ? "fresh" : "");
    columns.forEach(([, value, num]) => tr.appendChild(el("td", value(row), num ? "num" : "")));
    t.appendChild(tr);
  });
  return t;
}
function engineCard(e) {
  const card = el("div", null, "engine");
  card.dataset.engine = e.id;
  card.appendChild(el("span", e.state, "state " + e.state));
  card.appendChild(el("div", e.id, "name"));
  card.appendChild(el("div", e.model));
  const bar = el("div", null, "bar"), fill = el("div");
  fill.style.width = Math.round(Math.min(1, e.kv_usage) * 100) + "%";
  bar.appendChild(fill);
  card.appendChild(bar);
  const kv = (e.kv_usage * 100).toFixed(1);
  card.appendChild(el("div", "KV " + kv + "%  step " + e.step_ms.toFixed(1) + " ms"));
  const here = e.inflight_here + " from here";
  card.appendChild(el("div", e.running + " running, " + e.waiting + " waiting, " + here));
  return card;
}
function render(s) {
  document.getElementById("status").textContent =
    "router " + s.router + " \\u00b7 " + s.engines.length + " engines \\u00b7 " + s.requests.length +
    " requests in flight \\u00b7 Redis " + (s.redis ? "ok" : "unreachable") + " \\u00b7 " +
    new Date(s.time * 1000).toLocaleTimeString();
  document.getElementById("engines").replaceChildren(...s.engines.map(engineCard));
  document.getElementById("requests").replaceChildren(table([
    ["request", r => r.id], ["engine", r => r.engine], ["tokens", r => r.tokens, 1],
    ["age (s)", r => r.age_s, 1], ["moves", r => r.moves, 1]], s.requests, "no request in flight"));
  s.migrations.forEach(m => { m.fresh = m.ago_s !== null && m.ago_s < 10; });
  document.getElementById("migrations").replaceChildren(table([
    ["request", m => m.request], ["from", m => m.source], ["to", m => m.target],
    ["reason", m => m.reason], ["outcome", m => m.outcome],
    ["stall (ms)", m => m.stall_ms === null ? "" : m.stall_ms.toFixed(1), 1],
    ["KV (MiB)", m => (m.bytes / 1048576).toFixed(2), 1], ["stages", m => m.stages, 1],
    ["ago (s)", m => m.ago_s, 1]], s.migrations, "no migration yet"));
}
async function refresh() {
  try {
    const reply = await fetch("fleet/state", {cache: "no-store"});
    if (!reply.ok) throw new Error("HTTP " + reply.status);
    render(await reply.json());
  } catch (err) {
    document.getElementById("status").textContent = "cannot reach the router: " + err.message;
  }
  setTimeout(refresh, 1000);
}
refresh();
</script>
</body>
</html>
"""
