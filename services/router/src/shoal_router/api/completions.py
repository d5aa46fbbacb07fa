"""The generation routes, ``/v1/completions`` and ``/v1/chat/completions``.

They are plain Starlette routes that read their body with pydantic themselves: FastAPI's
per-request dependency solving and body handling would be paid on every request. The OpenAPI
document describes them from the same models (``api.openapi``).

A request is admitted and started (``Generation.start``), and its first output awaited, before
any byte of the answer: an error known up front gets its own HTTP status. The answer is then
either collected whole (``stream: false``) or streamed (``api.relay``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

import msgspec
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from shoal_protos.messages import SamplingOptions
from shoal_router.api.protocol import ChatCompletionRequest, CompletionRequest, UnsupportedFieldError
from shoal_router.api.relay import EventStream, SseEvents, WhileConnected, aclose, finish, server_send, usage
from shoal_router.api.serving import Generation, GenerationHandle
from shoal_router.core.outputs import RequestDelta
from shoal_router.core.ratelimit import ApiKey, RateLimiter
from shoal_router.errors import InvalidRequestError, PriorityNotAllowedError, TooManyRequestsError
from shoal_router.ipc.tokenizing import Tokenized, TokenizerClient

ENGINE_HEADER = "X-Shoal-Engine"
"""Response header naming the engine that produced the first tokens (for operators and tests)."""
# The request's id across the fleet (engines, migrations, Redis records).
REQUEST_HEADER = "X-Shoal-Request-Id"

_json = msgspec.json.Encoder()

Body = CompletionRequest | ChatCompletionRequest
_Model = TypeVar("_Model", bound=BaseModel)


def invalid_body(errors: Sequence[Any]) -> InvalidRequestError:
    """The 400 for a request body that failed validation (pydantic's ``errors()``), naming the
    field at fault in ``param``."""
    first = errors[0] if errors else {}
    loc = [str(part) for part in first.get("loc", ())]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, UnsupportedFieldError):
        return InvalidRequestError(str(cause), param=cause.field)
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "")
        return InvalidRequestError(f"the request body is not valid JSON: {reason}")
    if first.get("type") in ("model_type", "model_attributes_type") or not loc:
        return InvalidRequestError(f"the request body must be a JSON object: {first.get('msg', '')}")
    param = ".".join(loc)
    return InvalidRequestError(f"invalid value for {param!r}: {first.get('msg', 'invalid')}", param=param)


async def request_body(request: Request, model: type[_Model]) -> _Model:
    """The request's JSON body read as ``model`` (pydantic parses the bytes itself); a body
    that is not JSON, not an object, or breaks the model raises the 400 naming the field."""
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        raise invalid_body(exc.errors()) from None


class GenerationRoutes:
    """The handlers of the two generation routes, over the router's ``Generation``."""

    def __init__(
        self, generation: Generation, tokenizer: TokenizerClient, rate_limiter: RateLimiter | None
    ) -> None:
        self._generation = generation
        self._tokenizer = tokenizer
        self._rate_limiter = rate_limiter
        self._metrics = generation.metrics

    async def completions(self, request: Request) -> Response:
        body = await request_body(request, CompletionRequest)
        self._generation.check_model(body.model)
        if isinstance(body.prompt, str):
            prompt = await self._tokenizer.tokenize_text(
                body.model, body.prompt, self._generation.block_sizes()
            )
        else:
            prompt = Tokenized(list(body.prompt))  # type: ignore[arg-type]
        max_tokens = body.max_tokens if body.max_tokens is not None else 16
        return await self._generate(request, body, prompt, max_tokens, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        body = await request_body(request, ChatCompletionRequest)
        self._generation.check_model(body.model)
        messages = [(m.role, m.text()) for m in body.messages]
        prompt = await self._tokenizer.tokenize_chat(body.model, messages, self._generation.block_sizes())
        return await self._generate(request, body, prompt, body.output_limit(), chat=True)

    def _sampling(self, body: Body, prompt_len: int, max_tokens: int | None) -> SamplingOptions:
        return self._generation.sampling(
            body.model,
            prompt_len,
            max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed,
            stop=body.stop_list(),
            ignore_eos=body.ignore_eos,
        )

    def _admit(self, request: Request, body: Body, prompt_len: int) -> Callable[[int], None] | None:
        """Check the caller's key may ask for the request's priority and is within its rate
        limits; the charge for the output tokens when the request ends (None: none)."""
        caller: ApiKey | None = getattr(request.state, "api_key", None)
        if caller is None:
            return None
        if body.priority < caller.min_priority:
            raise PriorityNotAllowedError(caller.name, body.priority, caller.min_priority)
        if self._rate_limiter is None:
            return None
        try:
            self._rate_limiter.admit(caller, prompt_len)
        except TooManyRequestsError:
            self._metrics.rate_limited.labels(caller.name).inc()
            raise
        return functools.partial(self._rate_limiter.charge, caller)

    async def _generate(
        self, request: Request, body: Body, prompt: Tokenized, max_tokens: int | None, chat: bool
    ) -> Response:
        prompt_ids = prompt.ids
        sampling = self._sampling(body, len(prompt_ids), max_tokens)
        charge = self._admit(request, body, len(prompt_ids))
        session = request.headers.get(self._generation.session_header)
        deltas: AsyncIterator[RequestDelta] | None = None
        connected = WhileConnected(request.receive)
        try:
            async with connected:
                handle = await self._generation.start(
                    body.model,
                    prompt_ids,
                    sampling,
                    on_close=charge,
                    session=session,
                    priority=body.priority,
                    block_hashes=prompt.block_hashes,
                )
                deltas = handle.deltas()
                # Wait for the first output before answering, so that an engine refusing the
                # request still gets an HTTP status of its own rather than an error event in a
                # 200 stream.
                first = await anext(deltas)
                response_id = ("chatcmpl-" if chat else "cmpl-") + handle.request_id.rsplit("-", 1)[-1]
                if not body.stream:
                    return await _collect(handle, body, first, deltas, response_id, chat)
        except BaseException:
            if deltas is not None:
                await aclose(deltas)
            raise
        if connected.left:  # the client went away before the answer began
            if deltas is not None:
                await aclose(deltas)
            return Response(status_code=499)
        assert deltas is not None
        events = SseEvents(
            response_id,
            body.model,
            chat=chat,
            include_usage=body.include_usage,
            prompt_token_ids=handle.prompt_token_ids if body.return_token_ids else None,
        )
        return EventStream(
            handle,
            first,
            deltas,
            events,
            include_usage=body.include_usage,
            relay_delay=self._metrics.relay_delay,
            headers={ENGINE_HEADER: first.engine_id, REQUEST_HEADER: handle.request_id},
            server_send=server_send(request.scope),
        )


async def _collect(
    handle: GenerationHandle,
    body: Body,
    first: RequestDelta,
    deltas: AsyncIterator[RequestDelta],
    response_id: str,
    chat: bool,
) -> Response:
    """The whole answer of a request that does not stream."""
    parts = [first.text]
    token_ids = list(first.token_ids)
    last = first
    try:
        if not first.finished:
            async for delta in deltas:
                parts.append(delta.text)
                token_ids.extend(delta.token_ids)
                last = delta
    finally:
        await aclose(deltas)
    text = "".join(parts)
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish(last)}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    if body.return_token_ids:
        choice["token_ids"] = token_ids
    answer = {
        "id": response_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": body.model,
        "choices": [choice],
        "usage": usage(handle),
    }
    return Response(
        _json.encode(answer),
        media_type="application/json",
        headers={ENGINE_HEADER: last.engine_id, REQUEST_HEADER: handle.request_id},
    )
