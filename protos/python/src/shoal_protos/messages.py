"""ZeroMQ frames between routers and engines.

Every message is two frames: a one-byte type tag and a msgpack body encoded by msgspec. Nothing
else crosses these sockets (no pickle, no ``Any`` fields), so a peer can decode with a typed
decoder and reject what it does not understand.

Sockets::

    router  PUSH ──ADD / ABORT──▶  PULL  engine   (engine binds, each router connects)
    router  PULL ◀──OUTPUTS──────  PUSH  engine   (router binds, each engine connects lazily
                                                   to the ``reply_to`` address of an ADD)

An engine sends one ``OutputBatch`` per engine step per router. Each ``RequestPiece`` carries the
index of its first output token, so a router can put pieces in order and drop repeats whichever
engine they come from.
"""

from __future__ import annotations

import enum
from typing import Final

import msgspec

PROTOCOL_VERSION: Final = 1
"""Bumped on any incompatible change to the structs below; engines publish it in Redis."""


class FrameType(bytes, enum.Enum):
    """The first frame of every message."""

    ADD = b"\x00"
    ABORT = b"\x01"
    OUTPUTS = b"\x02"


class FinishReason(enum.StrEnum):
    """Why a request ended. The first two are OpenAI's; the others end a stream with an error."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class SamplingOptions(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The sampling parameters the router validated; the engine maps them onto vLLM's."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    # 0 disables top-k, as in vLLM.
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False


class AddRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Start generating for ``request_id``; outputs go to the router PULL socket ``reply_to``."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    reply_to: str
    # A request resumed elsewhere (migration, or a retry after its engine died): the output
    # tokens it already has. The engine continues after them: its pieces start at index
    # len(output_token_ids), ``max_tokens`` counts them, usage counts only the prompt as prompt.
    output_token_ids: list[int] = []
    # Ownership generation: grows by one each time the request moves; pieces carry it.
    generation: int = 0
    # vLLM's convention: lower values are served first; below 0 marks a priority request, for
    # which the engine keeps KV headroom and whose neighbours migrations move first.
    priority: int = 0


class AbortRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Stop generating; the engine answers with a final ``ABORT`` piece for each id it had."""

    request_ids: list[str]
    reason: str = "client disconnected"


class PieceError(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Why a request failed. ``retryable`` means another engine may take the request over,
    continuing after the tokens already delivered (the engine was draining, or died)."""

    code: str
    message: str
    retryable: bool = False


class RequestPiece(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """New output of one request since its last piece."""

    request_id: str
    # Index of token_ids[0] among the request's output tokens.
    first_index: int
    token_ids: list[int] = []
    text: str = ""
    finish_reason: FinishReason | None = None
    # Set with finish_reason=STOP when a stop string or stop token id ended the request.
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    error: PieceError | None = None
    # The ownership generation the piece was produced under. A piece with a higher generation
    # than the router has seen moves the request to ``owner`` (or to the sending engine).
    generation: int = 0
    owner: str = ""


class OutputBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Everything one engine step produced for one router."""

    engine_id: str
    step: int
    pieces: list[RequestPiece]


class RouterRequestEncoder:
    """Encodes the router's frames; one per router process."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()

    def add(self, request: AddRequest) -> tuple[bytes, bytes]:
        return FrameType.ADD.value, self._encoder.encode(request)

    def abort(self, request: AbortRequest) -> tuple[bytes, bytes]:
        return FrameType.ABORT.value, self._encoder.encode(request)


class EngineRequestDecoder:
    """Decodes what routers send to an engine, by the type frame."""

    def __init__(self) -> None:
        self._add = msgspec.msgpack.Decoder(AddRequest)
        self._abort = msgspec.msgpack.Decoder(AbortRequest)

    def decode(self, frame_type: bytes, body: bytes | memoryview) -> AddRequest | AbortRequest:
        if frame_type == FrameType.ADD.value:
            return self._add.decode(body)
        if frame_type == FrameType.ABORT.value:
            return self._abort.decode(body)
        raise msgspec.DecodeError(f"unknown frame type {frame_type!r}")
