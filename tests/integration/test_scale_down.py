"""Scale-down by migration with real engines (a local fleet; no Kubernetes): the engine chosen
for removal from the load the engines report in Redis (the least loaded) is emptied while
streams run, and every stream completes exactly once. Both ways a pod is drained are run: the
operator's drainer (gRPC ``Drain``, before it lowers ``replicas``) and the pod's preStop hook
(HTTP ``GET /drain`` on the engine, before its SIGTERM).

The drained engine leaves the rotation (DRAINING in Redis) and moves its requests to the other
engine. No shutdown follows here (nothing deletes a pod), so it returns to service by itself
after ``REJOIN_AFTER_S``, as it would if the scale-down were called off; the fleet stays whole
for the tests after this one.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from typing import Any

import httpx
import openai
import pytest
import redis
import redis.asyncio as aioredis

from shoal_operator import scale
from shoal_operator.autoscale import read_engine_loads
from shoal_operator.children import Cluster
from shoal_operator.drain import Drained, GrpcDrainer
from shoal_operator.scale import EngineLoad, Leaving
from shoal_operator.spec import InferenceClusterSpec
from shoal_protos.records import EngineRecord
from tests.integration.support import (
    GREEDY_IDS,
    STALL_S,
    RunningFleet,
    async_client,
    fleet_state,
    greedy_ids,
    model_frozen,
    model_processes,
    run_slice,
    until,
    wait_until,
)
from tests.integration.test_migration import _agree

pytestmark = pytest.mark.integration

REJOIN_AFTER_S = 10.0
# Long enough to outlast a stall of the machine of several seconds before the drain is asked.
STREAMS, MAX_TOKENS = 6, 400


def _states(fleet: RunningFleet) -> dict[str, str]:
    engines: dict[str, str] = httpx.get(fleet.base_url + "/health", timeout=STALL_S).json()["engines"]
    return engines


async def _reported_loads(
    fleet: RunningFleet, engines: list[str], streams: list[asyncio.Task[list[int]]], timeout_s: float
) -> dict[str, EngineLoad] | None:
    """The engines' loads as the operator reads them, once every engine reports running requests;
    None if ``streams`` all ended first. The engines' models are frozen (``model_frozen``): between
    two reads they run one short slice, since an engine's count of running requests is vLLM's as
    of its last step, which can be older than the streams' first tokens."""
    cores = model_processes(fleet, engines)
    client = aioredis.Redis.from_url(fleet.cfg.redis_url)
    deadline = time.monotonic() + timeout_s
    try:
        loads: dict[str, EngineLoad] | redis.RedisError = {}
        while True:
            try:
                loads = await read_engine_loads(client, fleet.cfg.cluster, time.time())
            except (redis.TimeoutError, redis.ConnectionError) as e:
                loads = e  # a stall of this machine; the operator would read again too
            if isinstance(loads, dict) and all(e in loads and loads[e].running > 0 for e in engines):
                return loads
            if all(stream.done() for stream in streams):
                return None
            assert time.monotonic() < deadline, f"no report of running requests from every engine: {loads}"
            run_slice(cores)
            await asyncio.sleep(0.1)
    finally:
        await client.aclose()


def _router_sees(fleet: RunningFleet, engines: list[str]) -> bool:
    """The router reads Redis and has every one of ``engines`` in dispatch."""
    health = httpx.get(fleet.base_url + "/health", timeout=STALL_S).json()
    return bool(health["redis"]) and all(health["engines"].get(e) == "ACTIVE" for e in engines)


def _reported_within(fleet: RunningFleet, engine_id: str, seconds: float) -> bool:
    report = fleet.load_report(engine_id)
    return report is not None and time.time() - report.time <= seconds


def _running_pod(name: str) -> dict[str, Any]:
    """The engine's pod as the API server would list it: running and ready."""
    status = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    return {"metadata": {"name": name}, "status": status}


async def _ask_drain(asked_by: str, fleet: RunningFleet, cluster: Cluster, record: EngineRecord) -> Drained:
    """Drain the engine the way ``asked_by`` names: the operator's drainer (with the fleet's TLS
    files, as the operator reads them from their Secret), or the pod's hook."""
    if asked_by == "operator":
        drainer = GrpcDrainer(rejoin_after_s=REJOIN_AFTER_S)
        leaving = [Leaving(record.engine_id, record.control_address)]
        (drained,) = await drainer.drain(cluster, leaving, fleet.fleet_tls)
        return drained
    return await _prestop_drain(record.http_address, record.engine_id)


async def _prestop_drain(http_address: str, pod: str) -> Drained:
    """What the kubelet does with the engine container's preStop hook (plus a rejoin delay, as
    no SIGTERM follows here)."""
    async with httpx.AsyncClient(timeout=120) as http:
        reply = await http.get(http_address + "/drain", params={"rejoin_after_s": REJOIN_AFTER_S})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    return Drained(pod, migrated=body["migrated"], remaining=body["remaining"])


@pytest.mark.parametrize("asked_by", ["operator", "prestop-hook"])
async def test_scale_down_drains_the_leaving_engine_while_streams_run(
    smol_fleet: RunningFleet, asked_by: str
) -> None:
    engines = [smol_fleet.cfg.engine_id(i) for i in range(smol_fleet.cfg.engines)]
    cluster = Cluster(
        name="smol",
        namespace="local",
        uid="local",
        spec=InferenceClusterSpec.model_validate(
            {"model": {"source": "SmolLM2", "servedName": smol_fleet.model}, "engine": {"replicas": 1}}
        ),
    )
    client = async_client(smol_fleet)
    prompts = [[900 + 13 * i + j for j in range(5)] for i in range(STREAMS)]

    async def reference(prompt: list[int]) -> list[int]:
        return await greedy_ids(client, smol_fleet.model, prompt, MAX_TOKENS)

    references = await asyncio.gather(*(reference(p) for p in prompts))

    def reporting() -> bool:
        return all(_reported_within(smol_fleet, e, 1.0) for e in engines)

    # A stall of this machine that holds the test up longer than a stream lasts lets the
    # leaving engine's streams end before the drain reaches it: such a try shows nothing, so the
    # streams are checked and the next try starts (at most three). Each try's streams are
    # listed by engine for the failure message.
    tries: list[str] = []
    for _attempt in range(3):
        # The router sends nothing to an engine that is draining or whose reports stopped (an
        # earlier test can hold an engine's event loop up for seconds), so the six streams
        # spread over both engines only once both serve and report again.
        wait_until(
            lambda: all(_states(smol_fleet).get(e) == "ACTIVE" for e in engines),
            REJOIN_AFTER_S + STALL_S,
            "engines ACTIVE",
        )
        wait_until(reporting, STALL_S, "fresh load reports")
        # A stall of Redis leaves the router dispatching from its last read; its first read
        # after it can find heartbeats that look late and hold an engine out of dispatch for a
        # moment: the streams start once the router reads Redis again and sees both engines.
        wait_until(lambda: _router_sees(smol_fleet, engines), STALL_S, "the router seeing both engines")
        done = await _drain_while_streaming(
            smol_fleet, client, cluster, engines, prompts, references, asked_by, tries
        )
        if done is not None:
            victim, drained_at = done
            break
    else:
        pytest.fail("in three tries no drain met streams on both engines:\n" + "\n".join(tries))

    # No pod deletion followed: the engine serves again by itself.
    wait_until(
        lambda: _states(smol_fleet).get(victim) == "ACTIVE",
        REJOIN_AFTER_S + STALL_S,
        f"{victim} serving again",
    )
    assert time.monotonic() - drained_at >= REJOIN_AFTER_S - 0.5


def _router_metrics(fleet: RunningFleet) -> str:
    return httpx.get(fleet.base_url + "/metrics", timeout=STALL_S).text


async def _drain_while_streaming(
    fleet: RunningFleet,
    client: openai.AsyncOpenAI,
    cluster: Cluster,
    engines: list[str],
    prompts: list[list[int]],
    references: list[list[int]],
    asked_by: str,
    tries: list[str],
) -> tuple[str, float] | None:
    """Start the streams, drain the engine the operator would remove, check every stream and the
    drain's migration records. Returns the drained engine and when its drain ended, or None when
    the streams did not land on both engines or that engine held no stream by the time the drain
    came (every stream still checked)."""
    started = asyncio.Event()
    on: dict[int, str] = {}
    request_ids: dict[int, str] = {}

    async def streamed(i: int) -> list[int]:
        response = await client.completions.create(
            model=fleet.model, prompt=prompts[i], max_tokens=MAX_TOKENS, temperature=0, stream=True,
            extra_body=GREEDY_IDS,
        )  # fmt: skip
        on[i] = response.response.headers["x-shoal-engine"]
        request_ids[i] = response.response.headers["x-shoal-request-id"]
        if len(on) == STREAMS:
            started.set()
        ids: list[int] = []
        async for chunk in response:
            ids.extend(chunk.choices[0].model_extra["token_ids"])  # type: ignore[index]
        return ids

    tasks = [asyncio.create_task(streamed(i)) for i in range(STREAMS)]
    await asyncio.wait_for(started.wait(), 120)
    # The router spreads six streams over both engines, unless one was out of dispatch as they
    # came (a stall of Redis makes its heartbeat look late for a moment): then no drain runs,
    # every stream is still checked, and the test tries again.
    spread = set(on.values()) == set(engines)
    # For the failure message: where the streams went, and the engines as the router saw them.
    seen = [
        {
            k: e[k]
            for k in (
                "id",
                "state",
                "running",
                "waiting",
                "kv_usage",
                "inflight_here",
                "freeness",
                "room",
                "held",
            )
        }
        for e in fleet_state(fleet.base_url)["engines"]
    ]
    resumed = re.findall(r"^shoal_router_resumed_requests_total\{[^}]*\} \S+$", _router_metrics(fleet), re.M)
    tries.append(f"{dict(sorted(on.items()))}, router: {seen}, resumed: {resumed}")

    # Both models are held still from here (every stream has had its first token; the models run
    # in short slices only until both engines report their streams) until the drain has taken
    # the leaving engine out of the rotation, which it does before it lists the requests to
    # move: on a loaded machine the streams could otherwise end while the drain is on its way.
    # The other engine runs again once the victim is chosen, to take the moves.
    frozen = {e: contextlib.ExitStack() for e in engines}
    drained: Drained | None = None
    try:
        for engine_id, stack in frozen.items():
            stack.enter_context(model_frozen(fleet, engine_id))
        # The operator's choice: the engines' own load reports, read from Redis as the operator
        # reads them, once both report the streams they run. The engine id is the pod's name.
        loads = await _reported_loads(fleet, engines, tasks, 30.0) if spread else None
        if loads is not None:
            pods = [_running_pod(engine) for engine in engines]
            (chosen,) = scale.choose(pods, loads, 1)
            victim = chosen["metadata"]["name"]
            requests = {e: loads[e].running + loads[e].waiting for e in engines}
            assert requests[victim] == min(requests.values()), (victim, loads)
            record = fleet.engine_record(victim)
            assert record is not None and record.control_address
            for engine_id in engines:
                if engine_id != victim:
                    frozen[engine_id].close()
            drain = asyncio.create_task(_ask_drain(asked_by, fleet, cluster, record))

            def draining() -> bool:
                now = fleet.engine_record(victim)
                return now is not None and now.state == "DRAINING"

            asked_at = time.monotonic()
            await until(lambda: draining() or drain.done(), STALL_S, f"{victim} leaving the rotation")
            frozen[victim].close()
            drained = await drain
            drained_at = time.monotonic()
    finally:
        for stack in frozen.values():
            stack.close()
    if drained is not None:
        # Out of the rotation and empty: nothing new reaches it, nothing runs on it.
        assert drained.error == "" and drained.remaining == 0, drained
        record = fleet.engine_record(victim)
        assert record is not None
        # It rejoins REJOIN_AFTER_S after its drain ended, so a record read sooner than that
        # after the drain was asked for must say DRAINING (a machine stall may delay the read).
        assert record.state == "DRAINING" or time.monotonic() - asked_at >= REJOIN_AFTER_S, record
    got = await asyncio.wait_for(asyncio.gather(*tasks), 300)

    # Every stream complete, once: the same tokens as its reference (up to a batch-shape tie,
    # as in the 16-stream drain test: a second reference run finds those).
    again = await asyncio.gather(*(greedy_ids(client, fleet.model, p, MAX_TOKENS) for p in prompts))
    for i, ids in enumerate(got):
        stable = _agree(references[i], again[i])
        assert len(ids) == MAX_TOKENS and ids[:stable] == references[i][:stable], (i, on[i], stable)
    if drained is None or drained.migrated == 0:
        # Nothing was left on it to move (the drain's ``remaining`` is 0 above).
        return None
    listed = fleet.redis.lrange(fleet.keys.migrations, 0, 100)
    moves = [fleet.migration_record(m.decode()) for m in listed]
    moved = {
        m.request_id
        for m in moves
        if m is not None and (m.reason, m.source, m.outcome) == ("drain", victim, "MIGRATED")
    }
    assert drained.migrated == len(moved & set(request_ids.values()))
    return victim, drained_at
