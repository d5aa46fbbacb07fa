"""Scheduling: which engine takes a new request, decided by small named plugins.

A scheduler runs three kinds of plugin for every request, in order:

* **filters** drop engines that cannot take it: not ACTIVE or unreachable from this router, or
  one that already failed this request (``dispatchable``); engines without free KV blocks for
  the prompt (``kv_room``, soft: when no engine has room, every engine stays, and vLLM queues);
* **scorers** give each engine left a score in [0, 1] (higher is better), summed with weights
  (an affinity scorer names the one engine it favours rather than scoring every engine, so a
  decision costs one pass over the engines whatever the profile);
* a **picker** takes one: the highest total (ties at random, so equal engines share the
  load), or the next engine in turn (``round_robin``).

Scorers:

* ``least_load``: Llumnix's *freeness*, the KV blocks an engine has left after what its batch
  already holds and will soon need, per batch slot: ``(total - used - pending - queued) /
  (requests + 1)``, compared across engines in tokens (each engine's blocks counted in its own
  block size). ``pending`` is the prompt blocks this router sent since the engine's last
  load report (the report cannot know them yet), ``queued`` the waiting requests' demand
  (estimated at the engine's mean blocks per running request). Scaled to [0, 1] over the
  candidates.
* ``prefix_affinity``: requests whose prompts start with the same blocks go to the same engine,
  where vLLM's prefix cache already holds them. The key is a hash of the prompt's first
  ``prefix_blocks`` full blocks (of ``prefix_block_tokens`` tokens, a unit of the hash alone);
  consistent hashing with bounded load (Mirrokni, Thorup and Zaderidis) maps it to an engine:
  walk the ring of engines from the key and take the first whose load is under
  ``(1 + epsilon)`` times the mean. That engine scores 1, the others 0. The ring depends only
  on the engine ids, so every router maps a prefix to the same engine.
* ``session_affinity``: the same ring keyed by the request's session header, so a
  conversation's turns meet their cached history.
* ``prefix_cache``: the share of the prompt an engine's prefix cache already holds, as the
  engines' own KV events say (``prefix_index``): full blocks from the start of the prompt, in
  [0, 1]. Only engines under a bounded-load cap score (``(1 + epsilon)`` times the mean
  requests, or the mean plus a sixteenth of the engine's batch slots, ``cache_cap``): a cached
  engine that is overloaded loses to a cold idle one, whose freeness ``least_load`` scores.
  Under the cap the cache weighs heavily (the profile's 8 to least-load's 1, whose score spans
  [0, 1] from the least free engine to the freest): computing an eighth of the prompt again
  costs more than the load between them.

Profiles (``--scheduler``): ``least_load`` (the default), ``round_robin``, ``prefix_affinity``
(prefix 2, least_load 1), ``session_affinity`` (session 2, least_load 1), ``prefix_cache``
(prefix_cache 8, least_load 1), or weights spelled out,
``prefix_affinity=2,least_load=1``. An affinity scorer outweighs ``least_load``, and its bound
on load keeps it from piling requests on one engine.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import random
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from shoal_protos.records import EngineState
from shoal_router.core.dispatch import EngineView
from shoal_router.core.prefix_index import PrefixIndex

ACTIVE = EngineState.ACTIVE
PREFIX_BLOCK_TOKENS = 16
"""Tokens per block of the prompt hashes (``prefix_key``) unless the router is told otherwise.
A unit of the hash only, apart from the engines' KV blocks (each engine's own size counts a
prompt's KV demand, ``EngineView.blocks``)."""
PRUNE_AFTER = 1000
"""Decisions between two prunings of departed engines from an affinity ring."""


@dataclass(frozen=True, slots=True)
class Ask:
    """What a scheduler knows about the request it places."""

    model: str
    prompt_token_ids: Sequence[int]
    session: str | None = None
    exclude: frozenset[str] | set[str] = frozenset()
    block_hashes: Mapping[int, Sequence[int]] | None = None
    """The prompt's full blocks by chained hash, per block size, where the tokenizer hashed
    them (``prefix_cache`` hashes the prompt itself in the sizes missing)."""

    def blocks_on(self, view: EngineView) -> int:
        """The KV blocks the prompt takes on the engine of ``view`` (in that engine's blocks)."""
        return view.blocks(len(self.prompt_token_ids))


Filter = Callable[[Ask, list[EngineView]], list[EngineView]]


# ---- filters ------------------------------------------------------------------------------


def dispatchable(ask: Ask, views: list[EngineView]) -> list[EngineView]:
    """ACTIVE engines this router reaches, not being emptied (unless only those are left), that
    have not failed this request."""
    exclude = ask.exclude
    if not exclude:
        found = [v for v in views if v.dispatchable]
    else:
        found = [v for v in views if v.dispatchable and v.engine_id not in exclude]
    if found:
        return found
    # Only engines being emptied are left (the others unreachable from here, say): better one of
    # them than no answer.
    return [v for v in views if v.usable and v.engine_id not in exclude]


def kv_room(ask: Ask, views: list[EngineView]) -> list[EngineView]:
    """Engines with free KV blocks for the prompt; all of them when none has room."""
    return [v for v in views if v.room >= ask.blocks_on(v)] or views


# ---- scorers ------------------------------------------------------------------------------


def freeness(view: EngineView) -> float:
    """Llumnix's freeness: KV blocks left per batch slot once what is running, sent and queued
    is counted (negative when the engine is oversubscribed); ``EngineView`` keeps it current."""
    return view.free


def free_tokens(view: EngineView) -> float:
    """Freeness in tokens (blocks times the engine's block size): what engines are compared by,
    so that engines of different block sizes weigh alike (in a fleet of one block size the
    order, and the scaled score, are freeness's own)."""
    return view.free_tokens


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class BoundedRing:
    """Consistent hashing with bounded load over engine ids (``replicas`` points per engine).

    ``owner`` walks clockwise from a key's point and returns the first of the given engines whose
    load is under ``ceil((1 + epsilon) * (total + 1) / engines)``. The ring holds every engine
    it has been given (an engine filtered out of one request is skipped, not removed, so the
    ring is rebuilt only when a new engine appears or departed ones outnumber the rest); the
    answer depends only on the engines given and their loads.
    """

    def __init__(self, replicas: int = 64, epsilon: float = 0.25) -> None:
        self.replicas = replicas
        self.epsilon = epsilon
        self._members: set[str] = set()
        self._points: list[int] = []
        self._owners: list[str] = []
        self._since_rebuild = 0

    def _rebuild(self, members: set[str]) -> None:
        points = sorted(
            (_hash64(f"{engine}#{i}".encode()), engine) for engine in members for i in range(self.replicas)
        )
        self._points = [p for p, _ in points]
        self._owners = [e for _, e in points]
        self._members = members
        self._since_rebuild = 0

    def owner(self, key: int, loads: dict[str, int]) -> str | None:
        """The engine of ``loads`` (id -> requests) that takes ``key``."""
        if not loads:
            return None
        self._since_rebuild += 1
        if not self._members.issuperset(loads):
            self._rebuild(self._members | loads.keys())
        elif len(self._members) > 2 * len(loads) and self._since_rebuild > PRUNE_AFTER:
            self._rebuild(set(loads))  # engines gone for good (or filtered out for a long while)
        cap = math.ceil((1 + self.epsilon) * (sum(loads.values()) + 1) / len(loads))
        owners = self._owners
        count = len(owners)
        start = bisect.bisect_left(self._points, key)
        for step in range(count):
            load = loads.get(owners[(start + step) % count])
            if load is not None and load < cap:
                return owners[(start + step) % count]
        return None  # unreachable: some engine is at or under the mean


@dataclass
class Affinity:
    """A scorer that favours one engine: the one ``key(ask)`` hashes to on the ring (bounded
    load). It scores 1 there and 0 everywhere else, so it names that engine (None when the
    request has no key)."""

    key: Callable[[Ask], int | None]
    ring: BoundedRing = field(default_factory=BoundedRing)

    def favourite(self, ask: Ask, views: list[EngineView]) -> str | None:
        key = self.key(ask)
        if key is None:
            return None
        return self.ring.owner(key, {v.engine_id: v.held for v in views})


def prefix_key(prefix_blocks: int, block_tokens: int = PREFIX_BLOCK_TOKENS) -> Callable[[Ask], int | None]:
    """The hash of the prompt's first ``prefix_blocks`` full blocks of ``block_tokens`` tokens
    (fewer if the prompt is shorter; None under one block: nothing worth caching)."""

    def key(ask: Ask) -> int | None:
        blocks = min(prefix_blocks, len(ask.prompt_token_ids) // block_tokens)
        if blocks == 0:
            return None
        head = array("q", ask.prompt_token_ids[: blocks * block_tokens]).tobytes()
        return _hash64(ask.model.encode() + b"\0" + head)

    return key


def session_key(ask: Ask) -> int | None:
    return None if not ask.session else _hash64(f"{ask.model}\0{ask.session}".encode())


# ---- pickers ------------------------------------------------------------------------------


class RoundRobin:
    """Each model's engines in turn (by engine id), skipping those filtered out."""

    def __init__(self) -> None:
        self._turns: dict[str, itertools.count[int]] = {}

    def __call__(self, ask: Ask, views: list[EngineView]) -> EngineView:
        turn = next(self._turns.setdefault(ask.model, itertools.count()))
        ordered = sorted(views, key=lambda v: v.engine_id)
        return ordered[turn % len(ordered)]


# ---- profiles -----------------------------------------------------------------------------

SCORERS = ("least_load", "prefix_affinity", "session_affinity", "prefix_cache")
PROFILES: dict[str, str] = {
    "least_load": "least_load=1",
    "round_robin": "",
    "prefix_affinity": "prefix_affinity=2,least_load=1",
    "session_affinity": "session_affinity=2,least_load=1",
    "prefix_cache": "prefix_cache=8,least_load=1",
}
LOAD_EPSILON = 0.25
"""Cache scores count on engines under ``(1 + LOAD_EPSILON)`` times the mean requests (the cap
``BoundedRing`` puts on affinity), or under the mean plus a slack (``cache_cap``)."""
CACHE_SLACK = 2
"""The slack at least: in a small fleet at light load the ratio alone sends a prompt away from
its cache for one request more (two engines holding 2 and 0), where computing the prompt again
costs more than joining a batch of a few."""
SLACK_PER_SLOT = 1 / 16
"""The slack of an engine that says its batch slots (``max_num_seqs``): this share of them. An
engine that batches hundreds of requests a step (a GPU) steps about as fast with a few more,
while a prompt sent away from its cache is computed again whole; a slack of a few requests there
sent a conversation's turns away from their history at light load."""


def cache_cap(views: Sequence[EngineView], epsilon: float = LOAD_EPSILON) -> list[EngineView]:
    """The engines under the cache scorer's cap: one at or over it takes no request for its
    cache's sake."""
    total = sum(v.held for v in views)
    ratio = math.ceil((1 + epsilon) * (total + 1) / len(views))
    mean = total // len(views)
    return [
        v
        for v in views
        if v.held < max(ratio, mean + max(CACHE_SLACK, int(v.record.max_num_seqs * SLACK_PER_SLOT)))
    ]


@dataclass
class PrefixCache:
    """The ``prefix_cache`` scorer: the share of the prompt each engine under the load cap
    holds in its prefix cache (only engines holding some)."""

    index: PrefixIndex = field(default_factory=PrefixIndex)

    def scores(self, ask: Ask, views: list[EngineView]) -> dict[str, float]:
        length = len(ask.prompt_token_ids)
        if not length or not len(self.index):
            return {}
        under = [v.engine_id for v in cache_cap(views)]
        cached = self.index.cached_tokens(ask.prompt_token_ids, under, ask.block_hashes)
        return {engine_id: tokens / length for engine_id, tokens in cached.items()}


def parse_weights(spec: str) -> dict[str, float]:
    """``name=weight,...`` (a bare name weighs 1) into scorer weights; ValueError names what is
    wrong."""
    weights: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, weight = item.partition("=")
        if name not in SCORERS:
            raise ValueError(f"unknown scorer {name!r} (scorers: {', '.join(SCORERS)})")
        try:
            value = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"scorer {name}: weight {weight!r} is not a number") from None
        if not value > 0 or math.isinf(value):
            raise ValueError(f"scorer {name}: weight must be a positive number, not {weight}")
        weights[name] = value
    if not weights:
        raise ValueError("no scorer given")
    return weights


class Scheduler:
    """Filters, weighted scorers and a picker, chosen by name (see the module docstring)."""

    def __init__(
        self,
        profile: str = "least_load",
        prefix_blocks: int = 4,
        rng: random.Random | None = None,
        prefix_block_tokens: int = PREFIX_BLOCK_TOKENS,
    ):
        self.name = profile
        spec = PROFILES.get(profile, profile)
        self.filters: list[Filter] = [dispatchable, kv_room]
        self.load_weight = 0.0
        self.affinities: list[tuple[Affinity, float]] = []
        self.prefix_cache: PrefixCache | None = None
        self.prefix_weight = 0.0
        self._rng = rng or random.Random()
        self._round_robin = RoundRobin() if profile == "round_robin" else None
        if self._round_robin is not None:
            return
        for name, weight in parse_weights(spec).items():
            if name == "least_load":
                self.load_weight = weight
            elif name == "prefix_affinity":
                self.affinities.append((Affinity(prefix_key(prefix_blocks, prefix_block_tokens)), weight))
            elif name == "prefix_cache":
                self.prefix_cache, self.prefix_weight = PrefixCache(), weight
            else:
                self.affinities.append((Affinity(session_key), weight))

    def _kept(self, ask: Ask, views: list[EngineView]) -> list[EngineView]:
        """The engines every filter keeps for ``ask`` (empty: none can take it)."""
        for keep in self.filters:
            views = keep(ask, views)
            if not views:
                break
        return views

    def pick(self, ask: Ask, views: list[EngineView]) -> EngineView | None:
        """The engine for ``ask`` among ``views`` (None: no engine can take it)."""
        views = self._kept(ask, views)
        if not views:
            return None
        if len(views) == 1:
            return views[0]
        if self._round_robin is not None:
            return self._round_robin(ask, views)
        favourites: dict[str, float] = {}
        for affinity, weight in self.affinities:
            owner = affinity.favourite(ask, views)
            if owner is not None:
                favourites[owner] = favourites.get(owner, 0.0) + weight
        if self.prefix_cache is not None:
            for engine_id, share in self.prefix_cache.scores(ask, views).items():
                favourites[engine_id] = favourites.get(engine_id, 0.0) + self.prefix_weight * share
        if not self.load_weight:
            # Affinity alone: its favourite, else any engine (all score 0).
            best = max(favourites.values(), default=0.0)
            tied = [v for v in views if favourites.get(v.engine_id, 0.0) >= best]
            return self._draw(tied)
        # least_load scores every engine (freeness scaled to [0, 1]) and affinities add to a
        # few: the winner is either one of those few or an engine of top freeness, so only they
        # are summed up.
        free = [v.free_tokens for v in views]
        low, high = min(free), max(free)
        top = [v for v, f in zip(views, free, strict=True) if f >= high]
        if not favourites:
            return self._draw(top)
        span = high - low

        def total(view: EngineView) -> float:
            scaled = (view.free_tokens - low) / span if span > 0 else 1.0
            return self.load_weight * scaled + favourites.get(view.engine_id, 0.0)

        contenders = top + [v for v in views if v.engine_id in favourites and v.free_tokens < high]
        best = max(total(v) for v in contenders)
        return self._draw([v for v in contenders if total(v) >= best - 1e-12])

    def roomiest(self, ask: Ask, views: list[EngineView]) -> EngineView | None:
        """The engine with the most KV room per batch slot (the highest freeness) among those
        the filters keep, whatever the profile's scorers prefer; None when none is left. Of
        equal engines the first: a fallback draws nothing from the picker's random numbers."""
        views = self._kept(ask, views)
        return max(views, key=free_tokens) if views else None

    def _draw(self, tied: list[EngineView]) -> EngineView:
        """One of equally good engines, at random (equal engines share the load)."""
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)
