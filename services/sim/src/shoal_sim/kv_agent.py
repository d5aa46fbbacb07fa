"""The simulated engine's KV agent: the migration protocol's KV moves, timed, with no bytes.

A ``--backend sim --migration`` engine runs this in place of the KV agent that lives in vLLM's
worker (``agent.py``). It answers the same control commands on the same socket, so the engine's
``MigrationManager`` drives a move exactly as it does between vLLM engines (prepare, pre-copy
stages while the request decodes, stop, last blocks, commit, ownership switch), and the router
and its balancing policy see the same records and pieces:

* ``SendBlocks`` takes the request's KV as the simulated batch has it (every token computed so
  far: the context less the last sampled token), sleeps for ``blocks x bytes_per_block /
  bandwidth`` (divided by the engine's ``--sim-speed``, like its steps; paced when the command
  says so), then tells the target's agent how many blocks of the migration arrived;
* the target's data thread counts staged blocks per migration; the commit's request is
  admitted with its KV (no prefill) when its blocks were staged, else computed again, and
  ``FreeStaging`` or an admission clears them.

Blocks are ``SimConfig.kv_bytes_per_token x block_size`` bytes, the model's real KV size, so a
move's bytes, stages and stall are those the real protocol would have at ``kv_gbps``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import msgspec
import zmq

from shoal_protos import kv
from shoal_protos.addresses import zmq_bind, zmq_connect

if TYPE_CHECKING:
    from shoal_sim.engine import SimulatedBackend

logger = logging.getLogger(__name__)


class SimStaging:
    """Blocks staged per migration on the target, shared by the agent's data thread and the
    simulated backend that admits the migrated request."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blocks: dict[str, int] = {}

    def add(self, migration_id: str, blocks: int) -> None:
        with self._lock:
            self._blocks[migration_id] = self._blocks.get(migration_id, 0) + blocks

    def blocks(self, migration_id: str) -> int:
        """The blocks staged for a migration so far."""
        with self._lock:
            return self._blocks.get(migration_id, 0)

    def take(self, migration_id: str) -> int:
        """The blocks staged for a migration, forgotten from now on."""
        with self._lock:
            return self._blocks.pop(migration_id, 0)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._blocks)


class SimKvAgent:
    """Control (REP at ``control_address``) and data (PULL at ``data_address``) threads."""

    def __init__(
        self,
        backend: SimulatedBackend,
        control_address: str,
        data_address: str,
        block_size: int,
        bytes_per_block: int,
        bytes_per_s: float,
    ) -> None:
        self._backend = backend
        self._staging = backend.staging
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self._bytes_per_s = bytes_per_s
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._control = self._ctx.socket(zmq.REP)
        zmq_bind(self._control, control_address)
        self._data = self._ctx.socket(zmq.PULL)
        zmq_bind(self._data, data_address)
        self._peers: dict[str, zmq.Socket[bytes]] = {}  # touched by the control thread only
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._serve_control, name="shoal-sim-kv-control", daemon=True),
            threading.Thread(target=self._serve_data, name="shoal-sim-kv-data", daemon=True),
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=2)
        self._ctx.destroy(linger=0)

    # ---- control ------------------------------------------------------------------------------

    def _serve_control(self) -> None:
        poller = zmq.Poller()
        poller.register(self._control, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            raw = self._control.recv()
            try:
                reply = self._handle(kv.agent_command_decoder.decode(raw))
            except Exception as exc:  # the engine service gets the error, the thread goes on
                logger.exception("simulated KV agent command failed")
                reply = kv.AgentError(message=f"{type(exc).__name__}: {exc}")
            self._control.send(kv.encoder.encode(reply))
        for sock in self._peers.values():
            sock.close(linger=0)
        self._control.close(linger=0)

    def _handle(self, command: kv.AgentCommand) -> kv.AgentReply:
        if isinstance(command, kv.SendBlocks):
            try:
                return self._send_blocks(command)
            finally:
                if command.release:
                    self._backend.release(command.request_id)
        if isinstance(command, kv.Connect):
            self._peer(command.target)
            return None
        if isinstance(command, kv.Hold):
            self._backend.hold(command.request_id)
            return None
        if isinstance(command, kv.Release):
            self._backend.release(command.request_id)
            return None
        if isinstance(command, kv.FreeStaging):
            self._staging.take(command.migration_id)
            return None
        if isinstance(command, kv.ReadSteps):
            return kv.steps_since(list(self._backend.step_ends), command.since)
        if isinstance(command, kv.AgentStatus):
            staged = self._staging.snapshot()
            return kv.Status(
                block_size=self.block_size,
                num_layers=0,
                bytes_per_block=self.bytes_per_block,
                staging_areas=staged,
                staged_bytes=sum(staged.values()) * self.bytes_per_block,
                tracked_requests=0,
            )
        return kv.AgentError(
            message=f"the simulated engine holds no KV bytes to read ({type(command).__name__})"
        )

    def _send_blocks(self, command: kv.SendBlocks) -> kv.AgentReply:
        started = time.perf_counter()
        written = self._backend.tokens_written(command.request_id)
        preempted = self._backend.times_preempted(command.request_id)
        if not written:
            # Not computed yet (it waits for a batch slot): the target computes it all.
            return kv.SentBlocks(
                next_block=command.first_block, blocks=0, bytes=0, seconds=0.0, tokens_written=0
            )
        blocks = -(-written // self.block_size) if command.partial else written // self.block_size
        count = max(0, min(blocks, command.first_block + command.max_blocks) - command.first_block)
        # The real agent's pacing: at most the byte rate, sending for at most the share of the
        # time, and a paced send stops once ``max_seconds`` have passed.
        rate = min(self._bytes_per_s, command.max_bytes_per_s or self._bytes_per_s)
        if command.max_busy_share:
            rate = min(rate, self._bytes_per_s * command.max_busy_share)
        if command.max_seconds and rate < self._bytes_per_s:
            count = min(count, max(1, int(command.max_seconds * rate) // self.bytes_per_block))
        nbytes = count * self.bytes_per_block
        if count:
            time.sleep(nbytes / rate)
        if self._backend.times_preempted(command.request_id) != preempted:
            # As the real agent: the batch took the blocks back during the send, so none of
            # them is staged (the target counts staged blocks; they go again later).
            return kv.lost_send(command, nbytes, time.perf_counter() - started)
        if count:
            header = kv.StageHeader(
                migration_id=command.migration_id,
                first_block=command.first_block,
                num_blocks=count,
                bytes_per_block=self.bytes_per_block,
            )
            self._peer(command.target).send(kv.encoder.encode(header))
        return kv.SentBlocks(
            next_block=command.first_block + count,
            blocks=count,
            bytes=nbytes,
            seconds=time.perf_counter() - started,
            tokens_written=written,
        )

    def _peer(self, address: str) -> zmq.Socket[bytes]:
        sock = self._peers.get(address)
        if sock is None:
            sock = self._peers[address] = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            zmq_connect(sock, address)
        return sock

    # ---- data ---------------------------------------------------------------------------------

    def _serve_data(self) -> None:
        poller = zmq.Poller()
        poller.register(self._data, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            raw = self._data.recv()
            try:
                message = kv.data_message_decoder.decode(raw)
            except msgspec.DecodeError:
                message = None
            if isinstance(message, kv.StageHeader):
                self._staging.add(message.migration_id, message.num_blocks)
            else:
                logger.warning("simulated KV agent: dropping an unexpected data message")
        self._data.close(linger=0)
