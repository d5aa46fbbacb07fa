"""Engines killed mid-request: their streams go on on another engine with every token exactly
once, and the dead engines leave dispatch within their heartbeat TTL; with no engine left, a
stream ends with an error event, never a hang. It kills engines: the module has a tiny fleet
of its own."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time

import httpx
import openai
import psutil
import pytest

from tests.integration.support import (
    STALL_S,
    RunningFleet,
    dispatched,
    in_flight,
    model_frozen,
    models_frozen,
    run_models_until,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.destructive]


@pytest.fixture(scope="module")
def tiny_fleet(own_tiny_fleet: RunningFleet) -> RunningFleet:
    """This module's own tiny fleet, in place of the shared one."""
    return own_tiny_fleet


TRIES_S = 240.0
"""How long the killed-engine test goes on starting streams until a kill meets one running."""


REAPED_S = 10.0
"""How soon after the engine's service process vLLM's processes under it must be gone."""


def _kill_engine(pid: int) -> list[psutil.Process]:
    """SIGKILL the engine's service process alone, as an OOM kill does; returns the processes
    under it then (vLLM's, and the engine's reaper), which ``_assert_reaped`` sees end."""
    tree = psutil.Process(pid).children(recursive=True)
    assert any(p.name().startswith("VLLM") for p in tree), tree
    os.kill(pid, signal.SIGKILL)
    return tree


def _assert_reaped(tree: list[psutil.Process]) -> None:
    """Every process of a killed engine's tree ends within ``REAPED_S`` (a zombie has ended: its
    new parent has yet to collect it)."""

    def running(process: psutil.Process) -> bool:
        try:
            return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    wait_until(
        lambda: not any(running(p) for p in tree),
        REAPED_S,
        f"the killed engine's processes to end: {[p for p in tree if running(p)]}",
    )


def _router_state(fleet: RunningFleet, engine_id: str) -> str | None:
    engines: dict[str, str] = httpx.get(fleet.base_url + "/health", timeout=STALL_S).json()["engines"]
    return engines.get(engine_id)


def test_an_engine_back_within_the_silence_grace_keeps_its_stream(tiny_fleet: RunningFleet) -> None:
    """An engine whose record expired (here: the engine frozen and its record deleted, as when a
    stall of the whole machine outlasts the heartbeat TTL) is SILENT to the router: no new
    requests, but its stream stays. Woken within ``--engine-silence-grace-s``, it writes its
    record again, the router takes it back, and the stream ends on it with the tokens of a run
    that never stopped; nothing was continued elsewhere."""
    body = {
        "model": tiny_fleet.model,
        "prompt": [5, 6, 7],
        "max_tokens": 256,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    reference = httpx.post(tiny_fleet.base_url + "/v1/completions", json=body, timeout=60).json()
    resumed_before = _resumed(tiny_fleet)
    back_before = _silences(tiny_fleet, "back")
    token_ids: list[int] = []
    with httpx.stream(
        "POST", tiny_fleet.base_url + "/v1/completions", json={**body, "stream": True}, timeout=60
    ) as response:
        assert response.status_code == 200
        engine_id = response.headers["x-shoal-engine"]
        record = tiny_fleet.engine_record(engine_id)
        assert record is not None
        frozen = False
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line.removeprefix("data: ")).get("choices") or [{}]
            token_ids.extend(choices[0].get("token_ids") or [])
            if token_ids and not frozen:
                frozen = True
                os.kill(record.pid, signal.SIGSTOP)
                try:
                    tiny_fleet.redis.delete(tiny_fleet.keys.engine(engine_id))
                    wait_until(
                        lambda: _router_state(tiny_fleet, engine_id) == "SILENT",
                        STALL_S,
                        f"the router to find {engine_id} silent",
                    )
                finally:
                    os.kill(record.pid, signal.SIGCONT)
                wait_until(
                    lambda: _router_state(tiny_fleet, engine_id) == "ACTIVE",
                    STALL_S,
                    f"{engine_id} to be taken back",
                )
    assert frozen
    assert token_ids == reference["choices"][0]["token_ids"], _first_difference(
        token_ids, reference["choices"][0]["token_ids"]
    )
    assert _resumed(tiny_fleet) == resumed_before
    assert _silences(tiny_fleet, "back") == back_before + 1


def test_engine_frozen_past_its_ttl_comes_back_into_dispatch(tiny_fleet: RunningFleet) -> None:
    """A live engine whose heartbeat lapsed (its process was starved) leaves dispatch, registers
    again by itself once it runs, and the router takes it back and serves from it."""
    engine_id = tiny_fleet.cfg.engine_id(0)
    record = tiny_fleet.engine_record(engine_id)
    assert record is not None
    os.kill(record.pid, signal.SIGSTOP)
    try:
        wait_until(
            lambda: _router_state(tiny_fleet, engine_id) is None,
            tiny_fleet.cfg.heartbeat_ttl_s + STALL_S,
            f"the router to drop the frozen {engine_id}",
        )
    finally:
        os.kill(record.pid, signal.SIGCONT)
    wait_until(
        lambda: _router_state(tiny_fleet, engine_id) == "ACTIVE",
        STALL_S,
        f"the router to take {engine_id} back",
    )
    # Ties between idle engines break at random: 16 requests all missing it is a 1 in 65,536 chance.
    before = dispatched(tiny_fleet).get(engine_id, 0.0)
    for _ in range(16):
        reply = httpx.post(
            tiny_fleet.base_url + "/v1/completions",
            json={"model": tiny_fleet.model, "prompt": [1, 2, 3], "max_tokens": 2},
            timeout=STALL_S,
        )
        assert reply.status_code == 200, reply.text
    assert dispatched(tiny_fleet).get(engine_id, 0.0) > before


@pytest.mark.timeout(900)  # tries of whole-context streams for up to TRIES_S twice, and the rest
async def test_streams_of_a_killed_engine_go_on_elsewhere_exactly_once(tiny_fleet: RunningFleet) -> None:
    """SIGKILL the engine running the most of four greedy streams: every stream completes, and
    the token ids of each equal a reference run's (the killed engine's streams continue on the
    other engine after the tokens their clients had). Then the dead engine leaves dispatch, and
    killing the last engine ends a running stream with an error event."""
    records = {
        r.engine_id: r for i in range(2) if (r := tiny_fleet.engine_record(tiny_fleet.cfg.engine_id(i)))
    }
    assert len(records) == 2
    engine_of: dict[int, str] = {}
    some_stream_has_tokens = threading.Event()
    # The four streams that had tokens: the kill waits for all four, so that each stream's
    # header names the engine it runs on (a request the killed engine held before its first
    # token would get that token, and the header, from the survivor).
    with_tokens: set[int] = set()
    every_stream_has_tokens = threading.Event()
    body = {
        "model": tiny_fleet.model,
        "prompt": [7, 8, 9],
        # As long as the tiny model's context allows: the engines' front ends can lag their cores by
        # hundreds of tokens when the machine stalls, and a kill must still meet unfinished streams.
        "max_tokens": tiny_fleet.cfg.max_model_len - 192,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }

    async def long_stream(http: httpx.AsyncClient, i: int) -> tuple[str, list[int]]:
        """Read the SSE stream; return how it ended and the token ids it delivered."""
        token_ids: list[int] = []
        async with http.stream("POST", tiny_fleet.base_url + "/v1/completions", json=body) as reply:
            if reply.status_code != 200:
                # Nothing to wait for: the gather below says why.
                some_stream_has_tokens.set()
                every_stream_has_tokens.set()
                await reply.aread()
                raise AssertionError(f"stream {i}: {reply.status_code} {reply.text}")
            # The router names the engine in a header; it is sent with the first token.
            engine_of[i] = reply.headers["x-shoal-engine"]
            last = ""
            async for line in reply.aiter_lines():
                if not line.startswith("data: "):
                    continue
                last = line
                if line != "data: [DONE]":
                    choices = json.loads(line.removeprefix("data: ")).get("choices") or [{}]
                    token_ids.extend(choices[0].get("token_ids") or [])
                    if token_ids:
                        some_stream_has_tokens.set()
                        with_tokens.add(i)
                        if with_tokens >= {0, 1, 2, 3}:
                            every_stream_has_tokens.set()
        if last == "data: [DONE]":
            return "completed", token_ids
        error = json.loads(last.removeprefix("data: "))["error"]
        return f"error: {error['message']}", token_ids

    busy_at_kill: dict[str, int] = {}
    slices: list[float] = []  # each try's longest run of the models, for the failure message
    # Only this test's streams count: a request the router still listed from before would make
    # its tokens look like theirs.
    earlier = {r["id"] for r in in_flight(tiny_fleet)}

    def kill_a_busy_engine() -> str:
        # A thread, so that the kill does not wait for the busy event loop. The router sees the
        # four streams' first tokens (and sends each its engine's header) long before this
        # process has parsed them all, so its list of requests in flight is asked too.
        def four_have_tokens() -> bool:
            if every_stream_has_tokens.is_set():
                return True
            return sum(r["tokens"] >= 1 for r in in_flight(tiny_fleet) if r["id"] not in earlier) >= 4

        # The tiny model decodes a whole stream in a few seconds, faster than this process may
        # look on a loaded machine. The streams start with vLLM's processes under both engines
        # frozen (the caller's block), which run in short slices until four streams have
        # tokens: a request an engine then counts cannot finish (short of its last step's
        # output already being on its way), and the kill meets it running.
        longest = run_models_until(tiny_fleet, records, four_have_tokens, 180, "four streams with tokens")
        slices.append(round(longest, 2))
        victim = ""
        for engine_id, record in records.items():
            health = httpx.get(record.http_address + "/health", timeout=STALL_S).json()
            busy_at_kill[engine_id] = int(health.get("requests", 0))
        busiest = max(busy_at_kill, key=lambda e: busy_at_kill[e])
        if busy_at_kill[busiest]:  # else every stream finished first: the caller tries again
            victim = busiest
            trees.append(_kill_engine(records[victim].pid))
        return victim

    resumed_before = _resumed(tiny_fleet)
    trees: list[list[psutil.Process]] = []  # each killed engine's processes
    # A stream may still end within one slice of the models' run: when this machine leaves the
    # test's thread unscheduled, a slice lasts as long as that. Tries go on for TRIES_S.
    deadline = time.monotonic() + TRIES_S
    tried = 0
    while time.monotonic() < deadline:
        tried += 1
        with_tokens.clear()
        every_stream_has_tokens.clear()
        async with httpx.AsyncClient(timeout=120) as http:
            with models_frozen(tiny_fleet, records):
                tasks = [asyncio.create_task(long_stream(http, i)) for i in range(4)]
                victim = await asyncio.to_thread(kill_a_busy_engine)
            results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=240)
        if victim:
            break
        # No kill this try (no engine held a stream by then): each stream ended whole by itself.
        assert [(ended, len(ids)) for ended, ids in results] == [("completed", body["max_tokens"])] * 4, [
            (ended, len(ids)) for ended, ids in results
        ]
    assert victim, f"every stream finished before the kill, {tried} times: {busy_at_kill}, slices {slices}"
    survivor = next(engine_id for engine_id in records if engine_id != victim)
    assert busy_at_kill[victim] >= 1, busy_at_kill
    # Every stream completes, those that were on the killed engine too.
    assert [ended for ended, _ in results] == ["completed"] * 4, results
    moved = [i for i in range(4) if engine_of[i] == victim]
    assert moved, (engine_of, victim)
    assert _resumed(tiny_fleet) - resumed_before >= 1
    # Killed alone, the engine's service takes vLLM's processes with it.
    _assert_reaped(trees[0])

    # The same request run whole on the survivor alone is the reference: every stream, moved or
    # not, has exactly its tokens (a lost token shifts the rest; a repeated one too).
    async with httpx.AsyncClient(timeout=120) as http:
        whole = await http.post(tiny_fleet.base_url + "/v1/completions", json={**body, "stream": False})
    reference = whole.json()["choices"][0]["token_ids"]
    assert len(reference) == body["max_tokens"]
    for i, (_, token_ids) in enumerate(results):
        assert len(token_ids) == len(reference), (i, len(token_ids))
        assert token_ids == reference, (i, _first_difference(token_ids, reference))

    client = openai.AsyncOpenAI(
        base_url=tiny_fleet.base_url + "/v1", api_key="unused", max_retries=0, timeout=120
    )
    # The heartbeat expires and the router forgets the engine; new requests go to the survivor.
    wait_until(
        lambda: tiny_fleet.redis.get(tiny_fleet.keys.engine(victim)) is None,
        STALL_S,
        f"{victim}'s Redis record to expire",
    )
    wait_until(lambda: _router_state(tiny_fleet, victim) is None, STALL_S, f"the router to forget {victim}")
    for _ in range(4):
        reply = await client.completions.create(model=tiny_fleet.model, prompt=[1, 2], max_tokens=2)
        assert reply.usage is not None and reply.usage.completion_tokens >= 1

    # The last engine dies under a running stream: nowhere to go, so an error event ends it.
    killed: list[float] = []
    tries: list[str] = []  # what each try saw, for the failure message

    def kill_the_last_engine(listed_before: set[str]) -> int:
        """On a thread, as above: the engine's model, frozen by the caller, runs in slices until
        the stream has tokens; the engine is killed if the request is still there (else the
        caller tries again with a new stream). Requests in ``listed_before`` are not the stream."""

        def has_tokens() -> bool:
            if some_stream_has_tokens.is_set():
                return True
            return any(r["tokens"] >= 1 for r in in_flight(tiny_fleet) if r["id"] not in listed_before)

        started = time.monotonic()
        longest = run_models_until(tiny_fleet, [survivor], has_tokens, 180, "the last stream's tokens")
        health = httpx.get(records[survivor].http_address + "/health", timeout=STALL_S).json()
        busy = int(health["requests"])
        tries.append(
            f"tokens after {time.monotonic() - started:.2f} s (longest slice {longest:.2f} s), "
            f"{busy} running on {survivor}, router lists {in_flight(tiny_fleet)}"
        )
        if busy:
            trees.append(_kill_engine(records[survivor].pid))
            killed.append(time.monotonic())
        return busy

    deadline = time.monotonic() + TRIES_S
    while time.monotonic() < deadline:
        attempt = len(tries)
        some_stream_has_tokens.clear()
        async with httpx.AsyncClient(timeout=120) as http:
            listed_before = {r["id"] for r in in_flight(tiny_fleet)}
            with model_frozen(tiny_fleet, survivor):
                last_stream = asyncio.create_task(long_stream(http, 4 + attempt))
                busy = await asyncio.to_thread(kill_the_last_engine, listed_before)
            ended, token_ids = await asyncio.wait_for(last_stream, timeout=120)
        tries[-1] += f"; the stream ended {ended!r} after {len(token_ids)} tokens"
        if busy:
            break
    assert killed, f"{len(tries)} streams in a row finished before the kill:\n" + "\n".join(tries)
    killed_at = killed[0]
    assert ended.startswith("error") and survivor in ended and "no other engine" in ended, ended

    # With the machine quiet, time how fast the last engine leaves dispatch once killed.
    wait_until(
        lambda: _router_state(tiny_fleet, survivor) in (None, "UNREACHABLE"),
        tiny_fleet.cfg.heartbeat_ttl_s,
        f"{survivor} to leave dispatch",
    )
    assert time.monotonic() - killed_at <= tiny_fleet.cfg.heartbeat_ttl_s
    async with httpx.AsyncClient(timeout=STALL_S) as http:
        reply_503 = await http.post(
            tiny_fleet.base_url + "/v1/completions",
            json={"model": tiny_fleet.model, "prompt": [1, 2], "max_tokens": 2},
        )
    assert reply_503.status_code == 503
    assert reply_503.json()["error"]["code"] == "no_engine"
    assert "retry-after" in reply_503.headers
    _assert_reaped(trees[-1])


def _resumed(fleet: RunningFleet) -> float:
    """Requests the router continued on another engine, from its Prometheus counter."""
    text = httpx.get(fleet.base_url + "/metrics", timeout=STALL_S).text
    counts = re.findall(r"^shoal_router_resumed_requests_total\{[^}]*\} (\S+)$", text, re.M)
    return sum(float(count) for count in counts)


def _silences(fleet: RunningFleet, outcome: str) -> float:
    """Engines whose heartbeat lapsed and came back (``back``) or not (``lost``), from the
    router's Prometheus counter."""
    text = httpx.get(fleet.base_url + "/metrics", timeout=STALL_S).text
    found = re.search(rf'^shoal_router_engine_silences_total\{{outcome="{outcome}"\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
