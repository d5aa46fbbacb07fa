"""The KV agent and its transports on CUDA KV caches, laid out the way vLLM 0.32 allocates them.

The other tiers run the agent on host memory, where sockets, gloo and ``.numpy()`` all work on
the KV cache's own bytes. On a GPU the cache is device memory and only ``nccl`` can carry it,
so this module hands real ``KvAgent`` pairs KV caches built as vLLM's GPU worker builds them
(``vllm.v1.worker.utils.allocate_kv_cache``: one flat int8 buffer, and per layer a
``[blocks, kv heads, block size, K and V]`` view whose strides follow the resolved KV cache
layout) and checks, block by block, that the bytes staged on the target and then injected into
its blocks are the source's bytes, and that nothing else of the target's cache changed.

Two layouts matter (vLLM's ``KVCacheLayout``): LBHNC, which Shoal's connector asks vLLM for and
vLLM's CPU backend and FlashAttention both take, and LBNHC, which FlashAttention, the CUDA
default, would get otherwise, and which the agent refuses when it starts.

Every test takes its device as a parameter: the ``cpu`` variants run the same bodies on host
memory (over ``tcp`` and ``gloo``), also on machines without a GPU when ``SHOAL_GPU_CHECK_CPU=1``
(see ``conftest.py``).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import zmq

from shoal_engine.kv.agent import KvAgent, Load, TableUpdate
from shoal_engine.kv.staging import StagingArena
from shoal_engine.kv.transport import check_backend
from shoal_protos import kv

pytestmark = pytest.mark.gpu

# A small model with a production head shape (8 KV heads of 128, bf16, 16-token blocks).
LAYERS = 4
BLOCKS = 40
BLOCK_SIZE = 16
KV_HEADS = 8
HEAD_SIZE = 128
DTYPE = torch.bfloat16
# vLLM 0.32's content axis C: one token of one head, its K then its V, in bytes.
CONTENT_BYTES = 2 * HEAD_SIZE * DTYPE.itemsize
# One layer's share of a block (vLLM's page), and a block over all layers.
PAGE_BYTES = KV_HEADS * BLOCK_SIZE * CONTENT_BYTES
BLOCK_BYTES = LAYERS * PAGE_BYTES
# NCCL's group set-up on first use, and the control round trips around it.
TIMEOUT_S = 60.0

# The physical order of the logical axes [L(ayer), B(lock), H(ead), N (token), C(ontent)]:
# the values of vLLM's ``KVCacheLayout`` members of these names.
LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4)}


@dataclass
class VllmKv:
    """A KV cache as vLLM's worker allocates it: one flat int8 buffer and a view per layer."""

    raw: torch.Tensor
    caches: dict[str, torch.Tensor]
    # Byte strides of the logical [L, B, H, N, C] axes.
    strides: tuple[int, ...]

    def page(self, layer: int, block: int) -> torch.Tensor:
        """Layer ``layer``'s bytes of block ``block`` (one dense run in the layer-outer layouts)."""
        start = layer * self.strides[0] + block * self.strides[1]
        return self.raw[start : start + PAGE_BYTES].view(torch.uint8)

    def snapshot(self) -> VllmKv:
        return VllmKv(self.raw.clone(), {}, self.strides)


def vllm_kv_cache(layout: str, device: torch.device, seed: int) -> VllmKv:
    """Reproduce ``allocate_kv_cache`` for one group of full-attention layers: the strides of
    ``compute_layout_strides`` (dense, in the layout's physical order), the per-layer views of
    ``create_kv_cache_views``; ``test_the_layouts_here_are_vllms`` holds the two side by side."""
    shape = (LAYERS, BLOCKS, KV_HEADS, BLOCK_SIZE, CONTENT_BYTES)
    strides = [0] * len(shape)
    step = 1
    for axis in reversed(LAYOUTS[layout]):
        strides[axis] = step
        step *= shape[axis]
    # Random bytes rather than random numbers: every bit pattern, NaNs too, must survive the trip.
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(-128, 128, (step,), dtype=torch.int8, generator=generator).to(device)
    logical = raw.as_strided(shape, strides)
    caches = {f"model.layers.{i}.self_attn.attn": logical[i].view(DTYPE) for i in range(LAYERS)}
    return VllmKv(raw, caches, tuple(strides))


def on(device: str) -> torch.device:
    return torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")


def pair_devices(device: str) -> tuple[torch.device, torch.device]:
    """The source's and the target's device."""
    if device != "cuda":
        return torch.device("cpu"), torch.device("cpu")
    count = torch.cuda.device_count()
    if count < 2:
        pytest.skip(
            f"an NCCL transfer needs two GPUs (NCCL refuses two ranks of one group on one GPU); "
            f"this machine has {count}"
        )
    return torch.device("cuda", 0), torch.device("cuda", 1)


def transport_for(device: str) -> str:
    """The transport a KV cache on ``device`` is served with: ``nccl`` on a GPU."""
    if device != "cuda":
        return "tcp"
    if not dist.is_nccl_available():
        pytest.skip(f"this torch ({torch.__version__}) has no NCCL, the only transport for a GPU KV cache")
    return "nccl"


def scheduled(agent: KvAgent, request_id: str, block_ids: list[int], tokens: int) -> None:
    """What the connector tells the agent of a request vLLM ran: its table, then the step done."""
    update = TableUpdate(request_id, request_id + "-vllm", block_ids, True, tokens)
    agent.update_tables([update], [])
    agent.step_done([update])


@dataclass
class Started:
    agent: KvAgent
    control: str
    data: str


@pytest.fixture
def start() -> Iterator[Callable[..., Started]]:
    """Start agents on KV caches (closed after the test), in a folder of their own: their ipc://
    paths must fit a Unix socket address, which a parametrized test's ``tmp_path`` may not."""
    folder = Path(tempfile.mkdtemp(prefix="shoal-kv-"))
    started: list[KvAgent] = []

    def agent(kv_cache: VllmKv, name: str, transport: str, **options: Any) -> Started:
        control, data = f"ipc://{folder}/{name}c", f"ipc://{folder}/{name}d"
        started.append(
            KvAgent(
                kv_cache.caches,
                BLOCKS,
                BLOCK_SIZE,
                control,
                data,
                transport=transport,
                timeout_s=TIMEOUT_S,
                debug_reads=True,
                **options,
            )
        )
        return Started(started[-1], control, data)

    yield agent
    for each in reversed(started):
        each.close()
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def call() -> Iterator[Callable[[str, kv.AgentCommand], kv.AgentReply]]:
    """Send a command to an agent's control address, the way the engine service does."""
    ctx = zmq.Context()
    socks: dict[str, zmq.Socket[bytes]] = {}

    def send(address: str, command: kv.AgentCommand) -> kv.AgentReply:
        sock = socks.get(address)
        if sock is None:
            sock = socks[address] = ctx.socket(zmq.REQ)
            sock.connect(address)
        sock.send(kv.encoder.encode(command))
        assert sock.poll(int(TIMEOUT_S * 1000)), f"the agent at {address} did not answer"
        return kv.agent_reply_decoder.decode(sock.recv())

    yield send
    for sock in socks.values():
        sock.close(linger=0)
    ctx.term()


@pytest.fixture(params=["cuda", "cpu"])
def device(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def cuda_device() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device("cuda", 0)


def _vllm_0_32() -> Any:
    vllm = pytest.importorskip(
        "vllm", reason="vLLM is not installed: the layouts are the copy of vLLM 0.32's rules in this file"
    )
    if not vllm.__version__.startswith("0.32."):
        pytest.skip(f"vLLM {vllm.__version__} is installed; the layouts here are vLLM 0.32's")
    return vllm


# ---- the layout ------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_layouts_here_are_vllms(device: str, layout: str) -> None:
    """The KV caches of this module are those vLLM's own allocator makes, view for view."""
    _vllm_0_32()
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheLayout,
        KVCacheTensor,
        compute_layout_strides,
    )
    from vllm.v1.worker.utils import allocate_kv_cache

    vllm_layout = KVCacheLayout[layout]
    assert vllm_layout.value == LAYOUTS[layout]
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=DTYPE)
    assert spec.page_size_bytes == PAGE_BYTES
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    layer_stride, block_stride, *_ = compute_layout_strides(spec, BLOCKS, LAYERS, vllm_layout)
    config = KVCacheConfig(
        num_blocks=BLOCKS,
        kv_cache_tensors=[
            KVCacheTensor(
                size=BLOCKS * BLOCK_BYTES, layers=names, layer_stride=layer_stride, block_stride=block_stride
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )
    theirs = allocate_kv_cache(config, on(device), vllm_layout)
    ours = vllm_kv_cache(layout, on(device), seed=0)
    assert list(theirs) == list(ours.caches)
    for name, tensor in theirs.items():
        mine = ours.caches[name]
        assert (tensor.shape, tensor.stride(), tensor.dtype, tensor.storage_offset()) == (
            mine.shape,
            mine.stride(),
            mine.dtype,
            mine.storage_offset(),
        ), name
        assert tensor.device == mine.device


def test_the_connector_asks_flash_attention_for_the_layout_the_agent_moves() -> None:
    """FlashAttention, the CUDA default, declares no layout: left to vLLM's default preference it
    gets LBNHC (``VLLM_KV_CACHE_LAYOUT`` aside), which the agent refuses (next test). Shoal's
    connector asks for LBHNC, which FlashAttention takes, as vLLM's CPU backend does."""
    _vllm_0_32()
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

    from shoal_engine.kv.connector import ShoalConnector

    assert get_supported_kv_cache_layouts([FlashAttentionBackend])[0].name == "LBNHC"
    asked = ShoalConnector.get_required_kvcache_layout(None)  # type: ignore[arg-type]
    assert asked == "LBHNC"
    for backend in (FlashAttentionBackend, CPUAttentionBackend):
        assert asked in {layout.name for layout in get_supported_kv_cache_layouts([backend])}, backend


def test_an_lbnhc_kv_cache_is_refused_when_the_agent_starts(
    device: str, start: Callable[..., Started]
) -> None:
    """Where a backend cannot take LBHNC (vLLM then warns and uses its own first choice), the
    engine fails at start with the reason, never at its first migration."""
    with pytest.raises(ValueError, match="not contiguous"):
        start(vllm_kv_cache("LBNHC", on(device), seed=1), "a", transport_for(device))


def test_the_agent_works_on_the_kv_cache_in_place(
    device: str, start: Callable[..., Started], call: Callable[..., kv.AgentReply]
) -> None:
    """The agent's per-layer block views are vLLM's pages themselves, never a copy: what it sends
    is what the model wrote, and what it injects is what the model reads."""
    kv_cache = vllm_kv_cache("LBHNC", on(device), seed=1)
    started = start(kv_cache, "a", transport_for(device))
    status = call(started.control, kv.AgentStatus())
    assert isinstance(status, kv.Status), status
    assert (status.block_size, status.num_layers, status.bytes_per_block) == (BLOCK_SIZE, LAYERS, BLOCK_BYTES)
    for layer, view in enumerate(started.agent._layers):
        assert (view.device, view.dtype, tuple(view.shape)) == (on(device), torch.uint8, (BLOCKS, PAGE_BYTES))
        for block in (0, 1, 17, BLOCKS - 1):
            assert view[block].data_ptr() == kv_cache.page(layer, block).data_ptr(), (layer, block)
        assert torch.equal(view[17], kv_cache.page(layer, 17))


# ---- which transports a GPU KV cache is served with --------------------------------------------


def test_tcp_is_refused_for_a_gpu_kv_cache(cuda_device: torch.device, start: Callable[..., Started]) -> None:
    with pytest.raises(ValueError, match="host memory"):
        start(vllm_kv_cache("LBHNC", cuda_device, seed=1), "a", "tcp")


def test_gloo_is_refused_for_a_gpu_kv_cache() -> None:
    # Asked of the check itself, which needs no GPU: with a CUDA KV cache the agent would start,
    # and its first send would hand gloo device memory.
    with pytest.raises(ValueError, match="gloo"):
        check_backend("gloo", torch.device("cuda", 0))


# ---- staging and the checking commands -----------------------------------------------------------


def test_the_staging_arena_lives_on_the_kv_caches_device(device: str) -> None:
    """A chunk's run of slots is one region per layer on the cache's device, the region a
    transport receives straight into."""
    arena = StagingArena(LAYERS, PAGE_BYTES, 6, on(device))
    assert (arena.take(2), arena.take(4), arena.take(1)) == (0, 2, None)
    source = vllm_kv_cache("LBHNC", on(device), seed=3)
    for layer, view in enumerate(arena.views(2, 4)):
        assert (view.device, view.dtype, tuple(view.shape)) == (on(device), torch.uint8, (4, PAGE_BYTES))
        assert view.is_contiguous()
        view.copy_(torch.stack([source.page(layer, block) for block in (5, 6, 7, 8)]))
    for layer, whole in enumerate(arena.views(0, 6)):
        for slot, block in zip(range(2, 6), (5, 6, 7, 8), strict=True):
            assert torch.equal(whole[slot], source.page(layer, block)), (layer, slot)
    arena.give_back(0, 2)
    arena.give_back(2, 4)
    assert arena.take(6) == 0


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_read_blocks_answers_with_the_pages_bytes(
    device: str, start: Callable[..., Started], call: Callable[..., kv.AgentReply]
) -> None:
    kv_cache = vllm_kv_cache("LBHNC", on(device), seed=1)
    started = start(kv_cache, "a", transport_for(device))
    ids = [9, 3, 4]
    scheduled(started.agent, "r", ids, tokens=len(ids) * BLOCK_SIZE)
    reply = call(started.control, kv.ReadBlocks("r", 0, len(ids)))
    assert isinstance(reply, kv.BlockBytes), reply
    expected = b"".join(
        kv_cache.page(layer, block).cpu().numpy().tobytes() for block in ids for layer in range(LAYERS)
    )
    assert reply.data == expected


# ---- moving blocks -----------------------------------------------------------------------------

# The source request's blocks: runs (3 to 5, 12 to 15, 21 and 22) and strays; its last block is
# partly written. The target's request got other blocks from its vLLM.
SOURCE_IDS = [9, 3, 4, 5, 0, 12, 13, 14, 15, 30, 7, 21, 22]
TARGET_IDS = [33, 1, 2, 10, 11, 5, 6, 7, 8, 38, 0, 17, 18]
# Where the target stages chunks: its arena; fresh memory (no arena); the arena until it is full
# (three blocks), then fresh memory.
STAGING = {"arena": 64 << 20, "fresh": 0, "both": 3 * BLOCK_BYTES}


def _transfers() -> Iterator[Any]:
    for device, transport in (("cuda", "nccl"), ("cpu", "tcp"), ("cpu", "gloo")):
        for staging in STAGING:
            yield pytest.param(
                device, transport, "LBHNC", staging, id=f"{device}-{transport}-LBHNC-{staging}"
            )


def assert_staged(
    target: KvAgent, migration_id: str, source: VllmKv, block_ids: list[int], device: torch.device
) -> tuple[int, int]:
    """The target's staging area holds, for each of the request's blocks ``i``, the source's block
    ``block_ids[i]``, layer by layer and byte for byte. Returns the blocks staged and how many of
    them sit in the arena."""
    with target._lock:
        staged = target._data.staging[migration_id]
        chunks = sorted(staged.chunks.items())
        in_arena = sum(count for _, count in staged.runs)
    seen: list[int] = []
    for first, (count, layers) in chunks:
        assert len(layers) == LAYERS
        for offset in range(count):
            index = first + offset
            for layer, data in enumerate(layers):
                assert data.device == device, (index, layer)
                assert torch.equal(data[offset], source.page(layer, block_ids[index]).to(device)), (
                    f"staged block {index} (source block {block_ids[index]}), layer {layer}: bytes differ"
                )
            seen.append(index)
    assert seen == list(range(len(block_ids)))
    return len(seen), in_arena


@pytest.mark.parametrize(("device", "transport", "layout", "staging"), list(_transfers()))
def test_blocks_arrive_byte_for_byte(
    device: str,
    transport: str,
    layout: str,
    staging: str,
    start: Callable[..., Started],
    call: Callable[..., kv.AgentReply],
) -> None:
    """A migration's moves: the full blocks while the request runs (several chunks, more of them
    in flight than a peer keeps posted), then the held request's partial block; the staged bytes
    are the source's, and the injection puts them in the target request's blocks and nowhere else."""
    source_device, target_device = pair_devices(device)
    if transport == "nccl":
        transport_for(device)
    source_kv = vllm_kv_cache(layout, source_device, seed=1)
    target_kv = vllm_kv_cache(layout, target_device, seed=2)
    # Chunks of two blocks at most, so that runs are split and many chunks go per send.
    options = {"chunk_bytes": 2 * BLOCK_BYTES, "staging_bytes": STAGING[staging]}
    source = start(source_kv, "s", transport, **options)
    target = start(target_kv, "t", transport, **options)
    full = len(SOURCE_IDS) - 1
    scheduled(source.agent, "r", SOURCE_IDS, tokens=full * BLOCK_SIZE + 5)

    assert call(source.control, kv.Connect(target.data)) is None
    sent = call(source.control, kv.SendBlocks("r", "m", target.data, 0))
    assert isinstance(sent, kv.SentBlocks), sent
    assert (sent.next_block, sent.blocks, sent.bytes) == (full, full, full * BLOCK_BYTES)
    assert_staged(target.agent, "m", source_kv, SOURCE_IDS[:full], target_device)

    # The stop: the held request's last, partly written block follows.
    assert call(source.control, kv.Hold("r")) is None
    last = call(source.control, kv.SendBlocks("r", "m", target.data, full, partial=True))
    assert isinstance(last, kv.SentBlocks), last
    assert (last.next_block, last.blocks, last.bytes) == (full + 1, 1, BLOCK_BYTES)
    blocks, in_arena = assert_staged(target.agent, "m", source_kv, SOURCE_IDS, target_device)
    assert in_arena == {"arena": blocks, "fresh": 0, "both": 3}[staging]

    before = target_kv.snapshot()
    assert target.agent.inject(Load("r", "m", 0, TARGET_IDS)) == len(TARGET_IDS)
    assert target.agent.take_load_errors() == set()
    for index, (source_block, target_block) in enumerate(zip(SOURCE_IDS, TARGET_IDS, strict=True)):
        for layer in range(LAYERS):
            assert torch.equal(
                target_kv.page(layer, target_block), source_kv.page(layer, source_block).to(target_device)
            ), f"block {index}: target block {target_block} is not source block {source_block}, layer {layer}"
    for block in sorted(set(range(BLOCKS)) - set(TARGET_IDS)):
        for layer in range(LAYERS):
            assert torch.equal(target_kv.page(layer, block), before.page(layer, block)), (
                f"target block {block}, layer {layer}, changed though no block was injected there"
            )
    status = call(target.control, kv.AgentStatus())
    assert isinstance(status, kv.Status) and status.staged_bytes == 0 and not status.staging_areas, status
    assert target.agent._data.arena.free_slots() == target.agent._data.arena.slots
