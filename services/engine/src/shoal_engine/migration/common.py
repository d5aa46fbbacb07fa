"""What every part of a move shares: its errors, its clock, the KV agent's line, and the
arithmetic of its measurements."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
from collections.abc import AsyncIterator
from typing import Protocol

import zmq
import zmq.asyncio

from shoal_engine.backend import EngineTimes
from shoal_protos import engine_control_pb2 as pb
from shoal_protos import kv
from shoal_protos.addresses import zmq_connect
from shoal_protos.moves import MoveCode
from shoal_protos.records import TARGET_PHASES

MIN_TOKENS_LEFT = 16
"""A request the engine picks to move must have this many tokens still to generate (moving one
about to finish costs more than it saves)."""


def sharded(source: tuple[int, int], here: tuple[int, int]) -> str:
    """Why a target refuses a source whose KV cache is split over its workers otherwise
    (``(tensor parallel size, pipeline parallel size)`` of each)."""
    return (
        f"the source splits its KV cache over TP {source[0]} x PP {source[1]} workers, this engine "
        f"over TP {here[0]} x PP {here[1]}: each worker's shard goes to the same rank, so both must "
        "split it alike"
    )


class MigrationError(Exception):
    """A migration step failed; the request stays on (or comes back to) the source."""


class MoveEndedError(Exception):
    """A move ends early with ``code`` (a refusal, or the request gone) and ``detail``."""

    def __init__(self, code: MoveCode, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


class AgentCaller(Protocol):
    """What the migration code needs of its KV agent: one command, one reply."""

    async def call(self, command: kv.AgentCommand) -> kv.AgentReply: ...


class Turns:
    """One holder at a time; those waiting get their turn by priority (lower first), then in the
    order they came."""

    def __init__(self) -> None:
        self._busy = False
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    @contextlib.asynccontextmanager
    async def turn(self, priority: int) -> AsyncIterator[None]:
        if self._busy:
            handed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            heapq.heappush(self._waiting, (priority, next(self._order), handed))
            try:
                await handed
            except asyncio.CancelledError:
                if handed.done() and not handed.cancelled():
                    self._pass_on()  # handed the turn as it was cancelled: the next one takes it
                raise
        else:
            self._busy = True
        try:
            yield
        finally:
            self._pass_on()

    def _pass_on(self) -> None:
        while self._waiting:
            _, _, handed = heapq.heappop(self._waiting)
            if not handed.done():  # not cancelled while it waited
                handed.set_result(None)
                return
        self._busy = False


def call_priority(command: kv.AgentCommand) -> int:
    """Which of the calls waiting for the KV agent goes first. A stopped request waits for its
    last stage and its release (its stream is stalled until the target takes over), so those go
    before the stops (holds) and tails of other moves (their requests still decode), which go
    before pre-copy stages and the rest: with several moves at once, a move's stall is not spent
    behind other moves' sends."""
    if isinstance(command, kv.SendBlocks):
        if command.running:
            return 1
        return 0 if command.partial else 2
    if isinstance(command, kv.Release):
        return 0
    if isinstance(command, kv.Hold):
        return 1
    return 2


class AgentClient:
    """The engine service's line to its KV agent (a REQ socket; one call at a time, the most
    urgent of those waiting next: ``call_priority``)."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, timeout_s: float) -> None:
        self._ctx = ctx
        self._address = address
        self._timeout_s = timeout_s
        self._turns = Turns()
        self._sock: zmq.asyncio.Socket | None = None

    async def call(self, command: kv.AgentCommand) -> kv.AgentReply:
        async with self._turns.turn(call_priority(command)):
            if self._sock is None:
                self._sock = self._ctx.socket(zmq.REQ)
                self._sock.setsockopt(zmq.LINGER, 0)
                zmq_connect(self._sock, self._address)  # type: ignore[arg-type]
            sock = self._sock
            try:
                await sock.send(kv.encoder.encode(command))
                if not await sock.poll(self._timeout_s * 1000):
                    raise MigrationError(f"KV agent did not answer within {self._timeout_s} s")
                reply = kv.agent_reply_decoder.decode(await sock.recv())
            except BaseException:
                # A REQ socket whose reply was not read (timeout, cancellation) is stuck in
                # its send-receive cycle: start over with a new one.
                sock.close(linger=0)
                self._sock = None
                raise
        if isinstance(reply, kv.AgentError):
            raise MigrationError(f"KV agent: {reply.message}")
        return reply

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)


class PhaseClock:
    """Times the parts of a move into ``result.phase_ms``: each ``mark`` ends the part it names,
    which began where the previous part ended (the first, where the move began)."""

    def __init__(self, result: pb.MigrationResult, started: float) -> None:
        self._result = result
        self._last = started

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self._result.phase_ms[phase] = (now - self._last) * 1000
        self._last = now


def count_stage(result: pb.MigrationResult, sent: kv.AgentReply) -> kv.SentBlocks:
    """Add a send's blocks and bytes to the move's totals; the send's reply."""
    assert isinstance(sent, kv.SentBlocks), sent
    result.stages += 1
    result.bytes += sent.bytes
    result.blocks += sent.blocks
    return sent


def mean_step_ms(ends: list[float], start: float, end: float) -> float:
    """The mean time between the steps that ended from ``start`` to ``end`` (seconds, oldest
    first), in ms; 0 when fewer than two did."""
    inside = [t for t in ends if start <= t <= end]
    if len(inside) < 2:
        return 0.0
    return (inside[-1] - inside[0]) / (len(inside) - 1) * 1000


def target_phases_ms(reached: float, engine_times: EngineTimes | None, delivered: float) -> dict[str, float]:
    """The parts of a hand-over on its target (``TARGET_PHASES``), in ms, from when the commit
    reached it, the engine's stamps of the request and when its first token reached the engine
    service (all ``time.monotonic``); empty without the engine's stamps. A stamp out of order
    (clocks read in other processes) counts its part as 0, never negative."""
    if engine_times is None:
        return {}
    marks = (
        reached,
        engine_times.queued,
        engine_times.scheduled,
        engine_times.first_token,
        delivered,
    )
    phases: dict[str, float] = {}
    last = reached
    for phase, mark in zip(TARGET_PHASES, marks[1:], strict=True):
        phases[phase] = max(0.0, mark - last) * 1000
        last = max(last, mark)
    return phases
