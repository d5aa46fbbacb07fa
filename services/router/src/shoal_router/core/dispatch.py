"""The router's view of one engine, which dispatch (``scheduling``) weighs.

It joins two sources: the engine's own load report from Redis (every ~100 ms, covering the
requests of every router) and what this router sent it since that report (requests and their
prompt blocks, which the report cannot know yet).
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal_protos.records import EngineRecord, EngineState, LoadReport


@dataclass(slots=True)
class EngineView:
    record: EngineRecord
    report: LoadReport | None = None
    # Requests this router sent since ``report`` was written, and their prompts' KV blocks.
    sent_since_report: int = 0
    pending_blocks: int = 0
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
            self.pending_blocks = 0

    def requests(self) -> int:
        """Requests the engine holds as this router sees them: the report's running and waiting
        plus those sent since. This router's in-flight count is a floor: the report may predate
        requests it still runs there."""
        report = self.report
        reported = 0 if report is None else report.num_running + report.num_waiting
        return max(reported + self.sent_since_report, self.inflight)
