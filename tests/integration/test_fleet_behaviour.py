"""Dispatch across engines, exactness against offline vLLM, aborts, and fleet state in Redis."""

from __future__ import annotations

import asyncio
import contextlib
import re

import httpx
import openai
import pytest

from tests.integration.support import (
    REFERENCE_MAX_TOKENS,
    REFERENCE_PROMPTS,
    STALL_S,
    RunningFleet,
    dispatched,
    model_frozen,
    wait_until,
)

pytestmark = pytest.mark.integration


async def test_32_concurrent_streams_equal_offline_vllm(
    tiny_fleet: RunningFleet, reference_token_ids: list[list[int]]
) -> None:
    before = dispatched(tiny_fleet)
    client = openai.AsyncOpenAI(
        base_url=tiny_fleet.base_url + "/v1", api_key="unused", max_retries=0, timeout=300
    )

    async def one(prompt: list[int]) -> list[int]:
        stream = await client.completions.create(
            model=tiny_fleet.model,
            prompt=prompt,
            max_tokens=REFERENCE_MAX_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        ids: list[int] = []
        async for chunk in stream:
            ids.extend(chunk.choices[0].model_extra["token_ids"])
        return ids

    results = await asyncio.gather(*(one(p) for p in REFERENCE_PROMPTS))
    for i, (got, want) in enumerate(zip(results, reference_token_ids, strict=True)):
        assert got == want, f"stream {i} differs from vLLM's offline LLM.generate"
    after = dispatched(tiny_fleet)
    served = {engine: after[engine] - before.get(engine, 0) for engine in after}
    assert sum(served.values()) == len(REFERENCE_PROMPTS)
    assert all(served.get(tiny_fleet.cfg.engine_id(i), 0) > 0 for i in range(2)), served


def test_redis_holds_engine_records_and_fresh_load_reports(tiny_fleet: RunningFleet) -> None:
    members = {m.decode() for m in tiny_fleet.redis.smembers(tiny_fleet.keys.engines)}
    assert {"engine-0", "engine-1"} <= members
    for engine_id in ("engine-0", "engine-1"):
        record = tiny_fleet.engine_record(engine_id)
        assert record is not None and record.model == tiny_fleet.model and record.pid > 0
        ttl_ms = tiny_fleet.redis.pttl(tiny_fleet.keys.engine(engine_id))
        assert 0 < ttl_ms <= tiny_fleet.cfg.heartbeat_ttl_s * 1000
        first = tiny_fleet.load_report(engine_id)
        assert first is not None
        # Reports are rewritten at least every 100 ms: a newer one shows up soon.
        wait_until(
            lambda eid=engine_id, seq=first.seq: tiny_fleet.load_report(eid).seq >= seq + 3,  # type: ignore[misc]
            timeout_s=STALL_S,
            what=f"three more load reports from {engine_id}",
        )


def test_client_disconnect_aborts_on_engine(tiny_fleet: RunningFleet) -> None:
    def aborted_total() -> float:
        total = 0.0
        for i in range(2):
            text = tiny_fleet.engine_metrics(tiny_fleet.cfg.engine_id(i))
            match = re.search(
                r'shoal_engine_requests_total\{[^}]*finish_reason="abort"[^}]*\} ([0-9.e+]+)', text
            )
            total += float(match.group(1)) if match else 0.0
        return total

    def running() -> int:
        reports = [tiny_fleet.load_report(tiny_fleet.cfg.engine_id(i)) for i in range(2)]
        return sum(r.num_running + r.num_waiting for r in reports if r is not None)

    aborted_before = aborted_total()
    body = {
        "model": tiny_fleet.model,
        "prompt": "a long story",
        "max_tokens": tiny_fleet.cfg.max_model_len - 192,
        "stream": True,
        "ignore_eos": True,
    }
    for _ in range(3):  # the tiny engine can finish the stream before this process acts
        with contextlib.ExitStack() as frozen:
            with httpx.stream(
                "POST", tiny_fleet.base_url + "/v1/completions", json=body, timeout=60
            ) as reply:
                assert reply.status_code == 200
                lines = reply.iter_lines()
                got = [next(lines) for _ in range(6)]
                assert any(line.startswith("data: ") for line in got)
                # The request cannot finish by itself before the disconnect.
                record = frozen.enter_context(model_frozen(tiny_fleet, reply.headers["x-shoal-engine"]))
                busy = httpx.get(record.http_address + "/health", timeout=STALL_S).json()["requests"]
            # Leaving the block closed the connection mid-stream.
            if busy:
                wait_until(
                    lambda: aborted_total() == aborted_before + 1, STALL_S, "the engine to count the abort"
                )
        if busy:
            break
    assert busy, "the stream finished before the disconnect, three times"
    wait_until(lambda: running() == 0, STALL_S, "the engines' running count to return to zero")
