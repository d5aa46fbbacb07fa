"""Per-API-key rate limits: requests per minute and tokens per minute, as token buckets.

Each key has two buckets, each holding at most a minute's allowance and refilling continuously
(``limit / 60`` per second). A request is admitted when its key's request bucket holds a whole
request and its token bucket is not in debt; it takes one request and its prompt tokens at once,
and its output tokens when it ends, so the token bucket may go below zero (a long answer is
paid for by the next requests, which wait until the debt is refilled). A refusal is a 429
``rate_limit_exceeded`` whose ``Retry-After`` is when the bucket will allow the request.

Limits hold per router process: with N routers behind one Service, a key can reach N times its
limit (set the limits to limit / N when that matters).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from shoal_router.errors import TooManyRequestsError


@dataclass(frozen=True, slots=True)
class ApiKey:
    """A caller: its key's name and its own limits (None: the router's default), and the most
    urgent ``priority`` it may ask for (lower is more urgent; 0: no priority requests)."""

    name: str
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    min_priority: int = 0


@dataclass(slots=True)
class TokenBucket:
    per_minute: int
    level: float
    updated: float

    def refill(self, now: float) -> None:
        self.level = min(float(self.per_minute), self.level + (now - self.updated) * self.per_minute / 60.0)
        self.updated = now

    def seconds_until(self, level: float) -> float:
        """How long until the bucket holds ``level`` (0 if it does)."""
        return max(0.0, (level - self.level) * 60.0 / self.per_minute)


@dataclass(frozen=True, slots=True)
class Limits:
    """The router's default limits for keys that set none; 0 means unlimited."""

    requests_per_minute: int = 0
    tokens_per_minute: int = 0


class RateLimiter:
    def __init__(self, defaults: Limits, clock: Callable[[], float] = time.monotonic) -> None:
        self._defaults = defaults
        self._clock = clock
        self._requests: dict[str, TokenBucket] = {}
        self._tokens: dict[str, TokenBucket] = {}

    def _bucket(self, buckets: dict[str, TokenBucket], name: str, per_minute: int, now: float) -> TokenBucket:
        bucket = buckets.get(name)
        if bucket is None or bucket.per_minute != per_minute:  # new key, or its limit changed
            bucket = buckets[name] = TokenBucket(per_minute, float(per_minute), now)
        bucket.refill(now)
        return bucket

    def admit(self, key: ApiKey, prompt_tokens: int) -> None:
        """Take one request and ``prompt_tokens`` from the key's buckets, or raise a 429."""
        now = self._clock()
        defaults = self._defaults
        rpm = defaults.requests_per_minute if key.requests_per_minute is None else key.requests_per_minute
        tpm = defaults.tokens_per_minute if key.tokens_per_minute is None else key.tokens_per_minute
        requests = self._bucket(self._requests, key.name, rpm, now) if rpm else None
        tokens = self._bucket(self._tokens, key.name, tpm, now) if tpm else None
        if requests is not None and requests.level < 1.0:
            raise _limited(key, f"{rpm} requests per minute", requests.seconds_until(1.0))
        if tokens is not None and tokens.level < 0.0:
            raise _limited(key, f"{tpm} tokens per minute", tokens.seconds_until(0.0))
        if requests is not None:
            requests.level -= 1.0
        if tokens is not None:
            tokens.level -= prompt_tokens

    def charge(self, key: ApiKey, output_tokens: int) -> None:
        """Take a finished request's output tokens from the key's token bucket."""
        bucket = self._tokens.get(key.name)
        if bucket is not None:
            bucket.refill(self._clock())
            bucket.level -= output_tokens


def _limited(key: ApiKey, limit: str, wait_s: float) -> TooManyRequestsError:
    return TooManyRequestsError(
        f"rate limit reached for key {key.name!r}: {limit}; retry in {wait_s:.1f} s",
        code="rate_limit_exceeded",
        retry_after_s=max(1, math.ceil(wait_s)),
    )
