"""How KV bytes travel from one engine's agent to another's.

``KvTransport.send`` delivers a request's blocks into the target agent's staging area and returns
once every chunk is acknowledged. A chunk is a run of consecutive block ids (at most
``chunk_bytes``); its data leaves straight from the KV cache, one piece per layer (a layer's
blocks ``[b, b + n)`` are one contiguous region), so nothing is gathered into a send buffer. Full
blocks never change once written, and a request's partial block is only sent once it is
stopped, so reading the cache while the model runs is safe.

The data plane is one long-lived stream connection per engine pair (TCP, or a Unix socket for
an ``ipc://`` address), made on the first send or by ``connect`` (the warm-up). On it every
message is a 4-byte length and a msgspec ``DataMessage`` (a ``StageHeader`` or ``PairJoin``);
every ``StageHeader`` is answered by a length-prefixed ``StageAck``. Where the layers go:

* ``tcp`` (the CPU default): right after the header on the same connection. The sender writes
  them from the KV cache's own memory; the receiver reads them straight into its staging arena
  (``shoal_engine.kv.staging``): one kernel copy on each side, as raw sockets get.
* ``gloo`` and ``nccl``: over a two-rank torch.distributed process group made per engine pair
  (a ``PairJoin`` on the connection; the sender hosts the rendezvous store), by ``send`` /
  ``recv`` per layer. ``nccl`` needs CUDA and a torch build with NCCL; on a CPU build asking for
  it fails when the agent starts.

All chunks of a call are written before the acks are read, so the pipe never drains between
chunks; over a process group the sender does not wait for a chunk's sends before the next
header, and the receiver posts a chunk's receives before the chunks ahead of it are in.
``Receiver`` is the receiving half, on one thread per connected peer of the target agent.

With the fleet's TLS (``shoal_protos.tls``) every connection is mutual TLS: a source without a
certificate of the fleet's CA gets no further than the handshake, and ``tcp``'s layers travel
encrypted. A ``gloo`` or ``nccl`` pair's own traffic (its rendezvous store and the collectives)
is torch.distributed's, which has no TLS: only the connection that sets it up is protected.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import os
import select
import socket
import ssl
import struct
import uuid
from collections.abc import Callable
from typing import Protocol
from urllib.parse import urlsplit

import msgspec
import torch
import torch.distributed as dist

from shoal_protos import kv
from shoal_protos.addresses import listen_tcp
from shoal_protos.tls import FLEET_NAME

logger = logging.getLogger(__name__)

_LENGTH = struct.Struct("!I")
_MAX_HEADER = 1 << 16
_IOV_MAX = 512  # buffers per sendmsg/recvmsg call (Linux allows 1024)


class TransportError(Exception):
    """A transfer failed or timed out; the migration it served is abandoned."""


class KvTransport(Protocol):
    def connect(self, target: str) -> None:
        """Open the connection to ``target`` ahead of the first migration to it (a warm-up)."""
        ...

    def send(
        self,
        target: str,
        migration_id: str,
        first_block: int,
        block_ids: list[int],
        layers: list[torch.Tensor],
    ) -> int:
        """Deliver blocks ``block_ids`` (block indices ``first_block...`` of the request) of
        every layer in ``layers`` (each ``[num_blocks, bytes per layer block]`` uint8) into
        ``target``'s staging area ``migration_id``; returns the bytes sent."""
        ...

    def close(self) -> None: ...


def runs(pairs: list[tuple[int, int]], limit: int = 1 << 30) -> list[tuple[int, int, int]]:
    """Group ``(a, b)`` index pairs into ``(first a, first b, length)`` runs of at most ``limit``
    in which both indices go up by one. With ``enumerate(block_ids)`` as the pairs: a request's
    chunks, ``(index in the request, first block id, number of blocks)``."""
    grouped: list[tuple[int, int, int]] = []
    for a, b in pairs:
        if grouped:
            first_a, first_b, length = grouped[-1]
            if length < limit and first_a + length == a and first_b + length == b:
                grouped[-1] = (first_a, first_b, length + 1)
                continue
        grouped.append((a, b, 1))
    return grouped


def host_of(address: str) -> str:
    """The host of a data address (``tcp://host:port``); loopback for ``ipc://``."""
    if not address.startswith("tcp://"):
        return "127.0.0.1"
    return urlsplit(address).hostname or "127.0.0.1"


def listen(address: str) -> socket.socket:
    """The listening socket of an agent's data address (``tcp://host:port`` or ``ipc://path``)."""
    if address.startswith("ipc://"):
        path = address.removeprefix("ipc://")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # left by an agent that did not exit cleanly
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        server.listen(64)
        return server
    # ``tcp://[::]:port`` listens on IPv6 and IPv4 alike.
    parts = urlsplit(address)
    return listen_tcp(parts.hostname or "0.0.0.0", parts.port or 0, backlog=64)


def _dial(address: str, timeout_s: float, tls: ssl.SSLContext | None = None) -> socket.socket:
    if address.startswith("ipc://"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        sock.connect(address.removeprefix("ipc://"))
    else:
        parts = urlsplit(address)
        sock = socket.create_connection((parts.hostname, parts.port), timeout=timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if tls is None:
        return sock
    try:
        return tls.wrap_socket(sock, server_hostname=FLEET_NAME)
    except (OSError, ssl.SSLError):
        sock.close()
        raise


def write_message(sock: socket.socket, message: kv.StageHeader | kv.PairJoin | kv.StageAck) -> None:
    body = kv.encoder.encode(message)
    sock.sendall(_LENGTH.pack(len(body)) + body)


def _advance(views: list[memoryview], done: int) -> None:
    """Drop ``done`` bytes from the front of ``views``."""
    while done and views:
        if done >= len(views[0]):
            done -= len(views.pop(0))
        else:
            views[0] = views[0][done:]
            done = 0


def send_buffers(sock: socket.socket, buffers: list[memoryview]) -> None:
    """Write every buffer, in order, with as few system calls as the kernel allows (gathered;
    over TLS, which encrypts record by record, one buffer after another)."""
    views = [view for view in buffers if len(view)]
    if isinstance(sock, ssl.SSLSocket):
        for view in views:
            sock.sendall(view)
        return
    while views:
        _advance(views, sock.sendmsg(views[:_IOV_MAX]))


def read_buffers(sock: socket.socket, buffers: list[memoryview]) -> None:
    """Fill every buffer, in order, scattering each read across them (over TLS, one after
    another)."""
    views = [view for view in buffers if len(view)]
    tls = isinstance(sock, ssl.SSLSocket)
    while views:
        got = sock.recv_into(views[0]) if tls else sock.recvmsg_into(views[:_IOV_MAX])[0]
        if not got:
            raise ConnectionError("the peer closed the connection")
        _advance(views, got)


def read_message(sock: socket.socket) -> bytes:
    """One length-prefixed message; ``EOFError`` when the peer closed between messages."""
    length = bytearray(_LENGTH.size)
    got = sock.recv_into(length)
    if not got:
        raise EOFError
    read_buffers(sock, [memoryview(length)[got:]])
    (size,) = _LENGTH.unpack(length)
    if size > _MAX_HEADER:
        raise ConnectionError(f"a {size}-byte header is not a KV data message")
    body = bytearray(size)
    read_buffers(sock, [memoryview(body)])
    return bytes(body)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return tensor.numpy().data.cast("B")


def _process_group(
    backend: str, store: dist.Store, rank: int, host: str, timeout_s: float
) -> dist.ProcessGroup:
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        # The options type is private in PyTorch's stubs, public in its bindings.
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = timeout
        # Gloo listens on the address the agent serves on (not whatever the hostname resolves to).
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        # A backend used as a group of its own (send/recv): PyTorch's stubs type it apart.
        return dist.ProcessGroupGloo(store, rank, 2, options)  # type: ignore[return-value]
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, 2, options)  # type: ignore[return-value]


def _wait_all(works: list[dist.Work], device: torch.device, timeout_s: float) -> None:
    """Return once every op of ``works`` is done with its tensors.

    For gloo, ``Work.wait`` does that. For NCCL it only orders the calling thread's current
    CUDA stream after the op, and returns before the bytes have moved: the stream is synchronized
    too, so that a chunk is acknowledged only once it is in the target's arena and the source
    hands its blocks back only once NCCL has read them."""
    timeout = datetime.timedelta(seconds=timeout_s)
    for work in works:
        work.wait(timeout)
    if works and device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def check_backend(backend: str, device: torch.device) -> None:
    """Fail at start, not mid-migration, when ``backend`` cannot carry this KV cache."""
    # Both read and write the tensor's memory as host memory: the socket directly, gloo through
    # ProcessGroupGloo's send and recv handing it to gloo's TCP transport.
    if backend in ("tcp", "gloo") and device.type != "cpu":
        raise ValueError(f"KV transport {backend!r} needs the KV cache in host memory; use 'nccl' on GPUs")
    if backend == "gloo" and not dist.is_gloo_available():
        raise ValueError("KV transport 'gloo' needs torch.distributed with gloo")
    if backend == "nccl" and (not dist.is_nccl_available() or device.type != "cuda"):
        raise ValueError(
            "KV transport 'nccl' needs a CUDA build of torch with NCCL and a KV cache on the GPU"
        )
    if backend not in ("tcp", "gloo", "nccl"):
        raise ValueError(f"unknown KV transport {backend!r} (tcp, gloo, nccl)")


def release_group(group: dist.ProcessGroup) -> None:
    """Free a pair group's resources now (an NCCL communicator's GPU buffers), rather than
    whenever the garbage collector gets to it."""
    shutdown = getattr(group, "shutdown", None)  # ProcessGroupNCCL; gloo's have nothing to free
    if shutdown is None:
        return
    try:
        shutdown()
    except RuntimeError as exc:
        logger.warning("KV transport: a pair group did not shut down cleanly: %s", exc)


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether ``sock`` is no longer fit to send on: between moves a target sends nothing, so
    anything to read (the end of the stream, once it closed the connection) says so."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    if not poller.poll(0):
        return False
    if not isinstance(sock, ssl.SSLSocket):
        return True
    # Over TLS, readable can be a record that carries no data (a session ticket, say): only
    # the end of the stream, or data nobody asked for, makes the connection unfit.
    timeout = sock.gettimeout()
    sock.setblocking(False)
    try:
        sock.recv(1)  # the end of the stream (b""), or a byte out of turn: unfit either way
        return True
    except ssl.SSLWantReadError:
        return False
    except OSError:
        return True
    finally:
        sock.settimeout(timeout)


class Transport:
    """The sending half of every transport: a connection per target agent and, for ``gloo`` and
    ``nccl``, rank 0 of a process group per target."""

    def __init__(
        self,
        backend: str,
        host: str,
        device: torch.device,
        chunk_bytes: int,
        timeout_s: float,
        max_pairs: int = 4,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """``tls``: the fleet's client context (``FleetTls.client_context``); None: plain."""
        check_backend(backend, device)
        self._tls = tls
        self._max_pairs = max_pairs
        self._backend = backend
        self._device = device
        self._host = host
        self._chunk_bytes = chunk_bytes
        self._timeout_s = timeout_s
        self._connections: dict[str, socket.socket] = {}
        self._groups: dict[str, tuple[dist.Store, dist.ProcessGroup]] = {}

    def connect(self, target: str) -> None:
        if target in self._connections:
            if not _closed_by_peer(self._connections[target]):
                return
            # The target closed it (idle too long, or it restarted): connect again.
            self._drop(target)
        try:
            sock = _dial(target, self._timeout_s, self._tls)
        except OSError as exc:
            raise TransportError(f"cannot reach {target}: {exc}") from exc
        self._connections[target] = sock
        if self._backend == "tcp":
            return
        # Pair groups are bounded (an NCCL communicator holds GPU buffers): the least recently
        # used goes; its target sees the connection close and lets its end go too.
        while len(self._groups) >= self._max_pairs:
            oldest = next(iter(self._groups))
            logger.info("KV transport: closing the %s pair with %s for %s", self._backend, oldest, target)
            self._drop(oldest)
        try:
            # This side hosts the pair's rendezvous store on a free port; the target joins it.
            store = dist.TCPStore(
                self._host,
                0,
                world_size=2,
                is_master=True,
                timeout=datetime.timedelta(seconds=self._timeout_s),
                wait_for_workers=False,
            )
            pair = uuid.uuid4().hex
            write_message(
                sock,
                kv.PairJoin(
                    pair_id=pair, backend=self._backend, store_host=self._host, store_port=store.port
                ),
            )
            group = _process_group(
                self._backend, dist.PrefixStore(pair, store), 0, self._host, self._timeout_s
            )
        except (OSError, RuntimeError) as exc:
            self._drop(target)
            raise TransportError(f"no {self._backend} group with {target}: {exc}") from exc
        self._groups[target] = (store, group)
        logger.info("KV transport: %s pair with %s ready", self._backend, target)

    def send(
        self,
        target: str,
        migration_id: str,
        first_block: int,
        block_ids: list[int],
        layers: list[torch.Tensor],
    ) -> int:
        self.connect(target)
        sock = self._connections[target]
        if target in self._groups:  # the most recently used, last
            self._groups[target] = self._groups.pop(target)
        per_block = len(layers) * layers[0].shape[1]
        sent = messages = 0
        works: list[dist.Work] = []
        try:
            limit = max(1, self._chunk_bytes // per_block)
            chunks = runs(list(enumerate(block_ids)), limit)
            for at, (index, start, count) in enumerate(chunks):
                header = kv.StageHeader(
                    migration_id=migration_id,
                    first_block=first_block + index,
                    num_blocks=count,
                    bytes_per_block=per_block,
                    via="" if self._backend == "tcp" else self._backend,
                    more=at + 1 < len(chunks),
                )
                write_message(sock, header)
                pieces = [layer[start : start + count] for layer in layers]
                if self._backend == "tcp":
                    send_buffers(sock, [_bytes_of(piece) for piece in pieces])
                else:
                    # Not waited for chunk by chunk: the next header goes out while this chunk's
                    # bytes are on the way, the target posts its receives as each header
                    # arrives (``more``), and the group's pipe does not drain between chunks.
                    group = self._groups[target][1]
                    works += [group.send([piece], 1, tag) for tag, piece in enumerate(pieces)]
                sent += count * per_block
                messages += 1
            _wait_all(works, self._device, self._timeout_s)
            for _ in range(messages):
                ack = kv.stage_ack_decoder.decode(read_message(sock))
                if ack.error:
                    raise TransportError(f"{target} refused a chunk: {ack.error}")
        except (OSError, RuntimeError, msgspec.DecodeError) as exc:
            # A connection (or group) that failed mid-message is out of step: make a new one next time.
            self._drop(target)
            raise TransportError(f"sending to {target} failed: {exc}") from exc
        except TransportError:
            self._drop(target)
            raise
        return sent

    def _drop(self, target: str) -> None:
        pair = self._groups.pop(target, None)
        if pair is not None:
            release_group(pair[1])
        sock = self._connections.pop(target, None)
        if sock is not None:
            sock.close()

    def close(self) -> None:
        for target in list(self._connections):
            self._drop(target)


class Receiver:
    """The receiving half, for one connected source: reads a chunk's layers into the tensors
    given (in the staging arena, or fresh ones)."""

    def __init__(self, sock: socket.socket, host: str, device: torch.device, timeout_s: float) -> None:
        self.sock = sock
        self._host = host
        self._device = device
        self._timeout_s = timeout_s
        self._group: tuple[dist.Store, dist.ProcessGroup] | None = None

    def join(self, join: kv.PairJoin) -> None:
        """Rank 1 of the pair group; blocks until the source (rank 0) is in it too."""
        check_backend(join.backend, self._device)
        store = dist.TCPStore(
            join.store_host,
            join.store_port,
            world_size=2,
            is_master=False,
            timeout=datetime.timedelta(seconds=self._timeout_s),
        )
        group = _process_group(
            join.backend, dist.PrefixStore(join.pair_id, store), 1, self._host, self._timeout_s
        )
        self._group = (store, group)

    @property
    def joined(self) -> bool:
        return self._group is not None

    def close(self) -> None:
        """Let go of the pair group: receives still posted on it end with it."""
        if self._group is not None:
            release_group(self._group[1])
        self._group = None

    def receive(self, header: kv.StageHeader, into: list[torch.Tensor]) -> Callable[[], None] | None:
        """Fill ``into`` (one tensor per layer) with the chunk's data. Over the connection
        (``tcp``) the data is in when this returns (``None``); over a process group the receives
        are posted and the returned function waits until the data is in, so the caller can read
        the next header and post its receives meanwhile. Any failure leaves the connection out of
        step: the caller closes it."""
        if not header.via:
            read_buffers(self.sock, [_bytes_of(tensor) for tensor in into])
            return None
        if self._group is None:
            raise ConnectionError(f"no {header.via} group with this source")
        works = [self._group[1].recv([tensor], 0, tag) for tag, tensor in enumerate(into)]
        return functools.partial(_wait_all, works, self._device, self._timeout_s)
