"""A router's fleet view read from a real Redis in one poll: every engine's record, load report
and emptying mark; DEAD engines, engines of another protocol, index entries whose record
expired, and engines whose heartbeat lapsed for a while are each handled as the module says
(``shoal_router.ipc.fleet``)."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest
import redis.asyncio as aioredis

from shoal_protos.messages import PROTOCOL_VERSION
from shoal_protos.records import EngineRecord, EngineState, Keys, LoadReport, json_encoder
from shoal_router.ipc.fleet import FleetView
from shoal_router.metrics import RouterMetrics

pytestmark = pytest.mark.integration

KEYS = Keys("view")
_SEQ = itertools.count(1)


async def _engine(
    redis_client: aioredis.Redis,
    engine_id: str,
    state: EngineState = EngineState.ACTIVE,
    running: int | None = 1,
    protocol: int = PROTOCOL_VERSION,
) -> None:
    """An engine's record and index entry, and a load report unless ``running`` is None."""
    record = EngineRecord(
        engine_id=engine_id, model="m", zmq_address=f"tcp://{engine_id}.engines:5557",
        http_address="http://127.0.0.1:1", state=state, max_model_len=2048,
        protocol_version=protocol, started_at=time.time(), kv_blocks_total=1000, max_num_seqs=64,
    )  # fmt: skip
    await redis_client.sadd(KEYS.engines, engine_id)
    await redis_client.set(KEYS.engine(engine_id), json_encoder.encode(record))
    if running is not None:
        report = LoadReport(
            engine_id=engine_id, seq=next(_SEQ), time=time.time(), num_running=running, kv_blocks_used=10
        )
        await redis_client.set(KEYS.load(engine_id), json_encoder.encode(report))


async def test_one_poll_reads_every_engine_and_tidies_the_index(redis_client: aioredis.Redis) -> None:
    await _engine(redis_client, "c", running=3)
    await _engine(redis_client, "a", running=None)
    await _engine(redis_client, "b", running=2)
    await redis_client.set(KEYS.emptying("b"), b"router-0", px=5000)
    await _engine(redis_client, "dead", state=EngineState.DEAD)
    await _engine(redis_client, "other-protocol", protocol=PROTOCOL_VERSION + 1)
    await redis_client.sadd(KEYS.engines, "expired")  # an index entry whose record is gone
    added: list[str] = []
    lost: list[tuple[str, str]] = []
    view = FleetView(
        redis_client, KEYS, lambda record: added.append(record.engine_id), lambda *gone: lost.append(gone)
    )

    await view.refresh()

    assert list(view.engines) == ["a", "b", "c"]
    assert added == ["a", "b", "c"]
    assert view.engines["a"].report is None
    assert view.engines["b"].report is not None and view.engines["b"].report.num_running == 2
    assert view.engines["c"].report is not None and view.engines["c"].report.num_running == 3
    assert view.engines["b"].state == "EMPTYING" and not view.engines["b"].dispatchable
    assert view.engines["c"].state == "ACTIVE" and view.engines["c"].dispatchable
    assert await redis_client.get(KEYS.epoch) == b"1"
    members = {m.decode() for m in await redis_client.smembers(KEYS.engines)}
    assert members == {"a", "b", "c", "dead", "other-protocol"}
    assert lost == []

    # The mark goes, c's report moves on, and b says DEAD: b leaves the view.
    await redis_client.delete(KEYS.emptying("b"))
    await _engine(redis_client, "c", running=5)
    await _engine(redis_client, "b", state=EngineState.DEAD)
    await view.refresh()
    assert list(view.engines) == ["a", "c"]
    assert view.engines["c"].report is not None and view.engines["c"].report.num_running == 5
    assert lost == [("b", "was marked DEAD")]


async def test_an_empty_fleet_reads_as_empty(redis_client: aioredis.Redis) -> None:
    view = FleetView(redis_client, KEYS, lambda _: None, lambda *_: None)
    await view.refresh()
    assert view.engines == {}
    assert await redis_client.get(KEYS.epoch) == b"1"


async def test_an_engine_whose_heartbeat_lapsed_is_silent_for_the_grace_then_lost(
    redis_client: aioredis.Redis,
) -> None:
    await _engine(redis_client, "a")
    await _engine(redis_client, "b")
    lost: list[tuple[str, str]] = []
    metrics = RouterMetrics()
    view = FleetView(
        redis_client,
        KEYS,
        lambda _: None,
        lambda *gone: lost.append(gone),
        silence_grace_s=0.5,
        metrics=metrics,
    )

    def silences(outcome: str) -> float:
        return metrics.engine_silences.labels(outcome)._value.get()

    await view.refresh()

    # a's record expires: it takes no new requests, but keeps what it runs.
    await redis_client.delete(KEYS.engine("a"))
    await view.refresh()
    assert view.engines["a"].state == "SILENT"
    assert not view.engines["a"].dispatchable and not view.engines["a"].usable
    assert view.engines["b"].dispatchable
    assert lost == []

    # Its heartbeat comes back within the grace: nothing happened.
    await _engine(redis_client, "a", running=4)
    await view.refresh()
    assert view.engines["a"].state == "ACTIVE" and view.engines["a"].dispatchable
    assert lost == []
    assert (silences("back"), silences("lost")) == (1, 0)

    # Silent again, and for longer than the grace: lost, its requests go on elsewhere.
    await redis_client.delete(KEYS.engine("a"))
    silent_at = time.monotonic()  # the grace starts in the refresh, no earlier
    await view.refresh()
    assert view.engines["a"].state == "SILENT"
    while "a" in view.engines:
        assert time.monotonic() - silent_at < 5.0, "a silent engine never lost"
        assert lost == []
        await asyncio.sleep(0.05)
        await view.refresh()
    assert time.monotonic() - silent_at >= 0.5
    assert lost == [("a", "stopped heartbeating")]
    assert (silences("back"), silences("lost")) == (1, 1)
