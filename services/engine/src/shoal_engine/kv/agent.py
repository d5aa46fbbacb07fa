"""The KV agent: lives in vLLM's worker process, next to the KV cache, on two threads of its own.

The connector (``shoal_engine.kv.connector``) hands it the KV tensors once and, every engine
step, the block tables of the requests the scheduler ran; the agent keeps, per request, its
block ids and how many tokens of KV have been written. Two threads serve the rest:

* **control** (ZeroMQ REP, for the engine service on the same machine): ``SendBlocks`` pushes a
  request's blocks, straight from the KV cache, to another engine's agent through the transport
  (``shoal_engine.kv.transport``); ``Connect`` opens that link ahead of time; ``Hold``,
  ``Release``, ``FreeStaging``, ``ReadBlocks``, ``ReadStaged``, ``AgentStatus``.
* **data** (a stream socket for other agents, one thread per connected source;
  ``shoal_engine.kv.data_server``): receives staged chunks into the staging arena, keyed by
  migration id, until the request arrives and ``inject`` copies them into the blocks vLLM gave
  it. A staging area nobody claims is freed after ``staging_ttl_s``.

Full blocks never change once written, so they are read while the model keeps decoding; the
engine step only ever writes a request's last, partial block, past the tokens already written.
So a stopped request's blocks go over at once, without waiting for vLLM to take in the stop:
the one step it may still run writes past what is sent. What can change blocks under a send is a
preemption (vLLM frees the blocks and may hand them to another request in the same step): the
connector reports preemptions, and a send during which its request was preempted or given a new
table counts for nothing (a pre-copy stage says so and is sent again; the send after the stop
fails) instead of delivering bytes that may have been overwritten.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import msgspec
import torch
import zmq

from shoal_engine.kv.data_server import DATA_IDLE_S, DataServer, Staged
from shoal_engine.kv.transport import KvTransport, Transport, host_of, runs
from shoal_protos import kv
from shoal_protos.addresses import zmq_bind
from shoal_protos.tls import FleetTls

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Table:
    vllm_id: str
    block_ids: list[int] = field(default_factory=list)
    tokens_written: int = 0
    # vLLM finished the request but keeps its blocks until we say the send is over.
    stopped: bool = False
    # Bumped when vLLM preempts the request (its blocks are freed and may be reused at once).
    epoch: int = 0


@dataclass(frozen=True, slots=True)
class TableUpdate:
    request_id: str
    vllm_id: str
    block_ids: list[int]
    # True: ``block_ids`` is the whole table (new or resumed request); False: appended blocks.
    replace: bool
    tokens_after_step: int


@dataclass(frozen=True, slots=True)
class Load:
    request_id: str
    migration_id: str
    first_block: int
    # The request's block ids for blocks first_block, first_block + 1, ...
    block_ids: list[int]
    # Leave the staged blocks staged: a warm-up load, the commit's load comes later.
    keep: bool = False


class KvAgent:
    def __init__(
        self,
        kv_caches: dict[str, torch.Tensor],
        num_blocks: int,
        block_size: int,
        control_address: str,
        data_address: str,
        transport: str = "tcp",
        chunk_bytes: int = 8 << 20,
        staging_ttl_s: float = 60.0,
        timeout_s: float = 10.0,
        staging_bytes: int = 1 << 30,
        host: str | None = None,
        max_pairs: int = 4,
        debug_reads: bool = False,
        idle_timeout_s: float = DATA_IDLE_S,
        tls: FleetTls | None = None,
    ) -> None:
        """``host``: where other engines reach this agent, for the rendezvous of ``gloo`` and
        ``nccl`` pairs; None: the data address's host (which a bind to ``::`` does not name).
        ``debug_reads``: serve ``ReadBlocks`` and ``ReadStaged``, which hand out KV bytes for
        tests to compare (an engine serves them only when told, ``--kv-debug-reads``).
        ``tls``: the fleet's TLS, for the data connections both ways; None: plain."""
        self.block_size = block_size
        self._debug_reads = debug_reads
        self._layers = _kv_layers(kv_caches, num_blocks)
        self.num_layers = len(self._layers)
        self.bytes_per_layer_block = self._layers[0].shape[1]
        self.bytes_per_block = self.num_layers * self.bytes_per_layer_block
        self._chunk_blocks = max(1, chunk_bytes // self.bytes_per_block)
        self._lock = threading.Lock()
        self._tables: dict[str, _Table] = {}
        self._load_errors: set[int] = set()
        # Requests to keep when they stop (request id -> hold deadline), and vLLM ids whose
        # held blocks may be freed now.
        self._holds: dict[str, float] = {}
        self._released: set[str] = set()
        # When each of the last forward passes ended (``time.monotonic``): a move reads the
        # source's pace from them, before it and while it ran.
        self._step_ends: deque[float] = deque(maxlen=kv.STEPS_KEPT)
        self._host = host or host_of(data_address)
        self._transport: KvTransport = Transport(
            transport,
            self._host,
            self._layers[0].device,
            self._chunk_blocks * self.bytes_per_block,
            timeout_s,
            max_pairs,
            tls.client_context() if tls is not None else None,
        )
        self._stop = threading.Event()
        self._ctx = zmq.Context(io_threads=1)
        self._control = self._ctx.socket(zmq.REP)
        zmq_bind(self._control, control_address)
        # The data side shares the lock: it guards the staging areas beside the tables.
        self._data = DataServer(
            data_address,
            self._layers,
            self._lock,
            self._stop,
            self._host,
            staging_bytes,
            staging_ttl_s,
            timeout_s,
            idle_timeout_s,
            max_pairs,
            tls.server_context() if tls is not None else None,
        )
        self._threads = self._start(control_address, data_address, transport)

    def _start(self, control_address: str, data_address: str, transport: str) -> list[threading.Thread]:
        """Start the control and data threads."""
        threads = [
            threading.Thread(target=self._serve_control, name="shoal-kv-control", daemon=True),
            threading.Thread(target=self._data.serve, name="shoal-kv-data", daemon=True),
        ]
        for thread in threads:
            thread.start()
        logger.info(
            "KV agent: %d layers, %d bytes per block, control %s, data %s, transport %s",
            self.num_layers,
            self.bytes_per_block,
            control_address,
            data_address,
            transport,
        )
        return threads

    # ---- called by the connector on the worker's main thread ------------------------------

    def update_tables(
        self,
        updates: list[TableUpdate],
        finished: list[str],
        preempted: list[str] | None = None,
        kept: list[str] | None = None,
    ) -> None:
        """One step's block tables. ``finished``: Shoal ids of requests vLLM finished; ``kept``:
        the vLLM ids among them whose blocks vLLM keeps until ``finished_sending`` names them
        (aborted requests). A held request that finished otherwise (its last token came before
        the stop) has no blocks left to release: vLLM freed them, and naming it would be an error
        there."""
        with self._lock:
            for request_id in preempted or ():
                table = self._tables.get(request_id)
                if table is not None:
                    # Its blocks are free now; it starts over with a new table when it resumes.
                    table.block_ids, table.tokens_written = [], 0
                    table.epoch += 1
            # Finished first: a request that left and came back in one step has a new table.
            kept_ids = set(kept or ())
            for request_id in finished:
                table = self._tables.get(request_id)
                if table is not None and request_id in self._holds and table.vllm_id in kept_ids:
                    table.stopped = True  # vLLM keeps its blocks until we release them
                else:
                    self._tables.pop(request_id, None)
            for update in updates:
                table = self._tables.get(update.request_id)
                if table is None or update.replace or table.stopped:
                    table = self._tables[update.request_id] = _Table(update.vllm_id, list(update.block_ids))
                else:
                    table.block_ids.extend(update.block_ids)

    def step_done(self, updates: list[TableUpdate]) -> None:
        """The forward pass wrote the KV of the tokens each update scheduled."""
        self._step_ends.append(time.monotonic())
        with self._lock:
            for update in updates:
                table = self._tables.get(update.request_id)
                if table is not None:
                    table.tokens_written = max(table.tokens_written, update.tokens_after_step)

    def inject(self, load: Load) -> int:
        """Copy staged blocks of ``load.migration_id`` into the request's blocks; returns the
        number of blocks loaded. Blocks with no staged data are reported as load errors. The
        staging area is freed after, unless ``load.keep`` (a warm-up: the commit's load follows;
        the copy then runs under the lock, so that a cancel cannot free the area under it)."""
        started = time.perf_counter()
        if load.keep:
            with self._lock:
                done, missing = self._inject(load, self._data.staging.get(load.migration_id))
        else:
            with self._lock:
                staged = self._data.staging.pop(load.migration_id, None)
            try:
                done, missing = self._inject(load, staged)
            finally:
                if staged is not None:
                    self._data.give_back(staged)
        if missing:
            logger.warning(
                "migration %s: %d of %d blocks were not staged; vLLM recomputes them",
                load.migration_id,
                len(missing),
                len(load.block_ids),
            )
            with self._lock:
                self._load_errors.update(missing)
        logger.info(
            "migration %s: injected %d blocks in %.1f ms",
            load.migration_id,
            done,
            (time.perf_counter() - started) * 1000,
        )
        return done

    def _inject(self, load: Load, staged: Staged | None) -> tuple[int, list[int]]:
        """Blocks copied, and the block ids of those with nothing staged."""
        wanted = range(load.first_block, load.first_block + len(load.block_ids))
        done: set[int] = set()
        if staged is not None:
            for first, (count, data) in sorted(staged.chunks.items()):
                picks = [b for b in range(first, first + count) if b in wanted and b not in done]
                if not picks:
                    continue
                # Plain slice copies over runs where both sides' blocks are consecutive (vLLM
                # mostly hands out runs): several times faster than index_select + index_copy_.
                for src, dst, n in runs([(b - first, load.block_ids[b - load.first_block]) for b in picks]):
                    for tensor, staged_layer in zip(self._layers, data, strict=True):
                        tensor[dst : dst + n].copy_(staged_layer[src : src + n])
                done.update(picks)
        missing = [load.block_ids[b - load.first_block] for b in wanted if b not in done]
        return len(done), missing

    def finished_sending(self, delayed: list[str]) -> set[str]:
        """vLLM ids whose blocks vLLM may free now: of the requests it finished with their
        blocks kept (``delayed``), those not held for a migration, plus held ones released
        (or whose hold ran out)."""
        now = time.monotonic()
        with self._lock:
            held_vllm_ids = {t.vllm_id for rid, t in self._tables.items() if rid in self._holds}
            done = {vllm_id for vllm_id in delayed if vllm_id not in held_vllm_ids}
            for request_id in [rid for rid, deadline in self._holds.items() if deadline < now]:
                logger.warning("hold on %s ran out; its blocks are freed", request_id)
                self._release_locked(request_id)
            done |= self._released
            self._released = set()
        return done

    def _release_locked(self, request_id: str) -> None:
        self._holds.pop(request_id, None)
        table = self._tables.get(request_id)
        if table is not None and table.stopped:
            del self._tables[request_id]
            self._released.add(table.vllm_id)

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def free_staging(self, migration_id: str) -> None:
        """Drop a migration's staging area, and any chunk of it still to come."""
        self._data.free(migration_id)

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=2)
        self._data.shutdown_peers()
        self._transport.close()
        self._ctx.destroy(linger=0)

    # ---- control thread ---------------------------------------------------------------------

    def _serve_control(self) -> None:
        poller = zmq.Poller()
        poller.register(self._control, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(200):
                continue
            raw = self._control.recv()
            try:
                reply = self._handle(kv.agent_command_decoder.decode(raw))
            except msgspec.DecodeError as exc:
                reply = kv.AgentError(message=f"undecodable command: {exc}")
            except Exception as exc:  # the agent must outlive any one bad command
                logger.exception("KV agent command failed")
                reply = kv.AgentError(message=f"{type(exc).__name__}: {exc}")
            self._control.send(kv.encoder.encode(reply))
        self._control.close(linger=0)

    def _handle(self, command: kv.AgentCommand) -> kv.AgentReply:
        if isinstance(command, kv.SendBlocks):
            try:
                return self._send_blocks(command)
            finally:
                if command.release:
                    with self._lock:
                        self._release_locked(command.request_id)
        if isinstance(command, kv.Connect):
            self._transport.connect(command.target)
            return None
        if isinstance(command, kv.Hold):
            with self._lock:
                self._holds[command.request_id] = time.monotonic() + command.hold_s
            return None
        if isinstance(command, kv.Release):
            with self._lock:
                self._release_locked(command.request_id)
            return None
        if isinstance(command, kv.FreeStaging):
            self.free_staging(command.migration_id)
            return None
        if isinstance(command, kv.ReadSteps):
            return kv.steps_since(list(self._step_ends), command.since)
        if isinstance(command, kv.ReadBlocks | kv.ReadStaged) and not self._debug_reads:
            return kv.AgentError(
                message="KV reads are not served here (the engine's --kv-debug-reads is off)"
            )
        if isinstance(command, kv.ReadBlocks):
            with self._lock:
                table = self._tables.get(command.request_id)
                # Only blocks whose KV a finished step wrote (or loaded): a table is known a
                # moment before its first step injects and computes.
                written = -(-table.tokens_written // self.block_size) if table else 0
                last = min(command.first_block + command.num_blocks, written)
                ids = list(table.block_ids[command.first_block : last]) if table else []
            if len(ids) < command.num_blocks:
                return kv.AgentError(message=f"request {command.request_id} has no blocks there")
            data = torch.stack(
                [t.index_select(0, torch.tensor(ids, device=t.device)) for t in self._layers]
            ).permute(1, 0, 2)
            return kv.BlockBytes(first_block=command.first_block, num_blocks=len(ids), data=_host_bytes(data))
        if isinstance(command, kv.ReadStaged):
            with self._lock:
                staged = self._data.staging.get(command.migration_id)
                chunks = sorted(staged.chunks.items()) if staged else []
            if not chunks:
                return kv.AgentError(message=f"nothing staged for {command.migration_id}")
            first = chunks[0][0]
            data = torch.cat([torch.stack(layers, dim=1) for _, (_, layers) in chunks])
            return kv.BlockBytes(first_block=first, num_blocks=data.shape[0], data=_host_bytes(data))
        self._data.expire()
        with self._lock:
            return kv.Status(
                block_size=self.block_size,
                num_layers=self.num_layers,
                bytes_per_block=self.bytes_per_block,
                staging_areas={m: len(s.chunks) for m, s in self._data.staging.items()},
                staged_bytes=sum(s.nbytes for s in self._data.staging.values()),
                tracked_requests=len(self._tables),
                sources=len(self._data.peers),
            )

    def _send_blocks(self, command: kv.SendBlocks) -> kv.AgentReply:
        started = time.perf_counter()
        with self._lock:
            if command.partial and not command.running and command.request_id not in self._holds:
                return kv.AgentError(
                    message=f"request {command.request_id} is not held: its last block is still written"
                )
            table = self._tables.get(command.request_id)
            if table is None:
                # Not scheduled yet (it just arrived, or waits in vLLM's queue): no KV to send;
                # the target computes it all.
                return kv.SentBlocks(
                    next_block=command.first_block, blocks=0, bytes=0, seconds=0.0, tokens_written=0
                )
            written, epoch = table.tokens_written, table.epoch
            # The partly filled last block goes only for a stopped (held) request: the step it
            # may still run writes past ``written``, which the target computes again itself.
            blocks = -(-written // self.block_size) if command.partial else written // self.block_size
            last = min(blocks, len(table.block_ids), command.first_block + command.max_blocks)
            ids = table.block_ids[command.first_block : last]
        if not ids:
            return kv.SentBlocks(
                next_block=command.first_block, blocks=0, bytes=0, seconds=0.0, tokens_written=written
            )
        sent, count = self._paced_send(command, ids)
        with self._lock:
            if self._tables.get(command.request_id) is not table or table.epoch != epoch:
                return kv.lost_send(command, sent, time.perf_counter() - started)
        return kv.SentBlocks(
            next_block=command.first_block + count,
            blocks=count,
            bytes=sent,
            seconds=time.perf_counter() - started,
            tokens_written=written,
        )

    def _paced_send(self, command: kv.SendBlocks, ids: list[int]) -> tuple[int, int]:
        """Send ``ids`` in one transport call, or, paced, chunk by chunk: after each chunk, wait
        until the bytes sent fit ``max_bytes_per_s`` and the time spent sending fits
        ``max_busy_share`` of the time since the first chunk began; stop between chunks once
        ``max_seconds`` have passed. Returns the bytes sent and how many of ``ids`` went."""
        pace, share = command.max_bytes_per_s, command.max_busy_share
        step = self._chunk_blocks if pace or share else max(1, len(ids))
        started, sent, busy = time.monotonic(), 0, 0.0
        for at in range(0, len(ids), step):
            if at and command.max_seconds and time.monotonic() - started >= command.max_seconds:
                return sent, at
            began = time.monotonic()
            sent += self._transport.send(
                command.target,
                command.migration_id,
                command.first_block + at,
                ids[at : at + step],
                self._layers,
            )
            busy += time.monotonic() - began
            if at + step < len(ids):  # no wait after the last chunk
                due = max(sent / pace if pace else 0.0, busy / share if share else 0.0)
                ahead = due - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)
        return sent, len(ids)


def _host_bytes(data: torch.Tensor) -> bytes:
    """A tensor's bytes, copied from the GPU first when it lives there (``.numpy()`` refuses a
    CUDA tensor; ``.cpu()`` of a host tensor is the tensor itself)."""
    return data.contiguous().cpu().numpy().tobytes()


def _kv_layers(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> list[torch.Tensor]:
    """Every layer's KV cache as ``[num_blocks, bytes per block]`` uint8, one layout for all."""
    layers = [_blocks_first(name, t, num_blocks) for name, t in kv_caches.items()]
    shapes = {tuple(t.shape) for t in layers}
    if len(shapes) != 1:
        raise ValueError(f"KV layers differ in shape ({shapes}); migration needs one layout")
    return layers


def _blocks_first(name: str, tensor: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """View one layer's KV cache as ``[num_blocks, bytes per block]`` uint8."""
    dims = [d for d, size in enumerate(tensor.shape) if size == num_blocks]
    if not dims:
        raise ValueError(
            f"layer {name}: no dimension of size {num_blocks} (the block count) in {tuple(tensor.shape)}"
        )
    moved = tensor.movedim(dims[0], 0)
    if not moved.is_contiguous():
        raise ValueError(f"layer {name}: blocks are not contiguous in layout {tuple(tensor.shape)}")
    return moved.view(torch.uint8).reshape(num_blocks, -1)
