"""The engine's two ZeroMQ threads.

::

    routers ──PUSH──▶ [PULL] RequestReceiver thread ──decode──▶ loop.call_soon_threadsafe(on_request)
    asyncio loop (AsyncLLM outputs) ──OutputBatch──▶ SimpleQueue ──▶ OutputSender thread
                                                                       ──encode──▶ [PUSH per router]

Why threads: the asyncio loop is the one that feeds vLLM and collects its outputs. Receiving,
decoding, encoding and sending are kept off it, as vLLM's ``EngineCoreProc`` keeps socket IO off
its model loop; pyzmq releases the GIL while it waits and copies, so these threads cost the loop
little. Each socket is touched by exactly one thread (ZeroMQ sockets are not thread-safe).

With a fleet key (``shoal_protos.curve``) both sockets speak CURVE: frames are encrypted and
only fleet members connect.

The sender watches the TCP link of each router's socket: when an established link drops (the
router process died or closed its socket), ``on_router_lost`` gets the router's address, and
the engine aborts that router's requests (nothing keeps generating for clients that are gone).

One thread sends to every router, so no send may wait: each router's socket queues up to
``hwm`` batches (ZeroMQ's high-water mark, beyond the TCP buffers), and a send finding that
queue full (a router that stopped reading but keeps its link) drops that router's link as if it
had gone, rather than holding up every other router's streams. A dropped link's socket and
monitor are closed. For ``DROPPED_HOLD_S`` after, batches to that address are discarded (the
final pieces of the requests aborted with it: nobody reads them) unless a new request from it
connects first; later ones connect afresh.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import re
import threading
import time
from collections.abc import Callable
from typing import cast

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from shoal_protos import curve
from shoal_protos.addresses import zmq_bind, zmq_connect
from shoal_protos.messages import (
    AbortRequest,
    AddRequest,
    EngineRequestDecoder,
    FrameType,
    OutputBatch,
)

logger = logging.getLogger(__name__)

_POLL_MS = 100
_STOP = object()
DROPPED_HOLD_S = 5.0
"""How long after a router's link was dropped its batches are discarded rather than sent."""


_REPLY_TO = re.compile(r"tcp://[A-Za-z0-9.\-]{1,253}:[0-9]{1,5}|tcp://\[[0-9A-Fa-f:.]{2,45}\]:[0-9]{1,5}")


def valid_reply_to(address: str) -> bool:
    """A router's output address: ``tcp://host:port`` (hostname, IPv4 or bracketed IPv6)."""
    if not _REPLY_TO.fullmatch(address):
        return False
    return 0 < int(address.rsplit(":", 1)[1]) < 65536


class RequestReceiver:
    """Reads ADD/ABORT frames on a bound PULL socket and hands them to the event loop.

    Its thread ending on an unexpected exception before ``stop`` is reported to ``on_fatal``
    (called on that thread), with the traceback logged: an engine that no longer reads requests
    must not go on heartbeating."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        address: str,
        loop: asyncio.AbstractEventLoop,
        on_request: Callable[[AddRequest | AbortRequest], None],
        curve_keys: curve.CurveKeys | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        self._socket = ctx.socket(zmq.PULL)
        if curve_keys is not None:
            curve.serve(self._socket, curve_keys)
        zmq_bind(self._socket, address)
        self._loop = loop
        self._on_request = on_request
        self._on_fatal = on_fatal
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shoal-zmq-in", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=2)

    def _run(self) -> None:
        decoder = EngineRequestDecoder()
        sock = self._socket
        try:
            while not self._stopped.is_set():
                if not sock.poll(_POLL_MS):
                    continue
                frames = sock.recv_multipart(copy=False)
                if len(frames) != 2:
                    logger.warning("dropping message with %d frames (want 2)", len(frames))
                    continue
                try:
                    message = decoder.decode(frames[0].bytes, frames[1].buffer)
                except msgspec.DecodeError as exc:
                    logger.warning("dropping undecodable frame: %s", exc)
                    continue
                if isinstance(message, AddRequest) and not valid_reply_to(message.reply_to):
                    logger.warning(
                        "dropping request with reply address %r (want tcp://host:port)", message.reply_to
                    )
                    continue
                self._loop.call_soon_threadsafe(self._on_request, message)
        except Exception as exc:
            if not self._stopped.is_set():
                logger.exception("the request socket's thread failed")
                if self._on_fatal is not None:
                    self._on_fatal(exc)
        finally:
            sock.close(linger=0)


class OutputSender:
    """Encodes and sends output batches, one PUSH socket per router address, and reports a
    router whose link dropped to ``on_router_lost`` (called on the sender's thread). Its thread
    ending on an unexpected exception is reported to ``on_fatal`` (on that thread), with the
    traceback logged: an engine whose outputs go nowhere must not go on heartbeating."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        hwm: int,
        on_router_lost: Callable[[str], None] | None = None,
        curve_keys: curve.CurveKeys | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        self._on_fatal = on_fatal
        self._ctx = ctx
        self._hwm = hwm
        self._curve_keys = curve_keys
        self._on_router_lost = on_router_lost
        # Each router's socket, and the monitor of its link (None when links are not watched).
        self._links: dict[str, tuple[zmq.Socket[bytes], zmq.Socket[bytes] | None]] = {}
        self._monitors: dict[zmq.Socket[bytes], str] = {}
        self._monitor_count = 0
        # Routers whose link was dropped, and when.
        self._dropped: dict[str, float] = {}
        self._poller = zmq.Poller()
        self._queue: queue.SimpleQueue[tuple[str, OutputBatch | None] | object] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="shoal-zmq-out", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def send(self, reply_to: str, batch: OutputBatch) -> None:
        """Queue a batch; called from the event loop, returns at once."""
        self._queue.put((reply_to, batch))

    def connect(self, reply_to: str) -> None:
        """Open (and watch) the socket to a router before its first batch: a router that dies
        while its requests wait for their first token is noticed too. Returns at once."""
        self._queue.put((reply_to, None))

    def stop(self) -> None:
        """Send what is queued, then close the sockets."""
        self._queue.put(_STOP)
        self._thread.join(timeout=5)

    def _run(self) -> None:  # noqa: C901, PLR0912 (over the complexity budget: to be split)
        encoder = msgspec.msgpack.Encoder()
        links = self._links
        outputs_tag = FrameType.OUTPUTS.value
        links_checked = time.monotonic()
        try:
            while True:
                try:
                    item = self._queue.get(timeout=_POLL_MS / 1000)
                except queue.Empty:
                    item = None
                if self._monitors and time.monotonic() - links_checked >= _POLL_MS / 1000:
                    self._check_links()
                    links_checked = time.monotonic()
                if item is None:
                    continue
                if item is _STOP:
                    return
                assert isinstance(item, tuple)
                reply_to, batch = item
                link = links.get(reply_to)
                if link is None and reply_to in self._dropped:
                    if batch is None or time.monotonic() - self._dropped[reply_to] > DROPPED_HOLD_S:
                        del self._dropped[reply_to]  # a new request from it, or long enough
                    else:
                        continue
                if link is None:
                    sock = self._ctx.socket(zmq.PUSH)
                    sock.setsockopt(zmq.SNDHWM, self._hwm)
                    # Do not hang shutdown on a router that went away.
                    sock.setsockopt(zmq.LINGER, 1000)
                    if self._curve_keys is not None:
                        curve.connect_as_member(sock, self._curve_keys)
                    try:
                        zmq_connect(sock, reply_to)
                    except zmq.ZMQError as exc:
                        # The receiver refuses such addresses; never let one stop every output.
                        sock.close(linger=0)
                        logger.warning("dropping output for %r: cannot connect: %s", reply_to, exc)
                        continue
                    link = links[reply_to] = (sock, self._watch(sock, reply_to))
                    logger.info("connected output socket to router %s", reply_to)
                if batch is not None and not self._send_now(link[0], (outputs_tag, encoder.encode(batch))):
                    logger.warning(
                        "router %s has %d batches it has not read: dropping its link", reply_to, self._hwm
                    )
                    self._drop(reply_to)
                    if self._on_router_lost is not None:
                        self._on_router_lost(reply_to)
        except Exception as exc:
            logger.exception("the output socket's thread failed")
            if self._on_fatal is not None:
                self._on_fatal(exc)
        finally:
            for monitor in self._monitors:
                monitor.close(linger=0)
            for sock, _ in links.values():
                sock.close()

    def _watch(self, sock: zmq.Socket[bytes], reply_to: str) -> zmq.Socket[bytes] | None:
        if self._on_router_lost is None:
            return None
        self._monitor_count += 1
        address = f"inproc://router-link-{id(self)}-{self._monitor_count}"
        sock.monitor(address, zmq.EVENT_DISCONNECTED)
        monitor = self._ctx.socket(zmq.PAIR)
        monitor.connect(address)
        self._monitors[monitor] = reply_to
        self._poller.register(monitor, zmq.POLLIN)
        return monitor

    @staticmethod
    def _send_now(sock: zmq.Socket[bytes], frames: tuple[bytes, bytes]) -> bool:
        """Send without waiting; False when the socket's queue is full. A send that finds the
        queue full may be reading a stale count (the socket learns of what its peer took only
        when it handles its commands, which a send does at most once a millisecond): asking
        for the socket's events handles them, and the send is tried once more if it may."""
        try:
            sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            if not cast(int, sock.get(zmq.EVENTS)) & zmq.POLLOUT:
                return False
        try:
            sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False

    def _drop(self, reply_to: str) -> None:
        """Close a router's socket (and the monitor of its link): it is gone, or stuck."""
        sock, monitor = self._links.pop(reply_to)
        now = time.monotonic()
        for old in [a for a, at in self._dropped.items() if now - at > DROPPED_HOLD_S]:
            del self._dropped[old]
        self._dropped[reply_to] = now
        if monitor is not None:
            self._poller.unregister(monitor)
            del self._monitors[monitor]
            sock.disable_monitor()
            monitor.close(linger=0)
        sock.close(linger=0)

    def _check_links(self) -> None:
        assert self._on_router_lost is not None
        for monitor, _ in self._poller.poll(0):
            reply_to = self._monitors[monitor]
            event = parse_monitor_message(monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                logger.warning("lost the link to router %s", reply_to)
                self._drop(reply_to)
                self._on_router_lost(reply_to)
