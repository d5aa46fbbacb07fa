"""Undecodable gRPC requests are the caller's fault: ``INVALID_ARGUMENT`` and one log line.

Left to itself, gRPC's asyncio server answers bytes that do not parse as the method's request
with ``UNKNOWN`` and logs an ERROR with a traceback for each, as for a bug in the servicer.
``RefuseUndecodable``, a server interceptor, decodes the request itself: bytes that do not parse
are refused with ``INVALID_ARGUMENT`` and the parser's message, logged once as a WARNING, and the
servicer never runs. Every unary method of Shoal's gRPC servers goes through it.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Undecodable:
    error: str


class RefuseUndecodable(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler.unary_unary is None or handler.request_deserializer is None:
            return handler
        parse, behaviour = handler.request_deserializer, handler.unary_unary
        method = handler_call_details.method

        def deserialize(raw: bytes) -> Any:
            try:
                return parse(raw)
            except DecodeError as exc:
                return _Undecodable(str(exc) or "not a valid message")

        async def call(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            if isinstance(request, _Undecodable):
                logger.warning("refused an undecodable %s request: %s", method, request.error)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"undecodable request: {request.error}")
            reply = behaviour(request, context)  # type: ignore[arg-type]  # the aio context, as grpc.aio passes it
            return await reply if inspect.isawaitable(reply) else reply

        return grpc.unary_unary_rpc_method_handler(
            call, request_deserializer=deserialize, response_serializer=handler.response_serializer
        )
