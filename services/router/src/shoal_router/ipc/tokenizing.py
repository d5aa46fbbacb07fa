"""gRPC client of the tokenizer service, mapping its status codes onto router errors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from shoal_protos import tokenizer_pb2 as pb
from shoal_protos import tokenizer_pb2_grpc as pb_grpc
from shoal_router.errors import InvalidRequestError, RouterError, TokenizerUnavailableError

REPLY_MAX_BYTES = 64 << 20
"""The largest reply taken from the tokenizer (gRPC's default, 4 MiB, is less than the ids and
text of the longest input the tokenizer takes by default)."""


@dataclass(frozen=True, slots=True)
class Tokenized:
    ids: list[int]
    block_hashes: dict[int, list[int]] = field(default_factory=dict)
    """The prompt's full blocks by Shoal's chained hash (``shoal_protos.prefix.chain_hashes``),
    per block size asked for; a tokenizer that predates them gives none."""


class TokenizerClient:
    def __init__(self, address: str, timeout_s: float) -> None:
        self._channel = grpc.aio.insecure_channel(
            address, options=[("grpc.max_receive_message_length", REPLY_MAX_BYTES)]
        )
        self._stub = pb_grpc.TokenizerStub(self._channel)
        self._timeout_s = timeout_s

    async def tokenize_text(self, model: str, text: str, block_sizes: Sequence[int] = ()) -> Tokenized:
        """The text's token ids, and its blocks hashed in each of ``block_sizes``."""
        request = pb.TokenizeRequest(model=model, text=text, add_special_tokens=True, block_sizes=block_sizes)
        return await self._tokenize(request, param="prompt")

    async def tokenize_chat(
        self, model: str, messages: Sequence[tuple[str, str]], block_sizes: Sequence[int] = ()
    ) -> Tokenized:
        """The messages' token ids (the model's chat template), and their blocks hashed in each
        of ``block_sizes``."""
        chat = pb.ChatMessages(
            messages=[pb.ChatMessage(role=role, content=content) for role, content in messages],
            add_generation_prompt=True,
        )
        request = pb.TokenizeRequest(model=model, chat=chat, block_sizes=block_sizes)
        return await self._tokenize(request, param="messages")

    async def _tokenize(self, request: pb.TokenizeRequest, param: str) -> Tokenized:
        try:
            response = await self._stub.Tokenize(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise _map_error(exc, param) from None
        hashed = {blocks.block_size: list(blocks.hashes) for blocks in response.block_hashes}
        return Tokenized(list(response.token_ids), hashed)

    async def model_info(self, model: str) -> pb.ModelInfo:
        try:
            return await self._stub.GetModelInfo(pb.ModelInfoRequest(model=model), timeout=self._timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise _map_error(exc, "model") from None

    async def close(self) -> None:
        await self._channel.close()


def _map_error(exc: grpc.aio.AioRpcError, param: str) -> RouterError:
    code = exc.code()
    details = exc.details() or code.name
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
        return InvalidRequestError(details, param=param)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details:
        # Past even the room the tokenizer makes for its longest input.
        return InvalidRequestError(f"the input is too large to tokenize ({details})", param=param)
    if code == grpc.StatusCode.NOT_FOUND:
        return TokenizerUnavailableError(
            f"the tokenizer does not serve this model: {details}", code="tokenizer_missing_model"
        )
    return TokenizerUnavailableError(
        f"tokenizer service unavailable ({code.name}): {details}", code="tokenizer_unavailable"
    )
