"""The other engines, as a source of moves sees them: which one to move to, the gRPC channels
to their control APIs, the KV links warmed up ahead of moves, and aborts passed on to where a
request moved."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence

import grpc
import msgspec
import redis.asyncio as aioredis
import zmq
from redis.exceptions import RedisError

from shoal_engine.migration.common import AgentCaller, MigrationError
from shoal_protos import engine_control_pb2_grpc as pb_grpc
from shoal_protos import kv
from shoal_protos.addresses import zmq_connect
from shoal_protos.messages import AbortRequest, RouterRequestEncoder
from shoal_protos.prefix import leading, prefix_snapshot_decoder
from shoal_protos.records import (
    EngineRecord,
    EngineState,
    Keys,
    engine_record_decoder,
    load_report_decoder,
)
from shoal_protos.tasks import background
from shoal_protos.tls import FleetTls, aio_channel

logger = logging.getLogger(__name__)

UNREACHABLE_S = 10.0
"""How long a target whose control API refused connections is left out of target picking."""

NEAR_FREEST = 0.75
"""An engine a move may go to for its prefix cache has at least this share of the free KV blocks
of the freest one: a cached engine that is nearly full loses to a cold one with room."""

MAX_CHANNELS = 32
"""Channels to other engines' control APIs kept open; past this, the least recently used one
is closed."""


def cached_blocks(snapshot: bytes | str | None) -> set[int]:
    """The blocks an engine's prefix-cache snapshot (``Keys.prefix_snapshot``) names; none
    without one."""
    if not snapshot:
        return set()
    try:
        return set(prefix_snapshot_decoder.decode(snapshot).blocks)
    except msgspec.DecodeError:
        return set()


class Peers:
    def __init__(
        self,
        engine_id: str,
        redis_client: aioredis.Redis,
        keys: Keys,
        tls: FleetTls | None,
        push_ctx: zmq.Context[zmq.Socket[bytes]],
    ) -> None:
        self._engine_id = engine_id
        self._redis = redis_client
        self._keys = keys
        self._tls = tls
        # Channels to other engines' control APIs, the most recently used last.
        self.channels: OrderedDict[str, grpc.aio.Channel] = OrderedDict()
        # Engines whose control API could not be reached, until when they are not picked.
        self._unreachable: dict[str, float] = {}
        self._push_ctx = push_ctx
        self._peer_push: dict[str, zmq.Socket[bytes]] = {}
        self._encoder = RouterRequestEncoder()

    def stub(self, address: str) -> pb_grpc.EngineControlStub:
        channel = self.channels.get(address)
        if channel is None:
            channel = self.channels[address] = aio_channel(address, self._tls)
            # Engines come and go: the channels of those not met for longest are closed.
            while len(self.channels) > MAX_CHANNELS:
                _, oldest = self.channels.popitem(last=False)
                background(oldest.close(), "close-channel")
        else:
            self.channels.move_to_end(address)
        return pb_grpc.EngineControlStub(channel)

    def mark_unreachable(self, engine_id: str) -> None:
        """The engine died but its record has not expired yet: pick others for a while."""
        self._unreachable[engine_id] = time.monotonic() + UNREACHABLE_S

    def is_unreachable(self, engine_id: str) -> bool:
        return engine_id in self._unreachable

    async def pick_target(self, engine_id: str, block_hashes: Sequence[int] = ()) -> EngineRecord | None:
        """``engine_id``'s record, or, left empty, an active engine picked for room first and
        then for the request's prefix: of those with nearly the most free KV blocks
        (``NEAR_FREEST`` of the most), the one whose prefix cache holds most of the request's
        first blocks (``block_hashes``, from its snapshot in Redis; fewer bytes to copy), then
        the freest. None when there is none."""
        if engine_id:
            raw = await self._redis.get(self._keys.engine(engine_id))
            if raw is None:
                raise MigrationError(f"engine {engine_id} is not registered")
            record = engine_record_decoder.decode(raw)
            if not record.control_address or engine_id == self._engine_id:
                raise MigrationError(f"engine {engine_id} cannot take migrations")
            return record
        ids = await self._engine_ids()
        candidates: list[tuple[int, EngineRecord, bytes | str | None]] = []
        now = time.monotonic()
        for other in ids:
            if other == self._engine_id or self._unreachable.get(other, 0.0) > now:
                continue
            raw_record, raw_load, snapshot = await self._redis.mget(
                self._keys.engine(other), self._keys.load(other), self._keys.prefix_snapshot(other)
            )
            if raw_record is None:
                continue
            record = engine_record_decoder.decode(raw_record)
            if record.state != EngineState.ACTIVE or not record.control_address:
                continue
            free = load_report_decoder.decode(raw_load).kv_blocks_free if raw_load else 0
            candidates.append((free, record, snapshot))
        if not candidates:
            return None
        most = max(free for free, _, _ in candidates)
        near = [c for c in candidates if c[0] >= NEAR_FREEST * most]
        if len(near) == 1 or not block_hashes:
            return max(near, key=lambda c: c[0])[1]
        return max(near, key=lambda c: (leading(block_hashes, cached_blocks(c[2])), c[0]))[1]

    async def prefix_snapshot(self, engine_id: str) -> bytes | str | None:
        """``engine_id``'s prefix-cache snapshot as it is in Redis (None: none, or unreadable)."""
        try:
            raw: bytes | str | None = await self._redis.get(self._keys.prefix_snapshot(engine_id))
        except RedisError as exc:
            logger.info("no prefix-cache snapshot of %s: %s", engine_id, exc)
            return None
        return raw

    async def _engine_ids(self) -> list[str]:
        members = await self._redis.smembers(self._keys.engines)
        return sorted(m.decode() if isinstance(m, bytes) else m for m in members)

    async def warm_up_forever(self, agent: AgentCaller, interval_s: float = 5.0) -> None:
        """Open the KV transport's connection to every other active engine as it appears, so
        that no migration pays for making it (with gloo, a process group's rendezvous)."""
        warmed: set[str] = set()
        while True:
            try:
                for record in await self._active_others():
                    if record.kv_address in warmed:
                        continue
                    try:
                        await agent.call(kv.Connect(record.kv_address))
                    except MigrationError as exc:
                        logger.info("KV link to %s not ready yet: %s", record.engine_id, exc)
                        continue
                    warmed.add(record.kv_address)
            except (RedisError, OSError, msgspec.DecodeError) as exc:
                logger.debug("KV warm-up pass failed: %s", exc)
            await asyncio.sleep(interval_s)

    async def _active_others(self) -> list[EngineRecord]:
        """The other active engines that take KV, by id."""
        records = []
        for engine_id in await self._engine_ids():
            if engine_id == self._engine_id:
                continue
            raw = await self._redis.get(self._keys.engine(engine_id))
            record = engine_record_decoder.decode(raw) if raw else None
            if record is not None and record.state == EngineState.ACTIVE and record.kv_address:
                records.append(record)
        return records

    def forward_abort(self, owner: str, request_id: str, reason: str) -> None:
        """Pass a client's abort on to the engine the request moved to."""
        background(self._send_abort(owner, request_id, reason), f"abort-{request_id}")

    async def _send_abort(self, owner: str, request_id: str, reason: str) -> None:
        try:
            raw = await self._redis.get(self._keys.engine(owner))
        except RedisError as exc:
            logger.warning("cannot pass the abort of %s on to %s: %s", request_id, owner, exc)
            return
        if raw is None:
            return
        address = engine_record_decoder.decode(raw).zmq_address
        sock = self._peer_push.get(address)
        if sock is None:
            sock = self._peer_push[address] = self._push_ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            zmq_connect(sock, address)
        try:
            sock.send_multipart(self._encoder.abort(AbortRequest([request_id], reason)), flags=zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("cannot pass the abort of %s on to %s: socket full", request_id, owner)

    async def aclose(self) -> None:
        for channel in self.channels.values():
            await channel.close()
        for sock in self._peer_push.values():
            sock.close(linger=0)
