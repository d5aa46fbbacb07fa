"""Bytes that do not parse as a gRPC method's request get INVALID_ARGUMENT and one WARNING line
(no traceback), the servicer never runs, and good requests still reach it. A real asyncio gRPC
server on loopback, with gRPC's own health servicer behind ``RefuseUndecodable``."""

from __future__ import annotations

import logging

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shoal_protos.grpc_errors import RefuseUndecodable

CHECK = "/grpc.health.v1.Health/Check"
# Field 1 (a string) said to be 100 bytes long, with 2 there.
GARBAGE = b"\x0a\x64ab"


class CountingHealth(health.aio.HealthServicer):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    async def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        self.calls += 1
        return await super().Check(request, context)


@pytest.fixture
async def server_address():
    server = grpc.aio.server(interceptors=[RefuseUndecodable()])
    servicer = CountingHealth()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        await server.stop(grace=None)


async def test_garbage_is_invalid_argument_and_one_warning(server_address, caplog) -> None:
    address, servicer = server_address
    caplog.set_level(logging.WARNING)
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary(CHECK, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call(GARBAGE, timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "undecodable request" in (refused.value.details() or "")
    assert servicer.calls == 0
    ours = [r for r in caplog.records if r.name == "shoal_protos.grpc_errors"]
    assert len(ours) == 1 and ours[0].levelno == logging.WARNING and ours[0].exc_info is None
    assert CHECK in ours[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_good_requests_reach_the_servicer(server_address) -> None:
    address, servicer = server_address
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert servicer.calls == 1
