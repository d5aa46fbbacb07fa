"""What the bind-host tests need to know about this machine's addresses, and to ask a port
whether it listens there."""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import time

import pytest

from tests.integration.support import free_port


def _ipv6_problem() -> str:
    """Empty if an IPv6 socket can bind ``::`` here; else why not."""
    if not socket.has_ipv6:
        return "this Python has no IPv6 support (socket.has_ipv6 is False)"
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::", 0))
    except OSError as exc:
        return f"this machine cannot bind an IPv6 socket to '::': {exc}"
    return ""


def _has_ipv6_loopback() -> bool:
    if NO_IPV6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


NO_IPV6 = _ipv6_problem()
"""Why a listener cannot bind ``::`` here (empty: it can)."""

IPV6_LOOPBACK = _has_ipv6_loopback()
LOOPBACKS: tuple[str, ...] = ("127.0.0.1", "::1") if IPV6_LOOPBACK else ("127.0.0.1",)
"""The loopback addresses this machine has: a dual-stack listener must take both."""

ELSEWHERE = "198.51.100.7"
"""An address no machine running the tests has (TEST-NET-2): a service advertising it binds
another address, since binding this one fails."""


def skip_unless_ipv6_loopback() -> None:
    """Called once the IPv4 loopback was checked: marks the test skipped when ``::1`` was not."""
    if not IPV6_LOOPBACK:
        pytest.skip("this machine has no IPv6 loopback (::1 cannot be bound): only 127.0.0.1 was checked")


def own_addresses() -> list[str]:
    """This machine's non-loopback addresses that outgoing traffic would use (none if it has no
    route out); no packet is sent to find them."""
    found = []
    for family, probe in ((socket.AF_INET, "192.0.2.1"), (socket.AF_INET6, "2001:db8::1")):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as sock:
                sock.connect((probe, 9))
                address = str(sock.getsockname()[0])
        except OSError:
            continue
        if not ipaddress.ip_address(address).is_loopback:
            found.append(address)
    return found


def accepts(host: str, port: int, timeout_s: float = 5.0) -> bool:
    """Whether a TCP connection to ``host:port`` is accepted before ``timeout_s``; tried again
    while refused, since a listener started on another thread may not be listening yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
        time.sleep(0.02)


def refuses(host: str, port: int) -> bool:
    """Whether a TCP connection to ``host:port`` is refused (asked once: only call it once the
    same port is known to listen elsewhere)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(2.0)
        try:
            sock.connect((host, port))
        except OSError:  # refused, or unreachable: nothing listens there for us
            return True
    return False


def free_ports(count: int = 1) -> int:
    """The first of ``count`` consecutive ports free on IPv4 and on IPv6 (a dual-stack bind to
    ``::`` needs both)."""
    while True:
        first = free_port(count)
        if NO_IPV6:
            return first
        with contextlib.ExitStack() as probes:
            try:
                for port in range(first, first + count):
                    probe = probes.enter_context(socket.socket(socket.AF_INET6, socket.SOCK_STREAM))
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                    probe.bind(("::", port))
            except OSError:
                continue
        return first
