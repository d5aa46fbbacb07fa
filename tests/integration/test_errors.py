"""Every documented error: its status code and OpenAI-style JSON, and nothing left running."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.integration.support import STALL_S, RunningFleet, wait_until

pytestmark = pytest.mark.integration


def _post(fleet: RunningFleet, path: str, **kwargs: object) -> httpx.Response:
    return httpx.post(fleet.base_url + path, timeout=STALL_S, **kwargs)  # type: ignore[arg-type]


def _error(reply: httpx.Response, status: int) -> dict[str, object]:
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    error: dict[str, object] = body["error"]
    return error


def test_malformed_json_is_400(tiny_fleet: RunningFleet) -> None:
    reply = _post(
        tiny_fleet,
        "/v1/completions",
        content=b'{"model": "x", "prompt": ',
        headers={"content-type": "application/json"},
    )
    assert _error(reply, 400)["type"] == "invalid_request_error"


def test_body_that_is_not_an_object_is_400(tiny_fleet: RunningFleet) -> None:
    reply = _post(tiny_fleet, "/v1/chat/completions", json=[1, 2, 3])
    assert _error(reply, 400)["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 5),
        ("top_p", 0),
        ("max_tokens", 0),
        ("n", 2),
        ("top_k", -5),
        ("stop", [""]),
    ],
)
def test_invalid_field_is_400_naming_it(tiny_fleet: RunningFleet, field: str, value: object) -> None:
    body = {"model": tiny_fleet.model, "prompt": "hi", field: value}
    error = _error(_post(tiny_fleet, "/v1/completions", json=body), 400)
    assert error["param"] == field


def test_missing_field_is_400(tiny_fleet: RunningFleet) -> None:
    error = _error(_post(tiny_fleet, "/v1/chat/completions", json={"model": tiny_fleet.model}), 400)
    assert error["param"] == "messages"


def test_unsupported_feature_is_400_naming_it(tiny_fleet: RunningFleet) -> None:
    body = {"model": tiny_fleet.model, "prompt": "hi", "logprobs": 2}
    assert _error(_post(tiny_fleet, "/v1/completions", json=body), 400)["param"] == "logprobs"


def test_unknown_model_is_404(tiny_fleet: RunningFleet) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        openai.OpenAI(
            base_url=tiny_fleet.base_url + "/v1", api_key="unused", max_retries=0
        ).chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 404
    assert info.value.code == "model_not_found"


def test_context_overflow_is_400_with_both_numbers(tiny_fleet: RunningFleet) -> None:
    limit = tiny_fleet.cfg.max_model_len
    assert limit is not None
    prompt = [11] * (limit - 50)
    error = _error(
        _post(
            tiny_fleet,
            "/v1/completions",
            json={"model": tiny_fleet.model, "prompt": prompt, "max_tokens": 100},
        ),
        400,
    )
    assert error["code"] == "context_length_exceeded"
    message = str(error["message"])
    assert str(limit) in message and str(limit - 50) in message and "100" in message


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_prompt_over_the_tokenizers_limit_is_400(tiny_fleet: RunningFleet, path: str) -> None:
    """Refused by the tokenizer before any work (``--max-input-chars``, 2,000,000 characters by
    default), as a 400 naming the limit; the next request is served as ever."""
    text = "lorem ipsum " * 170_000  # 2,040,000 characters
    if path == "/v1/completions":
        body: dict[str, object] = {"model": tiny_fleet.model, "prompt": text, "max_tokens": 1}
    else:
        body = {"model": tiny_fleet.model, "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    error = _error(_post(tiny_fleet, path, json=body), 400)
    assert error["type"] == "invalid_request_error"
    assert "over this tokenizer's limit of 2,000,000" in str(error["message"]), error
    reply = _post(
        tiny_fleet, "/v1/completions", json={"model": tiny_fleet.model, "prompt": "hi", "max_tokens": 1}
    )
    assert reply.status_code == 200, reply.text


def test_unknown_path_is_404_json(tiny_fleet: RunningFleet) -> None:
    _error(httpx.get(tiny_fleet.base_url + "/v1/nothing", timeout=STALL_S), 404)


def test_errors_leave_nothing_running(tiny_fleet: RunningFleet) -> None:
    def busy() -> int:
        reports = [tiny_fleet.load_report(tiny_fleet.cfg.engine_id(i)) for i in range(2)]
        return sum(r.num_running + r.num_waiting for r in reports if r is not None)

    wait_until(lambda: busy() == 0, STALL_S, "the engines to be idle after the error cases")


@pytest.fixture
def ghost_router(tiny_fleet: RunningFleet) -> Iterator[str]:
    """A second router on the same Redis, configured for a model no engine serves."""
    port = tiny_fleet.cfg.router_port + 50
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shoal_router.main",
            "--models",
            "ghost-model",
            "--cluster",
            tiny_fleet.cfg.cluster,
            "--redis-url",
            tiny_fleet.cfg.redis_url,
            "--tokenizer-address",
            f"127.0.0.1:{tiny_fleet.cfg.tokenizer_port}",
            "--port",
            str(port),
            "--zmq-port",
            str(tiny_fleet.cfg.router_zmq_port + 50),
            "--router-id",
            "ghost",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(url + "/health", timeout=STALL_S).status_code in (200, 503)
        except httpx.HTTPError:
            return False

    try:
        wait_until(up, STALL_S, "the second router to listen")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=STALL_S)


def test_no_engine_is_503_with_retry_after(ghost_router: str, tiny_fleet: RunningFleet) -> None:
    reply = httpx.post(
        ghost_router + "/v1/completions", json={"model": "ghost-model", "prompt": [1, 2, 3]}, timeout=STALL_S
    )
    error = _error(reply, 503)
    assert error["code"] == "no_engine"
    assert int(reply.headers["retry-after"]) >= 1
    # The second router sees the same fleet through Redis and serves the real model too.
    wait_until(
        lambda: httpx.get(ghost_router + "/health", timeout=STALL_S).status_code == 200,
        STALL_S,
        "the second router to see the engines",
    )
    ok = httpx.post(
        ghost_router + "/v1/completions",
        json={"model": tiny_fleet.model, "prompt": [5, 6, 7], "max_tokens": 3},
        timeout=60,
    )
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] >= 1
