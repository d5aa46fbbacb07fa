"""How KV bytes travel from one engine's agent to another's.

``KvTransport.send`` gathers a request's blocks, chunk by chunk, into reused buffers and delivers
them into the target agent's staging area, returning once every chunk is acknowledged.

* ``tcp``: ZeroMQ over TCP (the CPU default). One long-lived DEALER socket per target agent;
  chunks are sent zero-copy from two alternating buffers (a buffer is refilled only after ZeroMQ
  has let go of it), all chunks of a call are in flight at once, then the acks are collected.
* ``gloo`` and ``nccl`` (torch.distributed process groups per engine pair) are not built yet:
  asking for them raises, so a misconfigured fleet fails at start rather than mid-migration.
"""

from __future__ import annotations

from typing import Protocol

import torch
import zmq

from shoal_protos import kv


class TransportError(Exception):
    """A transfer failed or timed out; the migration it served is abandoned."""


class KvTransport(Protocol):
    def send(
        self,
        target: str,
        migration_id: str,
        first_block: int,
        block_ids: list[int],
        layers: list[torch.Tensor],
        bytes_per_layer_block: int,
    ) -> int:
        """Deliver blocks ``block_ids`` (block indices ``first_block...`` of the request) into
        ``target``'s staging area ``migration_id``; returns the bytes sent."""
        ...

    def close(self) -> None: ...


class TcpTransport:
    def __init__(
        self, ctx: zmq.Context[zmq.Socket[bytes]], chunk_bytes: int, timeout_s: float = 30.0
    ) -> None:
        self._ctx = ctx
        self._chunk_bytes = chunk_bytes
        self._timeout_ms = int(timeout_s * 1000)
        self._sockets: dict[str, zmq.Socket[bytes]] = {}
        self._buffers = [torch.empty(chunk_bytes, dtype=torch.uint8) for _ in range(2)]
        self._trackers: list[zmq.MessageTracker | None] = [None, None]

    def _socket(self, target: str) -> zmq.Socket[bytes]:
        sock = self._sockets.get(target)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(target)
            self._sockets[target] = sock
        return sock

    def warm_up(self, target: str) -> None:
        """Open the connection ahead of the first migration to ``target``."""
        self._socket(target)

    def send(
        self,
        target: str,
        migration_id: str,
        first_block: int,
        block_ids: list[int],
        layers: list[torch.Tensor],
        bytes_per_layer_block: int,
    ) -> int:
        sock = self._socket(target)
        num_layers = len(layers)
        per_block = num_layers * bytes_per_layer_block
        step = max(1, self._chunk_bytes // per_block)
        sent = chunks = 0
        for start in range(0, len(block_ids), step):
            ids = block_ids[start : start + step]
            slot = chunks % 2
            tracker = self._trackers[slot]
            if tracker is not None:
                tracker.wait(self._timeout_ms / 1000)
            nbytes = len(ids) * per_block
            buf = self._buffers[slot][:nbytes].view(num_layers, len(ids), bytes_per_layer_block)
            index = torch.tensor(ids, dtype=torch.long)
            for layer, tensor in enumerate(layers):
                torch.index_select(tensor, 0, index, out=buf[layer])
            header = kv.StageHeader(
                migration_id=migration_id,
                first_block=first_block + start,
                num_blocks=len(ids),
                bytes_per_block=per_block,
            )
            self._trackers[slot] = sock.send_multipart(
                [kv.encoder.encode(header), memoryview(buf.numpy()).cast("B")], copy=False, track=True
            )
            sent += nbytes
            chunks += 1
        for _ in range(chunks):
            if not sock.poll(self._timeout_ms):
                self._drop(target)
                raise TransportError(f"no ack from {target} within {self._timeout_ms} ms")
            ack = kv.stage_ack_decoder.decode(sock.recv())
            if ack.error:
                raise TransportError(f"{target} refused a chunk: {ack.error}")
        return sent

    def _drop(self, target: str) -> None:
        sock = self._sockets.pop(target, None)
        if sock is not None:
            sock.close(linger=0)

    def close(self) -> None:
        for target in list(self._sockets):
            self._drop(target)


def make_transport(
    name: str, ctx: zmq.Context[zmq.Socket[bytes]], chunk_bytes: int, timeout_s: float
) -> KvTransport:
    if name == "tcp":
        return TcpTransport(ctx, chunk_bytes, timeout_s)
    if name in ("gloo", "nccl"):
        raise ValueError(f"KV transport {name!r} is not available in this build; use 'tcp'")
    raise ValueError(f"unknown KV transport {name!r} (tcp, gloo, nccl)")
