"""Admission control: a bounded number of requests run, a bounded line waits first come first
served, and past the line or its wait a request is refused with 429 (and ``Retry-After``)."""

from __future__ import annotations

import asyncio
import json

import pytest

from shoal_router.api.app import error_response
from shoal_router.core.admission import Admission
from shoal_router.errors import TooManyRequestsError


async def test_a_full_router_queues_then_refuses() -> None:
    admission = Admission(limit=2, queue=1, wait_s=30)
    await admission.enter()
    await admission.enter()
    waiting = asyncio.create_task(admission.enter())
    await asyncio.sleep(0)  # it is in line now
    assert admission.waiting == 1 and not waiting.done()
    with pytest.raises(TooManyRequestsError, match="already wait"):
        await admission.enter()  # the line is full: refused at once
    admission.leave()  # a request ends: the one in line runs
    await asyncio.wait_for(waiting, 5)
    assert admission.waiting == 0


async def test_the_line_is_first_come_first_served() -> None:
    admission = Admission(limit=1, queue=3, wait_s=30)
    await admission.enter()
    order: list[int] = []

    async def wait_then_note(i: int) -> None:
        await admission.enter()
        order.append(i)

    tasks = [asyncio.create_task(wait_then_note(i)) for i in range(3)]
    await asyncio.sleep(0)
    for _ in range(3):
        admission.leave()
        await asyncio.sleep(0.01)
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert order == [0, 1, 2]


async def test_a_wait_that_runs_out_is_refused_and_leaves_the_line() -> None:
    admission = Admission(limit=1, queue=4, wait_s=0.05)
    await admission.enter()
    with pytest.raises(TooManyRequestsError, match=r"within 0\.05 s"):
        await admission.enter()
    assert admission.waiting == 0
    admission.leave()
    await asyncio.wait_for(admission.enter(), 1)  # the slot is free again


def test_429_says_when_to_retry() -> None:
    response = error_response(TooManyRequestsError("busy", code="router_busy"), retry_after_s=2)
    assert response.status_code == 429 and response.headers["retry-after"] == "2"
    assert json.loads(response.body)["error"]["code"] == "router_busy"
