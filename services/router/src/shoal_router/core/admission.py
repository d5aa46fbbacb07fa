"""Admission: a bounded number of requests run at once, a bounded queue waits for a slot.

A request over ``limit`` waits in line (first come, first served) for at most ``wait_s``; when
``queue`` requests already wait, or the wait runs out, it is refused with 429 and a
``Retry-After``. Memory stays bounded: at most ``limit + queue`` requests are ever held.
"""

from __future__ import annotations

import asyncio

from shoal_router.errors import TooManyRequestsError


class Admission:
    def __init__(self, limit: int, queue: int, wait_s: float) -> None:
        self._slots = asyncio.Semaphore(limit)
        self._queue = queue
        self._wait_s = wait_s
        self.waiting = 0

    async def enter(self) -> None:
        """Take a slot, waiting in line if need be; TooManyRequestsError if the line is full
        or the wait runs out."""
        if not self._slots.locked():
            await self._slots.acquire()  # a free slot: no wait
            return
        if self.waiting >= self._queue:
            raise TooManyRequestsError(
                f"this router is full ({self.waiting} requests already wait for a slot); retry later",
                code="router_busy",
            )
        self.waiting += 1
        try:
            await asyncio.wait_for(self._slots.acquire(), self._wait_s)
        except TimeoutError:
            raise TooManyRequestsError(
                f"no slot freed up within {self._wait_s:g} s; retry later", code="router_busy"
            ) from None
        finally:
            self.waiting -= 1

    def leave(self) -> None:
        self._slots.release()
