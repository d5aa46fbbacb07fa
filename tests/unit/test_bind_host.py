"""``--bind-host``: the router, the engine and the tokenizer bind one address and tell their
peers another (``--host``). Bound to ``::`` they take connections on ``127.0.0.1`` (where
``kubectl port-forward`` connects) and on ``::1`` alike, while they advertise an address no
machine here has (binding it would fail, so each service started shows it did not bind it).
The KV agent's control socket, whose commands hand out KV bytes, stays on ``--host``. Without
``--bind-host`` every socket binds ``--host``, as before."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, cast

import grpc
import httpx
import pytest
import torch
import uvicorn
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shoal_engine import main as engine_main
from shoal_engine.ipc.sockets import RequestReceiver
from shoal_engine.kv.agent import KvAgent
from shoal_engine.metrics import EngineMetrics
from shoal_engine.migration import MigrationManager
from shoal_engine.serving import EngineService
from shoal_protos.addresses import host_port, http_url, tcp_url
from shoal_protos.messages import OutputBatch
from shoal_router import main as router_main
from shoal_sim.engine import SimConfig, SimulatedBackend
from shoal_sim.kv_agent import SimKvAgent
from shoal_tokenizer import main as tokenizer_main
from tests.integration.support import until
from tests.unit.listeners import (
    ELSEWHERE,
    LOOPBACKS,
    NO_IPV6,
    accepts,
    free_ports,
    own_addresses,
    refuses,
    skip_unless_ipv6_loopback,
)

WAIT_S = 10.0
"""How long a test waits for what it expects before it fails."""

needs_ipv6 = pytest.mark.skipif(bool(NO_IPV6), reason=NO_IPV6)


async def _accepts(host: str, port: int) -> bool:
    return await asyncio.to_thread(accepts, host, port)


@contextlib.asynccontextmanager
async def _serving(server: uvicorn.Server, serve: Awaitable[None]) -> AsyncIterator[None]:
    task = asyncio.create_task(serve)
    try:
        await until(lambda: server.started or task.done(), WAIT_S, "the HTTP server's start")
        assert not task.done(), "the HTTP server stopped at once"
        yield
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


async def _live(host: str, port: int) -> int:
    async with httpx.AsyncClient(trust_env=False, timeout=5.0) as client:
        return (await client.get(f"{http_url(host, port)}/livez")).status_code


# ---- router ---------------------------------------------------------------------------------


def test_the_router_binds_its_host_without_bind_host() -> None:
    config = router_main.parse_args(["--host", "10.1.2.3", "--zmq-port", "5701"])
    assert config.listen_host == "10.1.2.3"
    assert config.zmq_bind == config.reply_to == "tcp://10.1.2.3:5701"


def test_the_router_tells_engines_a_bracketed_ipv6_address() -> None:
    config = router_main.parse_args(["--host", "fd00::7", "--bind-host", "::", "--zmq-port", "5701"])
    assert config.reply_to == "tcp://[fd00::7]:5701"
    assert config.zmq_bind == "tcp://[::]:5701"


@needs_ipv6
async def test_a_router_bound_to_any_address_serves_both_loopbacks(caplog: pytest.LogCaptureFixture) -> None:
    port, zmq_port, redis_port = free_ports(), free_ports(), free_ports()
    config = router_main.parse_args(
        [
            *("--host", ELSEWHERE, "--bind-host", "::", "--port", str(port), "--zmq-port", str(zmq_port)),
            *("--redis-url", f"redis://127.0.0.1:{redis_port}/0", "--tokenizer-address", "127.0.0.1:1"),
        ]
    )
    caplog.set_level(logging.INFO, logger="shoal.router")
    server = router_main.http_server(config)
    sockets = router_main.listening_sockets(config.listen_host, config.port, count=2)
    async with _serving(server, server.serve(sockets=sockets)):
        for host in LOOPBACKS:
            assert await _live(host, port) == 200, host
            assert await _accepts(host, zmq_port), f"the output socket took nothing on {host}"
    # Engines are told the advertised address, not the bound one.
    assert f"outputs on tcp://{ELSEWHERE}:{zmq_port}" in caplog.text
    skip_unless_ipv6_loopback()


# ---- engine ---------------------------------------------------------------------------------


def _engine_args(*more: str) -> list[str]:
    return ["--model", "sim", "--served-model-name", "m", "--backend", "sim", *more]


def test_the_engine_binds_its_host_without_bind_host() -> None:
    config = engine_main.parse_args(_engine_args("--host", "10.1.2.3", "--migration"))
    assert config.listen_host == "10.1.2.3"
    assert config.zmq_bind == config.zmq_address == "tcp://10.1.2.3:5600"
    assert config.control_bind == config.control_address == "10.1.2.3:5800"
    assert config.kv_data_bind == config.kv_data_address == "tcp://10.1.2.3:5900"
    # The KV agent's control socket is the pod's own: loopback, whatever --host says.
    assert config.kv_agent_address == "tcp://127.0.0.1:5901"


def test_the_engine_advertises_bracketed_ipv6_addresses() -> None:
    config = engine_main.parse_args(_engine_args("--host", "fd00::7", "--bind-host", "::"))
    assert config.zmq_address == "tcp://[fd00::7]:5600"
    assert config.http_address == "http://[fd00::7]:8100"
    assert config.control_address == "[fd00::7]:5800"
    assert config.kv_data_address == "tcp://[fd00::7]:5900"
    assert config.kv_agent_address == "tcp://127.0.0.1:5901"
    assert (config.zmq_bind, config.control_bind, config.kv_data_bind) == (
        "tcp://[::]:5600",
        "[::]:5800",
        "tcp://[::]:5900",
    )


@pytest.mark.parametrize(
    ("peer", "own", "same"),
    [
        ("127.0.0.1", "10.0.0.5", True),
        ("::1", "10.0.0.5", True),
        # How a dual-stack listener sees IPv4 peers: the pod's own preStop hook among them.
        ("::ffff:127.0.0.1", "10.0.0.5", True),
        ("::ffff:10.0.0.5", "10.0.0.5", True),
        ("10.0.0.5", "10.0.0.5", True),
        ("fd00:0:0::5", "fd00::5", True),
        ("10.0.0.6", "10.0.0.5", False),
        ("::ffff:10.0.0.6", "10.0.0.5", False),
        ("", "10.0.0.5", False),
    ],
)
def test_drain_callers_from_the_pod_are_known_on_a_dual_stack_socket(peer: str, own: str, same: bool) -> None:
    assert engine_main._same_host(peer, own) is same


def _no_output(reply_to: str, batch: OutputBatch) -> None:
    raise AssertionError("no request was sent")


@needs_ipv6
async def test_an_engine_bound_to_any_address_serves_both_loopbacks() -> None:
    ports = [free_ports() for _ in range(3)]
    config = engine_main.parse_args(
        _engine_args(
            *("--host", ELSEWHERE, "--bind-host", "::", "--migration", "--zmq-port", str(ports[0])),
            *("--http-port", str(ports[1]), "--control-port", str(ports[2])),
        )
    )
    assert config.zmq_address == tcp_url(ELSEWHERE, ports[0])
    assert config.http_address == http_url(ELSEWHERE, ports[1])
    assert config.control_address == host_port(ELSEWHERE, ports[2])
    backend = SimulatedBackend(SimConfig(speed=20.0))
    await backend.start()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    receiver = RequestReceiver(ctx, config.zmq_bind, asyncio.get_running_loop(), lambda _: None)
    # No call reaches the manager: only the server's listening socket is looked at.
    control = engine_main.control_server(config, cast(MigrationManager, object()))
    await control.start()
    metrics = EngineMetrics("e", "m")
    app = engine_main.build_http_app(
        EngineService("e", backend, _no_output, metrics, print), backend, metrics
    )
    http = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    try:
        async with _serving(http, http.serve(sockets=[engine_main.http_socket(config)])):
            for host in LOOPBACKS:
                assert await _live(host, ports[1]) == 200, host
                assert await _accepts(host, ports[0]), f"the request socket took nothing on {host}"
                async with grpc.aio.insecure_channel(host_port(host, ports[2])) as channel:
                    await asyncio.wait_for(channel.channel_ready(), 5)
    finally:
        await control.stop(None)
        receiver._socket.close(linger=0)
        ctx.term()
        backend.shutdown()
    skip_unless_ipv6_loopback()


# ---- KV agent -------------------------------------------------------------------------------


def _sim_agent(control: str, data: str, host: str) -> SimKvAgent:
    agent = SimKvAgent(SimulatedBackend(SimConfig()), control, data, 16, 1024, 1e9)
    agent.start()
    return agent


def _vllm_agent(control: str, data: str, host: str) -> KvAgent:
    caches = {f"layer.{i}": torch.zeros(8, 16, dtype=torch.uint8) for i in range(2)}
    agent = KvAgent(caches, 8, 4, control, data, host=host)
    # Peers of a gloo or nccl pair are told where this agent is: never the bound ``::``.
    assert agent._host == host
    return agent


@contextlib.contextmanager
def _agent(make: Callable[[str, str, str], Any], control: str, data: str, host: str) -> Iterator[None]:
    agent = make(control, data, host)
    try:
        yield
    finally:
        agent.close()


@needs_ipv6
@pytest.mark.parametrize("make", [_sim_agent, _vllm_agent], ids=["sim", "vllm"])
def test_the_kv_data_socket_widens_but_the_control_socket_stays_on_host(
    make: Callable[[str, str, str], Any],
) -> None:
    kv_port = free_ports(2)
    config = engine_main.parse_args(
        _engine_args("--host", "127.0.0.1", "--bind-host", "::", "--migration", "--kv-port", str(kv_port))
    )
    # The control socket listens on loopback alone, whatever --host and --bind-host say.
    assert config.kv_agent_address == f"tcp://127.0.0.1:{kv_port + 1}"
    assert config.kv_data_address == f"tcp://127.0.0.1:{kv_port}"
    elsewhere = own_addresses()
    with _agent(make, config.kv_agent_address, config.kv_data_bind, config.host):
        for host in (*LOOPBACKS, *elsewhere):
            assert accepts(host, kv_port), f"the data socket took nothing on {host}"
        assert accepts("127.0.0.1", kv_port + 1), "the control socket is not on 127.0.0.1"
        for host in (*LOOPBACKS[1:], *elsewhere):
            assert refuses(host, kv_port + 1), f"the control socket answered on {host}"
    if not elsewhere:
        pytest.skip("this machine has no non-loopback address: only ::1 was refused the control socket")
    skip_unless_ipv6_loopback()


# ---- tokenizer ------------------------------------------------------------------------------


async def _health(host: str, port: int) -> int:
    async with grpc.aio.insecure_channel(host_port(host, port)) as channel:
        request = health_pb2.HealthCheckRequest(service=tokenizer_main.SERVICE_NAME)
        reply = await health_pb2_grpc.HealthStub(channel).Check(request, timeout=5.0)
        return int(reply.status)


def test_the_tokenizer_binds_its_host_without_bind_host() -> None:
    config = tokenizer_main.parse_args(["--models", "m=/models/m", "--host", "10.1.2.3"])
    assert config.listen_host == "10.1.2.3"


@needs_ipv6
async def test_a_tokenizer_bound_to_any_address_serves_both_loopbacks() -> None:
    port = free_ports()
    config = tokenizer_main.parse_args(
        ["--models", "m=/models/m", "--host", ELSEWHERE, "--bind-host", "::", "--port", str(port)]
    )
    server, _ = await tokenizer_main.start_server(config, {})
    try:
        for host in LOOPBACKS:
            assert await _health(host, port) == health_pb2.HealthCheckResponse.SERVING, host
    finally:
        await server.stop(None)
    skip_unless_ipv6_loopback()


async def test_a_tokenizer_bound_to_any_ipv4_address_serves_ipv4() -> None:
    port = free_ports()
    config = tokenizer_main.parse_args(
        ["--models", "m=/models/m", "--host", ELSEWHERE, "--bind-host", "0.0.0.0", "--port", str(port)]
    )
    server, _ = await tokenizer_main.start_server(config, {})
    try:
        assert await _health("127.0.0.1", port) == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(None)
