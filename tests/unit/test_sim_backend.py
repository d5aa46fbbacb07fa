"""The simulated engine backend: streams, determinism, the step-time model, KV block accounting,
preemption when the cache is full, aborts, and the batch limit. Runs at a high ``speed`` (the
model's step times divided by it) so the tests take milliseconds."""

from __future__ import annotations

import asyncio

import pytest

from shoal_engine.backend import BackendRequestError
from shoal_engine.kv.params import KvLoad
from shoal_protos.messages import FinishReason, SamplingOptions
from shoal_sim.engine import (
    STEP_MODELS,
    SimBatch,
    SimConfig,
    SimRequest,
    SimulatedBackend,
    StepModel,
    step_features,
)

FAST = 2000.0


async def _started(speed: float = FAST, **config: object) -> SimulatedBackend:
    backend = SimulatedBackend(SimConfig(speed=speed, **config))  # type: ignore[arg-type]
    await backend.start()
    return backend


async def _run(
    backend: SimulatedBackend, prompt: list[int], max_tokens: int, **sampling: object
) -> tuple[list[int], FinishReason | None]:
    tokens: list[int] = []
    finish = None
    options = SamplingOptions(max_tokens=max_tokens, **sampling)  # type: ignore[arg-type]
    async for output in backend.generate(f"r{len(prompt)}-{prompt[0]}", prompt, options):
        tokens += output.token_ids
        finish = output.finish_reason
        assert output.text == "".join(f" {t}" for t in output.token_ids)
    return tokens, finish


async def test_a_request_streams_its_tokens_the_same_for_the_same_seed() -> None:
    backend = await _started(seed=7)
    try:
        tokens, finish = await _run(backend, [1, 2, 3], 25)
        again, _ = await _run(backend, [1, 2, 3], 25)
        other, _ = await _run(backend, [1, 2, 4], 25)
    finally:
        backend.shutdown()
    assert len(tokens) == 25 and finish is FinishReason.LENGTH
    assert again == tokens and other != tokens
    reseeded = await _started(seed=8)
    try:
        assert (await _run(reseeded, [1, 2, 3], 25))[0] != tokens
    finally:
        reseeded.shutdown()


async def test_a_stop_token_ends_the_request() -> None:
    backend = await _started(vocab_size=4)  # a token out of four: one of them comes soon
    try:
        tokens, finish = await _run(backend, [5, 6], 500, stop_token_ids=[3])
    finally:
        backend.shutdown()
    assert finish is FinishReason.STOP and tokens[-1] == 3 and 3 not in tokens[:-1]


def test_step_time_grows_with_batch_context_and_prefill() -> None:
    model = STEP_MODELS["smollm2-cpu"]
    assert model.step_ms(0, [], 0) == 0.0  # an idle engine runs no step
    # Steps measured on the engine the fit comes from (docs/benchmarks.md, bench-stepfit).
    one = model.step_ms(1, [], 512)
    assert one == pytest.approx(16.2, rel=0.1)
    assert model.step_ms(16, [], 16 * 512) == pytest.approx(55.3, rel=0.1)
    assert model.step_ms(0, [(1900, 0)], 0) == pytest.approx(1642.4, rel=0.1)
    assert model.step_ms(0, [(256, 1024)], 0) == pytest.approx(254.0, rel=0.1)
    # A prompt split over two steps costs more than in one (its second chunk attends to its first).
    whole = model.step_ms(0, [(2000, 0)], 0)
    split = model.step_ms(4, [(2044, 0)], 4 * 256) + model.step_ms(4, [(1, 2044)], 4 * 257)
    assert split > whole
    gpu = STEP_MODELS["llama3-8b-a100"]
    assert 8.0 < gpu.step_ms(64, [], 64 * 1000) < 20.0  # memory-bound decode: weights dominate
    assert isinstance(gpu, StepModel) and gpu.source


def test_step_features_match_the_coefficients() -> None:
    """The fit and the model read the same terms: a step of one chunk after a cached prefix is
    the sum of its parts."""
    model = STEP_MODELS["smollm2-cpu"]
    features = step_features(2, [(100, 50)], 300)
    assert features == (1.0, 2.0, 1.0, 100.0, 0.35, (100 * 50 + 100 * 100 / 2) / 1000)
    expected = (
        model.base_ms + 2 * model.decode_ms + model.chunk_ms + 100 * model.prefill_ms
        + 0.35 * model.context_us + 10.0 * model.pair_us
    )  # fmt: skip
    assert model.step_ms(2, [(100, 50)], 300) == pytest.approx(expected)


def test_a_long_prompt_is_prefilled_in_chunks_beside_the_decoding_batch() -> None:
    """vLLM's chunked prefill: running requests decode first, a waiting prompt takes what the
    step's token budget leaves, and its next chunk continues in the next step; it gets its first
    token only when its whole prompt is computed, and holds only the blocks of its chunks."""
    config = SimConfig(kv_blocks=256, block_size=16, max_batched_tokens=64, max_model_len=512)
    batch = SimBatch(config)
    decoding = [SimRequest(f"d{i}", 10, 50) for i in range(4)]
    for request in decoding:
        batch.add(request)
    batch.finish(batch.plan())  # 40 prompt tokens, one step: one token each
    long = SimRequest("long", 100, 5)
    batch.add(long)
    step = batch.plan()
    assert step is not None
    assert [(r.request_id, n) for r, n in step.scheduled] == [
        ("d0", 1),
        ("d1", 1),
        ("d2", 1),
        ("d3", 1),
        ("long", 60),
    ]
    assert long.blocks == 4  # 60 tokens' worth, not the whole prompt's
    emitted = batch.finish(step)
    assert [r.request_id for r, _ in emitted] == ["d0", "d1", "d2", "d3"] and long.generated == 0
    step = batch.plan()
    assert step is not None and step.scheduled[-1] == (long, 40)
    assert step.ms == pytest.approx(batch.model.step_ms(4, [(40, 60)], sum(r.context for r in decoding)))
    emitted = batch.finish(step)
    assert long.generated == 1 and long.computed == 100 and long.blocks == 7
    step = batch.plan()
    assert step is not None and (long, 1) in step.scheduled


def test_a_step_gives_tokens_only_to_requests_still_in_its_batch() -> None:
    """A request that leaves its batch during a step (moved: dropped there, admitted in the
    target's batch) gets no token from the step it left, though the step listed it; requests
    that finish leave the batch, and the others keep their order."""
    config = SimConfig(kv_blocks=64, block_size=16, max_model_len=256)
    source, target = SimBatch(config), SimBatch(config)
    requests = [SimRequest(f"r{i}", 20, 2 if i == 1 else 50) for i in range(4)]
    for request in requests:
        source.add(request)
    source.finish(source.plan())  # prefills all four: one token each
    step = source.plan()
    assert step is not None and [r for r, _ in step.scheduled] == requests
    moved = requests[2]
    source.drop(moved)
    reserved = target.blocks(moved.context + 1)
    assert target.reserve(reserved)
    target.admit_moved(moved, reserved)
    emitted = source.finish(step)
    assert [r.request_id for r, _ in emitted] == ["r0", "r1", "r3"]
    assert moved.generated == 1 and list(target.running) == [moved]
    assert requests[1].finish == FinishReason.LENGTH and requests[1] not in source.running
    assert list(source.running) == [requests[0], requests[3]]
    assert source.free == 64 - sum(r.blocks for r in source.running)


async def test_blocks_follow_the_contexts_and_come_back() -> None:
    backend = await _started(speed=1.0, block_size=16, kv_blocks=512, max_model_len=2048)
    try:
        stream = backend.generate("a", list(range(40)), SamplingOptions(max_tokens=30))
        first = await anext(stream)
        assert len(first.token_ids) >= 1
        load = backend.load()
        # 40 prompt tokens plus the ones generated, and room for the next: 3 or 4 blocks.
        assert load.num_running == 1 and 3 <= load.kv_blocks_used <= 5
        async for _ in stream:
            pass
        assert backend.load().kv_blocks_used == 0 and backend.load().kv_blocks_total == 512
    finally:
        backend.shutdown()


async def test_a_full_cache_preempts_and_every_request_still_completes() -> None:
    # 8 blocks of 16 tokens: each request grows to 120 tokens (8 blocks), so two cannot both fit.
    backend = await _started(block_size=16, kv_blocks=8, max_model_len=128)
    alone = await _started(block_size=16, kv_blocks=64, max_model_len=128)
    try:
        prompts = [list(range(10 + i, 50 + i)) for i in range(3)]
        results = await asyncio.gather(*(_run(backend, p, 80) for p in prompts))
        references = [await _run(alone, p, 80) for p in prompts]
    finally:
        backend.shutdown()
        alone.shutdown()
    assert backend.preemptions >= 1 and alone.preemptions == 0
    assert results == references  # preemption recomputes; nothing lost, nothing repeated
    assert backend.load().kv_blocks_used == 0


async def test_a_request_continued_elsewhere_draws_the_tokens_it_would_have_drawn() -> None:
    """Moved (or taken over after its engine died) with the tokens it had, a request goes on
    with the same tokens as the one never moved, as greedy decoding of the same context does."""
    backend = await _started(seed=3)
    try:
        whole, _ = await _run(backend, [4, 5, 6], 30)
        tokens: list[int] = []
        options = SamplingOptions(max_tokens=30 - 12)
        async for output in backend.generate("moved", [4, 5, 6, *whole[:12]], options, produced=12):
            tokens += output.token_ids
    finally:
        backend.shutdown()
    assert whole[:12] + tokens == whole


async def test_each_request_counts_the_times_it_lost_its_blocks() -> None:
    """What the simulated KV agent reads to tell a send its request was preempted during."""
    backend = await _started(block_size=16, kv_blocks=8, max_model_len=128)
    seen: dict[str, int] = {}

    async def run(prompt: list[int]) -> None:
        request_id = f"p{prompt[0]}"
        options = SamplingOptions(max_tokens=80)
        async for _ in backend.generate(request_id, prompt, options):
            seen[request_id] = backend.times_preempted(request_id)

    try:
        await asyncio.gather(*(run(list(range(10 + i, 50 + i))) for i in range(3)))
        assert backend.times_preempted("p10") == 0  # finished: not here any more
    finally:
        backend.shutdown()
    # A preempted request runs again before it ends, so its last output saw all its preemptions.
    assert backend.preemptions >= 1 and sum(seen.values()) == backend.preemptions


async def test_an_abort_frees_the_requests_blocks() -> None:
    backend = await _started(kv_blocks=256, max_model_len=4096)
    try:
        stream = backend.generate("a", list(range(300)), SamplingOptions(max_tokens=1000))
        await anext(stream)
        assert backend.load().kv_blocks_used >= 19
        await stream.aclose()  # the client went away
        assert backend.load().kv_blocks_used == 0 and backend.load().num_running == 0
    finally:
        backend.shutdown()


async def test_the_batch_limit_keeps_requests_waiting() -> None:
    backend = await _started(speed=50.0, max_num_seqs=1)
    try:
        first = asyncio.create_task(_run(backend, [1, 2], 200))
        second = backend.generate("b", [3, 4], SamplingOptions(max_tokens=5))
        waiting = asyncio.create_task(anext(second))
        # The first is admitted at the next step; the second then waits behind it.
        deadline = asyncio.get_running_loop().time() + 5
        while (backend.load().num_running, backend.load().num_waiting) != (1, 1):
            assert asyncio.get_running_loop().time() < deadline, backend.load()
            await asyncio.sleep(0.001)
        assert not waiting.done()
        await first
        await waiting
        await second.aclose()
    finally:
        backend.shutdown()


async def test_a_migrated_request_with_its_kv_staged_skips_the_prefill() -> None:
    """The target side of a simulated migration: with the blocks of the source's KV staged (the
    simulated KV agent counted them), the request joins the batch at once with its context's
    KV, and the agent sees its KV tokens; without them it is computed again from the prompt."""
    backend = await _started(speed=1.0, kv_blocks=256, max_model_len=4096)
    try:
        context = list(range(101))  # prompt plus the outputs so far
        backend.staging.add("m1", 7)  # ceil(100 / 16): every token but the last sampled one
        moved = backend.generate(
            "moved",
            context,
            SamplingOptions(max_tokens=50),
            kv_load=KvLoad(migration="m1", tokens=100),
        )
        first = asyncio.create_task(anext(moved))
        deadline = asyncio.get_running_loop().time() + 5
        while backend.tokens_written("moved") != 100:  # admitted with its KV, before any step
            assert asyncio.get_running_loop().time() < deadline, backend.tokens_written("moved")
            await asyncio.sleep(0.001)
        assert backend.staging.snapshot() == {}  # taken on admission
        await first
        await moved.aclose()
        recomputed = backend.generate(
            "again",
            context,
            SamplingOptions(max_tokens=5),
            kv_load=KvLoad(migration="m2", tokens=100),
        )
        assert backend.tokens_written("again") is None  # not started before iteration
        await anext(recomputed)
        assert backend.tokens_written("again") == 101  # it prefilled, then sampled one token
        await recomputed.aclose()
    finally:
        backend.shutdown()


async def test_bad_requests_and_configs_are_refused() -> None:
    backend = await _started(max_model_len=64, kv_blocks=8)
    try:
        with pytest.raises(BackendRequestError, match="max_model_len"):
            await anext(backend.generate("a", list(range(60)), SamplingOptions(max_tokens=10)))
    finally:
        backend.shutdown()
    with pytest.raises(ValueError, match="unknown step model"):
        SimulatedBackend(SimConfig(model="gpt-9"))
    with pytest.raises(ValueError, match="at least one request"):
        SimulatedBackend(SimConfig(kv_blocks=4, block_size=16, max_model_len=128))


def _run_out(batch: SimBatch) -> None:
    while (step := batch.plan()) is not None:
        batch.finish(step)


def test_the_prefix_cache_skips_the_blocks_an_earlier_prompt_left_and_evicts_oldest_first() -> None:
    """As vLLM's prefix cache: a prompt whose leading blocks an earlier request computed starts
    after them (at least its last token is computed), the blocks of requests that ended stay
    cached in free blocks until those are taken, least recently used first, and the cache's
    changes are what its KV events would say."""
    from shoal_protos.prefix import chain_hashes

    config = SimConfig(kv_blocks=24, block_size=16, max_batched_tokens=512, max_model_len=256)
    batch = SimBatch(config)
    system = list(range(64))
    first = SimRequest("first", 96, 2, prefix=chain_hashes([*system, *range(1000, 1032)], 16))
    batch.add(first)
    step = batch.plan()
    assert step is not None and step.scheduled == [(first, 96)] and first.cached_tokens == 0
    _run_out(batch)
    stored, removed = batch.take_changes()
    assert stored == list(first.prefix) and removed == []
    # A second prompt sharing the 64-token system prompt computes only what follows it.
    second = SimRequest("second", 80, 2, prefix=chain_hashes([*system, *range(2000, 2016)], 16))
    batch.add(second)
    step = batch.plan()
    assert step is not None and step.scheduled == [(second, 16)] and second.cached_tokens == 64
    _run_out(batch)
    assert (batch.cache_hits, batch.cache_queries) == (64, 176)
    # A whole prompt cached still computes its last token.
    again = SimRequest("again", 96, 2, prefix=first.prefix)
    batch.add(again)
    step = batch.plan()
    assert step is not None and step.scheduled == [(again, 1)]
    _run_out(batch)
    batch.take_changes()
    # A request that needs every block evicts what was cached, least recently used first:
    # second's own last block (``again`` used the system prompt's and first's since).
    big = SimRequest("big", 24 * 16 - 8, 2)
    batch.add(big)
    batch.finish(batch.plan())  # type: ignore[arg-type]
    stored, removed = batch.take_changes()
    assert stored == [] and set(removed) == {*first.prefix, *second.prefix}
    assert removed[0] == second.prefix[-1] and removed[-1] == first.prefix[-1]
    assert batch.cached_blocks(first.prefix) == 0
