"""A stream's SSE events spliced from a per-stream template are the bytes the whole object
would encode to."""

from __future__ import annotations

import json

import pytest

from shoal_protos.messages import FinishReason
from shoal_router.api.relay import SseEvents
from shoal_router.core.outputs import RequestDelta

TEXTS = [
    "",
    " hello",
    'a "quoted" \\ back\\slash',
    "line\nbreak\ttab",
    "caf\u00e9 \u4e2d\u6587 \U0001f600",
    "\x01\x1f",
]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("token_ids", [False, True])
@pytest.mark.parametrize("include_usage", [False, True])
def test_spliced_events_equal_whole_ones(chat: bool, token_ids: bool, include_usage: bool) -> None:
    events = SseEvents(
        "cmpl-1f2e",
        'odd "model" \x00shoal-text\x00',  # a stand-in inside the model name still cuts right
        chat=chat,
        include_usage=include_usage,
        prompt_token_ids=[1, 2, 3] if token_ids else None,
        created=1_790_000_000,
    )
    for i, text in enumerate(TEXTS):
        delta = RequestDelta(token_ids=list(range(i)), text=text)
        spliced = events.event(delta)
        assert spliced == events.whole(delta)
        payload = json.loads(spliced.removeprefix(b"data: ").removesuffix(b"\n\n"))
        choice = payload["choices"][0]
        assert (choice["delta"]["content"] if chat else choice["text"]) == text
        assert choice["finish_reason"] is None
        assert ("token_ids" in choice) == token_ids
        if token_ids:
            assert choice["token_ids"] == list(range(i))
        assert ("usage" in payload) == include_usage


def test_first_and_last_events_are_whole() -> None:
    events = SseEvents("chatcmpl-9", "m", chat=True, include_usage=False, prompt_token_ids=[7], created=1)
    first = json.loads(events.first(RequestDelta(token_ids=[5], text="Hi"))[6:])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "Hi"}
    assert first["prompt_token_ids"] == [7]
    last_delta = RequestDelta(token_ids=[6], text="!", finish_reason=FinishReason.STOP)
    last = json.loads(events.event(last_delta)[6:])
    assert last["choices"][0]["finish_reason"] == "stop"
    assert "prompt_token_ids" not in last
