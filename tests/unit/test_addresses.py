"""Addresses made from a host and a port (``shoal_protos.addresses``): IPv6 literals come out in
brackets, IPv4 literals and host names as they are, and ``host:port`` comes apart again with a
bracketed IPv6 host. Listeners bound to ``::`` take IPv4 and IPv6 connections alike, ZeroMQ's
included."""

from __future__ import annotations

import socket

import pytest
import zmq

from shoal_protos.addresses import (
    bare_host,
    host_port,
    http_url,
    is_ipv6,
    is_loopback,
    listen_tcp,
    resolve_bind_host,
    same_ip,
    split_host_port,
    tcp_url,
    zmq_bind,
    zmq_connect,
)
from tests.unit.listeners import LOOPBACKS, NO_IPV6, accepts, skip_unless_ipv6_loopback


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("10.0.0.1", "10.0.0.1:5600"),
        ("127.0.0.1", "127.0.0.1:5600"),
        ("::1", "[::1]:5600"),
        ("[::1]", "[::1]:5600"),
        ("fd00::1", "[fd00::1]:5600"),
        ("[fd00::1]", "[fd00::1]:5600"),
        ("::", "[::]:5600"),
        ("::ffff:10.0.0.1", "[::ffff:10.0.0.1]:5600"),
        ("0.0.0.0", "0.0.0.0:5600"),
        ("localhost", "localhost:5600"),
        ("engine-0.shoal.svc.cluster.local", "engine-0.shoal.svc.cluster.local:5600"),
    ],
)
def test_host_port_brackets_ipv6_literals_alone(host: str, expected: str) -> None:
    assert host_port(host, 5600) == expected
    assert tcp_url(host, 5600) == f"tcp://{expected}"
    assert http_url(host, 5600) == f"http://{expected}"


def test_what_is_an_ipv6_literal() -> None:
    assert is_ipv6("::1") and is_ipv6("[::1]") and is_ipv6("fe80::1%eth0")
    assert not is_ipv6("10.0.0.1") and not is_ipv6("localhost") and not is_ipv6("")
    assert bare_host("[fd00::1]") == "fd00::1" and bare_host("10.0.0.1") == "10.0.0.1"


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("10.0.0.1:5600", ("10.0.0.1", 5600)),
        ("[::1]:5600", ("::1", 5600)),
        ("[fd00::1]:50051", ("fd00::1", 50051)),
        ("tokenizer.shoal.svc:50051", ("tokenizer.shoal.svc", 50051)),
        ("tcp://[fd00::1]:5700", ("fd00::1", 5700)),
        ("tcp://10.0.0.1:5700", ("10.0.0.1", 5700)),
        ("http://[::1]:8100", ("::1", 8100)),
    ],
)
def test_split_host_port_takes_bracketed_ipv6(address: str, expected: tuple[str, int]) -> None:
    assert split_host_port(address) == expected
    host, port = expected
    assert split_host_port(host_port(host, port)) == expected


@pytest.mark.parametrize(
    "address",
    ["", "10.0.0.1", "fd00::1:5600", "[fd00::1]", "[fd00::1]5600", ":5600", "host:0", "host:65536", "host:x"],
)
def test_split_host_port_refuses_what_it_cannot_read(address: str) -> None:
    with pytest.raises(ValueError, match="want"):
        split_host_port(address)


def test_ipv4_mapped_peers_are_their_ipv4_address() -> None:
    assert same_ip("::ffff:10.0.0.5", "10.0.0.5")
    assert same_ip("fd00:0:0::5", "[fd00::5]")
    assert not same_ip("10.0.0.6", "10.0.0.5")
    assert same_ip("engine-0", "engine-0") and not same_ip("engine-0", "10.0.0.5")
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("::ffff:127.0.0.1")
    assert not is_loopback("10.0.0.5") and not is_loopback("localhost")


@pytest.mark.skipif(bool(NO_IPV6), reason=NO_IPV6)
def test_a_tcp_listener_on_any_ipv6_takes_ipv4_too() -> None:
    with listen_tcp("::", 0) as server:
        port = server.getsockname()[1]
        for host in LOOPBACKS:
            assert accepts(host, port), f"nothing accepted on {host_port(host, port)}"
    skip_unless_ipv6_loopback()


def test_a_tcp_listener_on_ipv4_takes_ipv4_alone() -> None:
    with listen_tcp("0.0.0.0", 0) as server:
        assert server.family == socket.AF_INET
        assert accepts("127.0.0.1", server.getsockname()[1])


@pytest.mark.skipif(bool(NO_IPV6), reason=NO_IPV6)
@pytest.mark.parametrize("bind", ["tcp://[::]:*", "tcp://*:*"])
def test_zeromq_bound_to_any_address_takes_ipv4_and_ipv6(bind: str) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        pull = ctx.socket(zmq.PULL)
        zmq_bind(pull, bind)
        port = int(pull.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        for host in LOOPBACKS:
            push = ctx.socket(zmq.PUSH)
            zmq_connect(push, tcp_url(host, port))
            push.send(host.encode())
            assert pull.poll(5000), f"nothing arrived over {tcp_url(host, port)}"
            assert pull.recv() == host.encode()
            push.close(linger=0)
        pull.close(linger=0)
    finally:
        ctx.term()
    skip_unless_ipv6_loopback()


def test_zeromq_bound_to_ipv4_any_address_takes_ipv4() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        pull = ctx.socket(zmq.PULL)
        zmq_bind(pull, "tcp://0.0.0.0:*")
        assert not pull.getsockopt(zmq.IPV6)
        port = int(pull.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        assert accepts("127.0.0.1", port)
        pull.close(linger=0)
    finally:
        ctx.term()


def test_the_bind_host_falls_back_to_ipv4_where_the_kernel_has_no_ipv6() -> None:
    assert resolve_bind_host(None, "10.0.0.5") == "10.0.0.5"
    assert resolve_bind_host("::", "10.0.0.5", ipv6=True) == "::"
    assert resolve_bind_host("[::]", "10.0.0.5", ipv6=False) == "0.0.0.0"
    # Only the any-address falls back: a named IPv6 address fails loudly where it cannot bind.
    assert resolve_bind_host("fd00::5", "10.0.0.5", ipv6=False) == "fd00::5"
    # This machine, asked: it binds ``::`` wherever an IPv6 socket can be made.
    assert resolve_bind_host("::", "10.0.0.5") == ("0.0.0.0" if NO_IPV6 else "::")
