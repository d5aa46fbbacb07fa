"""The fleet-state Redis client across a Redis restart (a real ``redis-server``)."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shoal_protos.records import state_client
from tests.integration.support import free_port, redis_server


@pytest.mark.asyncio
async def test_the_first_call_after_redis_restarted_succeeds() -> None:
    """Redis closed every connection in the pool when it went down: each pooled connection's
    next call must go through on a new one (a drain's move picking its target was one such
    call, and failed), not raise that the server closed it."""
    port = free_port()
    client = state_client(f"redis://127.0.0.1:{port}/0", 1.0)
    try:
        with redis_server(port):
            # Two pooled connections, both idle.
            await asyncio.gather(client.set("a", "1"), client.set("b", "2"))
        with redis_server(port):
            assert await asyncio.gather(client.get("a"), client.get("b")) == [None, None]
            await client.set("c", "3")
            # The server drops this client's connections while they sit in the pool.
            async with aioredis.Redis.from_url(f"redis://127.0.0.1:{port}/0") as other:
                await other.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
            assert await client.get("c") == b"3"
    finally:
        await client.aclose()


@pytest.mark.asyncio
async def test_a_redis_that_is_down_or_stuck_fails_the_call_at_once() -> None:
    """Loops retry on their next tick: a Redis that refuses connections fails the call after
    one more immediate try, and one that does not answer after the timeout, not retried."""
    port = free_port()
    client = state_client(f"redis://127.0.0.1:{port}/0", 0.3)
    try:
        started = time.monotonic()
        with pytest.raises(RedisConnectionError):
            await client.get("a")
        assert time.monotonic() - started < 0.3
        with redis_server(port) as server:
            await client.set("a", "1")
            server.send_signal(signal.SIGSTOP)  # connected, and silent
            started = time.monotonic()
            with pytest.raises(RedisTimeoutError):
                await client.get("a")
            # One timeout, not two.
            assert time.monotonic() - started < 0.55
    finally:
        await client.aclose()
