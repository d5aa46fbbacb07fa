"""Keeps the router's ``PrefixIndex`` current from the engines' prefix-cache events in Redis.

For every engine in the fleet view it reads the engine's snapshot once, then its event stream
after the snapshot's position, all engines in one blocking ``XREAD``. An event that does not
follow the last one applied (events trimmed away while this router lagged, a write the engine
lost, an engine restarted) sends the engine back to its snapshot. An engine that leaves the
fleet view (dead, or its record expired for good) leaves the index. A router that starts, or
starts again, builds the same index from the same keys as the routers already running.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import cast

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shoal_protos.prefix import prefix_event_decoder, prefix_snapshot_decoder
from shoal_protos.records import Keys
from shoal_router.core.prefix_index import PrefixIndex

logger = logging.getLogger(__name__)

BLOCK_MS = 200
"""Longest wait of one ``XREAD``: engines that joined meanwhile are read from the next."""
COUNT = 256
"""Events read per engine per ``XREAD``."""
NO_SNAPSHOT_RETRY_S = 2.0
"""How long before looking again for the snapshot of an engine that has none (one starting, or
one that publishes no events: the simulated engines)."""

_Entries = list[tuple[bytes, dict[bytes, bytes]]]
_XreadReply = list[tuple[bytes, _Entries]]


class PrefixEventReader:
    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        index: PrefixIndex,
        engine_ids: Callable[[], Iterable[str]],
        block_ms: int = BLOCK_MS,
    ) -> None:
        self._client = client
        self._keys = keys
        self.index = index
        self._engine_ids = engine_ids
        self._block_ms = block_ms
        # Engines without a snapshot, and when to look again.
        self._no_snapshot: dict[str, float] = {}
        self._engine_of: dict[bytes, str] = {}
        self.resyncs = 0
        """Snapshots read after the first, per engine (gaps in its events)."""

    async def run_forever(self) -> None:
        failing = False
        while True:
            try:
                await self.read_once()
                if failing:
                    logger.info("prefix-cache events read from Redis again")
                failing = False
            except (RedisError, OSError) as exc:
                if not failing:
                    logger.warning("cannot read prefix-cache events from Redis: %s", exc)
                failing = True
                await asyncio.sleep(self._block_ms / 1000)

    async def read_once(self) -> None:
        """Follow the fleet's engines, then apply what their streams hold past the index's
        position (waiting up to ``block_ms`` for something)."""
        live = set(self._engine_ids())
        for engine_id in set(self.index.engines()) - live:
            self.index.drop(engine_id)
        for engine_id in set(self._no_snapshot) - live:
            del self._no_snapshot[engine_id]
        now = time.monotonic()
        for engine_id in live:
            if self.index.position(engine_id) is None and self._no_snapshot.get(engine_id, 0.0) <= now:
                await self.resync(engine_id)
        streams: dict[str, str] = {}
        for engine_id in live:
            position = self.index.position(engine_id)
            if position is not None:
                key = self._keys.prefix_events(engine_id)
                self._engine_of[key.encode()] = engine_id
                streams[key] = position[2]
        if not streams:
            await asyncio.sleep(self._block_ms / 1000)
            return
        reply = cast(
            _XreadReply | None,
            await self._client.xread(streams, count=COUNT, block=self._block_ms),  # type: ignore[arg-type]
        )
        for stream, entries in reply or ():
            owner = self._engine_of.get(stream)
            if owner is not None:
                await self._apply(owner, entries)

    async def _apply(self, engine_id: str, entries: _Entries) -> None:
        for stream_id, fields in entries:
            try:
                event = prefix_event_decoder.decode(fields.get(b"e", b""))
            except msgspec.DecodeError as exc:
                logger.warning("engine %s: undecodable prefix-cache event %s: %s", engine_id, stream_id, exc)
                continue
            if not self.index.apply(engine_id, event, stream_id.decode()):
                self.resyncs += 1
                await self.resync(engine_id)
                return

    async def resync(self, engine_id: str) -> None:
        """Replace what the index holds of the engine with its snapshot."""
        raw = await self._client.get(self._keys.prefix_snapshot(engine_id))
        if raw is None:
            self.index.drop(engine_id)
            self._no_snapshot[engine_id] = time.monotonic() + NO_SNAPSHOT_RETRY_S
            return
        try:
            snapshot = prefix_snapshot_decoder.decode(raw)
        except msgspec.DecodeError as exc:
            logger.warning("engine %s: undecodable prefix-cache snapshot: %s", engine_id, exc)
            self._no_snapshot[engine_id] = time.monotonic() + NO_SNAPSHOT_RETRY_S
            return
        self._no_snapshot.pop(engine_id, None)
        self.index.load(engine_id, snapshot)
