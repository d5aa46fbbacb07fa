"""The live fleet page (``/fleet``), opened in headless Chromium (Debian's package) while a
stream runs: the page, as its script renders it from ``/fleet/state``, shows both engines and
the request in flight on its engine; a screenshot of it is a real PNG.

The tiny model decodes fast enough to finish a stream while Chromium starts, so the engine's
vLLM process is frozen (SIGSTOP) while the page is read: the request stays in flight, and the
engine's own process keeps reporting, as a busy engine would."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import threading
from pathlib import Path

import httpx
import pytest

from tests.integration.support import RunningFleet, fleet_state, in_flight, model_frozen, wait_until

pytestmark = pytest.mark.integration


def _chromium(*args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("chromium")
    assert binary is not None, "chromium is not installed; `make setup` installs it"
    # --virtual-time-budget: run the page's script (its first fetch and render) before dumping.
    command = [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000", *args]
    return subprocess.run(command, check=True, capture_output=True, text=True, timeout=120)


def _section(dom: str, element_id: str) -> str:
    """The markup of the page's ``<div id=...>`` up to the next heading."""
    match = re.search(rf'<div[^>]*\bid="{element_id}"[^>]*>(.*?)(<h2>|<script>)', dom, re.S)
    assert match, f"no #{element_id} in the page"
    return match.group(1)


def _page_with_a_stream_held(fleet: RunningFleet, screenshot: Path) -> tuple[str, dict[str, str]] | None:
    """Start a long stream, freeze its engine's vLLM process once the first token is out, and
    dump the page while the router lists the request; None when the request was no longer in
    flight once frozen (the machine left this test unscheduled until the stream was done)."""
    streaming, done = threading.Event(), threading.Event()
    seen: dict[str, str] = {}

    def hold_a_stream() -> None:
        body = {
            "model": fleet.model,
            "prompt": [101, 102, 103, 104],
            "max_tokens": fleet.cfg.max_model_len - 192,  # tens of seconds of decoding
            "stream": True,
            "ignore_eos": True,
        }
        with (
            httpx.Client(timeout=120) as http,
            http.stream("POST", fleet.base_url + "/v1/completions", json=body) as reply,
        ):
            seen["request"] = reply.headers["x-shoal-request-id"]
            seen["engine"] = reply.headers["x-shoal-engine"]
            lines = reply.iter_lines()  # kept: a dropped iterator closes the stream
            next(lines)  # its first token is out: it runs
            streaming.set()
            done.wait(180)  # then closing the connection aborts it

    holder = threading.Thread(target=hold_a_stream, name="stream")
    holder.start()
    try:
        assert streaming.wait(120), "the stream never started"
        with model_frozen(fleet, seen["engine"]):

            def listed() -> bool:
                return any(r["id"] == seen["request"] for r in in_flight(fleet))

            try:
                # Not listed once frozen: it had ended; the caller streams again.
                wait_until(listed, 10, "the request in /fleet/state")
            except AssertionError:
                return None
            dom = _chromium("--dump-dom", fleet.base_url + "/fleet").stdout
            _chromium(f"--screenshot={screenshot}", "--window-size=1280,800", fleet.base_url + "/fleet")
            return dom, seen
    finally:
        done.set()
        holder.join(timeout=60)


def test_fleet_page_shows_both_engines_and_a_request_in_flight(
    tiny_fleet: RunningFleet, tmp_path: Path
) -> None:
    engines = [tiny_fleet.cfg.engine_id(i) for i in range(tiny_fleet.cfg.engines)]
    screenshot = tmp_path / "fleet.png"
    for _attempt in range(3):
        held = _page_with_a_stream_held(tiny_fleet, screenshot)
        if held is not None:
            break
    assert held is not None, "no stream was still in flight once its engine was frozen (3 tries)"
    dom, seen = held

    cards = re.findall(r'data-engine="([^"]+)"', _section(dom, "engines"))
    assert sorted(cards) == sorted(engines)
    requests = _section(dom, "requests")
    row = re.search(rf"<tr[^>]*><td>{re.escape(seen['request'])}</td><td>([^<]+)</td>", requests)
    assert row and row.group(1) == seen["engine"], requests
    assert "requests in flight" in dom and "Redis ok" in dom
    png = screenshot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert (width, height) == (1280, 800) and len(png) > 10_000


@pytest.mark.parametrize("name", ["tiny", "smol"])
def test_each_engine_publishes_its_kv_block_size(request: pytest.FixtureRequest, name: str) -> None:
    """vLLM's block size reaches the engine's record (the unit of its KV block counts) and the
    router's view: 128 tokens on the tiny fleet (the fleet's default), 32 on SmolLM2's."""
    fleet: RunningFleet = request.getfixturevalue(f"{name}_fleet")
    assert fleet.cfg.kv_block_size == {"tiny": 128, "smol": 32}[name]
    for i in range(fleet.cfg.engines):
        record = fleet.engine_record(fleet.cfg.engine_id(i))
        assert record is not None and record.kv_block_size == fleet.cfg.kv_block_size, record
    engines = fleet_state(fleet.base_url)["engines"]
    assert [e["block_size"] for e in engines] == [fleet.cfg.kv_block_size] * fleet.cfg.engines
