"""The engine's check of a router's reply address: only ``tcp://host:port`` is ever connected
to (a request naming anything else is dropped; see ``tests/integration/test_hostile_frames.py``
for what one bad address used to do to a running engine)."""

from __future__ import annotations

import queue

import pytest
import zmq

from shoal_engine.ipc.sockets import OutputSender, valid_reply_to
from shoal_protos.messages import OutputBatch, RequestPiece


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


def test_the_sender_reports_a_router_whose_link_dropped() -> None:
    """Over real loopback TCP: the router's PULL socket closes (its process died), and the
    sender names that router's address, once, and keeps serving the other router."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    lost: queue.SimpleQueue[str] = queue.SimpleQueue()
    sender = OutputSender(ctx, 100, on_router_lost=lost.put)
    routers = {}
    for name in ("a", "b"):
        pull = ctx.socket(zmq.PULL)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        routers[name] = (pull, f"tcp://127.0.0.1:{port}")
    sender.start()
    try:
        for pull, address in routers.values():
            sender.send(address, OutputBatch("e0", 1, [RequestPiece("r", 0, [1])]))
            assert pull.poll(5000), "no batch arrived"
            pull.recv_multipart()
        pull_a, address_a = routers["a"]
        pull_a.close(linger=0)

        assert lost.get(timeout=5) == address_a
        pull_b, address_b = routers["b"]
        sender.send(address_b, OutputBatch("e0", 2, [RequestPiece("r", 1, [2])]))
        assert pull_b.poll(5000), "the other router gets nothing after the loss"
        assert lost.empty()
    finally:
        sender.stop()
        routers["b"][0].close(linger=0)
        ctx.term()


def test_a_router_that_stops_reading_does_not_hold_up_the_others() -> None:
    """Over real loopback TCP: router a keeps its link but reads nothing. Once its queue (the
    sender's high-water mark, past the TCP buffers) is full, the sender drops a's link and
    names it lost, and router b's batches, sent between a's, go on arriving; a's further
    batches are discarded rather than queued for a router that does not read."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    lost: queue.SimpleQueue[str] = queue.SimpleQueue()
    sender = OutputSender(ctx, 20, on_router_lost=lost.put)
    stuck, reader = ctx.socket(zmq.PULL), ctx.socket(zmq.PULL)
    stuck.setsockopt(zmq.RCVHWM, 4)
    stuck.setsockopt(zmq.RCVBUF, 65536)
    stuck_address = f"tcp://127.0.0.1:{stuck.bind_to_random_port('tcp://127.0.0.1')}"
    reader_address = f"tcp://127.0.0.1:{reader.bind_to_random_port('tcp://127.0.0.1')}"
    sender.start()
    try:
        # b's link is up before the burst (a new link's first batches wait for its connection).
        sender.send(reader_address, OutputBatch("e0", 0, [RequestPiece("s", 0, [0])]))
        assert reader.poll(10_000), "router b got nothing"
        reader.recv_multipart()
        # 100 batches of 200,000 token ids (some 60 MB in all) to a, each followed by a small one
        # to b, which must arrive before the next pair is sent.
        big = list(range(200_000))
        for i in range(1, 101):
            sender.send(stuck_address, OutputBatch("e0", i, [RequestPiece("r", i, big)]))
            sender.send(reader_address, OutputBatch("e0", i, [RequestPiece("s", i, [i])]))
            assert reader.poll(10_000), f"router b got {i - 1} of 100 batches"
            reader.recv_multipart()
        assert lost.get(timeout=10) == stuck_address
        assert lost.empty()
    finally:
        sender.stop()
        stuck.close(linger=0)
        reader.close(linger=0)
        ctx.term()
