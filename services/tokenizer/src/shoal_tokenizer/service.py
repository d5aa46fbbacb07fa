"""The ``Tokenizer`` gRPC servicer.

Each served model's Hugging Face fast tokenizer is loaded once at start-up. Chat templates,
encoding and decoding run on a thread pool, off the server's event loop: a short prompt takes
microseconds to milliseconds, but a prompt of megabytes takes seconds, and on the loop it would
hold up every other call (the Rust tokenizer lets go of the GIL while it encodes, so the loop
goes on meanwhile). Inputs over ``max_input_chars`` are refused before any work.

Errors map to gRPC status codes here, at the edge: an unknown model is ``NOT_FOUND``; input the
chat template or tokenizer rejects, or input over the size limit, is ``INVALID_ARGUMENT`` with
the reason.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar, cast

import grpc
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from shoal_protos import tokenizer_pb2 as pb
from shoal_protos import tokenizer_pb2_grpc as pb_grpc
from shoal_protos.prefix import chain_hashes

logger = logging.getLogger(__name__)

T = TypeVar("T")

MAX_BLOCK_SIZE = 65536
"""The largest KV block size a prompt's blocks are hashed in: a bound on what a caller may ask,
far above any engine's."""


@dataclass(frozen=True)
class LoadedModel:
    name: str
    tokenizer: PreTrainedTokenizerBase
    max_model_len: int
    eos_token_ids: tuple[int, ...]


def load_model(name: str, path: Path, revision: str | None = None) -> LoadedModel:
    """The tokenizer and limits of ``path``, a folder or a Hub repository at ``revision``."""
    # No ``token`` argument: huggingface_hub then reads HF_TOKEN from the environment itself,
    # and the token never passes through this process's arguments or logs.
    tokenizer = AutoTokenizer.from_pretrained(path, revision=revision)
    config = AutoConfig.from_pretrained(path, revision=revision)
    max_len = int(getattr(config, "max_position_embeddings", 0) or tokenizer.model_max_length)
    eos = getattr(config, "eos_token_id", None)
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:
        eos_ids.append(tokenizer.eos_token_id)
    return LoadedModel(name, tokenizer, max_len, tuple(eos_ids))


def _encode(tok: PreTrainedTokenizerBase, request: pb.TokenizeRequest) -> tuple[list[int], str]:
    """The token ids and text of ``request``'s input (on the pool's threads)."""
    if request.WhichOneof("input") == "chat":
        messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
        prompt = tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=request.chat.add_generation_prompt
        )
        # The template already wrote BOS and friends into the text.
        return list(tok.encode(prompt, add_special_tokens=False)), str(prompt)
    ids = tok.encode(request.text, add_special_tokens=request.add_special_tokens)
    return list(ids), request.text


def _input_chars(request: pb.TokenizeRequest) -> int:
    if request.WhichOneof("input") == "chat":
        return sum(len(m.content) + len(m.role) for m in request.chat.messages)
    return len(request.text)


class TokenizerServicer(pb_grpc.TokenizerServicer):
    def __init__(self, models: dict[str, LoadedModel], pool: Executor, max_input_chars: int) -> None:
        self._models = models
        self._pool = pool
        self._max_input_chars = max_input_chars

    async def _off_loop(self, call: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, call, *args)

    async def _model(self, name: str, context: grpc.aio.ServicerContext) -> LoadedModel:
        model = self._models.get(name)
        if model is None:
            known = ", ".join(sorted(self._models))
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {name!r}; served: {known}")
        assert model is not None  # context.abort raises
        return model

    async def _encode(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> tuple[list[int], str]:
        model = await self._model(request.model, context)
        if request.WhichOneof("input") == "chat" and model.tokenizer.chat_template is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"model {model.name!r} has no chat template; use /v1/completions",
            )
        chars = _input_chars(request)
        if chars > self._max_input_chars:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the input is {chars:,} characters long, over this tokenizer's limit of "
                f"{self._max_input_chars:,} (--max-input-chars)",
            )
        try:
            ids, prompt = await self._off_loop(_encode, model.tokenizer, request)
        except (ValueError, TypeError, KeyError) as exc:
            # Chat templates raise on messages they do not accept (roles out of order, ...).
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot tokenize input: {exc}")
        return ids, prompt

    async def Tokenize(  # noqa: N802 (gRPC method name)
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        sizes = list(dict.fromkeys(request.block_sizes))
        if not all(1 <= size <= MAX_BLOCK_SIZE for size in sizes):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"block sizes must be 1 to {MAX_BLOCK_SIZE} tokens, not {sorted(sizes)}",
            )
        ids, prompt = await self._encode(request, context)
        blocks = [
            pb.BlockHashes(block_size=size, hashes=await self._off_loop(chain_hashes, ids, size))
            for size in sizes
        ]
        return pb.TokenizeResponse(token_ids=ids, prompt=prompt, block_hashes=blocks)

    async def CountTokens(  # noqa: N802
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.CountTokensResponse:
        ids, _ = await self._encode(request, context)
        return pb.CountTokensResponse(count=len(ids))

    async def Detokenize(  # noqa: N802
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        model = await self._model(request.model, context)
        vocab = len(model.tokenizer)
        bad = [t for t in request.token_ids if t >= vocab]
        if bad:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"token ids {bad[:5]} are outside the vocabulary (size {vocab})",
            )
        text = await self._off_loop(
            model.tokenizer.decode, list(request.token_ids), request.skip_special_tokens
        )
        return pb.DetokenizeResponse(text=cast(str, text))  # one sequence of ids: one string

    async def GetModelInfo(  # noqa: N802
        self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        model = await self._model(request.model, context)
        tok = model.tokenizer
        return pb.ModelInfo(
            model=model.name,
            max_model_len=model.max_model_len,
            vocab_size=len(tok),
            eos_token_ids=list(model.eos_token_ids),
            bos_token_id=tok.bos_token_id,
            has_chat_template=tok.chat_template is not None,
        )
