"""Scale-down by migration: the engines chosen to leave (``scale.choose``) go empty.

Before the operator lowers the engine Deployment's ``replicas``, it asks each engine chosen to
leave to drain for removal (gRPC ``EngineControl.Drain`` with ``leave_rotation``, at the pod's
address): the engine marks itself DRAINING in Redis, so routers stop sending it requests, and
migrates every running request to the other engines, within the spec's drain deadline. Only then
does the Deployment shrink, its ReplicaSet deleting the pods marked with the lowest
pod-deletion-cost; the pod's preStop hook and SIGTERM find an empty engine and it exits at once.
(An engine the operator could not reach still drains: its pod's preStop hook, ``/drain`` on the
engine, does the same before SIGTERM, within the same deadline, and SIGTERM itself drains
whatever is left.) Rollouts need no call from here: each old engine's preStop hook drains it.

If the scale-down is called off before the pods go, each drained engine returns to service by
itself ``rejoin_after_s`` after its drain.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Protocol

import grpc

from shoal_operator.children import Cluster
from shoal_operator.scale import Leaving
from shoal_protos import engine_control_pb2 as pb
from shoal_protos import engine_control_pb2_grpc as pb_grpc
from shoal_protos.tls import FleetTls, aio_channel

logger = logging.getLogger(__name__)
REJOIN_AFTER_S = 300.0
"""How long a drained engine waits for its removal before it serves again."""


@dataclass(frozen=True)
class Drained:
    """One engine's drain: requests moved away, and those left (or why it failed)."""

    pod: str
    migrated: int = 0
    remaining: int = 0
    error: str = ""


class Drainer(Protocol):
    async def drain(
        self, cluster: Cluster, engines: list[Leaving], tls: FleetTls | None = None
    ) -> list[Drained]: ...


class GrpcDrainer:
    """Drains engines over their gRPC control API, all at once, each within the drain deadline."""

    def __init__(self, rejoin_after_s: float = REJOIN_AFTER_S) -> None:
        self._rejoin_after_s = rejoin_after_s

    async def drain(
        self, cluster: Cluster, engines: list[Leaving], tls: FleetTls | None = None
    ) -> list[Drained]:
        """``tls``: the fleet's TLS files (its Secret), which the engines ask of callers."""
        deadline_s = float(cluster.spec.drain.deadline_seconds)
        drains = (self._drain_one(engine, deadline_s, tls) for engine in engines)
        return list(await asyncio.gather(*drains))

    async def _drain_one(self, engine: Leaving, deadline_s: float, tls: FleetTls | None) -> Drained:
        if not engine.address:
            return Drained(engine.pod)  # no address yet: the pod never started an engine
        request = pb.DrainRequest(
            deadline_s=deadline_s, leave_rotation=True, rejoin_after_s=self._rejoin_after_s
        )
        async with aio_channel(engine.address, tls) as channel:
            try:
                result = await pb_grpc.EngineControlStub(channel).Drain(request, timeout=deadline_s + 15)
            except grpc.aio.AioRpcError as exc:
                logger.warning("cannot drain %s: %s (its preStop drain remains)", engine.pod, exc.details())
                return Drained(engine.pod, error=exc.details() or exc.code().name)
        logger.info("drained %s: %d moved away, %d left", engine.pod, result.migrated, result.remaining)
        return Drained(engine.pod, migrated=result.migrated, remaining=result.remaining)
