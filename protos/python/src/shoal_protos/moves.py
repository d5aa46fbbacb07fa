"""Why a live migration ended: one code per cause, each belonging to one outcome.

Engines set the code on ``MigrationResult.code`` and in their migration records, and count
moves by it (``shoal_engine_migrations_total{code=...}``); routers, the operator's drains and
the tests read it instead of the free text in ``detail``, which is for people."""

from __future__ import annotations

from enum import StrEnum

from shoal_protos import engine_control_pb2 as pb


class MoveCode(StrEnum):
    MOVED = "moved"
    """The request runs on the target, its KV copied."""

    # GONE: there was nothing (any more) to move.
    NO_CANDIDATE = "no_candidate"
    """The engine was left to choose and no running request is worth moving."""
    ALREADY_MOVING = "already_moving"
    """Another move of the same request is under way."""
    NOT_RUNNING = "not_running"
    """The request is not running on this engine (finished, aborted, or moved already)."""
    FINISHED_FIRST = "finished_first"
    """The request finished or was aborted while it was being moved."""

    # REFUSED: the move did not start; the request runs on where it was.
    SHARDED = "sharded"
    """Source and target split the KV cache over their vLLM workers differently (tensor or
    pipeline parallel sizes differ): each worker's shard goes to the same rank, so both must
    split it alike."""
    NO_TARGET = "no_target"
    """No other active engine to move to."""
    TARGET_REFUSED = "target_refused"
    """The target declined (its own code, counted on the target, says why)."""
    TARGET_DRAINING = "target_draining"
    """On the target: it is draining itself."""
    LAYOUT_DIFFERS = "layout_differs"
    """On the target: its KV blocks are of another size (another model, dtype or block size)."""
    NO_ROOM = "no_room"
    """On the target: not enough free KV blocks."""

    # FAILED: a step went wrong; the request runs on at the source.
    STEP_TIMEOUT = "step_timeout"
    """A step outlasted ``migration_step_timeout_s``."""
    TARGET_UNREACHABLE = "target_unreachable"
    """The target's control API did not answer (it is left out of target picking for a while)."""
    STEP_FAILED = "step_failed"
    """A step failed otherwise (the KV agent, Redis, the target's commit)."""
    DRAIN_DEADLINE = "drain_deadline"
    """A drain's deadline passed before this request's turn."""

    @property
    def outcome(self) -> pb.Outcome:
        return _OUTCOMES[self]


_OUTCOMES: dict[MoveCode, pb.Outcome] = {
    MoveCode.MOVED: pb.MIGRATED,
    MoveCode.NO_CANDIDATE: pb.GONE,
    MoveCode.ALREADY_MOVING: pb.GONE,
    MoveCode.NOT_RUNNING: pb.GONE,
    MoveCode.FINISHED_FIRST: pb.GONE,
    MoveCode.SHARDED: pb.REFUSED,
    MoveCode.NO_TARGET: pb.REFUSED,
    MoveCode.TARGET_REFUSED: pb.REFUSED,
    MoveCode.TARGET_DRAINING: pb.REFUSED,
    MoveCode.LAYOUT_DIFFERS: pb.REFUSED,
    MoveCode.NO_ROOM: pb.REFUSED,
    MoveCode.STEP_TIMEOUT: pb.FAILED,
    MoveCode.TARGET_UNREACHABLE: pb.FAILED,
    MoveCode.STEP_FAILED: pb.FAILED,
    MoveCode.DRAIN_DEADLINE: pb.FAILED,
}

OUTCOME_NAMES: dict[pb.Outcome, str] = {
    pb.MIGRATED: "MIGRATED",
    pb.REFUSED: "REFUSED",
    pb.FAILED: "FAILED",
    pb.GONE: "GONE",
}
