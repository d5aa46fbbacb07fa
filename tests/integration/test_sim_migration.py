"""Live migration between simulated engines: two ``shoal-engine --backend sim --migration``
processes, whose KV agent times each move at the configured bandwidth (``kv.sim_agent``), run
the real migration protocol under a real router and Redis. A request moved by the engine's
control API finishes its stream with every token once, its KV counted in blocks of the model's
real size; the router's balancing leader moves requests off a crowded simulated engine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import httpx
import openai
import pytest
import redis

from shoal_engine.migration.source import TAIL_TOKENS
from shoal_protos import engine_control_pb2 as pb
from shoal_protos import engine_control_pb2_grpc as pb_grpc
from shoal_protos.records import Keys, engine_record_decoder, migration_record_decoder
from tests.integration.support import STALL_S, check_target_phases, free_port, sim_fleet, wait_until

pytestmark = pytest.mark.integration

CLUSTER, MODEL = "sim-move", "sim-move"
BLOCK, BYTES_PER_TOKEN = 16, 131_072  # the simulated engine's defaults (LLaMA-3-8B in fp16)


@dataclass(frozen=True)
class MovingFleet:
    url: str
    redis: redis.Redis
    keys: Keys

    def control(self, engine_id: str) -> pb_grpc.EngineControlStub:
        raw = self.redis.get(self.keys.engine(engine_id))
        assert raw is not None, f"{engine_id} is not registered"
        channel = grpc.insecure_channel(engine_record_decoder.decode(raw).control_address)
        return pb_grpc.EngineControlStub(channel)


@contextlib.contextmanager
def _moving_fleet(
    tmp_path_factory: pytest.TempPathFactory, cluster: str, engine_flags: tuple[str, ...] = ()
) -> Iterator[MovingFleet]:
    """Redis, two simulated engines that migrate, and a balancing router that places requests
    by session (so a test can pile them on one engine)."""
    engine_args = [
        "--model", "llama3-8b-a100", "--sim-kv-blocks", "2048", "--max-model-len", "4096",
        "--max-num-seqs", "32", "--migration", *engine_flags,
    ]  # fmt: skip
    router_args = (
        "--scheduler", "session_affinity", "--balance", "--balance-interval-s", "0.2",
        "--balance-threshold", "0.02", "--balance-cooldown-s", "0.5",
    )  # fmt: skip

    def ports(_: int) -> list[str]:
        return ["--control-port", str(free_port()), "--kv-port", str(free_port(2))]

    logs = tmp_path_factory.mktemp(cluster)
    with sim_fleet(logs, cluster, MODEL, engine_args, router_args, per_engine=ports) as fleet:
        client = redis.Redis.from_url(fleet.redis_url)
        yield MovingFleet(fleet.url, client, Keys(cluster))
        client.close()


@pytest.fixture(scope="module")
def moving_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MovingFleet]:
    with _moving_fleet(tmp_path_factory, CLUSTER) as fleet:
        yield fleet


Streaming = contextlib.AbstractContextManager[httpx.Response]


def _tokens(lines: Iterator[str], want: int) -> list[int]:
    """Token ids from a streaming completion's events until ``want`` came (or the stream ended)."""
    token_ids: list[int] = []
    for line in lines:
        if line.startswith("data: {"):
            token_ids += json.loads(line[6:])["choices"][0]["token_ids"]
            if len(token_ids) >= want:
                break
    return token_ids


def _move_a_stream(fleet: MovingFleet, reason: str) -> tuple[pb.MigrationResult, str, str]:
    """Stream a 300-token prompt's 600 tokens, moving the request (with ``reason``) after 50;
    returns the move's result, its source and its target once every token came, once."""
    body = {
        "model": MODEL, "prompt": list(range(300)), "max_tokens": 600, "stream": True,
        "ignore_eos": True, "return_token_ids": True,
    }  # fmt: skip
    with httpx.stream("POST", fleet.url + "/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        source = response.headers["X-Shoal-Engine"]
        request_id = response.headers["X-Shoal-Request-Id"]
        target = "sim-1" if source == "sim-0" else "sim-0"
        lines = response.iter_lines()
        token_ids = _tokens(lines, 50)
        assert len(token_ids) >= 50
        result = fleet.control(source).Migrate(
            pb.MigrateRequest(request_id=request_id, target_engine_id=target, reason=reason), timeout=STALL_S
        )
        assert pb.Outcome.Name(result.outcome) == "MIGRATED", result.detail
        token_ids += _tokens(lines, 10_000)
    assert len(token_ids) == 600  # every token once: none lost, none repeated
    return result, source, target


def test_a_request_moves_with_its_kv_timed_and_its_stream_goes_on(moving_fleet: MovingFleet) -> None:
    result, source, target = _move_a_stream(moving_fleet, "admin")
    # The KV went over in whole blocks of the model's size, most of it before the stop.
    assert result.bytes == result.blocks * BLOCK * BYTES_PER_TOKEN
    assert result.blocks >= (300 + 50) // BLOCK
    assert result.stages >= 2
    record = migration_record_decoder.decode(
        moving_fleet.redis.get(moving_fleet.keys.migration(result.migration_id))
    )
    assert (record.outcome, record.source, record.target) == ("MIGRATED", source, target)
    # The KV tokens the target loaded: the context but the last sampled token, at the stop, less
    # the few written after the move's tail (the target computes those).
    assert record.total_tokens - 1 - TAIL_TOKENS <= record.kv_tokens <= record.total_tokens - 1
    # The copies took the time the bytes need at 8 GB/s (the engines run at speed 1).
    assert record.duration_ms >= record.bytes / 8e9 * 1000
    # The target adds the client's gap and its own parts of it, from the commit to the first
    # token: they fit inside the gap, and the first step there took a simulated step's time.
    key = moving_fleet.keys.migration(result.migration_id)
    wait_until(
        lambda: migration_record_decoder.decode(moving_fleet.redis.get(key)).stall_ms is not None,
        STALL_S,
        "the target to record the stall",
    )
    check_target_phases(migration_record_decoder.decode(moving_fleet.redis.get(key)))


async def test_the_balancing_leader_moves_requests_off_a_crowded_simulated_engine(
    moving_fleet: MovingFleet,
) -> None:
    client = openai.AsyncOpenAI(
        base_url=moving_fleet.url + "/v1", api_key="unused", max_retries=0, timeout=120
    )

    def migrated() -> float:
        text = httpx.get(moving_fleet.url + "/metrics", timeout=STALL_S).text
        found = re.search(r'shoal_router_balance_migrations_total\{outcome="MIGRATED"\} (\S+)', text)
        return float(found.group(1)) if found else 0.0

    before = migrated()

    async def stream(i: int) -> int:
        # One session: session affinity sends them all to the same engine first.
        response = await client.completions.create(
            model=MODEL, prompt=[5, 6, 7 + i], max_tokens=800, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
            extra_headers={"x-session-id": "one"},
        )  # fmt: skip
        count = 0
        async for chunk in response:
            count += len(chunk.choices[0].model_extra["token_ids"])  # type: ignore[index]
        return count

    counts = await asyncio.gather(*(stream(i) for i in range(8)))
    assert counts == [800] * 8
    deadline = time.monotonic() + STALL_S
    while migrated() <= before:  # the counter moves when the Migrate call returns
        assert time.monotonic() < deadline, "the leader moved no request"
        await asyncio.sleep(0.1)


SHARE = 0.01  # of the time a paced pre-copy may spend sending


@pytest.fixture(scope="module")
def paced_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MovingFleet]:
    with _moving_fleet(tmp_path_factory, "sim-paced", ("--migration-precopy-share", str(SHARE))) as fleet:
        yield fleet


def test_a_paced_pre_copy_sends_for_its_share_of_the_time_but_a_drain_goes_at_full_speed(
    paced_fleet: MovingFleet,
) -> None:
    """Engines pace pre-copy to 1 % of the time: a move's pre-copy of some 45 MB at 8 GB/s takes
    about 0.6 s instead of 6 ms; a drain's move (the engine is leaving) is not paced."""
    paced, _, _ = _move_a_stream(paced_fleet, "admin")
    drained, _, _ = _move_a_stream(paced_fleet, "drain")
    durations = {}
    for result in (paced, drained):
        record = migration_record_decoder.decode(
            paced_fleet.redis.get(paced_fleet.keys.migration(result.migration_id))
        )
        assert record.bytes == result.bytes > 300 * BYTES_PER_TOKEN
        durations[record.reason] = record.duration_ms
    # The pre-copy (all but the last stage's few blocks) went at 1 % of 8 GB/s.
    assert durations["admin"] >= (paced.bytes - 4 * BLOCK * BYTES_PER_TOKEN) / (8e9 * SHARE) * 1000
    assert durations["drain"] < durations["admin"] / 4, durations


def test_a_request_preempted_during_its_pre_copy_still_moves_with_every_token_once(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A source with 46 KV blocks of 16 tokens runs two requests that cannot both finish there
    (29 + 38 blocks), at about 40 ms a step. The newer one is moved at its first token with a
    pre-copy paced to 1 MiB/s (a 2 MiB block every 2 s, stages of at most 4 s): the cache fills
    some 2.6 s in, during the first stage, the source preempts the request (the newest), and
    that stage's blocks count for nothing. The move goes on once the older request has finished
    and the moved one has its blocks back; its stream ends with the tokens of the same request
    never moved, each once."""
    engine_args = [
        "--model", "llama3-8b-a100", "--sim-kv-blocks", "46", "--max-model-len", "736",
        "--max-num-seqs", "8", "--sim-speed", "0.2", "--migration",
        "--migration-precopy-mib-per-s", "1", "--migration-step-timeout-s", "8",
    ]  # fmt: skip
    # Session affinity piles both on one engine; nothing held at the router for want of KV.
    router_args = ("--scheduler", "session_affinity", "--hold-below", "0")

    def ports(_: int) -> list[str]:
        return ["--control-port", str(free_port()), "--kv-port", str(free_port(2))]

    logs = tmp_path_factory.mktemp("sim-preempted")
    cluster = "sim-preempted"
    headers = {"x-session-id": "one"}

    def start(url: str, prompt: list[int], max_tokens: int) -> Streaming:
        body = {
            "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "return_token_ids": True,
        }  # fmt: skip
        return httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=120)

    moved_prompt, older_prompt = list(range(1000, 1300)), list(range(2000, 2300))
    with sim_fleet(logs, cluster, MODEL, engine_args, router_args, per_engine=ports) as sim:
        fleet = MovingFleet(sim.url, redis.Redis.from_url(sim.redis_url), Keys(cluster))
        with start(sim.url, moved_prompt, 300) as alone:
            reference = _tokens(alone.iter_lines(), 300)
        assert len(reference) == 300

        def router_sees(running: int) -> bool:
            """The router has read a load report with ``running`` requests on the fleet: what it
            sent before is covered, so it does not count a finished request's prompt blocks
            against the engine's room (it would send the next request to the other engine)."""
            engines = httpx.get(sim.url + "/fleet/state", timeout=STALL_S).json()["engines"]
            return sum(engine["running"] for engine in engines) == running and all(
                (engine["kv_usage"] > 0) == bool(engine["running"]) for engine in engines
            )

        wait_until(lambda: router_sees(0), STALL_S, "the router to see the fleet idle")
        with start(sim.url, older_prompt, 150) as older:
            older_lines = older.iter_lines()
            assert len(_tokens(older_lines, 1)) == 1
            wait_until(lambda: router_sees(1), STALL_S, "the router to see the older request")
            with start(sim.url, moved_prompt, 300) as moving:
                source = moving.headers["X-Shoal-Engine"]
                assert source == older.headers["X-Shoal-Engine"]
                target = "sim-1" if source == "sim-0" else "sim-0"
                lines = moving.iter_lines()
                got = _tokens(lines, 1)
                request_id = moving.headers["X-Shoal-Request-Id"]
                result = fleet.control(source).Migrate(
                    pb.MigrateRequest(request_id=request_id, target_engine_id=target, reason="admin"),
                    timeout=STALL_S,
                )
                assert pb.Outcome.Name(result.outcome) == "MIGRATED", result.detail
                got += _tokens(lines, 10_000)
            assert len(_tokens(older_lines, 10_000)) == 149
        # Every token once, the same as never moved (the simulated engines draw a moved
        # request's tokens on from where it was).
        assert got == reference
        raw = fleet.redis.get(fleet.keys.engine(source))
        assert raw is not None
        metrics = httpx.get(engine_record_decoder.decode(raw).http_address + "/metrics", timeout=STALL_S).text
        lost = re.search(r"^shoal_engine_migration_stages_lost_total\{[^}]*\} (\S+)$", metrics, re.M)
        preempted = re.search(r"^shoal_sim_preemptions_total\{?[^ ]*\}? (\S+)$", metrics, re.M)
        assert preempted is not None and float(preempted.group(1)) >= 1, "the source preempted nothing"
        assert lost is not None and float(lost.group(1)) >= 1, "no pre-copy stage was sent again"
        fleet.redis.close()
