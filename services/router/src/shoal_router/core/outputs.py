"""Per-request mailboxes: put engine pieces in order, drop repeats, hand them to one reader.

The ingest task calls ``RequestOutputCollector.put`` for every piece of the request, from any
engine. Pieces carry the index of their first output token, so the collector:

* appends a piece that starts where the delivered tokens end,
* holds one that starts later until the gap is filled,
* drops one whose tokens were all delivered already (a repeat after a resend),
* trims the delivered head off one that overlaps.

The reader (the HTTP handler) takes everything that arrived since its last read in one go, so a
slow client gets bigger chunks instead of an ever longer queue: the mailbox has one slot, as
vLLM's ``RequestOutputCollector`` does.

A streaming reader may also install ``push`` (the SSE relay's ``Pusher``, ``api.relay``): while
it waits in ``get`` with nothing unread, pieces with tokens (neither the last nor an error) go to
``push`` from the ingest task instead of waking the reader's task. That is what most pieces of a
stream are, and waking a task for each one would be paid for every token relayed. With a ``ready``
list (the ingest task's), such a piece waits in the mailbox and the collector joins the list;
the ingest task calls ``flush`` once it has taken every batch that was waiting, so the pieces
of several batches go out as one delta. ``push`` takes its delta whole; it removes itself
(``push = None``) when it cannot go on writing (its client is behind), and the mailbox then
fills and wakes the reader as before.

The collector also keeps the token ids it delivered and the newest ownership generation it saw:
when the request's engine dies, they are what another engine needs to continue the request
(``reopen`` then readies the collector for the new engine's pieces).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from shoal_protos.messages import FinishReason, PieceError, RequestPiece


@dataclass(slots=True)
class RequestDelta:
    """Everything new for a request since the reader's last ``get``."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    error: PieceError | None = None
    # The engine that produced the last piece.
    engine_id: str = ""
    # ``time.perf_counter()`` when the oldest of these tokens reached the router (0: none did,
    # the router made the delta itself): the start of the delay the router adds.
    arrived: float = 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestOutputCollector:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.delivered = 0
        # The delivered output token ids (``len(token_ids) == delivered``).
        self.token_ids: list[int] = []
        # The newest ownership generation among the accepted pieces.
        self.generation = 0
        self.finished = False
        self._pending: RequestDelta | None = None
        self._held: dict[int, tuple[str, RequestPiece, float]] = {}
        # The reader's wake-up while it waits in ``get`` (a bare future: an ``asyncio.Event``
        # costs more per token, and there is only ever one reader).
        self._waiter: asyncio.Future[None] | None = None
        # Set by a streaming reader: takes the new output while the reader waits (above).
        self.push: Callable[[RequestDelta], None] | None = None
        # The ingest task's list of collectors to ``flush`` (None: push at once).
        self.ready: list[RequestOutputCollector] | None = None
        self._in_ready = False

    def put(self, engine_id: str, piece: RequestPiece, arrived: float = 0.0) -> None:
        """Take a piece from ``engine_id`` that reached the router at ``arrived``
        (``time.perf_counter()``)."""
        if self.finished:
            return
        end = piece.first_index + len(piece.token_ids)
        if piece.first_index > self.delivered:
            self._held[piece.first_index] = (engine_id, piece, arrived)
            return
        if end <= self.delivered and piece.token_ids:
            return  # a repeat: every token was delivered already
        self._accept(engine_id, piece, self.delivered - piece.first_index, arrived)
        self._release_held()

    def _release_held(self) -> None:
        """Deliver held pieces that now follow on, trimming or dropping what was delivered."""
        while self._held and not self.finished:
            start = min(self._held)
            if start > self.delivered:
                return
            engine_id, piece, arrived = self._held.pop(start)
            if start + len(piece.token_ids) <= self.delivered and piece.finish_reason is None:
                continue  # every token of it arrived in the meantime
            self._accept(engine_id, piece, self.delivered - start, arrived)

    def fail(self, error: PieceError, generation: int = 0) -> None:
        """End the request with an error from the router's side (for example its engine died
        while serving it under ownership ``generation``)."""
        if self.finished:
            return
        self._accept(
            "",
            RequestPiece(
                self.request_id,
                self.delivered,
                finish_reason=FinishReason.ERROR,
                error=error,
                generation=generation,
            ),
            0,
        )

    def _accept(self, engine_id: str, piece: RequestPiece, overlap: int, arrived: float = 0.0) -> None:
        pending = self._pending
        if pending is None:
            pending = self._pending = RequestDelta(arrived=arrived)
        elif arrived and (not pending.arrived or arrived < pending.arrived):
            pending.arrived = arrived
        tokens = piece.token_ids[overlap:] if overlap else piece.token_ids
        pending.token_ids.extend(tokens)
        self.token_ids.extend(tokens)
        self.generation = max(self.generation, piece.generation)
        # Text of a partly repeated piece cannot be split by token, so the piece's text is kept
        # only when none of its tokens were delivered before.
        if not overlap:
            pending.text += piece.text
        pending.engine_id = engine_id
        self.delivered += len(tokens)
        if piece.finish_reason is not None:
            pending.finish_reason = piece.finish_reason
            pending.stop_reason = piece.stop_reason
            pending.num_prompt_tokens = piece.num_prompt_tokens
            pending.error = piece.error
            self.finished = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            if self.push is not None and not self.finished and pending.token_ids:
                # The reader has read everything else and waits: hand this on without it.
                ready = self.ready
                if ready is None:
                    self.flush()
                elif not self._in_ready:
                    self._in_ready = True
                    ready.append(self)
                return
            waiter.set_result(None)

    def flush(self) -> None:
        """Hand what waits in the mailbox to ``push``, or else to the reader, if the reader
        waits for it."""
        self._in_ready = False
        waiter = self._waiter
        if self._pending is None or waiter is None or waiter.done():
            return  # nothing new, or the reader is up and takes it
        push = self.push
        if push is None:
            waiter.set_result(None)
            return
        pending, self._pending = self._pending, None
        push(pending)

    def get_nowait(self) -> RequestDelta | None:
        delta, self._pending = self._pending, None
        return delta

    async def get(self) -> RequestDelta:
        while self._pending is None:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        delta = self.get_nowait()
        assert delta is not None
        return delta

    def reopen(self) -> None:
        """Forget the failure that ended the request, so another engine can continue it after
        the delivered tokens (its pieces start at index ``delivered``). Held pieces of the
        failed engine are dropped; unread tokens stay for the reader, without the failure."""
        self.finished = False
        self._held.clear()
        pending = self._pending
        if pending is not None and pending.token_ids:
            pending.finish_reason = pending.stop_reason = pending.error = None
        else:
            self._pending = None
