"""The order in which an engine's moves get their turn at its KV agent (one call at a time)."""

from __future__ import annotations

import asyncio

import pytest

from shoal_engine.migration.common import Turns, call_priority
from shoal_protos import kv


@pytest.mark.asyncio
async def test_a_stopped_requests_calls_go_before_other_moves_pre_copies() -> None:
    """Eight moves at once: the last stage and release of a stopped request (its stream stalls
    until they are done) must not wait behind the pre-copy stages or the tails (their requests
    still decode) queued before them."""
    turns, order = Turns(), []
    holder_in, holder_out = asyncio.Event(), asyncio.Event()

    async def call(name: str, command: kv.AgentCommand) -> None:
        async with turns.turn(call_priority(command)):
            order.append(name)
            if name == "holder":
                holder_in.set()
                await holder_out.wait()

    precopy = kv.SendBlocks(request_id="a", migration_id="m", target="tcp://t:1", first_block=0)
    holder = asyncio.create_task(call("holder", precopy))
    await holder_in.wait()
    queued = [
        asyncio.create_task(call(name, command))
        for name, command in [
            ("precopy-1", precopy),
            ("hold", kv.Hold(request_id="b")),
            ("precopy-2", precopy),
            (
                "tail",
                kv.SendBlocks(
                    request_id="d", migration_id="n", target="t", first_block=2, partial=True, running=True
                ),
            ),
            (
                "last-stage",
                kv.SendBlocks(request_id="c", migration_id="m", target="t", first_block=2, partial=True),
            ),
            ("release", kv.Release(request_id="c")),
        ]
    ]
    await asyncio.sleep(0)  # every call waits for its turn
    holder_out.set()
    await asyncio.gather(holder, *queued)
    assert order == ["holder", "last-stage", "release", "hold", "tail", "precopy-1", "precopy-2"]


@pytest.mark.asyncio
async def test_a_call_cancelled_while_it_waits_or_as_it_gets_its_turn_passes_it_on() -> None:
    turns, order = Turns(), []
    gate = asyncio.Event()
    tasks: dict[str, asyncio.Task[None]] = {}

    async def call(name: str, priority: int) -> None:
        async with turns.turn(priority):
            order.append(name)
            if name == "first":
                await gate.wait()
        if name == "first":
            # The turn was just handed to ``handed``, which has not run yet: cancelled now, it
            # must pass the turn on rather than keep it.
            tasks["handed"].cancel()

    tasks["first"] = asyncio.create_task(call("first", 2))
    await asyncio.sleep(0)
    for name, priority in [("gone", 0), ("handed", 1), ("last", 2)]:
        tasks[name] = asyncio.create_task(call(name, priority))
    await asyncio.sleep(0)
    tasks["gone"].cancel()  # while it waits
    await asyncio.sleep(0)
    gate.set()
    await asyncio.gather(*tasks.values(), return_exceptions=True)
    assert order == ["first", "last"]
    assert tasks["handed"].cancelled() and tasks["gone"].cancelled()
