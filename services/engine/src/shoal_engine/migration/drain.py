"""Emptying an engine: move every running request away, a few at a time, by a deadline; and,
for an engine about to be removed, leave the rotation first and come back if no shutdown
follows."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from shoal_engine.migration.common import MigrationError
from shoal_engine.migration.peers import Peers
from shoal_engine.serving import EngineService
from shoal_protos import engine_control_pb2 as pb
from shoal_protos.moves import MoveCode

logger = logging.getLogger(__name__)

DRAIN_MOVES_AT_ONCE = 4
"""Moves a drain runs at once: enough to overlap one move's waits with another's copy, few
enough that the source's KV agent and link are not split too thin."""


class Drainer:
    def __init__(
        self,
        service: EngineService,
        migrate: Callable[[str, str, str], Awaitable[pb.MigrationResult]],
        peers: Peers,
    ) -> None:
        self._service = service
        self._migrate = migrate
        self._peers = peers
        # Takes the engine out of the rotation (True) or back in: the engine's main sets it to
        # its Redis record's state and the service's refusal of new requests.
        self.set_draining: Callable[[bool], Awaitable[None]] | None = None
        self._rejoin: asyncio.Task[None] | None = None

    async def drain(self, deadline_s: float) -> pb.DrainResult:
        """Move every running request away, a few at a time, until done or ``deadline_s``."""
        result = pb.DrainResult()
        deadline = time.monotonic() + deadline_s
        limit = asyncio.Semaphore(DRAIN_MOVES_AT_ONCE)
        while time.monotonic() < deadline:
            pending = self._service.request_ids()
            if not pending:
                break
            moves = await asyncio.gather(*(self._move(rid, limit, deadline) for rid in pending))
            result.migrations.extend(moves)
            if not any(m.outcome == pb.MIGRATED for m in moves):
                if not any(self._peers.is_unreachable(m.target_engine_id) for m in moves):
                    break  # nowhere to go: do not spin
                # A target was down (and is now skipped): try the others.
                await asyncio.sleep(0.2)
        result.migrated = sum(1 for m in result.migrations if m.outcome == pb.MIGRATED)
        result.failed = sum(1 for m in result.migrations if m.outcome in (pb.FAILED, pb.REFUSED))
        result.remaining = len(self._service.request_ids())
        return result

    async def _move(self, request_id: str, limit: asyncio.Semaphore, deadline: float) -> pb.MigrationResult:
        async with limit:
            if time.monotonic() > deadline:
                return _failed(request_id, MoveCode.DRAIN_DEADLINE, "drain deadline passed")
            try:
                return await self._migrate(request_id, "", "drain")
            except Exception as exc:
                # One move's surprise must not cut the drain short: the others go on, and the
                # engine still unregisters after it.
                logger.exception("drain: moving %s failed", request_id)
                return _failed(request_id, MoveCode.STEP_FAILED, repr(exc))

    async def drain_for_removal(self, deadline_s: float, rejoin_after_s: float) -> pb.DrainResult:
        """Leave the rotation, then move every running request away (an engine about to be
        removed). Unless ``rejoin_after_s`` is 0, serve again if no shutdown followed by then."""
        if self.set_draining is None:
            raise MigrationError("this engine cannot leave the rotation")
        self.stop_rejoining()
        await self.set_draining(True)
        logger.info("leaving the rotation: draining for removal (deadline %.0f s)", deadline_s)
        result = await self.drain(deadline_s)
        if rejoin_after_s > 0:
            self._rejoin = asyncio.create_task(self._rejoin_after(rejoin_after_s), name="rejoin")
        return result

    async def _rejoin_after(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        if self.set_draining is not None:
            logger.warning("drained for removal %.0f s ago and still running: serving again", delay_s)
            await self.set_draining(False)

    def stop_rejoining(self) -> None:
        """The engine is stopping (or draining again): a pending return to service is off."""
        if self._rejoin is not None:
            self._rejoin.cancel()
            self._rejoin = None


def _failed(request_id: str, code: MoveCode, detail: str) -> pb.MigrationResult:
    return pb.MigrationResult(request_id=request_id, outcome=code.outcome, detail=detail, code=code.value)
