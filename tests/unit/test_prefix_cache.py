"""The engine's prefix cache in Shoal's hashes (``CachedBlocks``), kept from vLLM's own KV event
types, and its publication through a real Redis to a router's index (``PrefixPublisher``,
``PrefixEventReader``): snapshots, gaps, restarts and engines that leave."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from shoal_engine.prefix_cache import CachedBlocks, PrefixPublisher
from shoal_protos.prefix import ROOT, PrefixEvent, chain_hashes, prefix_event_encoder
from shoal_protos.records import Keys
from shoal_router.core.prefix_index import PrefixIndex
from shoal_router.ipc.prefix_events import PrefixEventReader
from tests.integration.support import free_port, redis_server

BLOCK = 4


def stored(
    hashes: list[bytes], tokens: list[int], parent: bytes | None = None, **extra: object
) -> BlockStored:
    fields: dict[str, object] = {"lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0}
    fields.update(extra)
    return BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BLOCK, **fields
    )  # type: ignore[arg-type]


def vllm_hash(n: int) -> bytes:
    return n.to_bytes(32, "big")


def test_chain_hashes_name_equal_prefixes_alike_and_depend_on_every_earlier_token() -> None:
    tokens = list(range(1, 17))
    hashes = chain_hashes(tokens, BLOCK)
    assert len(hashes) == 4 and len(set(hashes)) == 4
    # A prompt with the same first 8 tokens shares its first two blocks, no more.
    other = chain_hashes([*tokens[:8], 99, *tokens[9:]], BLOCK)
    assert other[:2] == hashes[:2] and other[2] != hashes[2] and other[3] != hashes[3]
    # Chained: a block's hash is its parent's continuation, so hashing in parts agrees.
    assert chain_hashes(tokens[8:], BLOCK, parent=hashes[1]) == hashes[2:]
    assert chain_hashes(tokens, BLOCK, limit=3) == hashes[:3]
    assert chain_hashes(tokens[:3], BLOCK) == []
    # Only whole blocks: the same 16 tokens as one block of 16 name something else.
    assert chain_hashes(tokens, 16) != hashes[3:]


def test_stored_blocks_are_named_by_the_router_hash_of_their_tokens() -> None:
    cache = CachedBlocks(BLOCK)
    tokens = list(range(10, 22))
    cache.apply([stored([vllm_hash(1), vllm_hash(2)], tokens[:8])])
    # A later event continues the chain from its parent's vLLM hash.
    cache.apply([stored([vllm_hash(3)], tokens[8:12], parent=vllm_hash(2))])
    assert cache.blocks() == chain_hashes(tokens, BLOCK)
    cleared, added, removed = cache.take()
    assert (cleared, added, removed) == (False, chain_hashes(tokens, BLOCK), [])
    # vLLM announces reused blocks again: nothing changes.
    cache.apply([stored([vllm_hash(1)], tokens[:4])])
    assert not cache.pending


def test_removed_and_cleared_blocks_leave_and_the_net_change_is_taken() -> None:
    cache = CachedBlocks(BLOCK)
    tokens = list(range(8))
    first, second = chain_hashes(tokens, BLOCK)
    cache.apply([stored([vllm_hash(1), vllm_hash(2)], tokens)])
    cache.take()
    cache.apply([BlockRemoved(block_hashes=[vllm_hash(2)], medium="GPU")])
    assert cache.take() == (False, [], [second])
    # Stored and evicted between two takes: reported evicted (a reader that never saw it
    # discards nothing), not stored.
    cache.apply([stored([vllm_hash(2)], tokens[4:], parent=vllm_hash(1))])
    cache.apply([BlockRemoved(block_hashes=[vllm_hash(2)], medium="GPU")])
    assert cache.take() == (False, [], [second])
    # Removing what was never stored changes nothing.
    cache.apply([BlockRemoved(block_hashes=[vllm_hash(7)], medium="GPU")])
    assert not cache.pending
    cache.apply([AllBlocksCleared(), stored([vllm_hash(5)], [9, 9, 9, 9])])
    assert cache.take() == (True, chain_hashes([9, 9, 9, 9], BLOCK), [])
    assert cache.blocks() == chain_hashes([9, 9, 9, 9], BLOCK)
    assert first not in cache.blocks()


def test_the_cache_says_how_much_of_a_request_it_holds_from_its_first_block() -> None:
    """A move's target answers with it how many of the request's first blocks need not go."""
    cache = CachedBlocks(BLOCK)
    tokens = list(range(30, 46))
    hashes = chain_hashes(tokens, BLOCK)
    cache.apply([stored([vllm_hash(1), vllm_hash(2), vllm_hash(3)], tokens[:12])])
    assert cache.held_prefix(hashes) == 3
    assert cache.held_prefix(chain_hashes([29, *tokens[1:]], BLOCK)) == 0  # its first differs
    cache.apply([BlockRemoved(block_hashes=[vllm_hash(2)], medium="GPU")])
    assert cache.held_prefix(hashes) == 1  # a hole ends the prefix
    assert cache.held_prefix([]) == 0


@pytest.mark.parametrize(
    "event",
    [
        stored([vllm_hash(1)], [1, 2, 3, 4], lora_id=3, lora_name="adapter"),
        stored([vllm_hash(1)], [1, 2, 3, 4], extra_keys=[("salt",)]),
        stored([vllm_hash(1)], [1, 2, 3, 4], medium="CPU"),
        stored([vllm_hash(1)], [1, 2, 3, 4], group_idx=1),
        stored([vllm_hash(1)], [1, 2, 3]),  # a partial block
        stored([vllm_hash(1)], [1, 2, 3, 4], parent=vllm_hash(42)),  # its parent unknown here
    ],
    ids=["lora", "cache-salt", "offloaded", "second-group", "partial", "orphan"],
)
def test_blocks_a_router_cannot_name_from_tokens_are_left_out(event: BlockStored) -> None:
    cache = CachedBlocks(BLOCK)
    cache.apply([event])
    assert cache.blocks() == [] and not cache.pending and cache.skipped == 1


def test_vllm_batches_decode_with_its_own_types() -> None:
    import msgspec

    batch = KVEventBatch(ts=1.0, events=[stored([vllm_hash(1)], [1, 2, 3, 4]), AllBlocksCleared()])
    decoded = msgspec.msgpack.Decoder(KVEventBatch).decode(msgspec.msgpack.encode(batch))
    cache = CachedBlocks(BLOCK)
    cache.apply(decoded.events)
    assert cache.take() == (True, [], [])


# ---- through Redis --------------------------------------------------------------------------


@pytest.fixture
async def client() -> AsyncIterator[aioredis.Redis]:
    port = free_port()
    with redis_server(port):
        redis_client = aioredis.Redis(port=port)
        yield redis_client
        await redis_client.aclose()


KEYS = Keys("prefix-test")


def publisher(client: aioredis.Redis, engine: str, cache: CachedBlocks) -> PrefixPublisher:
    return PrefixPublisher(client, KEYS, engine, cache, asyncio.Event(), snapshot_interval_s=60, ttl_s=60)


async def start(pub: PrefixPublisher) -> None:
    """What ``run_forever`` does before it waits: a fresh stream and the first snapshot."""
    await pub._client.delete(pub._events_key)
    await pub._write_snapshot()


def reader(client: aioredis.Redis, engines: list[str]) -> PrefixEventReader:
    return PrefixEventReader(client, KEYS, PrefixIndex(), lambda: engines, block_ms=10)


def prompt(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(blocks * BLOCK)]


def store_prompt(cache: CachedBlocks, tokens: list[int], first_id: int) -> None:
    ids = [vllm_hash(first_id + i) for i in range(len(tokens) // BLOCK)]
    cache.apply([stored(ids, tokens)])


async def test_a_reader_follows_snapshots_and_events_and_drops_engines_that_leave(
    client: aioredis.Redis,
) -> None:
    caches = {engine: CachedBlocks(BLOCK) for engine in ("e0", "e1")}
    pubs = {engine: publisher(client, engine, cache) for engine, cache in caches.items()}
    a, b = prompt(1, 6), prompt(2, 3)
    store_prompt(caches["e0"], a, 100)
    for pub in pubs.values():
        await start(pub)  # e0's snapshot holds prompt a already
    engines = ["e0", "e1"]
    follow = reader(client, engines)
    await follow.read_once()
    assert follow.index.cached_tokens([*a, 7], engines) == {"e0": 6 * BLOCK}
    # Later changes arrive as events.
    store_prompt(caches["e1"], b, 200)
    await pubs["e1"].publish_once()
    caches["e0"].apply([BlockRemoved(block_hashes=[vllm_hash(105)], medium="GPU")])
    await pubs["e0"].publish_once()
    await follow.read_once()
    assert follow.index.cached_tokens(a, engines) == {"e0": 5 * BLOCK}
    assert follow.index.cached_tokens(b + a, engines) == {"e1": 3 * BLOCK}
    # A second router started now builds the same index (the router's restart).
    late = reader(client, engines)
    await late.read_once()
    assert late.index.cached_tokens(a, engines) == {"e0": 5 * BLOCK}
    assert late.index.cached_tokens(b, engines) == {"e1": 3 * BLOCK}
    # e1 leaves the fleet (dead): its blocks leave the index.
    engines.remove("e1")
    await follow.read_once()
    assert follow.index.cached_tokens(b, ["e0", "e1"]) == {}
    assert follow.index.engines() == ["e0"]


async def test_a_gap_or_a_restarted_engine_sends_the_reader_to_the_snapshot(client: aioredis.Redis) -> None:
    cache = CachedBlocks(BLOCK)
    pub = publisher(client, "e0", cache)
    await start(pub)
    follow = reader(client, ["e0"])
    await follow.read_once()
    a, b = prompt(3, 4), prompt(4, 4)
    store_prompt(cache, a, 100)
    # An event the engine failed to write: lost, and a snapshot follows it.
    cache.take()
    pub._seq += 1
    pub._snapshot_due = True
    store_prompt(cache, b, 200)
    await pub.publish_once()
    await follow.read_once()  # sees seq 2 after 0: a gap, back to the (old) snapshot
    assert follow.resyncs == 1
    await pub._write_snapshot()
    await follow.read_once()
    await follow.read_once()
    assert follow.index.cached_tokens(a, ["e0"]) == {"e0": 4 * BLOCK}
    assert follow.index.cached_tokens(b, ["e0"]) == {"e0": 4 * BLOCK}
    # The engine restarts: a new epoch, an empty cache, a fresh stream.
    restarted = CachedBlocks(BLOCK)
    pub = publisher(client, "e0", restarted)
    await start(pub)
    store_prompt(restarted, b, 300)
    await pub.publish_once()
    await follow.read_once()
    await follow.read_once()
    assert follow.index.cached_tokens(a, ["e0"]) == {}
    assert follow.index.cached_tokens(b, ["e0"]) == {"e0": 4 * BLOCK}


async def test_events_past_the_trimmed_stream_come_back_through_the_snapshot(client: aioredis.Redis) -> None:
    cache = CachedBlocks(BLOCK)
    pub = publisher(client, "e0", cache)
    await start(pub)
    follow = reader(client, ["e0"])
    await follow.read_once()
    a = prompt(5, 2)
    store_prompt(cache, a, 100)
    await pub.publish_once()
    await pub._write_snapshot()
    # The stream lost its oldest entry (trimmed while this reader lagged): the next one does not
    # follow what the reader applied.
    await client.xtrim(KEYS.prefix_events("e0"), maxlen=0)
    event = PrefixEvent(epoch=pub.epoch, seq=pub._seq + 5)
    await client.xadd(KEYS.prefix_events("e0"), {"e": prefix_event_encoder.encode(event)})
    await follow.read_once()
    assert follow.resyncs == 1
    assert follow.index.cached_tokens(a, ["e0"]) == {"e0": 2 * BLOCK}


def test_root_is_the_parent_of_a_first_block() -> None:
    assert chain_hashes([1, 2, 3, 4], BLOCK) == chain_hashes([1, 2, 3, 4], BLOCK, parent=ROOT)
