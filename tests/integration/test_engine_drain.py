"""SIGTERM drains an engine: it takes no new work, moves what it runs to another engine, leaves
Redis, exits. It stops an engine: the module has a SmolLM2 fleet of its own."""

from __future__ import annotations

import os
import signal

import httpx
import openai
import pytest

from tests.integration.support import STALL_S, RunningFleet, model_frozen, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.destructive]


@pytest.fixture(scope="module")
def smol_fleet(own_smol_fleet: RunningFleet) -> RunningFleet:
    """This module's own SmolLM2 fleet, in place of the shared one."""
    return own_smol_fleet


def _exited(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie still answers signal 0 until supervisord reaps it.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] == "Z"


def test_sigterm_moves_running_request_away_then_leaves(smol_fleet: RunningFleet) -> None:
    engines = [smol_fleet.cfg.engine_id(i) for i in range(smol_fleet.cfg.engines)]
    # Earlier tests may have loaded the machine hard enough for a heartbeat to lapse; the
    # engine registers again by itself, and the router must see it before this test starts.
    wait_until(
        lambda: all(
            httpx.get(smol_fleet.base_url + "/health", timeout=STALL_S).json()["engines"].get(e) == "ACTIVE"
            for e in engines
        ),
        15.0,
        "the router to see every engine ACTIVE",
    )
    client = openai.OpenAI(base_url=smol_fleet.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    body = {"model": smol_fleet.model, "prompt": "Once upon a time", "max_tokens": 48, "temperature": 0}
    extra = {"ignore_eos": True, "return_token_ids": True}
    reference = client.completions.create(**body, extra_body=extra)  # type: ignore[call-overload]
    stream = client.completions.create(**body, stream=True, extra_body=extra)  # type: ignore[call-overload]
    victim = stream.response.headers["x-shoal-engine"]
    request_id = stream.response.headers["x-shoal-request-id"]
    record = smol_fleet.engine_record(victim)
    assert record is not None
    chunks = iter(stream)
    token_ids = list(next(chunks).choices[0].model_extra["token_ids"])

    # The victim's model stays stopped until the engine says DRAINING: the request cannot end
    # there before the drain begins, however late a loaded machine lets this test send the signal.
    with model_frozen(smol_fleet, victim):
        os.kill(record.pid, signal.SIGTERM)
        # The engine says DRAINING in Redis, so routers stop sending it new requests ...
        wait_until(
            lambda: (r := smol_fleet.engine_record(victim)) is None or r.state == "DRAINING",
            STALL_S,
            f"{victim} to mark itself DRAINING",
        )
    # ... and moves the request it runs to the other engine, where it goes on to the end.
    last = None
    for chunk in chunks:
        token_ids.extend(chunk.choices[0].model_extra["token_ids"])
        last = chunk
    assert last is not None and last.choices[0].finish_reason == "length"
    assert token_ids == reference.choices[0].model_extra["token_ids"]

    def drained() -> list[tuple[str, str, str]]:
        moves = [
            smol_fleet.migration_record(m.decode())
            for m in smol_fleet.redis.lrange(smol_fleet.keys.migrations, 0, 50)
        ]
        return [(m.reason, m.source, m.outcome) for m in moves if m and m.request_id == request_id]

    # The source writes the record once the move has returned, which the stream need not wait for.
    wait_until(lambda: bool(drained()), STALL_S, "the drain's migration record")
    assert drained() == [("drain", victim, "MIGRATED")]

    wait_until(lambda: smol_fleet.engine_record(victim) is None, STALL_S, f"{victim} to leave Redis")
    wait_until(lambda: _exited(record.pid), STALL_S, f"{victim} to exit")
    wait_until(
        lambda: victim not in httpx.get(smol_fleet.base_url + "/health", timeout=STALL_S).json()["engines"],
        STALL_S,
        f"the router to forget {victim}",
    )
    # The other engine serves on.
    reply = httpx.post(
        smol_fleet.base_url + "/v1/completions",
        json={"model": smol_fleet.model, "prompt": "hi", "max_tokens": 2},
        timeout=STALL_S,
    )
    assert reply.status_code == 200, reply.text
