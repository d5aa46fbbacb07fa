"""OpenAI request models, validated at the edge with pydantic.

Only what the router implements is accepted with a value: a field it does not implement yet
(``logprobs``, ``tools``, ...) is a 400 naming the field when it is set, never silently ignored.
Fields the OpenAI API defines as hints (``user``, ``metadata``) and unknown extra fields are
ignored, as OpenAI does. ``return_token_ids``, ``ignore_eos`` and ``priority`` are extensions that
vLLM's own server also offers.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_NOT_SUPPORTED = (
    "logprobs",
    "top_logprobs",
    "echo",
    "best_of",
    "suffix",
    "tools",
    "functions",
    "response_format",
    "logit_bias",
    "tool_choice",
    "function_call",
)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    # vLLM's extension: lower is served first; below 0 is a priority request.
    priority: int = Field(default=0, ge=-(2**31), lt=2**31)

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"n={n} is not supported; this server returns one choice per request (n=1)")
        return n

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        items = [stop] if isinstance(stop, str) else (stop or [])
        if len(items) > 16:
            raise ValueError("at most 16 stop sequences are allowed")
        if any(not item for item in items):
            raise ValueError("stop sequences must not be empty")
        return stop

    @model_validator(mode="after")
    def _reject_unsupported(self) -> _GenerationRequest:
        extra = self.model_extra or {}
        for name in _NOT_SUPPORTED:
            if extra.get(name):
                raise UnsupportedFieldError(name)
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class UnsupportedFieldError(ValueError):
    def __init__(self, field: str) -> None:
        super().__init__(f"{field!r} is not supported by this server")
        self.field = field


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[int] | list[str] | list[list[int]]) -> str | list[int]:
        if isinstance(prompt, str):
            return prompt
        if not prompt:
            raise ValueError("prompt must not be empty")
        first = prompt[0]
        if isinstance(first, int):
            return _token_ids(prompt)  # type: ignore[arg-type]
        if len(prompt) != 1:
            raise ValueError("batched prompts are not supported; send one prompt per request")
        return first if isinstance(first, str) else _token_ids(first)


MAX_TOKEN_ID = 2**32 - 1
"""Token ids travel as unsigned 32-bit numbers (the tokenizer's protocol); the vocabulary check
is the tokenizer's."""


def _token_ids(prompt: list[int]) -> list[int]:
    ids = [int(t) for t in prompt]
    if ids and not 0 <= min(ids) <= max(ids) <= MAX_TOKEN_ID:
        bad = next(t for t in ids if not 0 <= t <= MAX_TOKEN_ID)
        raise ValueError(f"token id {bad} is not a token id (0 to {MAX_TOKEN_ID})")
    return ids


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
