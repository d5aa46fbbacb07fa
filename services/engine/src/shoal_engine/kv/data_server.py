"""The KV agent's data side: other engines' agents connect to its data port and send the KV blocks
of the requests they move here, chunk by chunk, into staging areas keyed by migration id.

``DataServer`` accepts source agents' connections (one thread each, at most ``MAX_SOURCES``)
and receives their chunks into the staging arena (``shoal_engine.kv.staging``), or fresh host
memory when the arena is full, over the connection itself or a process group it joins (``gloo``,
``nccl``). Each chunk is acked once staged. The agent (``shoal_engine.kv.agent``) copies a
migration's staged blocks into the request's blocks when the request arrives; a staging area
nobody claims is freed after ``staging_ttl_s``. The agent's lock guards the staging areas and
the connections, shared with the rest of the agent's state.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import torch

from shoal_engine.kv.staging import StagingArena
from shoal_engine.kv.transport import Receiver, listen, read_message, write_message
from shoal_protos import kv

logger = logging.getLogger(__name__)

# A chunk bigger than this (about 1 GiB for SmolLM2) is not a chunk a sane source sends.
_MAX_CHUNK_BLOCKS = 2048
# Chunks whose receives a peer's thread keeps posted at once over a process group (``gloo``,
# ``nccl``) while their bytes arrive.
_CHUNKS_IN_FLIGHT = 4


MAX_SOURCES = 64
"""Source agents' connections served at once, a thread each; more are closed as they come."""
DATA_IDLE_S = 300.0
"""A source's connection with no message for this long is closed (its source connects again
for its next move): connections do not pile up from engines that left."""


@dataclass(slots=True)
class Staged:
    """A migration's staging area: the chunks received so far."""

    created: float
    # first block index -> (number of blocks, per layer a uint8 tensor [blocks, bytes_per_layer_block])
    chunks: dict[int, tuple[int, list[torch.Tensor]]] = field(default_factory=dict)
    nbytes: int = 0
    # Runs of the staging arena the chunks occupy: (first slot, slots).
    runs: list[tuple[int, int]] = field(default_factory=list)


@dataclass(slots=True)
class _Arriving:
    """A chunk whose receives are posted over a process group and whose bytes are on the way."""

    header: kv.StageHeader
    # The staging arena's run it lands in (None: fresh tensors), and the tensors.
    slot: int | None
    into: list[torch.Tensor]
    # Waits until the bytes are in (None until the receives are posted).
    wait: Callable[[], None] | None = None


class DataServer:
    """Receives other agents' chunks into staging; ``serve`` runs on a thread of its own."""

    def __init__(
        self,
        address: str,
        layers: list[torch.Tensor],
        lock: threading.Lock,
        stop: threading.Event,
        host: str,
        staging_bytes: int,
        staging_ttl_s: float,
        timeout_s: float,
        idle_timeout_s: float,
        max_pairs: int,
        tls: ssl.SSLContext | None,
    ) -> None:
        """``layers``: the KV cache, per layer ``[blocks, bytes]``; ``lock`` guards the staging
        areas and connections (the agent's lock); ``stop`` ends the threads; ``host``: where
        sources reach this agent, for the rendezvous of ``gloo`` and ``nccl`` pairs; ``tls``: the
        server side of the fleet's TLS, None: plain."""
        self._layers = layers
        self._lock = lock
        self._stop = stop
        self._host = host
        self._tls = tls
        if self._tls is not None:
            self._tls.num_tickets = 0  # connections live long and are never resumed
        self._timeout_s = timeout_s
        self._idle_timeout_s = idle_timeout_s
        self._staging_ttl_s = staging_ttl_s
        self.bytes_per_layer_block = layers[0].shape[1]
        self.bytes_per_block = len(layers) * self.bytes_per_layer_block
        self.staging: dict[str, Staged] = {}
        # Staging areas freed on purpose: chunks still in flight for them are dropped.
        self._freed: dict[str, None] = {}
        self.arena = StagingArena(
            len(layers), self.bytes_per_layer_block, staging_bytes // self.bytes_per_block, layers[0].device
        )
        self._max_pairs = max_pairs
        self._joined = 0  # pair groups sources hold with this agent
        self._server = listen(address)
        self._server.settimeout(0.2)
        self.peers: set[socket.socket] = set()
        self._refused = 0  # connections refused, the cap reached

    def shutdown_peers(self) -> None:
        """Shut every source connection down, so that its thread ends."""
        with self._lock:
            peers = list(self.peers)
        for conn in peers:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def serve(self) -> None:
        """Accept source agents' connections, one thread each; expire unclaimed staging."""
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                self.expire()
                continue
            except OSError:
                break
            with self._lock:
                full = len(self.peers) >= MAX_SOURCES
                if not full:
                    self.peers.add(conn)
            if full:
                # A thread per connection: a flood of them is not moves (a fleet's moves into
                # one engine run a few at a time), and must not cost a thread each.
                self._refused += 1
                if self._refused % 100 == 1:
                    logger.warning(
                        "KV agent: %d source connections open already: refused %d", MAX_SOURCES, self._refused
                    )
                conn.close()
                continue
            if conn.family != socket.AF_UNIX:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve_peer, args=(conn,), name="shoal-kv-peer", daemon=True).start()
        self._server.close()

    def _serve_peer(self, conn: socket.socket) -> None:
        if self._tls is not None:
            # The handshake runs here, on the connection's own thread: a source that stalls in
            # it holds only its own slot.
            raw = conn
            raw.settimeout(self._timeout_s)
            try:
                conn = self._tls.wrap_socket(raw, server_side=True)
            except (OSError, ssl.SSLError) as exc:
                logger.warning("KV agent: refused a source connection: %s", exc)
                with self._lock:
                    self.peers.discard(raw)
                raw.close()
                return
            with self._lock:  # the wrapped socket is the one to close on the way out
                self.peers.discard(raw)
                self.peers.add(conn)
        receiver = Receiver(conn, self._host, self._layers[0].device, self._timeout_s)
        # Chunks arriving over a process group, oldest first: while the newest says another
        # follows (``more``), its header is read and its receives posted before the oldest is
        # finished (waited for, staged, acked), up to ``_CHUNKS_IN_FLIGHT``, so the group's pipe
        # does not drain between chunks. Over ``tcp`` a chunk is in when its receive returns and
        # is acked at once.
        arriving: deque[_Arriving] = deque()
        try:
            while not self._stop.is_set():
                if arriving and (len(arriving) >= _CHUNKS_IN_FLIGHT or not arriving[-1].header.more):
                    ack, in_step = self._finish_stage(arriving)
                else:
                    conn.settimeout(self._idle_timeout_s)  # idle until the next message
                    try:
                        frame = read_message(conn)
                    except TimeoutError:
                        logger.info(
                            "KV agent: closed a source connection idle for %.0f s", self._idle_timeout_s
                        )
                        break
                    conn.settimeout(self._timeout_s)
                    message = kv.data_message_decoder.decode(frame)
                    if isinstance(message, kv.PairJoin):
                        self._join(receiver, message)
                        continue
                    started = self._start_stage(receiver, message, arriving)
                    if started is None:
                        continue  # on its way
                    ack, in_step = started
                write_message(conn, ack)
                if not in_step:
                    break
        except EOFError:
            pass  # the source closed its end between messages
        except (OSError, RuntimeError, ValueError, msgspec.DecodeError) as exc:
            if not self._stop.is_set():
                logger.warning("KV agent: dropped a source connection: %s", exc)
        finally:
            # Chunks left here did not come in (the connection closes mid-transfer): the
            # receives still posted go with the group, and only then are their arena runs free
            # for other migrations (nothing can land in them after).
            taken = [(left.slot, left.header.num_blocks) for left in arriving if left.slot is not None]
            arriving.clear()
            if receiver.joined:
                with self._lock:
                    self._joined -= 1
            receiver.close()
            for slot, count in taken:
                self.arena.give_back(slot, count)
            with self._lock:
                self.peers.discard(conn)
            conn.close()

    def _join(self, receiver: Receiver, join: kv.PairJoin) -> None:
        """Join a source's pair group, unless ``max_pairs`` are held already: the refusal closes
        the connection, and the source's group set-up fails within its timeout."""
        if receiver.joined:
            raise ValueError("a second pair join on one connection")
        with self._lock:
            if self._joined >= self._max_pairs:
                raise ValueError(f"{self._max_pairs} {join.backend} pair groups are open here already")
            self._joined += 1
        try:
            receiver.join(join)
        except BaseException:
            with self._lock:
                self._joined -= 1
            raise

    def _start_stage(
        self, receiver: Receiver, header: kv.StageHeader, arriving: deque[_Arriving]
    ) -> tuple[kv.StageAck, bool] | None:
        """Start receiving one chunk into staging. Over a process group the chunk joins
        ``arriving`` with its receives posted (None comes back); otherwise the ack, and whether
        the connection is still in step (it is not once a chunk's bytes could not be read). A
        chunk whose receive failed stays in ``arriving``: some of its receives may be posted, and
        its arena run is given back once the group is gone."""
        if header.bytes_per_block != self.bytes_per_block or not 0 < header.num_blocks <= _MAX_CHUNK_BLOCKS:
            error = (
                f"layout mismatch: {header.bytes_per_block} bytes per block sent, {self.bytes_per_block} here"
                if header.bytes_per_block != self.bytes_per_block
                else f"a chunk of {header.num_blocks} blocks"
            )
            return kv.StageAck(migration_id=header.migration_id, staged_blocks=0, error=error), False
        # Into the arena when it has room; otherwise into fresh memory, on the host only: a GPU
        # engine's staging is the arena alone, which its GPU budget counts.
        count = header.num_blocks
        slot = self.arena.take(count)
        if slot is not None:
            into = self.arena.views(slot, count)
        elif self._layers[0].device.type != "cpu":
            error = f"staging full: {count} blocks do not fit in the {self.arena.slots}-block arena"
            return kv.StageAck(migration_id=header.migration_id, staged_blocks=0, error=error), False
        else:
            shape = (count, self.bytes_per_layer_block)
            into = [
                torch.empty(shape, dtype=torch.uint8, device=self._layers[0].device) for _ in self._layers
            ]
        chunk = _Arriving(header, slot, into)
        arriving.append(chunk)
        try:
            chunk.wait = receiver.receive(header, into)
        except (OSError, RuntimeError, ConnectionError) as exc:
            return _receive_failed(header, exc), False
        if chunk.wait is not None:
            return None
        arriving.pop()  # in already
        return self._staged(header, slot, into)

    def _finish_stage(self, arriving: deque[_Arriving]) -> tuple[kv.StageAck, bool]:
        """Wait for the oldest arriving chunk's bytes and stage it; the ack, and whether the
        connection is in step. A chunk whose bytes did not come stays in ``arriving``."""
        oldest = arriving[0]
        assert oldest.wait is not None
        try:
            oldest.wait()
        except (OSError, RuntimeError, ConnectionError) as exc:
            return _receive_failed(oldest.header, exc), False
        arriving.popleft()
        return self._staged(oldest.header, oldest.slot, oldest.into)

    def _staged(
        self, header: kv.StageHeader, slot: int | None, into: list[torch.Tensor]
    ) -> tuple[kv.StageAck, bool]:
        """Keep a received chunk in its migration's staging area (or drop it, cancelled)."""
        count = header.num_blocks
        with self._lock:
            cancelled = header.migration_id in self._freed
            if not cancelled:
                staged = self.staging.setdefault(header.migration_id, Staged(time.monotonic()))
                staged.chunks[header.first_block] = (count, into)
                staged.nbytes += count * self.bytes_per_block
                if slot is not None:
                    staged.runs.append((slot, count))
                total = sum(n for n, _ in staged.chunks.values())
        if cancelled:
            if slot is not None:
                self.arena.give_back(slot, count)
            return kv.StageAck(
                migration_id=header.migration_id, staged_blocks=0, error="migration cancelled"
            ), True
        return kv.StageAck(migration_id=header.migration_id, staged_blocks=total), True

    def free(self, migration_id: str) -> None:
        """Drop a migration's staging area, and any chunk of it still to come."""
        with self._lock:
            staged = self.staging.pop(migration_id, None)
            self._freed[migration_id] = None
            if len(self._freed) > 4096:
                del self._freed[next(iter(self._freed))]
        if staged is not None:
            self.give_back(staged)

    def give_back(self, staged: Staged) -> None:
        """Give a staging area's arena runs back (the area is no longer in ``staging``)."""
        for slot, count in staged.runs:
            self.arena.give_back(slot, count)
        staged.runs.clear()

    def expire(self) -> None:
        """Free the staging areas older than ``staging_ttl_s``: their requests never came."""
        cutoff = time.monotonic() - self._staging_ttl_s
        with self._lock:
            stale = [m for m, s in self.staging.items() if s.created < cutoff]
            for migration_id in stale:
                self.give_back(self.staging.pop(migration_id))
        for migration_id in stale:
            logger.warning("freed staging of migration %s: its request never arrived", migration_id)


def _receive_failed(header: kv.StageHeader, exc: Exception) -> kv.StageAck:
    return kv.StageAck(migration_id=header.migration_id, staged_blocks=0, error=f"receive failed: {exc}")
