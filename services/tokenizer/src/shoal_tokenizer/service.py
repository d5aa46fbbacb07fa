"""The ``Tokenizer`` gRPC servicer.

Each served model's Hugging Face fast tokenizer is loaded once at start-up. Tokenizing a prompt
takes microseconds to a few milliseconds in Rust, so the servicer calls it directly on the
server's event loop instead of paying for a thread hop per call.

Errors map to gRPC status codes here, at the edge: an unknown model is ``NOT_FOUND``; input the
chat template or tokenizer rejects is ``INVALID_ARGUMENT`` with the reason.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import grpc
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from shoal_protos import tokenizer_pb2 as pb
from shoal_protos import tokenizer_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


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


class TokenizerServicer(pb_grpc.TokenizerServicer):
    def __init__(self, models: dict[str, LoadedModel]) -> None:
        self._models = models

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
        tok = model.tokenizer
        kind = request.WhichOneof("input")
        try:
            if kind == "chat":
                if tok.chat_template is None:
                    await context.abort(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"model {model.name!r} has no chat template; use /v1/completions",
                    )
                messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
                prompt = tok.apply_chat_template(
                    messages,
                    tokenize=False,
                    add_generation_prompt=request.chat.add_generation_prompt,
                )
                # The template already wrote BOS and friends into the text.
                ids = tok.encode(prompt, add_special_tokens=False)
            else:
                prompt = request.text
                ids = tok.encode(prompt, add_special_tokens=request.add_special_tokens)
        except (ValueError, TypeError, KeyError) as exc:
            # Chat templates raise on messages they do not accept (roles out of order, ...).
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot tokenize input: {exc}")
        return list(ids), str(prompt)

    async def Tokenize(  # noqa: N802 (gRPC method name)
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        ids, prompt = await self._encode(request, context)
        return pb.TokenizeResponse(token_ids=ids, prompt=prompt)

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
        text = model.tokenizer.decode(
            list(request.token_ids), skip_special_tokens=request.skip_special_tokens
        )
        return pb.DetokenizeResponse(text=text)

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
