"""Scale-down by migration: the engines a smaller StatefulSet removes leave first, empty.

A StatefulSet scaled from N to M replicas removes the pods of ordinals M..N-1. Before the
operator lowers ``replicas``, it asks each of those engines to drain for removal (gRPC
``EngineControl.Drain`` with ``leave_rotation``): the engine marks itself DRAINING in Redis, so
routers stop sending it requests, and migrates every running request to the other engines,
within the spec's drain deadline. Only then does the StatefulSet shrink; the pod's SIGTERM finds
an empty engine and it exits at once. (An engine the operator could not reach still drains: its
pod's preStop hook, ``GET /drain`` on the engine, does the same before SIGTERM, within the same
deadline, and SIGTERM itself drains whatever is left.)

If the scale-down is called off before the pods go, each drained engine returns to service by
itself ``rejoin_after_s`` after its drain. Rollouts (``rollout.py``) drain the same way each old
engine the StatefulSet is about to replace.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import grpc

from shoal_operator.children import ENGINE_CONTROL_PORT, Cluster
from shoal_protos import engine_control_pb2 as pb
from shoal_protos import engine_control_pb2_grpc as pb_grpc

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


def leaving(cluster: Cluster, present: int, wanted: int) -> list[str]:
    """Pods a StatefulSet going from ``present`` to ``wanted`` replicas removes (highest first)."""
    return [f"{cluster.name}-engine-{i}" for i in range(present - 1, wanted - 1, -1)]


def control_address(cluster: Cluster, pod: str) -> str:
    """An engine pod's EngineControl address through the engines' headless Service."""
    return f"{pod}.{cluster.name}-engine.{cluster.namespace}.svc:{ENGINE_CONTROL_PORT}"


class Drainer(Protocol):
    async def drain(self, cluster: Cluster, pods: list[str]) -> list[Drained]: ...


class GrpcDrainer:
    """Drains engines over their gRPC control API, all at once, each within the drain deadline."""

    def __init__(
        self, address: Callable[[Cluster, str], str] | None = None, rejoin_after_s: float = REJOIN_AFTER_S
    ) -> None:
        self._address = address or control_address
        self._rejoin_after_s = rejoin_after_s

    async def drain(self, cluster: Cluster, pods: list[str]) -> list[Drained]:
        deadline_s = float(cluster.spec.drain.deadline_seconds)
        return list(await asyncio.gather(*(self._drain_one(cluster, pod, deadline_s) for pod in pods)))

    async def _drain_one(self, cluster: Cluster, pod: str, deadline_s: float) -> Drained:
        request = pb.DrainRequest(
            deadline_s=deadline_s, leave_rotation=True, rejoin_after_s=self._rejoin_after_s
        )
        async with grpc.aio.insecure_channel(self._address(cluster, pod)) as channel:
            try:
                result = await pb_grpc.EngineControlStub(channel).Drain(request, timeout=deadline_s + 15)
            except grpc.aio.AioRpcError as exc:
                logger.warning("cannot drain %s: %s (its own SIGTERM drain remains)", pod, exc.details())
                return Drained(pod, error=exc.details() or exc.code().name)
        logger.info("drained %s: %d moved away, %d left", pod, result.migrated, result.remaining)
        return Drained(pod, migrated=result.migrated, remaining=result.remaining)
