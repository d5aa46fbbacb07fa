"""The router's view of one engine, which dispatch (``scheduling``) weighs.

It joins two sources: the engine's own load report from Redis (every ~100 ms, covering the
requests of every router) and what this router sent it that the report does not cover yet
(requests and their prompt blocks). Which sends a report covers, the engine says: it counts the
requests it took in from each router (``LoadReport.received``, by the router's output address),
and this router numbers its sends to the engine, so a report read 90 ms after it was written
leaves the sends of those 90 ms counted. An engine that does not count (or a view that does not
know its router's address, as in the fleet simulation, whose reports are written and read at
the same instant) has every send before the report taken as covered.

How many requests an engine holds (``held``) counts this router's own there as it knows them now
(``inflight``: sent and not ended) and only the other routers' from the report, which says how
many of each router's were live (``LoadReport.live``): a report is as old as its interval and
the router's read, and one written just before a batch of requests ended would otherwise have
the engine look busy, and get nothing, until the next.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Generic, TypeVar, cast, overload

from shoal_protos.records import EngineRecord, EngineState, LoadReport

T = TypeVar("T")

ACTIVE = EngineState.ACTIVE
UNKNOWN_ROOM = 1 << 62
"""``room`` of an engine whose KV size nobody reported yet: room for anything."""
DEFAULT_BLOCK_SIZE = 16
"""Tokens per KV block of an engine whose record does not say (vLLM's default on GPUs)."""
UNREPORTED_FOR_S = 2.0
"""A send no report covered within this long is taken as covered anyway (the engine restarted
at the same address and counts from zero again, say), so it cannot weigh on dispatch for good."""


class _Input(Generic[T]):
    """An input of an ``EngineView``'s derived numbers: setting it computes them again."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._slot = "_" + name

    @overload
    def __get__(self, view: None, owner: type) -> _Input[T]: ...

    @overload
    def __get__(self, view: EngineView, owner: type) -> T: ...

    def __get__(self, view: EngineView | None, owner: type) -> T | _Input[T]:
        return self if view is None else cast(T, getattr(view, self._slot))

    def __set__(self, view: EngineView, value: T) -> None:
        setattr(view, self._slot, value)
        view._derive()


class EngineView:
    """One engine as this router sees it.

    Besides what it is told (``record``, ``report``, ``connected``, and the counts of what this
    router sent), it keeps the numbers dispatch reads on every request, computed again whenever
    one of those changes (a few times per request, against reading them for every engine on
    every request): ``usable`` (ACTIVE and reachable), ``dispatchable`` (usable and not being
    emptied for consolidation), ``held`` (requests, see ``requests``),
    ``room`` (free KV blocks not yet claimed by prompts sent since the report) and ``free``
    (Llumnix's freeness, see ``freeness``).

    Every block count is in the engine's own blocks (``block_size`` tokens each, from its
    record): engines of one fleet may differ (128 tokens on CPUs, 16 or 32 on GPUs), and a
    prompt's demand is counted in the blocks of the engine it is weighed for (``blocks``), and
    engines are compared by ``free_tokens``, their freeness in tokens.
    """

    __slots__ = (
        "_connected", "_emptying", "_inflight", "_pending_blocks", "_record", "_reply_to", "_report",
        "_sends", "_sent", "_sent_since_report", "_silent", "block_size", "dispatchable", "free",
        "free_tokens", "held", "room", "usable",
    )  # fmt: skip

    def __init__(
        self,
        record: EngineRecord,
        report: LoadReport | None = None,
        sent_since_report: int = 0,
        inflight: int = 0,
        connected: bool = True,
        pending_blocks: int = 0,
        emptying: bool = False,
        silent: bool = False,
        reply_to: str = "",
    ) -> None:
        self._record = record
        # This router's output address: its key in the report's ``received`` counts.
        self._reply_to = reply_to
        # This router's sends to the engine no report covered yet: (number, when, blocks).
        self._sends: deque[tuple[int, float, int]] = deque()
        self._sent = 0
        self._report = report
        # Requests this router sent since ``report`` was written, and their prompts' KV blocks.
        self._sent_since_report = sent_since_report
        self._pending_blocks = pending_blocks
        # Requests of this router running there now.
        self._inflight = inflight
        # Whether this router's ZeroMQ link to the engine is up.
        self._connected = connected
        # Whether the balancing leader is emptying it (``Keys.emptying``).
        self._emptying = emptying
        # Whether its record expired (no heartbeat) within the last ``silence_grace_s``: its
        # requests stay, but it gets no new ones (``FleetView``).
        self._silent = silent
        self.usable = self.dispatchable = self.held = self.room = self.block_size = 0
        self.free = self.free_tokens = 0.0
        self._derive()

    def _derive(self) -> None:
        record, report = self._record, self._report
        self.block_size = record.kv_block_size or DEFAULT_BLOCK_SIZE
        self.usable = record.state is ACTIVE and self._connected and not self._silent
        self.dispatchable = self.usable and not self._emptying
        total = record.kv_blocks_total
        if report is None:  # not reported yet: what this router sent is all it knows
            self.held = max(self._sent_since_report, self._inflight)
            self.room = total - self._pending_blocks if total else UNKNOWN_ROOM
            self.free = (total - self._pending_blocks) / (self.held + 1)
            self.free_tokens = self.free * self.block_size
            return
        running, waiting, used = report.num_running, report.num_waiting, report.kv_blocks_used
        live = report.live
        if live is not None and self._reply_to:
            # This router's own requests there are ``_inflight``, exact and current; the report
            # adds the other routers' (see ``LoadReport.live``).
            self.held = max(running + waiting - live.get(self._reply_to, 0), 0) + self._inflight
        else:
            self.held = max(running + waiting + self._sent_since_report, self._inflight)
        self.room = report.kv_blocks_free - self._pending_blocks
        # Llumnix's freeness: blocks left per batch slot once what runs, was sent and waits is
        # counted; a waiting request is taken to need as many blocks as a running one on average.
        # The headroom the engine keeps for its priority requests counts as used (virtual usage).
        queued = waiting * used / running if running else 0.0
        total = total or used + report.kv_blocks_free
        taken = used + report.kv_blocks_reserved + self._pending_blocks + queued
        self.free = (total - taken) / (self.held + 1)
        self.free_tokens = self.free * self.block_size

    record: _Input[EngineRecord] = _Input()
    connected: _Input[bool] = _Input()
    sent_since_report: _Input[int] = _Input()
    pending_blocks: _Input[int] = _Input()
    inflight: _Input[int] = _Input()
    emptying: _Input[bool] = _Input()
    silent: _Input[bool] = _Input()

    @property
    def report(self) -> LoadReport | None:
        return self._report

    def blocks(self, tokens: int) -> int:
        """The KV blocks ``tokens`` tokens take on this engine."""
        return -(-tokens // self.block_size)

    def sent(self, blocks: int, now: float | None = None) -> None:
        """This router sent the engine a request whose prompt takes ``blocks`` KV blocks."""
        self._sent += 1
        self._sends.append((self._sent, time.monotonic() if now is None else now, blocks))
        self._sent_since_report += 1
        self._pending_blocks += blocks
        self._inflight += 1
        self._derive()

    @property
    def engine_id(self) -> str:
        return self._record.engine_id

    @property
    def state(self) -> str:
        """The engine's registered state, UNREACHABLE while this router's link to it is down,
        SILENT while its heartbeat has lapsed (for at most the fleet view's grace), or EMPTYING
        while the balancing leader empties it."""
        if not self._connected:
            return "UNREACHABLE"
        if self._silent:
            return "SILENT"
        if self._emptying and self.usable:
            return "EMPTYING"
        return str(self._record.state)

    @property
    def kv_usage(self) -> float:
        """KV blocks in use over all blocks, as the last load report says (0 without one)."""
        if self._report is None:
            return 0.0
        blocks = self._report.kv_blocks_used + self._report.kv_blocks_free
        return self._report.kv_blocks_used / blocks if blocks else 0.0

    def update_report(self, report: LoadReport, now: float | None = None) -> None:
        """A load report read from Redis; what this router sent that it does not cover stays
        counted (see the module)."""
        if self._report is None or report.seq != self._report.seq:
            self._report = report
            sends = self._sends
            covered = report.received.get(self._reply_to) if self._reply_to else None
            if covered is None:
                sends.clear()
            else:
                stale = (time.monotonic() if now is None else now) - UNREPORTED_FOR_S
                while sends and (sends[0][0] <= covered or sends[0][1] < stale):
                    sends.popleft()
            self._sent_since_report = len(sends)
            self._pending_blocks = sum(blocks for _, _, blocks in sends)
            self._derive()

    def requests(self) -> int:
        """Requests the engine holds as this router sees them: its own there now plus the other
        routers' as the report counts them; from an engine that does not say whose are whose,
        the report's running and waiting plus those sent since (this router's in-flight count a
        floor: the report may predate requests it still runs there)."""
        return self.held
