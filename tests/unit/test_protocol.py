"""OpenAI request models: what the router accepts, normalizes and rejects at the edge."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from shoal_router.api.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    UnsupportedFieldError,
)

MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, **fields})


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hello", **fields})


def test_minimal_chat_request_gets_defaults() -> None:
    request = chat()
    assert request.n == 1
    assert request.stream is False
    assert request.temperature is None
    assert request.stop_list() == []
    assert request.output_limit() is None
    assert request.messages[0].text() == "hi"


def test_n_above_one_is_rejected_naming_n_1() -> None:
    with pytest.raises(ValidationError) as info:
        chat(n=2)
    errors = info.value.errors()
    assert [error["loc"] for error in errors] == [("n",)]
    assert "n=1" in errors[0]["msg"]


def test_n_equal_one_is_accepted() -> None:
    assert completion(n=1).n == 1


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 3),
        ("temperature", -0.1),
        ("top_p", 0),
        ("top_p", 1.5),
        ("max_tokens", 0),
        ("top_k", -2),
        ("max_completion_tokens", 0),
    ],
)
def test_out_of_range_sampling_values_are_rejected(field: str, value: float) -> None:
    with pytest.raises(ValidationError) as info:
        chat(**{field: value})
    assert info.value.errors()[0]["loc"] == (field,)


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", 0), ("temperature", 2), ("top_p", 1), ("top_k", -1), ("max_tokens", 1)],
)
def test_boundary_sampling_values_are_accepted(field: str, value: float) -> None:
    assert getattr(chat(**{field: value}), field) == value


def test_empty_messages_are_rejected() -> None:
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"model": "m", "messages": []})
    assert info.value.errors()[0]["loc"] == ("messages",)


def test_empty_model_is_rejected() -> None:
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"model": "", "messages": MESSAGES})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logprobs", True),
        ("top_logprobs", 3),
        ("tools", [{"type": "function"}]),
        ("response_format", {"type": "json_object"}),
        ("logit_bias", {"50256": -100}),
        ("echo", True),
        ("best_of", 2),
    ],
)
def test_unsupported_field_names_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValidationError) as info:
        chat(**{field: value})
    errors = info.value.errors()
    assert len(errors) == 1
    cause = errors[0]["ctx"]["error"]
    assert isinstance(cause, UnsupportedFieldError)
    assert cause.field == field
    assert field in errors[0]["msg"]


def test_unsupported_field_is_rejected_on_completions_too() -> None:
    with pytest.raises(ValidationError) as info:
        completion(suffix="tail")
    cause = info.value.errors()[0]["ctx"]["error"]
    assert isinstance(cause, UnsupportedFieldError)
    assert cause.field == "suffix"


@pytest.mark.parametrize(("field", "value"), [("logprobs", False), ("logprobs", None), ("tools", [])])
def test_unsupported_field_left_unset_is_accepted(field: str, value: Any) -> None:
    chat(**{field: value})


def test_hints_and_unknown_fields_are_ignored() -> None:
    request = chat(user="u-1", metadata={"k": "v"}, some_future_field=1)
    assert request.model == "m"


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("hello", "hello"), ([1, 2, 3], [1, 2, 3]), (["hello"], "hello"), ([[4, 5]], [4, 5])],
    ids=["str", "tokens", "one-str", "one-token-list"],
)
def test_prompt_forms_normalize_to_one_prompt(prompt: Any, expected: str | list[int]) -> None:
    assert completion(prompt=prompt).prompt == expected


@pytest.mark.parametrize("prompt", [["a", "b"], [[1], [2]]], ids=["strs", "token-lists"])
def test_batched_prompts_are_rejected(prompt: Any) -> None:
    with pytest.raises(ValidationError, match="batched prompts are not supported"):
        completion(prompt=prompt)


@pytest.mark.parametrize("prompt", [[5, -1], [[2**32]]], ids=["negative", "past-32-bits"])
def test_token_ids_outside_32_bits_are_rejected(prompt: Any) -> None:
    with pytest.raises(ValidationError, match="is not a token id"):
        completion(prompt=prompt)


def test_empty_prompt_list_is_rejected() -> None:
    with pytest.raises(ValidationError, match="prompt must not be empty"):
        completion(prompt=[])


def test_missing_prompt_is_rejected() -> None:
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m"})


def test_stop_string_becomes_a_list() -> None:
    assert completion(stop="\n").stop_list() == ["\n"]
    assert completion(stop=["a", "b"]).stop_list() == ["a", "b"]


def test_sixteen_stop_sequences_are_accepted_seventeen_are_not() -> None:
    assert len(chat(stop=[f"s{i}" for i in range(16)]).stop_list()) == 16
    with pytest.raises(ValidationError, match="at most 16 stop sequences"):
        chat(stop=[f"s{i}" for i in range(17)])


@pytest.mark.parametrize("stop", ["", ["ok", ""]])
def test_empty_stop_sequences_are_rejected(stop: Any) -> None:
    with pytest.raises(ValidationError, match="must not be empty"):
        chat(stop=stop)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, False),
        ({"stream": True}, False),
        ({"stream": True, "stream_options": {}}, False),
        ({"stream": True, "stream_options": {"include_usage": False}}, False),
        ({"stream": True, "stream_options": {"include_usage": True}}, True),
    ],
)
def test_include_usage(fields: dict[str, Any], expected: bool) -> None:
    assert chat(**fields).include_usage is expected


def test_output_limit_prefers_max_completion_tokens() -> None:
    assert chat(max_tokens=10).output_limit() == 10
    assert chat(max_tokens=10, max_completion_tokens=5).output_limit() == 5


def test_chat_message_text_joins_text_parts() -> None:
    message = ChatMessage.model_validate(
        {"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]}
    )
    assert message.text() == "Hello, world"


@pytest.mark.parametrize(("content", "expected"), [("plain", "plain"), (None, ""), ([], "")])
def test_chat_message_text_of_other_contents(content: Any, expected: str) -> None:
    assert ChatMessage(role="assistant", content=content).text() == expected


def test_chat_message_rejects_non_text_parts() -> None:
    with pytest.raises(ValidationError):
        ChatMessage.model_validate(
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}
        )


def test_chat_message_rejects_unknown_role() -> None:
    with pytest.raises(ValidationError):
        ChatMessage.model_validate({"role": "wizard", "content": "hi"})


def test_priority_is_vllms_extension_and_bounded() -> None:
    assert completion().priority == 0
    assert chat(priority=-10).priority == -10
    with pytest.raises(ValidationError, match="priority"):
        completion(priority=2**31)
