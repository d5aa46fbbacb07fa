"""The engine's request logic: run requests on the backend, batch their outputs per router.

Each ADD becomes one asyncio task that iterates the backend's output stream. Every new output
becomes a ``RequestPiece`` appended to the outbox of the request's router. The first piece added
after a flush schedules the next flush with ``call_soon``: the backend hands out one engine
step's outputs to all its streams in one pass, the woken tasks run one after another, and the
flush runs after them, so one step becomes one ``OutputBatch`` per router. The flush only moves
the batches to the sender thread; encoding and sending happen there.

An ABORT cancels the request's task; cancelling the backend stream aborts the request in the
backend. A done-callback on each task sends the final piece when the stream did not (``ABORT``
on cancellation, ``ERROR`` with a code on a failure) and forgets the request, so this holds even
for a task cancelled before it ever ran.

Migration (``shoal_engine.migration``) uses three more calls: ``stop_for_migration`` stops a
request without a final piece and returns its token state; ``start`` runs a request that
continues after output tokens it already has (on the target, or back here if the target
failed); ``hand_over`` tells the router the request's new owner and remembers where it went, so
an ABORT that still arrives here is passed on.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from shoal_engine.backend import BackendDeadError, BackendRequestError, EngineBackend, EngineTimes
from shoal_engine.kv.params import KvLoad
from shoal_engine.metrics import EngineMetrics
from shoal_protos.messages import (
    AbortRequest,
    AddRequest,
    FinishReason,
    OutputBatch,
    PieceError,
    RequestPiece,
    SamplingOptions,
)

logger = logging.getLogger(__name__)

SendBatch = Callable[[str, OutputBatch], None]
ForwardAbort = Callable[[str, str, str], None]
"""(owner engine id, request id, reason): pass an ABORT on to a request's new owner."""


@dataclass(slots=True)
class _Running:
    add: AddRequest
    kv_load: KvLoad | None = None
    task: asyncio.Task[None] | None = None
    abort_reason: str = ""
    # Output tokens of this request so far, those it arrived with included.
    output_ids: list[int] = field(default_factory=list)
    final: RequestPiece | None = None
    # Set by stop_for_migration: the task ends without a final piece, right after its next
    # output or when cancelled.
    migrating: bool = False
    # The request stopped here to go on elsewhere (its stream was closed for the migration).
    handed_off: bool = False
    # Wall-clock time of the latest output tokens (a migration's target measures its client's
    # gap from the source's last one).
    last_output_at: float = 0.0
    # Set at its first output here: its KV here is complete from then on (a request that
    # arrived by migration has its staged blocks loaded).
    output_here: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def produced(self) -> int:
        return len(self.output_ids) - len(self.add.output_token_ids)


@dataclass(frozen=True, slots=True)
class StoppedRequest:
    """A request stopped for migration: everything needed to continue it elsewhere."""

    add: AddRequest
    output_ids: list[int]
    last_output_at: float


@dataclass(slots=True)
class _Outbox:
    pieces: dict[str, list[RequestPiece]] = field(default_factory=dict)
    scheduled: bool = False


class EngineService:
    def __init__(
        self,
        engine_id: str,
        backend: EngineBackend,
        send: SendBatch,
        metrics: EngineMetrics,
        on_fatal: Callable[[BaseException], None],
    ) -> None:
        self._engine_id = engine_id
        self._backend = backend
        self._send = send
        self._metrics = metrics
        self._on_fatal = on_fatal
        self._running: dict[str, _Running] = {}
        self.received: dict[str, int] = {}
        """ADD frames taken in from each router (by its output address) since the start; the
        load report carries it (``LoadReport.received``)."""
        # Requests that moved away: request id -> owner engine id (bounded, oldest dropped).
        self._moved: dict[str, str] = {}
        self.forward_abort: ForwardAbort | None = None
        # A request continued here (moved, or its engine died): its first output's wall time,
        # the engine's stamps of it, and when it reached this service (``time.monotonic``).
        self.on_first_output: Callable[[AddRequest, float, EngineTimes | None, float], None] | None = None
        self._outbox = _Outbox()
        self._step = 0
        self._draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def num_requests(self) -> int:
        return len(self._running)

    @property
    def draining(self) -> bool:
        return self._draining

    def set_draining(self, draining: bool) -> None:
        """Refuse new requests (retryable, so routers send them elsewhere) or take them again."""
        self._draining = draining

    def request_ids(self) -> list[str]:
        return [rid for rid, running in self._running.items() if not running.migrating]

    def tokens_of(self, request_id: str) -> int | None:
        """Prompt plus output tokens of a running request (None when it is not running here)."""
        running = self._running.get(request_id)
        if running is None or running.migrating:
            return None
        return len(running.add.prompt_token_ids) + len(running.output_ids)

    def token_ids_of(self, request_id: str) -> list[int] | None:
        """Prompt plus output token ids of a running request (None when it is not running here)."""
        running = self._running.get(request_id)
        if running is None or running.migrating:
            return None
        return running.add.prompt_token_ids + running.output_ids

    async def prefill(self, request_id: str, token_ids: list[int], kv_load: KvLoad) -> None:
        """Run ``token_ids`` through the backend for one token, dropped: no request of the
        fleet's, nothing sent to a router. A migration's warm-up (its KV loaded from staging
        by ``kv_load``) leaves the context in the backend's prefix cache."""
        stream = self._backend.generate(
            request_id, token_ids, SamplingOptions(max_tokens=1, temperature=0.0), kv_load
        )
        try:
            async for _ in stream:
                pass
        finally:
            await stream.aclose()

    async def wait_output_here(self, request_id: str, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for a running request's first output on this engine (at
        once if it has one). A request that just arrived, by migration or not, has no KV blocks
        here to send before its first step. False if it has none by then or is not running."""
        running = self._running.get(request_id)
        if running is None:
            return False
        if running.output_here.is_set():
            return True
        try:
            await asyncio.wait_for(running.output_here.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def moved_to(self, request_id: str) -> str | None:
        """The engine a request that left this one went to, if it is remembered."""
        return self._moved.get(request_id)

    def cheapest_to_move(self, min_left: int, held: Callable[[list[int]], int] | None = None) -> str | None:
        """The running request a balancing migration should move: of those that produced a
        token here (their KV exists) and have at least ``min_left`` tokens to go, the one with
        the least KV to copy (its tokens, less those the target holds already: ``held`` of its
        token ids), a request that is not a priority request before any that is (moves make
        room for priority requests). None when no request qualifies."""
        best: tuple[bool, int, str] | None = None
        for request_id, running in self._running.items():
            if running.migrating or running.produced < 1:
                continue
            ids = running.add.prompt_token_ids + running.output_ids
            tokens = len(ids)
            limit = self.max_tokens_of(request_id) or tokens
            to_copy = tokens - held(ids) if held is not None else tokens
            candidate = (running.add.priority < 0, to_copy, request_id)
            if limit - tokens >= min_left and (best is None or candidate < best):
                best = candidate
        return None if best is None else best[2]

    @property
    def num_priority(self) -> int:
        """Priority requests (priority below 0) the engine holds."""
        return sum(1 for running in self._running.values() if running.add.priority < 0)

    def live_by_router(self) -> dict[str, int]:
        """Requests running here now, by their router's output address (``LoadReport.live``)."""
        return dict(collections.Counter(running.add.reply_to for running in self._running.values()))

    def max_tokens_of(self, request_id: str) -> int | None:
        running = self._running.get(request_id)
        if running is None:
            return None
        return (
            len(running.add.prompt_token_ids)
            + len(running.add.output_token_ids)
            + running.add.sampling.max_tokens
        )

    def on_request(self, message: AddRequest | AbortRequest) -> None:
        """Called on the event loop for each decoded frame."""
        if isinstance(message, AddRequest):
            self.received[message.reply_to] = self.received.get(message.reply_to, 0) + 1
            self._add(message)
        else:
            for request_id in message.request_ids:
                self.abort(request_id, message.reason)

    def _add(self, add: AddRequest) -> None:
        if self._draining:
            self._refuse(
                add, PieceError("engine_draining", f"engine {self._engine_id} is draining", retryable=True)
            )
            return
        if add.request_id in self._running:
            self._refuse(add, PieceError("duplicate_request", f"request {add.request_id} already runs here"))
            return
        self.start(add)

    def start(self, add: AddRequest, kv_load: KvLoad | None = None) -> None:
        """Run ``add`` (continuing after ``add.output_token_ids`` if it has any)."""
        self._moved.pop(add.request_id, None)
        running = _Running(add, kv_load, output_ids=list(add.output_token_ids))
        self._running[add.request_id] = running
        self._idle.clear()
        running.task = asyncio.create_task(self._run(running), name=f"request-{add.request_id}")
        running.task.add_done_callback(functools.partial(self._done, running))

    def _refuse(self, add: AddRequest, error: PieceError) -> None:
        """End a request that was never started with ``error``."""
        piece = RequestPiece(add.request_id, 0, finish_reason=FinishReason.ERROR, error=error)
        self._emit(add.reply_to, piece)

    def abort(self, request_id: str, reason: str) -> bool:
        running = self._running.get(request_id)
        if running is None or running.task is None:
            owner = self._moved.get(request_id)
            if owner is not None and self.forward_abort is not None:
                self.forward_abort(owner, request_id, reason)
            return False
        running.abort_reason = reason
        running.task.cancel()
        return True

    def router_lost(self, reply_to: str) -> int:
        """Abort every request of the router whose output address is ``reply_to`` (its link
        dropped: the router died, and its clients with it). Returns how many."""
        self.received.pop(reply_to, None)
        lost = [rid for rid, running in self._running.items() if running.add.reply_to == reply_to]
        for request_id in lost:
            self.abort(request_id, f"router at {reply_to} is gone")
        if lost:
            logger.warning("router at %s is gone: aborted its %d requests", reply_to, len(lost))
        return len(lost)

    async def stop_for_migration(self, request_id: str, align_s: float = 1.0) -> StoppedRequest | None:
        """Stop a request without a final piece, right after its next output (waiting at most
        ``align_s``): the client's gap then starts at its last token, and the step vLLM still
        runs for it before the abort lands overlaps the hand-over. None if it is not running
        (it finished, was aborted, or is already moving)."""
        running = self._running.get(request_id)
        if running is None or running.task is None or running.migrating or running.final is not None:
            return None
        running.migrating = True
        done, _ = await asyncio.wait([running.task], timeout=align_s)
        if not done and running.final is None:
            # No output in time (it waits in vLLM's queue): stop it where it is.
            running.handed_off = True
            running.task.cancel()
            await asyncio.wait([running.task])
        if not running.handed_off or running.abort_reason:
            # It ended meanwhile (finished or failed: its final piece went out as usual), or
            # its client left.
            return None
        return StoppedRequest(running.add, list(running.output_ids), running.last_output_at)

    def hand_over(self, add: AddRequest, owner: str, generation: int) -> None:
        """Tell the router that ``owner`` serves the request from now on (generation
        ``generation``), and remember where it went for late ABORTs."""
        self._moved[add.request_id] = owner
        if len(self._moved) > 10_000:
            del self._moved[next(iter(self._moved))]
        first_index = len(add.output_token_ids)
        self._emit(
            add.reply_to, RequestPiece(add.request_id, first_index, generation=generation, owner=owner)
        )

    async def _run(self, running: _Running) -> None:
        """Stream the request's outputs; the final piece and the clean-up are ``_done``'s."""
        add = running.add
        self._metrics.prompt_tokens.inc(len(add.prompt_token_ids))
        prompt, sampling = add.prompt_token_ids, add.sampling
        if add.output_token_ids:
            prompt = prompt + add.output_token_ids
            sampling = msgspec.structs.replace(
                sampling, max_tokens=sampling.max_tokens - len(add.output_token_ids)
            )
        stream = self._backend.generate(
            add.request_id, prompt, sampling, running.kv_load, add.priority, len(add.output_token_ids)
        )
        async for out in stream:
            piece = RequestPiece(
                add.request_id,
                len(running.output_ids),
                token_ids=out.token_ids,
                text=out.text,
                finish_reason=out.finish_reason,
                stop_reason=out.stop_reason,
                generation=add.generation,
            )
            if out.token_ids:
                first_here = not running.last_output_at
                running.last_output_at = time.time()
                running.output_here.set()
                if first_here and add.output_token_ids and self.on_first_output is not None:
                    self.on_first_output(add, running.last_output_at, out.engine_times, time.monotonic())
            running.output_ids.extend(out.token_ids)
            if out.finish_reason is not None:
                piece.num_prompt_tokens = len(add.prompt_token_ids)
                running.final = piece
            self._emit(add.reply_to, piece)
            if running.migrating and running.final is None and out.token_ids:
                # Stopping for a migration: end here, after the piece just sent.
                running.handed_off = True
                break
        if running.handed_off:
            await stream.aclose()  # vLLM aborts the request (its blocks are held for the move)

    def _done(self, running: _Running, task: asyncio.Task[None]) -> None:
        """Runs when a request's task ends in any way, even cancelled before it started, so
        every request gets exactly one final piece and leaves ``_running``."""
        add = running.add
        final = running.final
        self._metrics.output_tokens.inc(running.produced)
        if running.handed_off and final is None and not running.abort_reason:
            self._metrics.finished("migrated")
        else:
            if final is None:
                final = self._final_piece(running, task)
                self._emit(add.reply_to, final)
            self._metrics.finished(str(final.finish_reason))
        if self._running.get(add.request_id) is running:  # not a successor started since
            del self._running[add.request_id]
        if not self._running:
            self._idle.set()

    def _final_piece(self, running: _Running, task: asyncio.Task[None]) -> RequestPiece:
        add = running.add

        def ended(reason: FinishReason, error: PieceError) -> RequestPiece:
            return RequestPiece(
                add.request_id,
                len(running.output_ids),
                finish_reason=reason,
                num_prompt_tokens=len(add.prompt_token_ids),
                error=error,
                generation=add.generation,
            )

        if task.cancelled():
            return ended(FinishReason.ABORT, PieceError("aborted", running.abort_reason or "aborted"))
        exc = task.exception()
        if exc is None:
            # The backend closed the stream without a finish reason; say so.
            return ended(FinishReason.ERROR, PieceError("stream_ended", "engine stream ended early"))
        if isinstance(exc, BackendRequestError):
            return ended(FinishReason.ERROR, PieceError("invalid_request", str(exc)))
        if isinstance(exc, BackendDeadError):
            self._on_fatal(exc)
            return ended(FinishReason.ERROR, PieceError("engine_dead", str(exc), retryable=True))
        logger.error("request %s failed", add.request_id, exc_info=exc)
        return ended(FinishReason.ERROR, PieceError("internal_error", f"{type(exc).__name__}: {exc}"))

    def _emit(self, reply_to: str, piece: RequestPiece) -> None:
        outbox = self._outbox
        outbox.pieces.setdefault(reply_to, []).append(piece)
        if not outbox.scheduled:
            outbox.scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        outbox = self._outbox
        pieces, outbox.pieces, outbox.scheduled = outbox.pieces, {}, False
        self._step += 1
        for reply_to, batch_pieces in pieces.items():
            self._metrics.batch_pieces.observe(len(batch_pieces))
            self._send(reply_to, OutputBatch(self._engine_id, self._step, batch_pieces))

    async def drain(self, timeout_s: float) -> int:
        """Take no new requests; wait up to ``timeout_s`` for running ones, abort the rest.

        Returns how many requests were aborted."""
        self._draining = True
        if self._running:
            logger.info("draining: waiting up to %.0f s for %d requests", timeout_s, len(self._running))
            try:
                await asyncio.wait_for(self._idle.wait(), timeout_s)
            except TimeoutError:
                pass
        left = list(self._running)
        for request_id in left:
            self.abort(request_id, f"engine {self._engine_id} shut down before the request finished")
        if left:
            await self._idle.wait()
        return len(left)
