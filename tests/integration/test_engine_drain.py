"""SIGTERM drains an engine: it takes no new work, finishes what it runs, leaves Redis, exits.
Runs last: it stops the shared SmolLM2 fleet's only engine."""

from __future__ import annotations

import os
import signal

import httpx
import openai
import pytest

from tests.integration.support import RunningFleet, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.destructive]


def _exited(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie still answers signal 0 until supervisord reaps it.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] == "Z"


def test_sigterm_finishes_running_request_then_leaves(smol_fleet: RunningFleet) -> None:
    engine_id = smol_fleet.cfg.engine_id(0)
    # Earlier tests may have loaded the machine hard enough for a heartbeat to lapse; the
    # engine registers again by itself, and the router must see it before this test starts.
    wait_until(
        lambda: (
            httpx.get(smol_fleet.base_url + "/health", timeout=5).json()["engines"].get(engine_id) == "ACTIVE"
        ),
        15.0,
        f"the router to see {engine_id} ACTIVE",
    )
    record = smol_fleet.engine_record(engine_id)
    assert record is not None
    client = openai.OpenAI(base_url=smol_fleet.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    stream = client.completions.create(
        model=smol_fleet.model,
        prompt="Once upon a time",
        max_tokens=48,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    chunks = iter(stream)
    token_ids = list(next(chunks).choices[0].model_extra["token_ids"])

    os.kill(record.pid, signal.SIGTERM)
    # The engine says DRAINING in Redis, so routers stop sending it new requests ...
    wait_until(
        lambda: (r := smol_fleet.engine_record(engine_id)) is None or r.state == "DRAINING",
        5.0,
        f"{engine_id} to mark itself DRAINING",
    )
    # ... while the request it runs goes on to the end.
    last = None
    for chunk in chunks:
        token_ids.extend(chunk.choices[0].model_extra["token_ids"])
        last = chunk
    assert last is not None and last.choices[0].finish_reason == "length"
    assert len(token_ids) == 48

    wait_until(lambda: smol_fleet.engine_record(engine_id) is None, 30.0, f"{engine_id} to leave Redis")
    wait_until(lambda: _exited(record.pid), 60.0, f"{engine_id} to exit")
    wait_until(
        lambda: engine_id not in httpx.get(smol_fleet.base_url + "/health", timeout=5).json()["engines"],
        5.0,
        f"the router to forget {engine_id}",
    )
    reply = httpx.post(
        smol_fleet.base_url + "/v1/completions",
        json={"model": smol_fleet.model, "prompt": "hi", "max_tokens": 2},
        timeout=30,
    )
    assert reply.status_code == 503
    assert reply.json()["error"]["code"] == "no_engine"
