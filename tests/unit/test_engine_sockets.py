"""The engine's check of a router's reply address: only ``tcp://host:port`` is ever connected
to (a request naming anything else is dropped; see ``tests/integration/test_hostile_frames.py``
for what one bad address used to do to a running engine)."""

from __future__ import annotations

import pytest

from shoal_engine.ipc.sockets import valid_reply_to


@pytest.mark.parametrize(
    "address",
    ["tcp://127.0.0.1:5700", "tcp://router-0.serving.svc:5700", "tcp://[fd00::1]:5700", "tcp://10.1.2.3:1"],
)
def test_router_addresses_are_accepted(address: str) -> None:
    assert valid_reply_to(address)


@pytest.mark.parametrize(
    "address",
    [
        "",
        "garbage",
        "tcp://",
        "tcp://host",
        "tcp://host:0",
        "tcp://host:65536",
        "tcp://256.1.1.1:99999",
        "ipc:///tmp/router",
        "inproc://x",
        "tcp://host:5700/extra",
        "tcp://a b:5700",
        "tcp://*:5700",
    ],
)
def test_anything_else_is_refused(address: str) -> None:
    assert not valid_reply_to(address)
