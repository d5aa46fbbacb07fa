"""Dispatch: pick the engine for a new request.

The router's view of an engine joins two sources: the engine's own load report from Redis
(every ~100 ms, covering the requests of every router) and this router's count of requests it
sent since that report (which the report cannot know yet). The least-loaded engine is the one
with the fewest requests by that sum; KV blocks in use break ties, then chance, so equal engines
share the load instead of the first one taking every request.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from shoal_protos.records import EngineRecord, EngineState, LoadReport

LEAST_LOAD = "least_load"
"""The dispatch policy's name in metrics."""


@dataclass(slots=True)
class EngineView:
    record: EngineRecord
    report: LoadReport | None = None
    # Requests this router sent since ``report`` was written.
    sent_since_report: int = 0
    # Requests of this router running there now.
    inflight: int = 0
    # Whether this router's ZeroMQ link to the engine is up.
    connected: bool = True

    @property
    def engine_id(self) -> str:
        return self.record.engine_id

    @property
    def dispatchable(self) -> bool:
        return self.record.state == EngineState.ACTIVE and self.connected

    @property
    def state(self) -> str:
        """The engine's registered state, or UNREACHABLE while this router's link to it is down."""
        return str(self.record.state) if self.connected else "UNREACHABLE"

    @property
    def kv_usage(self) -> float:
        """KV blocks in use over all blocks, as the last load report says (0 without one)."""
        if self.report is None:
            return 0.0
        blocks = self.report.kv_blocks_used + self.report.kv_blocks_free
        return self.report.kv_blocks_used / blocks if blocks else 0.0

    def update_report(self, report: LoadReport) -> None:
        if self.report is None or report.seq != self.report.seq:
            self.report = report
            self.sent_since_report = 0

    def load_score(self) -> tuple[int, int]:
        reported = 0
        kv_used = 0
        if self.report is not None:
            reported = self.report.num_running + self.report.num_waiting
            kv_used = self.report.kv_blocks_used
        # Our in-flight count is a floor: the report may predate requests we still run there.
        return max(reported + self.sent_since_report, self.inflight), kv_used


def pick_least_loaded(candidates: list[EngineView], rng: random.Random | None = None) -> EngineView | None:
    """The dispatchable engine with the lowest load score, ties broken at random."""
    live = [view for view in candidates if view.dispatchable]
    if not live:
        return None
    best = min(view.load_score() for view in live)
    tied = [view for view in live if view.load_score() == best]
    return (rng or random).choice(tied)
