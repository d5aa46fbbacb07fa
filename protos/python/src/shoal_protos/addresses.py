"""Addresses built from a host and a port, and taken apart again, for IPv4, IPv6 and host names
alike.

A service binds one address (``--bind-host``) and tells its peers another (``--host``). Either
may be an IPv6 literal, which must be bracketed wherever a port follows it (``[fd00::1]:5600``,
``tcp://[fd00::1]:5600``, ``http://[fd00::1]:8100``): every address made from a host and a port
is made here, never with a format string of its own.

Binding ``::`` listens on IPv6 and IPv4 alike (dual stack), so that ``kubectl port-forward``,
which connects to the pod's ``127.0.0.1``, reaches a service bound for an IPv6 cluster; ``0.0.0.0``
listens on IPv4 only. ZeroMQ takes IPv6 addresses only on sockets with its ``IPV6`` option set
(``zmq_bind``, ``zmq_connect``), and that option is also what makes its ``[::]`` and ``*`` dual
stack.
"""

from __future__ import annotations

import functools
import ipaddress
import socket

import zmq

ANY_IPV6 = "::"
"""Bind host of a dual-stack listener: every address, IPv6 and IPv4."""
ANY_IPV4 = "0.0.0.0"


@functools.cache
def _ipv6_sockets() -> bool:
    """Whether this kernel makes IPv6 sockets (not where booted with ``ipv6.disable=1``)."""
    if not socket.has_ipv6:
        return False
    try:
        socket.socket(socket.AF_INET6, socket.SOCK_STREAM).close()
    except OSError:
        return False
    return True


def resolve_bind_host(bind_host: str | None, host: str, ipv6: bool | None = None) -> str:
    """The address a service's listeners bind: ``bind_host``, else ``host``. ``::`` (what the
    operator passes, so every pod takes ``kubectl port-forward`` on IPv4 and IPv6 clusters alike)
    becomes ``0.0.0.0`` where the kernel makes no IPv6 sockets (``ipv6``: whether it does; None:
    ask it), since binding ``::`` would fail there."""
    if not bind_host:
        return host
    if bare_host(bind_host) == ANY_IPV6 and not (_ipv6_sockets() if ipv6 is None else ipv6):
        return ANY_IPV4
    return bind_host


def bare_host(host: str) -> str:
    """``host`` without the brackets an IPv6 literal may come in (``[::1]`` -> ``::1``)."""
    if host.startswith("[") and host.endswith("]"):
        return host[1:-1]
    return host


def is_ipv6(host: str) -> bool:
    """Whether ``host`` (bracketed or not) is an IPv6 literal; False for IPv4 and host names."""
    try:
        return ipaddress.ip_address(bare_host(host)).version == 6
    except ValueError:
        return False


def host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 literal in brackets: ``[::1]:5600``, ``10.0.0.1:5600``."""
    host = bare_host(host)
    return f"[{host}]:{port}" if is_ipv6(host) else f"{host}:{port}"


def tcp_url(host: str, port: int) -> str:
    """A ZeroMQ (or KV agent) TCP address: ``tcp://[::1]:5600``, ``tcp://10.0.0.1:5600``."""
    return f"tcp://{host_port(host, port)}"


def http_url(host: str, port: int) -> str:
    """The base URL of an HTTP server: ``http://[::1]:8100``, ``http://10.0.0.1:8100``."""
    return f"http://{host_port(host, port)}"


def split_host_port(address: str) -> tuple[str, int]:
    """``(host, port)`` of ``host:port`` or ``[ipv6]:port`` (the host without brackets); a
    ``scheme://`` in front is dropped. ValueError if there is no port or it is out of range."""
    rest = address.split("://", 1)[-1]
    if rest.startswith("["):
        host, bracket, tail = rest[1:].partition("]")
        if not bracket or not tail.startswith(":"):
            raise ValueError(f"want [host]:port, got {address!r}")
        port_text = tail[1:]
    else:
        host, colon, port_text = rest.rpartition(":")
        if not colon or ":" in host:
            # ``fd00::1:5600`` cannot be told apart from an IPv6 literal without a port.
            raise ValueError(f"want host:port (an IPv6 host in brackets), got {address!r}")
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"want host:port with a port from 1 to 65535, got {address!r}")
    return host, int(port_text)


def same_ip(a: str, b: str) -> bool:
    """Whether two literals name one address: ``::ffff:10.0.0.1`` (how a dual-stack listener
    sees an IPv4 peer) is ``10.0.0.1``, and IPv6 spellings are compared by value. Host names are
    compared as text."""
    try:
        return _unmapped(a) == _unmapped(b)
    except ValueError:
        return bare_host(a) == bare_host(b)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback literal, IPv4-mapped ones (``::ffff:127.0.0.1``) included."""
    try:
        return _unmapped(host).is_loopback
    except ValueError:
        return False


def _unmapped(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    ip = ipaddress.ip_address(bare_host(host))
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def stream_socket(host: str) -> socket.socket:
    """An unbound TCP socket for binding ``host``: IPv6 for an IPv6 literal, which then also
    takes IPv4 connections when bound to ``::`` whatever the system's default; IPv4 otherwise
    (a host name is resolved to its IPv4 address)."""
    if not is_ipv6(host):
        return socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    except OSError:
        sock.close()
        raise
    return sock


def listen_tcp(host: str, port: int, backlog: int = 128) -> socket.socket:
    """A TCP socket listening on ``host:port`` (port 0: a free one), dual stack for ``::``."""
    sock = stream_socket(host)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((bare_host(host), port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def _zmq_needs_ipv6(url: str) -> bool:
    if not url.startswith("tcp://"):
        return False
    host = url.removeprefix("tcp://").rpartition(":")[0]
    return host == "*" or is_ipv6(host)


def zmq_bind(sock: zmq.Socket[bytes], url: str) -> None:
    """Bind a ZeroMQ socket to ``url``; ``tcp://[::]:port`` and ``tcp://*:port`` listen on IPv6
    and IPv4 alike."""
    if _zmq_needs_ipv6(url):
        sock.setsockopt(zmq.IPV6, 1)
    sock.bind(url)


def zmq_connect(sock: zmq.Socket[bytes], url: str) -> None:
    """Connect a ZeroMQ socket to ``url``, an IPv6 one (``tcp://[fd00::1]:5600``) included."""
    if _zmq_needs_ipv6(url):
        sock.setsockopt(zmq.IPV6, 1)
    sock.connect(url)
