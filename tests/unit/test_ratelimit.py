"""Per-key rate limits: token buckets on a fake clock (the limiter's own seam)."""

from __future__ import annotations

import pytest

from shoal_router.core.ratelimit import ApiKey, Limits, RateLimiter
from shoal_router.errors import TooManyRequestsError


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_requests_per_minute_allow_a_burst_then_refill_steadily() -> None:
    clock = Clock()
    limiter = RateLimiter(Limits(), clock)
    key = ApiKey("alice", requests_per_minute=3)
    for _ in range(3):
        limiter.admit(key, 10)
    with pytest.raises(TooManyRequestsError) as refused:
        limiter.admit(key, 10)
    assert refused.value.status_code == 429
    assert refused.value.code == "rate_limit_exceeded"
    assert refused.value.retry_after_s == 20  # one request refills in 60 / 3 s
    assert "alice" in refused.value.message and "3 requests per minute" in refused.value.message
    clock.now += 19.0
    with pytest.raises(TooManyRequestsError):
        limiter.admit(key, 10)
    clock.now += 1.0
    limiter.admit(key, 10)


def test_tokens_per_minute_count_prompt_and_output_and_may_go_into_debt() -> None:
    clock = Clock()
    limiter = RateLimiter(Limits(), clock)
    key = ApiKey("bob", tokens_per_minute=600)  # 10 tokens a second
    limiter.admit(key, 100)
    limiter.charge(key, 400)  # 500 of 600 used
    limiter.admit(key, 50)
    limiter.charge(key, 250)  # 200 in debt: the long answer is paid by the next requests
    with pytest.raises(TooManyRequestsError) as refused:
        limiter.admit(key, 1)
    assert refused.value.retry_after_s == 20
    clock.now += 20.0
    limiter.admit(key, 1)


def test_defaults_apply_to_keys_without_their_own_and_keys_are_separate() -> None:
    clock = Clock()
    limiter = RateLimiter(Limits(requests_per_minute=1), clock)
    limiter.admit(ApiKey("carol"), 1)
    with pytest.raises(TooManyRequestsError):
        limiter.admit(ApiKey("carol"), 1)
    limiter.admit(ApiKey("dave"), 1)  # a bucket of its own
    unlimited = ApiKey("erin", requests_per_minute=0)  # its own 0: no limit despite the default
    for _ in range(100):
        limiter.admit(unlimited, 1)


def test_a_changed_limit_starts_a_fresh_bucket() -> None:
    clock = Clock()
    limiter = RateLimiter(Limits(), clock)
    limiter.admit(ApiKey("frank", requests_per_minute=1), 1)
    with pytest.raises(TooManyRequestsError):
        limiter.admit(ApiKey("frank", requests_per_minute=1), 1)
    limiter.admit(ApiKey("frank", requests_per_minute=5), 1)  # the keys file raised it
