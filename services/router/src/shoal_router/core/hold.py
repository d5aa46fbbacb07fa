"""Holding new requests at the router while every engine is short of KV cache.

An engine admits a waiting request as soon as its prompt fits in the free KV blocks, without
counting how its running requests will grow. When they grow into a full cache, vLLM preempts the
newest of them and recomputes it later, and the fleet's decode latency takes the blow; in the
fleet benchmark most preemptions happen when the whole fleet is nearly out of KV. The router
sees every engine's freeness (Llumnix's KV blocks left per batch slot, ``EngineView.free``), so
it can do better than the engines alone: while the engine dispatch would pick, and the engine
with the most room as well, have less than ``below`` blocks per slot left once the request's
prompt is counted, the request waits at the router, first come first served, and goes out as
soon as a load report shows room, or after ``max_s`` at most. The wait is bounded so that a
fleet that stays full still serves (its engines queue as before), and a request never waits
longer than a client would notice against its time to first token.

``HoldLine`` is the line itself, with no clock and no event loop of its own: the router calls
``release`` after each read of the fleet (``FleetView.poll_forever``) and the fleet simulation
after each load report, so both run the same decisions. Requests are sent through callbacks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from shoal_router.core.dispatch import EngineView
from shoal_router.core.scheduling import Ask


@dataclass(frozen=True)
class HoldPolicy:
    below: float = 2.0
    """Freeness (KV blocks per batch slot, counting the request's prompt) under which a new
    request waits for room."""
    max_s: float = 1.0
    """The longest a request waits; 0 sends every request at once."""

    def room(self, view: EngineView, ask: Ask) -> bool:
        """Whether ``view`` has room for ``ask``: its freeness once the prompt is sent. An
        engine whose KV size nobody knows yet (no size registered, no blocks reported) has room:
        there is nothing to wait for."""
        if not kv_known(view):
            return True
        return freeness_after(view, ask.blocks_on(view)) >= self.below


def kv_known(view: EngineView) -> bool:
    """Whether the engine's KV cache size is known, from its record or its load report."""
    report = view.report
    return bool(view.record.kv_blocks_total or (report and report.kv_blocks_used + report.kv_blocks_free))


def freeness_after(view: EngineView, blocks: int) -> float:
    """The engine's freeness once a request whose prompt takes ``blocks`` KV blocks is sent to
    it: one more request holding ``blocks`` more."""
    return (view.free * (view.held + 1) - blocks) / (view.held + 2)


@dataclass(eq=False, slots=True)
class Held:
    """A request waiting at the router: what it asks, since when, and how it goes on."""

    ask: Ask
    since: float
    send: Callable[[EngineView], None]
    """Sends the request to the engine given (called once, from ``offer`` or ``release``)."""
    fail: Callable[[Exception], None]
    """Called when the request cannot go out: with what ``pick`` or ``send`` raised."""
    out: bool = False
    """Whether it left the line (sent, failed or taken out)."""


class HoldLine:
    """The requests held, first come first served.

    ``pick`` is dispatch's choice of engine for a request (it may raise, when no engine serves
    the model). When that engine is short of room, ``spill`` (if given) names the engine with
    the most room, and the request goes there if it has enough: dispatch may prefer an engine
    for other reasons than room (the one whose prefix cache holds the prompt, a session's
    engine, the next in turn), and a request waits only while no engine has room for it, not
    for its favourite. A request is sent when it reaches the head of the line and an engine has
    room, or once it has waited ``policy.max_s`` (to the picked engine). Nobody overtakes: a
    request that arrives while others wait joins the line behind them, even if it would fit.
    """

    def __init__(
        self,
        policy: HoldPolicy,
        pick: Callable[[Ask], EngineView],
        spill: Callable[[Ask], EngineView | None] | None = None,
    ) -> None:
        self.policy = policy
        self._pick = pick
        self._spill = spill
        self._line: deque[Held] = deque()
        self.expired = 0
        """Requests sent because their wait ran out, not because room showed up."""
        self.spilled = 0
        """Requests sent to the engine with the most room, their picked engine being short."""

    def _choose(self, ask: Ask) -> tuple[EngineView, bool]:
        """The engine for ``ask`` and whether it has room: the picked engine, or the roomiest
        when only that one has room."""
        view = self._pick(ask)
        if self.policy.room(view, ask):
            return view, True
        if self._spill is not None:
            other = self._spill(ask)
            if other is not None and other is not view and self.policy.room(other, ask):
                self.spilled += 1
                return other, True
        return view, False

    def __len__(self) -> int:
        return len(self._line)

    def offer(
        self,
        ask: Ask,
        now: float,
        send: Callable[[EngineView], None],
        fail: Callable[[Exception], None],
    ) -> Held | None:
        """Send the request at once when nobody waits and the engine picked has room (``send``
        is called before this returns, and None returned); else it joins the line, which is
        returned (``leave`` takes it out). An exception from ``pick`` propagates."""
        if not self._line:
            if self.policy.max_s <= 0:
                send(self._pick(ask))
                return None
            view, fits = self._choose(ask)
            if fits:
                send(view)
                return None
        held = Held(ask, now, send, fail)
        self._line.append(held)
        return held

    def leave(self, held: Held) -> None:
        """Take a request out of the line (its client went away); a no-op once it left."""
        if not held.out:
            held.out = True
            self._line.remove(held)

    def release(self, now: float) -> int:
        """Send, from the head of the line, every request whose engine has room or whose wait
        ran out; stop at the first that must wait on. Returns the requests sent."""
        sent = 0
        line, policy = self._line, self.policy
        while line:
            held = line[0]
            try:
                view, fits = self._choose(held.ask)
            except Exception as exc:  # no engine serves the model any more
                line.popleft().out = True
                held.fail(exc)
                continue
            if not fits and now - held.since < policy.max_s:
                break
            line.popleft().out = True
            self.expired += not fits
            try:
                held.send(view)
            except Exception as exc:  # the engine would not take it (overloaded, say)
                held.fail(exc)
                continue
            sent += 1
        return sent
