"""ZeroMQ between this router and the engines.

::

    handler ── add()/abort() ──▶ PUSH socket per engine (non-blocking send)
    engines ── OutputBatch ──▶ [PULL, bound at reply_to] ── ingest task ──▶ collector.put()

One task reads the PULL socket (a plain socket read without blocking: no future per message; the
task waits on the socket's descriptor only once it is empty), decodes each batch and hands every
piece to its request's collector (from the engine that owns the request; a piece with a higher
ownership generation says the request moved, and its owner becomes the engine that serves it and
receives its ABORT), yielding to the loop every ``_CHUNK`` pieces so that a burst of large
batches does not starve the HTTP handlers (``AsyncLLM``'s output handler does the same). It
takes every batch already waiting on the socket (up to ``_DRAIN_PIECES`` pieces) before it
flushes the collectors whose streams write as tokens come (``RequestOutputCollector.push``, the
SSE relay of ``api.relay``): a router that falls behind writes a stream's tokens of several engine
steps as one event. Sends
never block the loop: a full socket (``zmq.Again``) means the engine is not keeping up, and the
request is answered 503 instead of being queued without bound.

Each engine socket is monitored: when its TCP link drops (the engine process died or closed),
the engine's requests fail at once with ``engine_lost`` (their handlers continue them on another
engine) and ``on_link`` takes it out of dispatch until the link comes back; the Redis heartbeat
is the slower backstop for engines that hang.

With the fleet's CURVE key (``shoal_protos.curve``), both directions are encrypted and only
fleet members connect.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from shoal_protos import curve
from shoal_protos.addresses import zmq_bind, zmq_connect
from shoal_protos.messages import (
    AbortRequest,
    AddRequest,
    FrameType,
    OutputBatch,
    PieceError,
    RequestPiece,
    RouterRequestEncoder,
)
from shoal_router.core.outputs import RequestOutputCollector
from shoal_router.errors import ServiceUnavailableError
from shoal_router.metrics import RouterMetrics

logger = logging.getLogger(__name__)

_CHUNK = 256
_OUTPUTS_TAG = FrameType.OUTPUTS.value
# At most this many pieces are taken from waiting batches before the collectors are flushed.
_DRAIN_PIECES = 2048
# How long a closing engine socket may still deliver queued ABORTs, in ms.
_ABORT_LINGER_MS = 200


@dataclass(frozen=True, slots=True)
class InFlight:
    """A request as the fleet page shows it."""

    request_id: str
    engine_id: str
    tokens: int
    started: float
    moves: int


@dataclass(slots=True)
class _Tracked:
    collector: RequestOutputCollector
    # The engine serving the request, and the ownership generation it serves under.
    engine_id: str
    generation: int = 0
    # The owner before the last move: its pieces of the previous generation may still be in
    # flight (they hold tokens produced before the move).
    previous: str = ""
    started: float = field(default_factory=time.time)


class EngineClient:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        reply_to: str,
        send_hwm: int,
        on_link: Callable[[str, bool], None],
        metrics: RouterMetrics | None = None,
        curve_keys: curve.CurveKeys | None = None,
        bind_to: str | None = None,
    ) -> None:
        """``reply_to``: the output socket's address as engines reach it (sent with every
        request); ``bind_to``: the address it binds, None: ``reply_to``."""
        self.reply_to = reply_to
        self._curve_keys = curve_keys
        self._metrics = metrics
        self._ctx = ctx
        self._on_link = on_link
        self._monitors: dict[str, asyncio.Task[None]] = {}
        self._links_made = 0
        # PUSH sockets are plain (not asyncio) sockets of the same context: a NOBLOCK send
        # either queues at once or raises zmq.Again; it never awaits.
        self._push_ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(ctx.underlying)
        self._send_hwm = send_hwm
        self._encoder = RouterRequestEncoder()
        self._sockets: dict[str, zmq.Socket[bytes]] = {}
        self._requests: dict[str, _Tracked] = {}
        # Collectors with output for a stream that waits for it (flushed by the ingest task).
        self._ready: list[RequestOutputCollector] = []
        # A plain socket as well: the ingest task reads it without a future per message
        # (``ingest_forever``) and waits on its file descriptor only when it is empty.
        self._pull: zmq.Socket[bytes] = self._push_ctx.socket(zmq.PULL)
        if curve_keys is not None:
            curve.serve(self._pull, curve_keys)
        zmq_bind(self._pull, bind_to or reply_to)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def in_flight(self) -> list[InFlight]:
        """Every request this router is serving now, oldest first."""
        return sorted(
            (
                InFlight(
                    rid, tracked.engine_id, tracked.collector.delivered, tracked.started, tracked.generation
                )
                for rid, tracked in self._requests.items()
            ),
            key=lambda request: request.started,
        )

    def connect(self, engine_id: str, address: str) -> None:
        if engine_id in self._sockets:
            return
        sock = self._push_ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, self._send_hwm)
        sock.setsockopt(zmq.LINGER, 0)
        if self._curve_keys is not None:
            curve.connect_as_member(sock, self._curve_keys)
        # Watch the TCP link: a local engine that dies drops it at once, long before its
        # Redis heartbeat expires.
        # A fresh inproc name per link: a closed socket's monitor may still hold the last one.
        self._links_made += 1
        monitor_address = f"inproc://engine-monitor-{id(self)}-{self._links_made}"
        sock.monitor(monitor_address, zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        monitor = self._ctx.socket(zmq.PAIR)
        monitor.connect(monitor_address)
        zmq_connect(sock, address)
        self._sockets[engine_id] = sock
        self._monitors[engine_id] = asyncio.create_task(
            self._watch_link(engine_id, monitor), name=f"link-{engine_id}"
        )

    async def _watch_link(self, engine_id: str, monitor: zmq.asyncio.Socket) -> None:
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                up = event["event"] == zmq.EVENT_CONNECTED
                if not up:
                    failed = self.fail_requests(engine_id, "dropped its connection")
                    logger.warning(
                        "lost the link to engine %s; its %d requests go on elsewhere", engine_id, failed
                    )
                self._on_link(engine_id, up)
        finally:
            monitor.close(linger=0)

    def add(self, engine_id: str, request: AddRequest, collector: RequestOutputCollector) -> None:
        sock = self._sockets.get(engine_id)
        if sock is None:
            raise ServiceUnavailableError(f"engine {engine_id} is not connected", code="engine_gone")
        try:
            sock.send_multipart(self._encoder.add(request), flags=zmq.NOBLOCK)
        except zmq.Again:
            raise ServiceUnavailableError(
                f"engine {engine_id} is not taking requests fast enough; retry later",
                code="engine_overloaded",
            ) from None
        collector.ready = self._ready
        self._requests[request.request_id] = _Tracked(collector, engine_id, request.generation)

    def abort(self, request_id: str, reason: str) -> None:
        tracked = self._requests.pop(request_id, None)
        if tracked is None:
            return
        sock = self._sockets.get(tracked.engine_id)
        if sock is None:
            return
        try:
            sock.send_multipart(self._encoder.abort(AbortRequest([request_id], reason)), flags=zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("could not send abort of %s to %s: socket full", request_id, tracked.engine_id)

    def release(self, request_id: str) -> None:
        """Forget a finished request."""
        self._requests.pop(request_id, None)

    def engine_of(self, request_id: str) -> str | None:
        tracked = self._requests.get(request_id)
        return tracked.engine_id if tracked else None

    def engine_lost(self, engine_id: str, reason: str) -> int:
        """Fail every request on a lost engine and drop its socket. Returns how many failed.

        An engine lost by its heartbeat may only be stalled: its requests are aborted there
        first (the frames leave within the socket's linger if the engine still reads), so it
        does not keep generating what another engine now continues."""
        monitor = self._monitors.pop(engine_id, None)
        if monitor is not None:
            monitor.cancel()
        sock = self._sockets.pop(engine_id, None)
        if sock is not None:
            lost = [rid for rid, t in self._requests.items() if t.engine_id == engine_id]
            if lost:
                abort = AbortRequest(lost, f"engine {engine_id} {reason}; the request went on elsewhere")
                with contextlib.suppress(zmq.ZMQError):
                    sock.send_multipart(self._encoder.abort(abort), flags=zmq.NOBLOCK)
            sock.close(linger=_ABORT_LINGER_MS)
        return self.fail_requests(engine_id, reason)

    def fail_requests(self, engine_id: str, reason: str) -> int:
        """Fail every request running on ``engine_id`` with ``engine_lost`` (its handler may
        continue it elsewhere). Returns how many."""
        lost = [rid for rid, t in self._requests.items() if t.engine_id == engine_id]
        for request_id in lost:
            tracked = self._requests.pop(request_id)
            tracked.collector.fail(
                PieceError("engine_lost", f"engine {engine_id} {reason} while serving it", retryable=True),
                tracked.generation,
            )
        return len(lost)

    async def ingest_forever(self) -> None:
        """Read the engines' batches until cancelled. The socket is read without blocking until
        it is empty (up to ``_DRAIN_PIECES`` pieces before a flush); only then does the task
        wait, on the socket's file descriptor. A ZeroMQ descriptor signals edges, not levels: it
        becomes readable when the socket's events may have changed, so the events are read
        again (which also re-arms it) before every wait."""
        decoder = msgspec.msgpack.Decoder(OutputBatch)
        pull, ready = self._pull, self._ready
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] | None = None

        def readable() -> None:
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

        fd = pull.FD
        loop.add_reader(fd, readable)
        try:
            while True:
                taken = 0
                while taken < _DRAIN_PIECES:
                    try:
                        frames = pull.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    taken += await self._take(frames, decoder)
                if ready:
                    flushing = ready[:]
                    ready.clear()  # the collectors hold this list: cleared in place
                    for collector in flushing:
                        collector.flush()
                if taken >= _DRAIN_PIECES:
                    await asyncio.sleep(0)  # more waits: let the handlers in first
                elif not cast(int, pull.get(zmq.EVENTS)) & zmq.POLLIN:
                    waiter = loop.create_future()
                    await waiter
                    waiter = None
        finally:
            loop.remove_reader(fd)

    async def _take(self, frames: list[zmq.Frame], decoder: msgspec.msgpack.Decoder[OutputBatch]) -> int:
        """Hand one engine batch's pieces to their collectors; returns how many pieces it had
        (1 for a message dropped, so that a flood of them still ends a drain)."""
        started = time.perf_counter()
        if len(frames) != 2 or frames[0].bytes != _OUTPUTS_TAG:
            logger.warning("dropping unexpected message from an engine")
            return 1
        try:
            batch = decoder.decode(frames[1].buffer)
        except msgspec.DecodeError as exc:
            logger.warning("dropping undecodable output batch: %s", exc)
            return 1
        requests = self._requests
        for i, piece in enumerate(batch.pieces):
            tracked = requests.get(piece.request_id)
            if (
                tracked is not None
                and _owned(tracked, batch.engine_id, piece)
                and (piece.token_ids or piece.finish_reason is not None)
            ):
                tracked.collector.put(batch.engine_id, piece, started)
            if i and i % _CHUNK == 0:
                await asyncio.sleep(0)
        if self._metrics is not None:
            self._metrics.batch.observe(time.perf_counter() - started)
            self._metrics.batch_pieces.inc(len(batch.pieces))
        return max(1, len(batch.pieces))

    async def aclose(self) -> None:
        for task in self._monitors.values():
            task.cancel()
        await asyncio.gather(*self._monitors.values(), return_exceptions=True)
        self._monitors.clear()
        for sock in self._sockets.values():
            sock.close(linger=0)
        self._sockets.clear()
        self._pull.close(linger=0)


def _owned(tracked: _Tracked, engine_id: str, piece: RequestPiece) -> bool:
    """Whether a piece from ``engine_id`` belongs to the request as the router knows it, moving
    the request to its new owner when the piece says it moved (a higher generation)."""
    if piece.generation > tracked.generation:
        tracked.previous = tracked.engine_id
        tracked.engine_id = piece.owner or engine_id
        tracked.generation = piece.generation
        return True
    if engine_id == tracked.engine_id:
        return True
    # Late tokens from the owner before the move; the collector orders them by index.
    return engine_id == tracked.previous and piece.generation == tracked.generation - 1
