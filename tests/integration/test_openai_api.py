"""The official ``openai`` client, sync and async, streaming and not, against real fleets."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from tests.integration.support import STALL_S, RunningFleet, models_frozen, wait_until

pytestmark = pytest.mark.integration

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def client(fleet: RunningFleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def async_client(fleet: RunningFleet) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=fleet.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_smollm2_chat_answers_paris(smol_fleet: RunningFleet) -> None:
    reply = client(smol_fleet).chat.completions.create(
        model=smol_fleet.model, messages=QUESTION, temperature=0, max_tokens=24
    )  # type: ignore[arg-type]
    assert "Paris" in (reply.choices[0].message.content or "")
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage is not None and reply.usage.prompt_tokens > 5
    assert reply.usage.completion_tokens <= 24


async def test_smollm2_async_chat_stream_answers_paris(smol_fleet: RunningFleet) -> None:
    stream = await async_client(smol_fleet).chat.completions.create(
        model=smol_fleet.model,
        messages=QUESTION,
        temperature=0,
        max_tokens=24,
        stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    )
    text, finish, usage = "", None, None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert "Paris" in text
    assert finish in ("stop", "length")
    assert usage is not None and usage.completion_tokens >= 1


def test_completion_non_streaming(tiny_fleet: RunningFleet) -> None:
    reply = client(tiny_fleet).completions.create(
        model=tiny_fleet.model,
        prompt="the quick brown fox",
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert reply.object == "text_completion"
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 12
    assert reply.choices[0].text


def test_completion_streaming_matches_non_streaming(tiny_fleet: RunningFleet) -> None:
    c = client(tiny_fleet)
    kwargs = {
        "model": tiny_fleet.model,
        "prompt": "over the lazy dog",
        "max_tokens": 16,
        "temperature": 0,
        "extra_body": {"ignore_eos": True, "return_token_ids": True},
    }
    whole = c.completions.create(**kwargs)  # type: ignore[call-overload]
    chunks = list(c.completions.create(stream=True, **kwargs))  # type: ignore[call-overload]
    assert "".join(ch.choices[0].text for ch in chunks) == whole.choices[0].text
    streamed_ids = [t for ch in chunks for t in ch.choices[0].model_extra["token_ids"]]
    assert streamed_ids == whole.choices[0].model_extra["token_ids"]
    assert len(streamed_ids) == 16
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_async_chat_non_streaming(tiny_fleet: RunningFleet) -> None:
    reply = await async_client(tiny_fleet).chat.completions.create(
        model=tiny_fleet.model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert reply.object == "chat.completion"
    assert reply.usage is not None and reply.usage.completion_tokens == 5


async def test_async_completion_stream_with_usage(tiny_fleet: RunningFleet) -> None:
    stream = await async_client(tiny_fleet).completions.create(
        model=tiny_fleet.model,
        prompt="hello",
        max_tokens=7,
        stream=True,
        temperature=0,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 7
    assert chunks[-1].choices == []


def test_chat_stream_ends_with_done(tiny_fleet: RunningFleet) -> None:
    body = {
        "model": tiny_fleet.model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "stream": True,
    }
    with httpx.stream("POST", tiny_fleet.base_url + "/v1/chat/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        events = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert '"role":"assistant"' in events[0]


def test_models_and_openapi(tiny_fleet: RunningFleet) -> None:
    models = client(tiny_fleet).models.list()
    assert [m.id for m in models.data] == [tiny_fleet.model]
    spec = httpx.get(tiny_fleet.base_url + "/openapi.json", timeout=STALL_S).json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(spec["paths"])


def test_router_metrics_count_requests(tiny_fleet: RunningFleet) -> None:
    client(tiny_fleet).completions.create(model=tiny_fleet.model, prompt="count me", max_tokens=2)
    text = httpx.get(tiny_fleet.base_url + "/metrics", timeout=STALL_S).text
    assert 'shoal_router_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert "shoal_router_time_to_first_token_seconds_count" in text


def test_a_priority_request_answers_alike_and_its_engine_keeps_headroom_for_it(
    tiny_fleet: RunningFleet,
) -> None:
    """``priority`` (vLLM's extension) reaches the engine: under FCFS scheduling the output is
    the same, and while the request runs its engine's load report counts KV headroom for it
    (``--priority-headroom``), which dispatch and balancing read as used."""
    c = client(tiny_fleet)
    kwargs = {
        "model": tiny_fleet.model,
        "prompt": "a priority request",
        "max_tokens": 12,
        "temperature": 0,
    }
    plain = c.completions.create(**kwargs, extra_body={"ignore_eos": True, "return_token_ids": True})  # type: ignore[call-overload]
    urgent = c.completions.create(
        **kwargs,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True, "return_token_ids": True, "priority": -1},
    )
    assert urgent.choices[0].token_ids == plain.choices[0].token_ids  # type: ignore[attr-defined]

    engines = [tiny_fleet.cfg.engine_id(i) for i in range(tiny_fleet.cfg.engines)]

    def reserved(engine: str) -> int:
        report = tiny_fleet.load_report(engine)
        return report.kv_blocks_reserved if report else 0

    # Both engines' models are frozen before the request is sent: it cannot end (the tiny model
    # decodes its whole context in seconds, faster than a loaded machine may run this test), and
    # the engine's front end, which holds it and writes the load reports, runs on.
    body = {**kwargs, "max_tokens": 8000, "stream": True, "ignore_eos": True, "priority": -1}
    answered: dict[str, object] = {}

    def ask() -> None:
        # The router answers at the first token, once the models run again; then the client
        # leaves, and the request is aborted.
        with httpx.stream(
            "POST", tiny_fleet.base_url + "/v1/completions", json=body, timeout=STALL_S
        ) as reply:
            answered.update(status=reply.status_code, engine=reply.headers.get("X-Shoal-Engine"))

    asking = threading.Thread(target=ask, name="priority-request")
    try:
        with models_frozen(tiny_fleet, engines):
            asking.start()
            wait_until(lambda: any(reserved(e) for e in engines), STALL_S, "a load report with headroom")
            holding = [e for e in engines if reserved(e)]
            assert len(holding) == 1, holding
            record = tiny_fleet.engine_record(holding[0])
            assert record is not None and reserved(holding[0]) == round(0.25 * record.kv_blocks_total)
    finally:
        if asking.ident is not None:  # started
            asking.join(STALL_S)
    # Its engine answered, or the other one: balancing reads the headroom as used, and may move
    # the request (with its headroom) once the models run.
    assert answered.get("status") == 200 and answered.get("engine") in engines, answered
    # The headroom goes with the request, wherever it ran.
    wait_until(lambda: not any(reserved(e) for e in engines), STALL_S, "the headroom to go with the request")
