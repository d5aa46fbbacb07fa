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
  with the least KV to copy) with reason ``balance``. A router that indexes the engines' prefix
  caches sends the move, of the engines nearly as free as the freest, to the one whose cache
  shares most blocks with the crowded engine's: the likeliest to hold the prefix of the request
  moved, so the least to copy.
* **Consolidation** (with ``consolidate_below`` set). While a model's load (its KV blocks in
  use, and its requests per batch slot where engines say their batch size) would stay under
  ``consolidate_below`` of what the engines left hold, the leader marks its least-loaded engine
  *emptying* (a key in Redis with a short TTL that it renews: every router stops dispatching
  there) and moves that engine's requests, one at a time, to the fullest engines that still
  have room, packing them so the emptied engine holds nothing and the autoscaler can remove it
  (the operator takes the least-loaded engines first). One more engine is marked per check
  while the condition holds; when the load climbs past ``consolidate_release`` of the engines
  left, the last one marked goes back to dispatch. Balancing runs among the other engines.
* **Hysteresis.** Both engines of a move are left alone for ``cooldown_s`` after it ends (their
  reports must catch up first; no ping-pong; an emptying source may move again at once, its
  load only falls), and at most ``max_concurrent`` moves run at once.
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
from shoal_protos.records import Keys
from shoal_protos.tls import FleetTls, aio_channel
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
        self.holder = holder
        self._ttl_ms = int(ttl_s * 1000)
        self.held = False

    async def hold(self) -> bool:
        """Renew the lease if this holder has it, else take it if it is free; whether this
        holder has it now (False, too, when Redis cannot be reached)."""
        try:
            if self.held:
                self.held = bool(await self._client.eval(_RENEW, 1, self._key, self.holder, self._ttl_ms))
            if not self.held:
                self.held = bool(await self._client.set(self._key, self.holder, nx=True, px=self._ttl_ms))
        except (RedisError, OSError) as exc:
            logger.warning("cannot reach Redis for the balancing lease: %s", exc)
            self.held = False
        return self.held

    async def release(self) -> None:
        if self.held:
            self.held = False
            try:
                await self._client.eval(_RELEASE, 1, self._key, self.holder)
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
    consolidate_below: float = 0.0
    """Empty an engine while the model's load over the engines left (``_load``) stays below
    this fraction (0: never consolidate)."""
    consolidate_release: float = 0.7
    """Give an emptying engine back to dispatch once the load over the engines left passes
    this fraction."""

    def __post_init__(self) -> None:
        if self.consolidate_below and self.consolidate_release <= self.consolidate_below:
            raise ValueError("consolidate_release must be above consolidate_below")


@dataclass(frozen=True)
class Move:
    source: EngineView
    target: EngineView
    reason: str
    """``balance`` or ``consolidate`` (the migration record and metrics carry it)."""


def relative_freeness(view: EngineView) -> float:
    """Freeness as a fraction of the engine's KV cache, so engines of any size compare."""
    total = view.record.kv_blocks_total or 1
    return view.free / total


def _kv_used(view: EngineView) -> int:
    return view.report.kv_blocks_used if view.report is not None else 0


def _kv_total(view: EngineView) -> int:
    report = view.report
    free = report.kv_blocks_free if report is not None else 0
    return view.record.kv_blocks_total or _kv_used(view) + free


def _load(engines: list[EngineView], over: list[EngineView]) -> float:
    """The load of ``engines`` if ``over`` alone carried it: the larger of the KV blocks in use
    and the requests held (running and waiting), each over what ``over`` has (KV blocks, batch
    slots); requests count only where engines say their batch size."""
    kv = sum(_kv_total(v) for v in over)
    load = sum(_kv_used(v) for v in engines) / kv if kv else float("inf")
    slots = sum(v.record.max_num_seqs for v in over)
    if slots and all(v.record.max_num_seqs for v in engines):
        load = max(load, sum(v.requests() for v in engines) / slots)
    return load


NEAR_FREEST = 0.75
"""A balancing move may go to an engine with this share of the freest engine's freeness (and a
lead over its source past the threshold) when its prefix cache shares more with the source's."""
CANDIDATES = 4
"""The freest engines weighed as a move's target by what their caches share with its source."""


@dataclass
class Balancer:
    """Decides the moves (no IO): ``decide`` is called once per check."""

    policy: BalancePolicy = field(default_factory=BalancePolicy)
    shared: Callable[[str, str], int] | None = None
    """KV blocks two engines' prefix caches both hold (the router's prefix index), where the
    router keeps one; else a move goes to the freest engine. A source's running requests' full
    blocks are in its cache, so a target sharing many is likelier to hold the prefix of the
    request the source moves (the one with the least left to copy there)."""
    _streak: dict[tuple[str, str], int] = field(default_factory=dict)
    _resting_until: dict[str, float] = field(default_factory=dict)
    in_flight: int = 0
    emptying: list[str] = field(default_factory=list)
    """Engines being emptied, in the order they were marked."""

    def decide(self, views: Iterable[EngineView], now: float) -> list[Move]:
        """The moves to start now, at most ``max_concurrent`` running in all: first those
        emptying the engines marked for consolidation, then balancing ones among the others,
        within each model the least free engine paired with the most free, the second least
        with the second most, and so on while the lead passes the threshold."""
        by_model: dict[str, list[EngineView]] = {}
        for view in views:
            if view.usable and view.report is not None and view.record.control_address:
                by_model.setdefault(view.record.model, []).append(view)
        present = {view.engine_id for engines in by_model.values() for view in engines}
        self.emptying = [engine_id for engine_id in self.emptying if engine_id in present]
        moves: list[Move] = []
        streaks: dict[tuple[str, str], int] = {}
        for engines in by_model.values():
            if self.policy.consolidate_below:
                self._mark(engines)
            awake = [v for v in engines if self._resting_until.get(v.engine_id, 0.0) <= now]
            staying = [v for v in awake if v.engine_id not in self.emptying]
            moves += self._consolidate(awake, staying, len(moves))
            ranked = sorted(staying, key=relative_freeness)
            low = 0
            while low < len(ranked) - 1 and self.in_flight + len(moves) < self.policy.max_concurrent:
                source = ranked[low]
                if relative_freeness(ranked[-1]) - relative_freeness(source) <= self.policy.threshold:
                    break
                assert source.report is not None
                low += 1
                if source.report.num_running < 2:
                    continue  # moving a lone request only moves the load
                target = ranked.pop(self._target(source, ranked, low))
                pair = (source.engine_id, target.engine_id)
                streaks[pair] = self._streak.get(pair, 0) + 1
                if streaks[pair] >= self.policy.patience:
                    moves.append(Move(source, target, "balance"))
                    streaks.pop(pair)
        self._streak = streaks
        return moves

    def _target(self, source: EngineView, ranked: list[EngineView], first: int) -> int:
        """Where in ``ranked`` (by freeness, from ``first`` on) the move off ``source`` goes: the
        freest engine, or, of the ``CANDIDATES`` freest that are nearly as free and lead the
        source past the threshold, the one sharing most cached blocks with it (the freer of
        equals)."""
        last = len(ranked) - 1
        if self.shared is None:
            return last
        floor = max(
            NEAR_FREEST * relative_freeness(ranked[last]), relative_freeness(source) + self.policy.threshold
        )
        best, most = last, self.shared(source.engine_id, ranked[last].engine_id)
        for i in range(last - 1, max(first, last - CANDIDATES + 1) - 1, -1):
            if relative_freeness(ranked[i]) <= floor:
                break
            shared = self.shared(source.engine_id, ranked[i].engine_id)
            if shared > most:
                best, most = i, shared
        return best

    def _mark(self, engines: list[EngineView]) -> None:
        """Mark one more engine of a model for emptying, or give the last one back, by the
        model's load over the engines that would stay."""
        marked = [v for v in engines if v.engine_id in self.emptying]
        staying = [v for v in engines if v.engine_id not in self.emptying]
        if marked and _load(engines, staying) > self.policy.consolidate_release:
            self.emptying.remove(marked[-1].engine_id)
            return
        if len(staying) < 2:
            return
        lightest = min(staying, key=lambda v: (v.requests(), _kv_used(v), v.engine_id))
        rest = [v for v in staying if v is not lightest]
        if _load(engines, rest) <= self.policy.consolidate_below:
            self.emptying.append(lightest.engine_id)

    def _consolidate(self, awake: list[EngineView], staying: list[EngineView], planned: int) -> list[Move]:
        """Moves off the emptying engines, each to the least free engine that still has room
        (a freeness above the threshold and a free batch slot), so requests pack onto as few
        engines as they fit."""
        moves: list[Move] = []
        targets = [
            v
            for v in staying
            if relative_freeness(v) > self.policy.threshold
            and (not v.record.max_num_seqs or v.requests() < v.record.max_num_seqs)
        ]
        for source in awake:
            if (
                source.engine_id not in self.emptying
                or source.report is None
                or not source.report.num_running
            ):
                continue
            if not targets or self.in_flight + planned + len(moves) >= self.policy.max_concurrent:
                break
            target = min(targets, key=relative_freeness)
            targets.remove(target)
            moves.append(Move(source, target, "consolidate"))
        return moves

    def started(self, move: Move) -> None:
        self.in_flight += 1
        for view in (move.source, move.target):
            self._resting_until[view.engine_id] = float("inf")  # until the move ends

    def ended(self, move: Move, now: float) -> None:
        self.in_flight -= 1
        for view in (move.source, move.target):
            self._resting_until[view.engine_id] = now + self.policy.cooldown_s
        if move.source.engine_id in self.emptying:
            self._resting_until[move.source.engine_id] = now  # its load only falls


class Rebalancer:
    """Runs the policy as the cluster's leader: holds the lease, checks every ``interval_s``,
    keeps the emptying marks in Redis, and calls the source engine's ``Migrate``."""

    def __init__(
        self,
        lease: Lease,
        views: Callable[[], Iterable[EngineView]],
        metrics: RouterMetrics,
        policy: BalancePolicy | None = None,
        interval_s: float = 1.0,
        timeout_s: float = 60.0,
        client: aioredis.Redis | None = None,
        keys: Keys | None = None,
        tls: FleetTls | None = None,
        shared: Callable[[str, str], int] | None = None,
    ) -> None:
        """``tls``: the fleet's TLS, which engines' EngineControl asks of its callers;
        ``shared``: what two engines' prefix caches share (``Balancer.shared``)."""
        self._tls = tls
        self._lease = lease
        self._views = views
        self._metrics = metrics
        self.balancer = Balancer(policy or BalancePolicy(), shared=shared)
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._client = client
        self._keys = keys
        # Marks outlive a few missed renewals, and not much more once their leader is gone.
        self._mark_ttl_ms = int(max(3.0, 3 * interval_s) * 1000)
        self._marked: set[str] = set()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def run_forever(self) -> None:
        try:
            while True:
                leader = await self._lease.hold()
                self._metrics.leader.set(1 if leader else 0)
                if leader:
                    for move in self.balancer.decide(self._views(), time.monotonic()):
                        self.balancer.started(move)
                        task = asyncio.create_task(self._move(move), name=f"{move.reason}-move")
                        self._tasks.add(task)
                        task.add_done_callback(self._tasks.discard)
                    await self._publish_marks(self.balancer.emptying)
                elif self.balancer.emptying:
                    self.balancer.emptying.clear()  # the new leader decides afresh
                    self._marked.clear()
                self._metrics.emptying.set(len(self.balancer.emptying) if leader else 0)
                await asyncio.sleep(self._interval_s)
        finally:
            for task in list(self._tasks):
                task.cancel()
            await self._publish_marks([])
            await self._lease.release()
            for channel in self._channels.values():
                await channel.close()

    async def _publish_marks(self, emptying: list[str]) -> None:
        """Renew the emptying marks in Redis and remove those given back."""
        if self._client is None or self._keys is None or not (emptying or self._marked):
            return
        keys = self._keys
        marking = set(emptying)
        given_back = self._marked - marking
        # Counted as marked before the round trip: a cancel that lands while it is under way (the
        # leader stopping) leaves marks Redis may hold, and the last call removes them too.
        self._marked |= marking
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                for engine_id in emptying:
                    pipe.set(keys.emptying(engine_id), self._lease.holder, px=self._mark_ttl_ms)
                for engine_id in given_back:
                    pipe.delete(keys.emptying(engine_id))
                await pipe.execute()
            self._marked = marking
        except (RedisError, OSError) as exc:
            logger.warning("cannot write the emptying marks: %s", exc)

    async def _move(self, move: Move) -> None:
        source, target = move.source, move.target
        address = source.record.control_address
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = aio_channel(address, self._tls)
        request = pb.MigrateRequest(target_engine_id=target.engine_id, reason=move.reason)
        outcome = "FAILED"
        try:
            result = await pb_grpc.EngineControlStub(channel).Migrate(request, timeout=self._timeout_s)
            outcome = pb.Outcome.Name(result.outcome)
            logger.info(
                "%s: %s -> %s, request %s: %s %s",
                move.reason,
                source.engine_id,
                target.engine_id,
                result.request_id or "-",
                outcome,
                result.detail,
            )
        except grpc.aio.AioRpcError as exc:
            logger.warning("%s: %s unreachable: %s", move.reason, source.engine_id, exc.details())
        finally:
            counter = (
                self._metrics.balance_migrations if move.reason == "balance" else self._metrics.consolidations
            )
            counter.labels(outcome).inc()
            self.balancer.ended(move, time.monotonic())
