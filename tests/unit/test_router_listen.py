"""The router's listening sockets: several on one port (``SO_REUSEPORT``), so that a busy event
loop, which accepts one connection per listening socket each time round, takes in a burst of
new streams quickly; a port another process holds is still refused."""

from __future__ import annotations

import select
import socket

import pytest

from shoal_router.main import listening_sockets


def test_the_sockets_share_one_port_and_take_its_connections() -> None:
    sockets = listening_sockets("127.0.0.1", 0, count=4)
    try:
        ports = {sock.getsockname()[1] for sock in sockets}
        assert len(ports) == 1
        port = ports.pop()
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(32)]
        accepted = 0
        used = set()
        while accepted < len(clients):
            ready, _, _ = select.select(sockets, [], [], 5)
            assert ready, f"only {accepted} of {len(clients)} connections were accepted"
            for sock in ready:
                conn, _ = sock.accept()
                conn.close()
                accepted += 1
                used.add(sock)
        # The kernel spread them: 32 connections all on one of four sockets is a 1 in 4**31 draw.
        assert len(used) > 1
        for client in clients:
            client.close()
    finally:
        for sock in sockets:
            sock.close()


def test_a_port_another_socket_holds_is_refused() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        with pytest.raises(OSError, match="in use"):
            listening_sockets("127.0.0.1", holder.getsockname()[1])
