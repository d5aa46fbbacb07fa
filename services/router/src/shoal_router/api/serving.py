"""Generation logic shared by ``/v1/completions`` and ``/v1/chat/completions``.

``Generation.start`` checks the model and the context length, picks an engine and sends the ADD
before any byte of the response is written, so every error known up front gets its own HTTP
status. While every engine is short of KV, the request first waits at the router for room, a
bounded time (``core.hold``). ``GenerationHandle.deltas`` then yields the request's output. An
engine that refuses the request (it is draining) or dies while serving it (its link dropped,
its heartbeat lapsed, its vLLM core died) is replaced by another one, which continues the
request after the tokens the client already has: the prompt plus those tokens go to it as a
resumed request, whose pieces start at the next index, so the stream goes on with every token
exactly once. At most ``max_attempts`` engines serve one request; past that, or with no engine
left, the stream ends with an error event. Leaving the iteration early (the client went away)
aborts the request on its engine.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence

from shoal_protos.messages import AddRequest, FinishReason, PieceError, SamplingOptions
from shoal_router.core.admission import Admission
from shoal_router.core.dispatch import EngineView
from shoal_router.core.hold import HoldLine, HoldPolicy
from shoal_router.core.outputs import RequestDelta, RequestOutputCollector
from shoal_router.core.scheduling import Ask, Scheduler
from shoal_router.errors import (
    ContextLengthError,
    EngineFailedError,
    InvalidRequestError,
    ModelNotFoundError,
    NoEngineError,
    RouterError,
)
from shoal_router.ipc.engines import EngineClient
from shoal_router.ipc.fleet import FleetView
from shoal_router.metrics import RouterMetrics


class Generation:
    """Everything a handler needs to run one generation request."""

    def __init__(
        self,
        router_id: str,
        configured_models: list[str],
        fleet: FleetView,
        engines: EngineClient,
        metrics: RouterMetrics,
        max_inflight: int,
        max_attempts: int,
        max_queued: int = 0,
        queue_timeout_s: float = 30.0,
        scheduler: Scheduler | None = None,
        session_header: str = "x-session-id",
        hold: HoldPolicy | None = None,
    ) -> None:
        self._router_id = router_id
        self._configured = configured_models
        self.fleet = fleet
        self.engines = engines
        self.metrics = metrics
        self.admission = Admission(max_inflight, max_queued, queue_timeout_s)
        self.max_attempts = max_attempts
        self.scheduler = scheduler or Scheduler()
        self.session_header = session_header
        self.inflight = 0
        # Requests waiting for an engine with KV room (``core.hold``); None: never held.
        self.held = HoldLine(hold, self.pick, self.roomiest) if hold is not None and hold.max_s > 0 else None
        # The gauges of requests in flight and waiting are read when scraped, not set per request.
        metrics.inflight.set_function(lambda: self.inflight)
        metrics.queued.set_function(lambda: self.admission.waiting)
        metrics.held.set_function(lambda: len(self.held) if self.held is not None else 0)

    @property
    def router_id(self) -> str:
        return self._router_id

    def served_models(self) -> list[str]:
        return sorted(set(self._configured) | self.fleet.models())

    def block_sizes(self) -> tuple[int, ...]:
        """The block sizes a prompt's blocks are looked up in, for the tokenizer to hash them in
        (none unless the scheduler reads the engines' prefix caches)."""
        cache = self.scheduler.prefix_cache
        return cache.index.block_sizes() if cache is not None else ()

    def check_model(self, model: str) -> None:
        if model not in self._configured and model not in self.fleet.models():
            raise ModelNotFoundError(model, self.served_models())

    def sampling(
        self,
        model: str,
        prompt_len: int,
        max_tokens: int | None,
        *,
        temperature: float | None,
        top_p: float | None,
        top_k: int | None,
        seed: int | None,
        stop: list[str],
        ignore_eos: bool,
    ) -> SamplingOptions:
        max_len = self.fleet.max_model_len(model)
        if max_len is None:
            raise NoEngineError(model)
        if prompt_len >= max_len:
            raise ContextLengthError(prompt_len, max_tokens or 0, max_len)
        if max_tokens is None:
            max_tokens = max_len - prompt_len
        elif prompt_len + max_tokens > max_len:
            raise ContextLengthError(prompt_len, max_tokens, max_len)
        return SamplingOptions(
            max_tokens=max_tokens,
            temperature=1.0 if temperature is None else temperature,
            top_p=1.0 if top_p is None else top_p,
            top_k=0 if top_k is None or top_k == -1 else top_k,
            seed=seed,
            stop=stop,
            ignore_eos=ignore_eos,
        )

    async def start(
        self,
        model: str,
        prompt_token_ids: list[int],
        sampling: SamplingOptions,
        on_close: Callable[[int], None] | None = None,
        session: str | None = None,
        priority: int = 0,
        block_hashes: Mapping[int, Sequence[int]] | None = None,
    ) -> GenerationHandle:
        """Admit the request (waiting in line for a slot if the router is full) and send it to
        an engine; the handle gives the slot back when it closes, and calls ``on_close`` with
        the output tokens it delivered. ``session`` (a client's session header) is what
        session affinity keys on; ``priority`` goes to the engine (below 0: a priority
        request); ``block_hashes``, the prompt's blocks as the tokenizer hashed them, spare
        dispatch hashing them."""
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty after tokenization", param="prompt")
        await self.admission.enter()
        handle: GenerationHandle | None = None
        try:
            handle = GenerationHandle(
                self,
                model,
                f"{self._router_id}-{secrets.token_hex(16)}",
                AddRequest("", prompt_token_ids, sampling, self.engines.reply_to, priority=priority),
                on_close,
                session,
                block_hashes,
            )
            if self.held is None or priority < 0:  # a priority request has its KV headroom
                handle.dispatch()
            else:
                await self._dispatch_when_room(handle)
        except BaseException:
            if handle is not None and handle.dispatched:
                handle.close()  # sent as the wait was cancelled: abort it there; frees the slot
            else:
                self.admission.leave()
            raise
        return handle

    async def _dispatch_when_room(self, handle: GenerationHandle) -> None:
        """Dispatch at once if an engine has KV room for the request (and none waits before
        it); else wait in the hold line until ``release_held`` sends it or fails it."""
        assert self.held is not None
        sent: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def send(view: EngineView) -> None:
            handle.dispatch(view)
            if not sent.done():
                sent.set_result(None)

        def fail(exc: Exception) -> None:
            if not sent.done():
                sent.set_exception(exc)

        spilled = self.held.spilled
        held = self.held.offer(handle.ask(), time.monotonic(), send, fail)
        self._count_hold(self.held.expired, spilled)
        if held is None:
            return
        try:
            await sent
        finally:
            self.held.leave(held)

    def release_held(self) -> None:
        """Send the held requests that now have room or waited their longest (called after
        each read of the fleet's load reports)."""
        if self.held is None or not len(self.held):
            return
        expired, spilled = self.held.expired, self.held.spilled
        self.held.release(time.monotonic())
        self._count_hold(expired, spilled)

    def _count_hold(self, expired: int, spilled: int) -> None:
        """The hold line's metrics, given its counts before what it just did."""
        assert self.held is not None
        if self.held.expired != expired:
            self.metrics.hold_expired.inc(self.held.expired - expired)
        if self.held.spilled != spilled:
            self.metrics.hold_spilled.inc(self.held.spilled - spilled)

    def pick(self, ask: Ask) -> EngineView:
        view = self.scheduler.pick(ask, self.fleet.engines_for(ask.model))
        if view is None:
            raise NoEngineError(ask.model)
        return view

    def roomiest(self, ask: Ask) -> EngineView | None:
        return self.scheduler.roomiest(ask, self.fleet.engines_for(ask.model))


class GenerationHandle:
    def __init__(
        self,
        generation: Generation,
        model: str,
        request_id: str,
        add: AddRequest,
        on_close: Callable[[int], None] | None = None,
        session: str | None = None,
        block_hashes: Mapping[int, Sequence[int]] | None = None,
    ) -> None:
        self._gen = generation
        self._session = session
        self._block_hashes = block_hashes or None
        self._on_close = on_close
        self.model = model
        self.request_id = request_id
        self._add = add
        add.request_id = request_id
        self.collector = RequestOutputCollector(request_id)
        self.arrived = time.monotonic()
        self._attempts = 0
        self._failed: set[str] = set()  # engines that refused or lost this request
        self._view: EngineView | None = None
        self._closed = False
        self._first_token_at: float | None = None
        self._last_token_at = 0.0
        self._last_engine = ""  # the engine whose tokens came last
        self.prompt_tokens = len(add.prompt_token_ids)
        self.finish_reason: str | None = None
        self._metrics = generation.metrics.for_model(model)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._add.prompt_token_ids

    @property
    def output_tokens(self) -> int:
        return self.collector.delivered

    @property
    def dispatched(self) -> bool:
        """Whether the request went to an engine (it may have ended there since)."""
        return self._attempts > 0

    def ask(self) -> Ask:
        """What dispatch weighs: the request's context, session and the engines it failed on."""
        add = self._add
        if add.output_token_ids:  # resumed: the engine takes in the tokens delivered too
            context = [*add.prompt_token_ids, *add.output_token_ids]
            return Ask(self.model, context, self._session, self._failed)
        return Ask(self.model, add.prompt_token_ids, self._session, self._failed, self._block_hashes)

    def dispatch(self, view: EngineView | None = None) -> None:
        """Send the request to ``view``, or to the engine dispatch picks now."""
        gen = self._gen
        add = self._add
        ask = self.ask()
        if view is None:
            view = gen.pick(ask)
        gen.engines.add(view.engine_id, add, self.collector)
        self._attempts += 1
        self._view = view
        view.sent(ask.blocks_on(view))
        if self._attempts == 1:
            gen.inflight += 1
            self._metrics.prompt_tokens.inc(self.prompt_tokens)
            self._metrics.queue.observe(time.monotonic() - self.arrived)
        gen.metrics.dispatched.labels(view.engine_id, self.model, gen.scheduler.name).inc()

    def _leave_engine(self) -> None:
        if self._view is not None:
            self._view.inflight -= 1
            self._view = None

    async def deltas(self) -> AsyncIterator[RequestDelta]:
        """Yield output until the request ends; raises ``EngineFailedError`` on an engine error
        that is not retried."""
        gen = self._gen
        try:
            while True:
                delta = await self.collector.get()
                error = delta.error
                if error is not None and error.retryable and self._attempts < gen.max_attempts:
                    if delta.token_ids:
                        # What the engine produced before it failed goes out first.
                        tokens_first = RequestDelta(
                            token_ids=delta.token_ids,
                            text=delta.text,
                            engine_id=delta.engine_id,
                            arrived=delta.arrived,
                        )
                        self.observe(tokens_first)
                        yield tokens_first
                    self._continue_elsewhere(error)
                    continue
                self.observe(delta)
                if delta.finished:
                    self._finish(delta)
                    if delta.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                        if delta.token_ids:
                            # Deliver what the engine produced before it failed, then the error.
                            yield RequestDelta(
                                token_ids=delta.token_ids, text=delta.text, arrived=delta.arrived
                            )
                        code = error.code if error else "engine_error"
                        message = error.message if error else "the engine ended the request with an error"
                        if code == "invalid_request":
                            raise InvalidRequestError(message, code=code)
                        raise EngineFailedError(message, code=code)
                    yield delta
                    return
                yield delta
        finally:
            self.close()

    def _continue_elsewhere(self, error: PieceError) -> None:
        """Send the request to another engine, continuing after the delivered tokens."""
        gen = self._gen
        collector = self.collector
        if self._view is not None:
            self._failed.add(self._view.engine_id)
        self._leave_engine()
        gen.engines.release(self.request_id)
        collector.reopen()
        self._add.output_token_ids = list(collector.token_ids)
        # A generation above any the request had: late pieces of the failed engine are ignored.
        self._add.generation = collector.generation + 1
        # The new engine's first tokens are not a migration (for the metrics).
        self._last_engine = ""
        try:
            self.dispatch()
        except RouterError as exc:
            if not collector.delivered:
                raise  # nothing was sent yet: the client gets the error's own status
            message = f"{error.message}; no other engine could continue it: {exc.message}"
            raise EngineFailedError(message, code=error.code) from exc
        if collector.delivered:
            gen.metrics.resumed.labels(self.model, error.code).inc()
        else:
            gen.metrics.dispatch_retries.inc()

    def observe(self, delta: RequestDelta) -> None:
        """Count output handed to the client: TTFT, gaps, tokens, and a move between engines."""
        count = len(delta.token_ids)
        if not count:
            return
        now = time.monotonic()
        metrics = self._metrics
        if self._first_token_at is None:
            self._first_token_at = now
            metrics.ttft.observe(now - self.arrived)
        else:
            metrics.token_gap.observe((now - self._last_token_at) / count)
            if delta.engine_id and self._last_engine and delta.engine_id != self._last_engine:
                # The request moved mid-stream: what the client waited across the switch.
                metrics.migrations.inc()
                metrics.migration_stall.observe(now - self._last_token_at)
                self._moved_to(delta.engine_id)
        self._last_token_at = now
        if delta.engine_id:
            self._last_engine = delta.engine_id
        metrics.output_tokens.inc(count)

    def _moved_to(self, engine_id: str) -> None:
        """Count the request on its new engine (dispatch weighs each engine by what runs there)."""
        view = self._gen.fleet.engines.get(engine_id)
        if view is not None and view is not self._view:
            self._leave_engine()
            view.inflight += 1
            self._view = view

    def _finish(self, delta: RequestDelta) -> None:
        self.finish_reason = str(delta.finish_reason)
        now = time.monotonic()
        metrics = self._gen.metrics
        metrics.e2e.labels(self.model, self.finish_reason).observe(now - self.arrived)
        if self._first_token_at is not None and self.collector.delivered > 1:
            tpot = (self._last_token_at - self._first_token_at) / (self.collector.delivered - 1)
            self._metrics.tpot.observe(tpot)

    def close(self) -> None:
        """Release the request; abort it on its engine if it has not finished."""
        if self._closed:
            return
        self._closed = True
        gen = self._gen
        if self.collector.finished:
            gen.engines.release(self.request_id)
        else:
            gen.engines.abort(self.request_id, "client disconnected")
            gen.metrics.e2e.labels(self.model, "client_disconnected").observe(time.monotonic() - self.arrived)
        self._leave_engine()
        gen.inflight -= 1
        gen.admission.leave()
        if self._on_close is not None:
            self._on_close(self.collector.delivered)
