"""``SimulatedBackend``: the ``EngineBackend`` protocol with vLLM replaced by a step-time model.

Fleet experiments need more engines than one machine can run for real. A simulated engine is
the real engine service (the same ZeroMQ frames to routers, the same records and load reports
in Redis) with this backend in place of vLLM, so the real router and its scheduler drive it.

The model follows vLLM's (V1) scheduler, simplified:

* The KV cache holds ``kv_blocks`` blocks of ``block_size`` tokens; a request holds the blocks
  of the tokens of its context whose KV it computed (``SimRequest.computed``).
* Each step has a budget of ``max_batched_tokens`` tokens. Running requests come first, oldest
  first: one decoding computes one token; one whose prompt is part-way through its prefill
  computes the rest of it, or as much as the budget leaves (chunked prefill). A request that
  needs a block when none is free preempts the newest running request (vLLM's recompute
  preemption: its blocks are freed, it goes back to the head of the line with the tokens it
  has, and is prefilled again when readmitted). Then, unless the step preempted, waiting
  requests are admitted first come first served while a batch slot (``max_num_seqs``), the
  budget and the blocks of their first chunk last. There is no prefix cache: every prompt is
  computed in full.
* A step lasts ``StepModel.step_ms(decoding requests, prompt chunks, context tokens)``, divided
  by ``speed`` (above 1: faster than the modelled hardware, for quick runs); the model of a CPU
  engine is fit to a real one (``bench.stepfit``). A request whose whole context is computed
  at the end of a step gets a token.
* Token ids are drawn from a generator seeded by the engine's seed and the prompt, so a run is
  the same for the same seed. There is no end-of-sequence token: a request runs to its
  ``max_tokens`` or to one of its ``stop_token_ids``. The text of a token is its id.

* Migrations: with ``--migration``, the engine runs ``shoal_sim.kv_agent`` in place of the KV agent
  in vLLM's worker. A request's KV is its context but the last sampled token; moving it takes
  ``blocks x kv_bytes_per_token x block_size / kv_gbps`` (divided by ``speed``), and a migrated
  request whose blocks were staged joins the batch with no prefill (``SimBatch.admit_moved``).
  It continues with the token ids it would have drawn unmoved: its generator is seeded by the
  client's prompt and advanced past the tokens it already has.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
from array import array
from collections import Counter as Tally
from collections import OrderedDict, deque
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field

from prometheus_client import Counter

from shoal_engine.backend import (
    BackendDeadError,
    BackendInfo,
    BackendLoad,
    BackendOutput,
    BackendRequestError,
    EngineTimes,
)
from shoal_engine.config import EngineConfig
from shoal_engine.kv.params import KvLoad
from shoal_protos import kv
from shoal_protos.messages import FinishReason, SamplingOptions
from shoal_sim.kv_agent import SimKvAgent, SimStaging

logger = logging.getLogger(__name__)
PREEMPTIONS = Counter(
    "shoal_sim_preemptions", "Requests a simulated engine preempted for want of KV blocks (recompute)"
)
"""In the default registry, so an engine's /metrics shows it (only simulated engines have it)."""


Chunk = tuple[int, int]
"""A prompt's share of one step: (tokens computed, tokens of its context before them). The tokens
before are earlier chunks of the same prompt (chunked prefill) or a prefix-cache hit."""


def step_features(decoding: int, chunks: Sequence[Chunk], context_tokens: int) -> tuple[float, ...]:
    """What a step's time is linear in, in ``StepModel.coefficients``' order: 1 (any step),
    requests decoding, prompt chunks, prompt tokens computed, thousands of tokens of KV read
    (the decoding requests' contexts and each chunk's context before it), thousands of (query,
    key) pairs the prompt tokens attend across. The fit (``bench.stepfit``) and the model share
    it, so they cannot disagree on the terms."""
    tokens = sum(n for n, _ in chunks)
    before = sum(prior for _, prior in chunks)
    pairs = sum(n * prior + n * n / 2.0 for n, prior in chunks)
    return (
        1.0,
        float(decoding),
        float(len(chunks)),
        float(tokens),
        (context_tokens + before) / 1000.0,
        pairs / 1000.0,
    )


@dataclass(frozen=True)
class StepModel:
    """The duration of one engine step from what it computes.

    ``base_ms`` is paid by every step that runs anything (reading the weights, launching the
    step), ``decode_ms`` per request decoding a token, ``chunk_ms`` per prompt chunk (a prompt
    computed in the step: its own attention call and sampling), ``prefill_ms`` per prompt token
    computed, ``context_us`` per token of KV read from the cache (a decoding request's context,
    a chunk's context before it), and ``pair_us`` per (query, key) pair a prompt's tokens
    attend across: its own tokens' triangle plus everything before them (earlier chunks, a
    prefix-cache hit).
    """

    name: str
    base_ms: float
    decode_ms: float
    chunk_ms: float
    prefill_ms: float
    context_us: float
    pair_us: float
    source: str

    @property
    def coefficients(self) -> tuple[float, ...]:
        return (self.base_ms, self.decode_ms, self.chunk_ms, self.prefill_ms, self.context_us, self.pair_us)

    def step_ms(self, decoding: int, chunks: Sequence[Chunk], context_tokens: int) -> float:
        if not decoding and not chunks:
            return 0.0
        features = step_features(decoding, chunks, context_tokens)
        return sum(c * f for c, f in zip(self.coefficients, features, strict=True))


STEP_MODELS = {
    model.name: model
    for model in (
        StepModel(
            name="smollm2-cpu",
            base_ms=13.98,
            decode_ms=0.9342,
            chunk_ms=1.891,
            prefill_ms=0.5038,
            context_us=2.927,
            pair_us=0.3686,
            source="SmolLM2-135M-Instruct in bf16 on one core of an AVX-512 (bf16) machine, as the "
            "fleet runs it: a fit to 29 measured step shapes (make bench-stepfit, docs/benchmarks.md, "
            "with each shape's error held out of the fit). CPUs differ several times in speed: refit "
            "on the machine a comparison runs on",
        ),
        StepModel(
            name="llama3-8b-a100",
            base_ms=8.0,
            decode_ms=0.05,
            chunk_ms=0.0,
            prefill_ms=0.1,
            context_us=0.066,
            pair_us=0.0034,
            source="a roofline estimate for Llama-3.1-8B in bf16 on one A100-80GB: 16 GB of weights "
            "read per step at 2.0 TB/s (8 ms), 128 KiB of KV per context token read per decode, "
            "16 GFLOP per prefilled token at half of 312 TFLOPS",
        ),
        StepModel(
            name="llama2-7b-a10",
            base_ms=22.5,
            decode_ms=0.1,
            chunk_ms=0.0,
            prefill_ms=0.22,
            context_us=0.87,
            pair_us=0.0084,
            source="a roofline estimate for LLaMA-2-7B in fp16 on one A10-24GB (Llumnix's setting): "
            "13.5 GB of weights read per step at 600 GB/s (22.5 ms), 512 KiB of KV per context "
            "token read per decode, 14 GFLOP per prefilled token at half of 125 TFLOPS",
        ),
    )
}


@dataclass(frozen=True)
class SimConfig:
    model: str = "smollm2-cpu"
    kv_blocks: int = 4096
    block_size: int = 16
    max_num_seqs: int = 64
    max_batched_tokens: int = 2048
    max_model_len: int = 8192
    speed: float = 1.0
    seed: int = 0
    vocab_size: int = 32_000
    kv_bytes_per_token: int = 131_072
    """KV cache bytes per token (LLaMA-3-8B in fp16: 32 layers x 8 KV heads x 128 x 2 x 2 bytes);
    what a migration moves per token."""
    kv_gbps: float = 8.0
    """Gigabytes per second a migration's KV moves between two simulated engines."""
    step: StepModel | None = None
    """A step model of its own (a fit made in the same run) in place of ``model``'s."""

    @property
    def bytes_per_block(self) -> int:
        return self.kv_bytes_per_token * self.block_size


@dataclass(eq=False)
class SimRequest:
    """One request in a ``SimBatch``: its lengths, its token generator and the blocks it holds."""

    request_id: str
    prompt_len: int
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    rng: random.Random | None = None
    """Draws the token ids; None: every token is 0 (the fleet simulator needs only counts)."""
    generated: int = 0
    blocks: int = 0
    computed: int = 0
    """Tokens of its context whose KV the batch holds: the context but the last sampled token
    while it decodes, fewer while its prompt is prefilled chunk by chunk, 0 when preempted."""
    finish: FinishReason | None = None
    preempted: int = 0
    """Times it was preempted (its blocks freed) here."""
    load_ms: float = 0.0
    """Added to the next step that runs it (a moved request's admission and KV load)."""
    prefix: Sequence[int] = ()
    """The hashes of its prompt's full blocks (``shoal_protos.prefix.chain_hashes``), which the
    engine's prefix cache keeps: empty, no caching."""
    holds_prefix: bool = False
    """Whether its prefix blocks are counted as in use here (admitted, not yet gone)."""
    cached_tokens: int = 0
    """Prompt tokens its last admission found in the prefix cache."""

    @property
    def context(self) -> int:
        return self.prompt_len + self.generated

    @property
    def left(self) -> int:
        return self.max_tokens - self.generated


@dataclass(frozen=True, slots=True)
class Step:
    """What one engine step computes: each scheduled request with the tokens it computes (1 for
    one decoding, a chunk of its context for one being prefilled), and how long the step takes
    in the modelled hardware's milliseconds."""

    scheduled: list[tuple[SimRequest, int]]
    ms: float


class SimBatch:
    """The batch and KV cache of a simulated engine, as plain bookkeeping with no clock:
    ``plan`` says what the next step computes and how long it lasts, ``finish`` applies it.
    ``SimulatedBackend`` runs it on asyncio time; the fleet benchmark runs many on simulated
    time."""

    def __init__(self, config: SimConfig) -> None:
        if config.step is None and config.model not in STEP_MODELS:
            raise ValueError(f"unknown step model {config.model!r} (known: {', '.join(STEP_MODELS)})")
        if config.kv_blocks * config.block_size < config.max_model_len:
            # Else a request could outgrow the whole cache and wait forever.
            raise ValueError("the KV cache must hold at least one request of max_model_len tokens")
        self.config = config
        self.model = config.step or STEP_MODELS[config.model]
        self.waiting: deque[SimRequest] = deque()
        # The running requests, oldest first, as the keys of a dict: a step asks whether each
        # of its requests still runs here (a search of a list made a step quadratic in the
        # batch's size), and a request that finishes or is dropped leaves at once.
        self.running: dict[SimRequest, None] = {}
        self.free = config.kv_blocks
        self.preemptions = 0
        self.steps = 0
        # The prefix cache, as vLLM keeps it: the blocks running requests hold (shared, counted
        # by requests) and, in least recently used order, those whose requests left, kept in
        # free blocks until the blocks are taken.
        self._in_use: Tally[int] = Tally()
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._changes: dict[int, bool] = {}
        self.cache_queries = self.cache_hits = 0
        """Prompt tokens looked up in the prefix cache at admission, and found there."""

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.config.block_size)

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    def add(self, request: SimRequest) -> None:
        self.waiting.append(request)

    def drop(self, request: SimRequest) -> None:
        """An aborted (or moved) request leaves the line or the batch and gives its blocks back."""
        if request in self.running:
            del self.running[request]
        elif request in self.waiting:
            self.waiting.remove(request)
        self.free += request.blocks
        request.blocks = 0
        self._release_prefix(request)

    # ---- the prefix cache -------------------------------------------------------------------

    def cached_blocks(self, prefix: Sequence[int]) -> int:
        """Leading blocks of ``prefix`` the prefix cache holds."""
        found = 0
        for block in prefix:
            if block not in self._in_use and block not in self._cached:
                break
            found += 1
        return found

    def _admit_prefix(self, request: SimRequest, hit: int) -> None:
        """A request admitted from the line with nothing computed, ``hit`` tokens of its prompt
        found cached (``_hit``): those count as computed, and its prompt's blocks are in use now."""
        if not request.prefix:
            return
        self.cache_queries += request.prompt_len
        self.cache_hits += hit
        request.cached_tokens = request.computed = hit
        self._hold_prefix(request)

    def _hold_prefix(self, request: SimRequest) -> None:
        for block in request.prefix:
            was_cached = self._cached.pop(block, 0) is None
            if not was_cached and block not in self._in_use:
                self._changes[block] = True
            self._in_use[block] += 1
        request.holds_prefix = True

    def _release_prefix(self, request: SimRequest) -> None:
        """The request left: its prompt's blocks stay cached in free blocks, newest last."""
        if not request.holds_prefix:
            return
        request.holds_prefix = False
        for block in request.prefix:
            self._in_use[block] -= 1
            if self._in_use[block] <= 0:
                del self._in_use[block]
                self._cached[block] = None
                self._cached.move_to_end(block)
        self._evict()

    def _evict(self) -> None:
        """Free blocks taken for other uses lose what they cached, least recently used first."""
        while len(self._cached) > self.free:
            block, _ = self._cached.popitem(last=False)
            self._changes[block] = False

    def take_changes(self) -> tuple[list[int], list[int]]:
        """Blocks the cache gained and lost since the last call (as vLLM's KV events say)."""
        changes, self._changes = self._changes, {}
        return [b for b, kept in changes.items() if kept], [b for b, kept in changes.items() if not kept]

    def reserve(self, blocks: int) -> bool:
        """Set ``blocks`` aside for a request moving here, if they are free and a batch slot is
        open; ``admit_moved`` (or ``unreserve``) settles them."""
        if blocks > self.free or len(self.running) >= self.config.max_num_seqs:
            return False
        self.free -= blocks
        self._evict()
        return True

    def unreserve(self, blocks: int) -> None:
        self.free += blocks

    def admit_moved(self, request: SimRequest, reserved: int) -> None:
        """A request whose KV arrived from another engine joins the batch with no prefill; it
        takes the blocks reserved for it, and more if it grew meanwhile (when free)."""
        need = self.blocks(request.context + 1)
        self.free += reserved
        if need > self.free:
            # It grew past what was reserved and the cache filled meanwhile: recompute later.
            request.blocks = request.computed = 0
            self.waiting.appendleft(request)
            return
        self.free -= need
        request.blocks = need
        request.computed = request.context - 1
        self.running[request] = None
        # Its blocks are cached here now, as the target's vLLM caches the blocks it loaded.
        self._hold_prefix(request)
        self._evict()

    def load(self, into: BackendLoad) -> BackendLoad:
        into.num_running = len(self.running)
        into.num_waiting = len(self.waiting)
        into.kv_blocks_used = self.config.kv_blocks - self.free
        into.kv_blocks_total = self.config.kv_blocks
        return into

    def _preempt_newest(self) -> SimRequest:
        victim, _ = self.running.popitem()
        self.free += victim.blocks
        victim.blocks = victim.computed = 0
        self._release_prefix(victim)
        victim.preempted += 1
        self.waiting.appendleft(victim)
        self.preemptions += 1
        PREEMPTIONS.inc()
        return victim

    def _schedule_running(self, budget: int) -> tuple[list[tuple[SimRequest, int]], int, bool]:
        """vLLM's first pass: every running request, oldest first, gets the tokens it needs
        (one to decode, the rest of its prompt to prefill) while the step's token budget lasts,
        and the blocks they fill; when none is free the newest running request is preempted
        (recompute), and a request that cannot get its blocks ends the pass."""
        scheduled: list[tuple[SimRequest, int]] = []
        preempted = False
        for request in list(self.running):
            if budget <= 0:
                break
            if request not in self.running:
                continue  # preempted earlier in this pass
            n = min(request.context - request.computed, budget)
            need = self.blocks(request.computed + n) - request.blocks
            while need > self.free:
                preempted = True
                if self._preempt_newest() is request:
                    return scheduled, budget, preempted
            self.free -= max(0, need)
            request.blocks += max(0, need)
            scheduled.append((request, n))
            budget -= n
        return scheduled, budget, preempted

    def _schedule_waiting(self, budget: int) -> list[tuple[SimRequest, int]]:
        """vLLM's second pass: waiting requests, first come first served, while a batch slot, the
        token budget (a prompt over it is split over steps: chunked prefill) and the blocks of
        the chunk last."""
        scheduled: list[tuple[SimRequest, int]] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            fresh = request.computed == 0 and request.blocks == 0
            start = self._hit(request) if fresh else request.computed
            n = min(request.context - start, budget)
            need = self.blocks(start + n) - request.blocks
            if need > self.free:
                break
            self.waiting.popleft()
            if fresh:
                self._admit_prefix(request, start)
            self.free -= need
            request.blocks += need
            self.running[request] = None
            scheduled.append((request, n))
            budget -= n
        return scheduled

    def _hit(self, request: SimRequest) -> int:
        """Prompt tokens an admission of ``request`` now would find cached (vLLM computes at
        least the prompt's last token)."""
        if not request.prefix:
            return 0
        return max(
            min(self.cached_blocks(request.prefix) * self.config.block_size, request.prompt_len - 1), 0
        )

    def plan(self) -> Step | None:
        """Schedule the next step as vLLM's scheduler does; None when there is nothing to run."""
        if self.idle:
            return None
        scheduled, budget, preempted = self._schedule_running(self.config.max_batched_tokens)
        if not preempted:  # vLLM admits nothing in a step that preempted
            scheduled += self._schedule_waiting(budget)
        scheduled = [(r, n) for r, n in scheduled if r in self.running]
        self._evict()
        if not scheduled:  # cannot happen (a lone request always fits)
            raise RuntimeError("the simulated engine has requests but can run none")
        decoding, context, chunks, extra = 0, 0, [], 0.0
        for request, n in scheduled:
            extra, request.load_ms = extra + request.load_ms, 0.0
            if n == 1 and request.computed == request.context - 1 and request.generated:
                decoding += 1
                context += request.context
            else:
                chunks.append((n, request.computed))
        return Step(scheduled, self.model.step_ms(decoding, chunks, context) + extra)

    def finish(self, step: Step) -> list[tuple[SimRequest, int]]:
        """End ``step``: each of its requests still running computes its tokens, and those whose
        whole context is computed get a token; finished requests leave the batch. Returns the
        (request, token id) pairs."""
        emitted = []
        for request, n in step.scheduled:
            if request not in self.running:  # aborted or moved during the step
                continue
            request.computed += n
            if request.computed < request.context:
                continue  # a chunk of its prompt: no token yet
            token = request.rng.randrange(self.config.vocab_size) if request.rng is not None else 0
            request.generated += 1
            if token in request.stop_token_ids:
                request.finish = FinishReason.STOP
            elif request.generated >= request.max_tokens:
                request.finish = FinishReason.LENGTH
            if request.finish is not None:
                del self.running[request]
                self.free += request.blocks
                request.blocks = 0
                self._release_prefix(request)
            emitted.append((request, token))
        self.steps += 1
        return emitted


def _written(request: SimRequest) -> int:
    return request.computed if request.blocks else 0


@dataclass(eq=False)
class _Stream:
    """Tokens of one request not yet handed to its ``generate`` iterator."""

    request: SimRequest
    pending: list[int] = field(default_factory=list)
    waiter: asyncio.Future[None] | None = None
    """What its ``generate`` awaits while it has no tokens: a bare future, cheaper per token
    than an ``asyncio.Event``'s wait and set."""
    queued: float = 0.0
    times: EngineTimes | None = None
    """Set with its first token: when it joined the batch, and the step that made that token."""

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class SimulatedBackend:
    """An engine whose model is ``StepModel`` and whose batch and KV cache are a ``SimBatch``."""

    def __init__(self, config: SimConfig) -> None:
        self.batch = SimBatch(config)
        self.config = config
        self.model = self.batch.model
        self._streams: dict[str, _Stream] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._load = BackendLoad(kv_blocks_total=config.kv_blocks)
        # Blocks of migrations arriving here, as the simulated KV agent counts them.
        self.staging = SimStaging()
        # Requests a migration holds (the agent's Hold): the KV tokens they had when they left
        # the batch (None while they still run), until the agent releases them.
        self._holds: dict[str, int | None] = {}
        # When each of the last steps ended (``time.monotonic``), for the simulated KV agent's
        # ``ReadSteps``.
        self.step_ends: deque[float] = deque(maxlen=kv.STEPS_KEPT)

    def tokens_written(self, request_id: str) -> int | None:
        """Tokens whose KV the batch computed for a request: its context but the last sampled
        token, once a step ran it or its KV arrived (0 before); for a held request that left
        the batch, what it had then; None: not here. Called from the simulated KV agent's
        thread; it only reads."""
        stream = self._streams.get(request_id)
        if stream is None:
            return self._holds.get(request_id)
        return _written(stream.request)

    def times_preempted(self, request_id: str) -> int:
        """How often the request lost its blocks here (0 when not here): a migration's send
        during which this grows sent blocks the request no longer had."""
        stream = self._streams.get(request_id)
        return stream.request.preempted if stream is not None else 0

    def hold(self, request_id: str) -> None:
        """Keep the request's KV count after it leaves the batch (a migration's stop)."""
        self._holds[request_id] = None

    def release(self, request_id: str) -> None:
        self._holds.pop(request_id, None)

    @property
    def preemptions(self) -> int:
        return self.batch.preemptions

    @property
    def steps(self) -> int:
        return self.batch.steps

    async def start(self) -> BackendInfo:
        self._task = asyncio.create_task(self._run(), name="simulated-engine")
        logger.info(
            "simulated engine: %s (%s), %d KV blocks of %d tokens, speed x%g",
            self.model.name,
            self.model.source,
            self.config.kv_blocks,
            self.config.block_size,
            self.config.speed,
        )
        return BackendInfo(
            max_model_len=self.config.max_model_len,
            kv_blocks_total=self.config.kv_blocks,
            kv_block_size=self.config.block_size,
        )

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingOptions,
        kv_load: KvLoad | None = None,
        priority: int = 0,
        produced: int = 0,
    ) -> AsyncGenerator[BackendOutput]:
        # ``priority`` is not used: the simulated batch admits first come, first served, as
        # vLLM's FCFS policy does.
        if len(prompt_token_ids) + sampling.max_tokens > self.config.max_model_len:
            raise BackendRequestError(
                f"prompt ({len(prompt_token_ids)}) plus max_tokens ({sampling.max_tokens}) exceed "
                f"max_model_len ({self.config.max_model_len})"
            )
        # Seeded by the client's prompt alone: a request continued here after ``produced`` tokens
        # elsewhere (moved, or its engine died) draws on from where it was, as greedy decoding
        # of the same context would.
        original = prompt_token_ids[: len(prompt_token_ids) - produced]
        digest = hashlib.blake2b(array("q", original).tobytes(), digest_size=8).digest()
        rng = random.Random(int.from_bytes(digest, "little") ^ self.config.seed ^ (sampling.seed or 0))
        for _ in range(produced):
            rng.randrange(self.config.vocab_size)
        request = SimRequest(
            request_id,
            len(prompt_token_ids),
            sampling.max_tokens,
            frozenset(sampling.stop_token_ids),
            rng,
        )
        stream = _Stream(request)
        self._streams[request_id] = stream
        if kv_load is not None and await self._staged(kv_load.migration, kv_load.tokens):
            # Its KV arrived: it joins the batch with no prefill (or waits, if the cache filled).
            reserved = self.batch.blocks(request.context + 1)
            if self.batch.reserve(reserved):
                self.batch.admit_moved(request, reserved)
            else:
                self.batch.add(request)
        else:
            self.batch.add(request)
        stream.queued = time.monotonic()
        self._wake.set()
        loop = asyncio.get_running_loop()
        told = False
        try:
            while True:
                if not stream.pending:
                    stream.waiter = loop.create_future()
                    await stream.waiter
                tokens, stream.pending = stream.pending, []
                text = "".join(f" {token}" for token in tokens)
                yield BackendOutput(tokens, text, request.finish, engine_times=None if told else stream.times)
                told = True
                if request.finish is not None:
                    return
        finally:
            if request_id in self._holds:
                self._holds[request_id] = _written(request)
            self._streams.pop(request_id, None)
            if request.finish is None:
                self.batch.drop(request)

    async def _staged(self, migration_id: str, tokens: int, wait_s: float = 0.5) -> bool:
        """Whether the blocks holding ``tokens`` tokens of a migration were staged here; the
        source announces them before its commit, but on another socket, so they get a moment
        to land. The staging is cleared either way."""
        need = -(-tokens // self.config.block_size)
        deadline = asyncio.get_running_loop().time() + wait_s
        while self.staging.blocks(migration_id) < need:
            if asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.002)
        return self.staging.take(migration_id) >= need

    def load(self) -> BackendLoad:
        return self.batch.load(self._load)

    async def check_health(self) -> None:
        if self._task is not None and self._task.done():
            raise BackendDeadError("the simulated engine's step loop ended")

    def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        step_ema_ms = 0.0
        while True:
            step = self.batch.plan()
            if step is None:
                self._load.step_time_ms = step_ema_ms = 0.0
                self._wake.clear()
                await self._wake.wait()
                continue
            started, began = loop.time(), time.monotonic()
            await asyncio.sleep(max(0.0, started + step.ms / 1000.0 / self.config.speed - loop.time()))
            finished = self.batch.finish(step)
            ended = time.monotonic()
            self.step_ends.append(ended)
            for request, token in finished:
                stream = self._streams.get(request.request_id)
                if stream is not None:
                    if stream.times is None:
                        stream.times = EngineTimes(stream.queued, began, ended)
                    stream.pending.append(token)
                    stream.wake()
            elapsed_ms = (loop.time() - started) * 1000.0
            step_ema_ms = elapsed_ms if not step_ema_ms else 0.8 * step_ema_ms + 0.2 * elapsed_ms
            self._load.step_time_ms = step_ema_ms


def simulated_engine(config: EngineConfig) -> tuple[SimulatedBackend, SimKvAgent | None]:
    """The simulated backend an engine of ``config`` (``--backend sim``) runs, and, with
    ``--migration``, the KV agent that times its moves (started; the caller closes it)."""
    sim = SimConfig(
        model=config.model,
        kv_blocks=config.sim_kv_blocks,
        block_size=config.block_size or 16,
        max_num_seqs=config.max_num_seqs,
        max_model_len=config.max_model_len or 8192,
        speed=config.sim_speed,
        seed=config.sim_seed,
        kv_bytes_per_token=config.sim_kv_bytes_per_token,
        kv_gbps=config.sim_kv_gbps,
    )
    backend = SimulatedBackend(sim)
    if not config.migration:
        return backend, None
    # vLLM's worker runs the real KV agent; the simulated engine runs one that times the moves
    # at the configured bandwidth (sped up as its steps are).
    agent = SimKvAgent(
        backend,
        config.kv_agent_address,
        config.kv_data_bind,
        sim.block_size,
        sim.bytes_per_block,
        sim.kv_gbps * 1e9 * sim.speed,
    )
    agent.start()
    return backend, agent
