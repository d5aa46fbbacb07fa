"""Balancing migrations: one router at a time moves requests from crowded engines to free ones.

Dispatch places each request once; load drifts afterwards (outputs grow, requests end). Like
Llumnix, Shoal then moves running requests, KV and all, from the engine with the least
freeness to the one with the most (freeness: ``EngineView.free``, KV blocks left per batch
slot), so no engine preempts while another idles.

* **One leader.** Every router with ``--balance`` competes for a lease in Redis
  (``Keys.leader``, set if absent with a TTL, renewed by its holder); only the holder issues
  migrations, so two routers never move the same load twice. A leader that dies stops renewing
  and another router takes over when the lease expires.
* **Policy.** Every ``interval_s`` the leader ranks the ACTIVE engines of each model by their
  freeness as a fraction of their KV cache, and pairs the least free with the most free, the
  second least with the second most, and so on. When a pair's lead passes ``threshold`` on
  ``patience`` checks in a row, and its crowded engine runs at least two requests (moving a
  lone request only moves the load), the leader asks the crowded engine to move one request
  there (``Migrate`` with no request id: the engine picks the one
  with the least KV to copy) with reason ``balance``.
* **Hysteresis.** Both engines of a balancing move are left alone for ``cooldown_s`` after it
  ends (their reports must catch up first; no ping-pong), and at most ``max_concurrent`` moves
  run at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import grpc
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shoal_protos import engine_control_pb2 as pb
from shoal_protos import engine_control_pb2_grpc as pb_grpc
from shoal_router.core.dispatch import EngineView
from shoal_router.metrics import RouterMetrics

logger = logging.getLogger(__name__)

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class Lease:
    """A lease in Redis held by one holder at a time: taken when absent, renewed only by its
    holder, gone when the holder stops renewing for ``ttl_s``."""

    def __init__(self, client: aioredis.Redis, key: str, holder: str, ttl_s: float) -> None:
        self._client = client
        self._key = key
        self._holder = holder
        self._ttl_ms = int(ttl_s * 1000)
        self.held = False

    async def hold(self) -> bool:
        """Renew the lease if this holder has it, else take it if it is free; whether this
        holder has it now (False, too, when Redis cannot be reached)."""
        try:
            if self.held:
                self.held = bool(await self._client.eval(_RENEW, 1, self._key, self._holder, self._ttl_ms))
            if not self.held:
                self.held = bool(await self._client.set(self._key, self._holder, nx=True, px=self._ttl_ms))
        except (RedisError, OSError) as exc:
            logger.warning("cannot reach Redis for the balancing lease: %s", exc)
            self.held = False
        return self.held

    async def release(self) -> None:
        if self.held:
            self.held = False
            try:
                await self._client.eval(_RELEASE, 1, self._key, self._holder)
            except (RedisError, OSError):
                pass  # it expires by itself


@dataclass(frozen=True)
class BalancePolicy:
    threshold: float = 0.1
    """Lead in freeness (a fraction of the KV cache per batch slot) that calls for a move."""
    patience: int = 2
    """Checks in a row the lead must last."""
    cooldown_s: float = 5.0
    """An engine that took part in a move is left alone this long after it."""
    max_concurrent: int = 2
    """Balancing moves running at once."""


def relative_freeness(view: EngineView) -> float:
    """Freeness as a fraction of the engine's KV cache, so engines of any size compare."""
    total = view.record.kv_blocks_total or 1
    return view.free / total


@dataclass
class Balancer:
    """Decides the balancing moves (no IO): ``decide`` is called once per check."""

    policy: BalancePolicy = field(default_factory=BalancePolicy)
    _streak: dict[tuple[str, str], int] = field(default_factory=dict)
    _resting_until: dict[str, float] = field(default_factory=dict)
    in_flight: int = 0

    def decide(self, views: Iterable[EngineView], now: float) -> list[tuple[EngineView, EngineView]]:
        """The (source, target) moves to start now. Within each model the least free engine is
        paired with the most free, the second least with the second most, and so on while the
        lead passes the threshold, as far as ``max_concurrent`` allows."""
        by_model: dict[str, list[EngineView]] = {}
        for view in views:
            if view.usable and view.report is not None and view.record.control_address:
                by_model.setdefault(view.record.model, []).append(view)
        moves: list[tuple[EngineView, EngineView]] = []
        streaks: dict[tuple[str, str], int] = {}
        for engines in by_model.values():
            awake = [v for v in engines if self._resting_until.get(v.engine_id, 0.0) <= now]
            ranked = sorted(awake, key=relative_freeness)
            low, high = 0, len(ranked) - 1
            while low < high and self.in_flight + len(moves) < self.policy.max_concurrent:
                source, target = ranked[low], ranked[high]
                if relative_freeness(target) - relative_freeness(source) <= self.policy.threshold:
                    break
                assert source.report is not None
                low += 1
                if source.report.num_running < 2:
                    continue  # moving a lone request only moves the load
                high -= 1
                pair = (source.engine_id, target.engine_id)
                streaks[pair] = self._streak.get(pair, 0) + 1
                if streaks[pair] >= self.policy.patience:
                    moves.append((source, target))
                    streaks.pop(pair)
        self._streak = streaks
        return moves

    def started(self, source: EngineView, target: EngineView) -> None:
        self.in_flight += 1
        for view in (source, target):
            self._resting_until[view.engine_id] = float("inf")  # until the move ends

    def ended(self, source: EngineView, target: EngineView, now: float) -> None:
        self.in_flight -= 1
        for view in (source, target):
            self._resting_until[view.engine_id] = now + self.policy.cooldown_s


class Rebalancer:
    """Runs the policy as the cluster's leader: holds the lease, checks every ``interval_s``,
    and calls the crowded engine's ``Migrate``."""

    def __init__(
        self,
        lease: Lease,
        views: Callable[[], Iterable[EngineView]],
        metrics: RouterMetrics,
        policy: BalancePolicy | None = None,
        interval_s: float = 1.0,
        timeout_s: float = 60.0,
    ) -> None:
        self._lease = lease
        self._views = views
        self._metrics = metrics
        self.balancer = Balancer(policy or BalancePolicy())
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def run_forever(self) -> None:
        try:
            while True:
                leader = await self._lease.hold()
                self._metrics.leader.set(1 if leader else 0)
                if leader:
                    for source, target in self.balancer.decide(self._views(), time.monotonic()):
                        self.balancer.started(source, target)
                        task = asyncio.create_task(self._move(source, target), name="balance-move")
                        self._tasks.add(task)
                        task.add_done_callback(self._tasks.discard)
                await asyncio.sleep(self._interval_s)
        finally:
            for task in list(self._tasks):
                task.cancel()
            await self._lease.release()
            for channel in self._channels.values():
                await channel.close()

    async def _move(self, source: EngineView, target: EngineView) -> None:
        address = source.record.control_address
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(address)
        request = pb.MigrateRequest(target_engine_id=target.engine_id, reason="balance")
        outcome = "FAILED"
        try:
            result = await pb_grpc.EngineControlStub(channel).Migrate(request, timeout=self._timeout_s)
            outcome = pb.Outcome.Name(result.outcome)
            logger.info(
                "balance: %s -> %s, request %s: %s %s",
                source.engine_id,
                target.engine_id,
                result.request_id or "-",
                outcome,
                result.detail,
            )
        except grpc.aio.AioRpcError as exc:
            logger.warning("balance: %s unreachable: %s", source.engine_id, exc.details())
        finally:
            self._metrics.balance_migrations.labels(outcome).inc()
            self.balancer.ended(source, target, time.monotonic())
