"""What this engine's prefix cache holds, published to Redis for the routers' ``prefix_cache``
scorer.

vLLM's engine core publishes its KV events on a ZeroMQ PUB socket (``kv_events_config``, its
public route for them): ``BlockStored`` when a full block enters the prefix cache (with the
block's tokens and its parent's hash), ``BlockRemoved`` when one is evicted, ``AllBlocksCleared``
when the cache is reset. ``KvEventSubscriber`` reads them on the engine's event loop and
``CachedBlocks`` keeps the cache's content in Shoal's own block hashes
(``shoal_protos.prefix.chain_hashes``): vLLM's are seeded per process, so routers could not
compute them. ``PrefixPublisher`` writes what changed to the engine's Redis stream as it
changes, and the whole content as a snapshot every ``snapshot_interval_s``, from which a router
that starts late, lags or loses events starts again (``shoal_protos.prefix``).

Only blocks a router can name from a prompt's tokens are kept: full blocks of the engine's block
size in its one KV cache group, without a LoRA adapter, multimodal input or cache salt in their
hash, in the device's own cache. Others are counted (``skipped``) and left out, so a request
that would hit them is just not steered by them.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import Counter
from collections.abc import Iterable

import msgspec
import redis.asyncio as aioredis
import zmq
import zmq.asyncio
from redis.exceptions import RedisError
from vllm.distributed.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
)

from shoal_protos.prefix import ROOT, PrefixEvent, PrefixSnapshot, chain_hashes, leading, prefix_event_encoder
from shoal_protos.records import Keys, json_encoder
from shoal_protos.tasks import Supervisor

logger = logging.getLogger(__name__)

STREAM_MAXLEN = 1_000
"""Events kept in an engine's stream (Redis trims the oldest, roughly): a router further behind
than this starts again from the snapshot. Each event holds a step's new blocks, so this bounds
what a fleet's streams hold in Redis (hundreds of engines share one)."""


class CachedBlocks:
    """The engine's prefix cache in Shoal's block hashes, kept from vLLM's KV events, and what
    changed since ``take`` was last called."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # vLLM's hash of each cached block -> Shoal's, and how many cached blocks have each
        # of Shoal's (one, unless tokens alone do not tell two of vLLM's blocks apart).
        self._shoal: dict[bytes | int, int] = {}
        self._held: Counter[int] = Counter()
        # Net changes since the last ``take``: True stored, False removed.
        self._changed: dict[int, bool] = {}
        self._cleared = False
        self.skipped = 0
        """Blocks left out (see the module docstring)."""

    def apply(self, events: Iterable[KVCacheEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                for vllm_hash in event.block_hashes:
                    shoal = self._shoal.pop(vllm_hash, None)
                    if shoal is not None:
                        self._held[shoal] -= 1
                        if not self._held[shoal]:
                            del self._held[shoal]
                            self._changed[shoal] = False
            elif isinstance(event, AllBlocksCleared):
                self._shoal.clear()
                self._held.clear()
                self._changed.clear()
                self._cleared = True

    def _stored(self, event: BlockStored) -> None:
        count = len(event.block_hashes)
        if not self._nameable(event):
            self.skipped += count
            return
        if event.parent_block_hash is None:
            parent = ROOT
        else:
            known = self._shoal.get(event.parent_block_hash)
            if known is None:  # its parent was left out (or evicted first): so is it
                self.skipped += count
                return
            parent = known
        for vllm_hash, shoal in zip(
            event.block_hashes, chain_hashes(event.token_ids, self.block_size, parent), strict=True
        ):
            # vLLM announces blocks again when a request reuses them: already known, no change.
            if vllm_hash not in self._shoal:
                self._shoal[vllm_hash] = shoal
                self._held[shoal] += 1
                self._changed[shoal] = True

    def _nameable(self, event: BlockStored) -> bool:
        """Whether a router can name the event's blocks from a prompt's tokens alone."""
        return (
            event.block_size == self.block_size
            and len(event.token_ids) == len(event.block_hashes) * self.block_size
            and event.lora_id is None
            and event.lora_name is None
            and not any(event.extra_keys or ())
            and event.group_idx in (None, 0)
            and event.medium in (None, MEDIUM_GPU)
        )

    def take(self) -> tuple[bool, list[int], list[int]]:
        """What changed since the last call: (cleared, stored, removed)."""
        changed, cleared = self._changed, self._cleared
        self._changed, self._cleared = {}, False
        stored = [block for block, kept in changed.items() if kept]
        removed = [block for block, kept in changed.items() if not kept]
        return cleared, stored, removed

    @property
    def pending(self) -> bool:
        return bool(self._changed) or self._cleared

    def blocks(self) -> list[int]:
        return list(self._held)

    def held_prefix(self, hashes: Iterable[int]) -> int:
        """How many of ``hashes`` (a request's chained block hashes, first block first) lead
        in the cache: a prefix-cache lookup would find that many blocks."""
        return leading(hashes, self._held)


class KvEventSubscriber:
    """Reads vLLM's KV events from its PUB socket into ``CachedBlocks``; calls ``on_change``
    after each batch that changed something."""

    def __init__(self, endpoint: str, topic: str, blocks: CachedBlocks, on_change: asyncio.Event) -> None:
        self._ctx = zmq.asyncio.Context.instance()
        self._socket = self._ctx.socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._socket.connect(endpoint)
        self._blocks = blocks
        self._on_change = on_change
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        # vLLM numbers its batches: a gap means its socket dropped some past its high-water
        # mark, and the cache's content here may miss blocks until they are stored again.
        self._last_seq: int | None = None

    async def run_forever(self) -> None:
        while True:
            frames = await self._socket.recv_multipart()
            if len(frames) != 3:
                logger.warning("KV event of %d parts, not (topic, seq, payload): ignored", len(frames))
                continue
            _, seq_bytes, payload = frames
            seq = int.from_bytes(seq_bytes, "big")
            if self._last_seq is not None and seq != self._last_seq + 1:
                logger.warning("vLLM KV events %d to %d never arrived", self._last_seq + 1, seq - 1)
            self._last_seq = seq
            try:
                batch = self._decoder.decode(payload)
            except msgspec.DecodeError as exc:
                logger.warning("undecodable KV event batch %d: %s", seq, exc)
                continue
            self._blocks.apply(batch.events)
            if self._blocks.pending:
                self._on_change.set()

    def close(self) -> None:
        self._socket.close(linger=0)


class PrefixPublisher:
    """Writes the engine's prefix-cache changes to its Redis stream as they come, and the whole
    content as a snapshot every ``snapshot_interval_s`` (at once after a failed write, whose
    changes are lost: routers see the gap in ``seq`` and read the snapshot)."""

    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        engine_id: str,
        blocks: CachedBlocks,
        changed: asyncio.Event,
        snapshot_interval_s: float,
        ttl_s: float,
    ) -> None:
        self._client = client
        self._events_key = keys.prefix_events(engine_id)
        self._snapshot_key = keys.prefix_snapshot(engine_id)
        self._blocks = blocks
        self._changed = changed
        self._snapshot_interval_s = snapshot_interval_s
        # Both keys outlive a dead engine by this long (routers drop its blocks as it leaves the
        # fleet; the keys just go).
        self._ttl_ms = int(ttl_s * 1000)
        self.epoch = uuid.uuid4().hex
        self._seq = 0
        self._stream_id = "0-0"
        self._snapshot_due = True
        self.failures = 0

    async def run_forever(self) -> None:
        loop = asyncio.get_running_loop()
        next_snapshot = loop.time()
        try:
            # A stream left by this engine's previous process holds another epoch's events.
            await self._client.delete(self._events_key)
        except (RedisError, OSError) as exc:
            self._failed(exc)
        while True:
            timeout = max(next_snapshot - loop.time(), 0.0)
            try:
                await asyncio.wait_for(self._changed.wait(), timeout)
            except TimeoutError:
                self._snapshot_due = True
            self._changed.clear()
            await self.publish_once()
            if self._snapshot_due:
                await self._write_snapshot()
                next_snapshot = loop.time() + self._snapshot_interval_s

    async def publish_once(self) -> None:
        """Write what changed since the last call, if anything did."""
        if not self._blocks.pending:
            return
        cleared, stored, removed = self._blocks.take()
        self._seq += 1
        event = PrefixEvent(epoch=self.epoch, seq=self._seq, stored=stored, removed=removed, cleared=cleared)
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.xadd(
                    self._events_key,
                    {"e": prefix_event_encoder.encode(event)},
                    maxlen=STREAM_MAXLEN,
                    approximate=True,
                )
                pipe.pexpire(self._events_key, self._ttl_ms)
                stream_id, _ = await pipe.execute()
            self._stream_id = stream_id.decode() if isinstance(stream_id, bytes) else str(stream_id)
        except (RedisError, OSError) as exc:
            self._failed(exc)

    async def _write_snapshot(self) -> None:
        snapshot = PrefixSnapshot(
            epoch=self.epoch,
            seq=self._seq,
            block_size=self._blocks.block_size,
            blocks=self._blocks.blocks(),
            stream_id=self._stream_id,
        )
        try:
            await self._client.set(self._snapshot_key, json_encoder.encode(snapshot), px=self._ttl_ms)
            self._snapshot_due = False
        except (RedisError, OSError) as exc:
            self._failed(exc)

    def _failed(self, exc: Exception) -> None:
        self.failures += 1
        if not self._snapshot_due:
            logger.warning("cannot write prefix-cache changes to Redis (%s): a snapshot follows", exc)
        self._snapshot_due = True

    async def remove(self) -> None:
        """The engine stops: its keys go now rather than after their TTL."""
        try:
            await self._client.delete(self._events_key, self._snapshot_key)
        except (RedisError, OSError) as exc:
            logger.info("could not remove the prefix-cache keys: %s", exc)


class PrefixCacheFeed:
    """The subscriber and the publisher of one engine, run and closed together."""

    def __init__(
        self, subscriber: KvEventSubscriber, publisher: PrefixPublisher, blocks: CachedBlocks
    ) -> None:
        self.subscriber = subscriber
        self.publisher = publisher
        self.held_prefix = blocks.held_prefix
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, supervisor: Supervisor) -> None:
        """Run both loops as long as the engine (one that ends stops it, as a dead backend does)."""
        self._tasks = [
            supervisor.start(self.subscriber.run_forever(), "kv-events"),
            supervisor.start(self.publisher.run_forever(), "prefix-publisher"),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.subscriber.close()
        await self.publisher.remove()
