"""A client that goes away before its answer is done: the router's app in a real uvicorn
server over engines played by the test (``played_engines``). Wherever the request waited (for
its first token, for the rest of a JSON answer, for a slot at the router), it is aborted on its
engine or never sent there, and its slot is free again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
import pytest

from shoal_protos.messages import AbortRequest, AddRequest, FinishReason, RequestPiece
from shoal_router.api.serving import Generation
from shoal_router.core.hold import HoldPolicy
from tests.integration.support import until
from tests.unit.played_engines import MODEL, PlayedEngine, played_fleet, served
from tests.unit.test_hold import BLOCKS, report

Fleet = tuple[Generation, dict[str, PlayedEngine]]


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    # One request at a time, on e0 alone.
    async with played_fleet(max_inflight=1, max_queued=4) as (generation, played):
        for view in generation.fleet.engines.values():
            view.connected = view.engine_id == "e0"
        yield generation, played


async def _send(url: str, prompt: list[int], *, stream: bool) -> asyncio.StreamWriter:
    """Open a connection and send a completion request on it; the writer closes it."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    body = msgspec.json.encode({"model": MODEL, "prompt": prompt, "max_tokens": 50, "stream": stream})
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    await writer.drain()
    writer.reader = reader  # type: ignore[attr-defined]  # kept open with the writer
    return writer


async def _leave(writer: asyncio.StreamWriter) -> None:
    writer.close()
    await writer.wait_closed()


async def _aborted(engine: PlayedEngine, request_id: str) -> None:
    message = await engine.next_frame()
    assert isinstance(message, AbortRequest), message
    assert message.request_ids == [request_id]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_a_client_that_leaves_before_its_first_token_is_aborted_on_its_engine(
    fleet: Fleet, stream: bool
) -> None:
    generation, played = fleet
    async with served(generation) as url:
        client = await _send(url, [1, 2, 3], stream=stream)
        add = await played["e0"].next_add()
        await _leave(client)
        await _aborted(played["e0"], add.request_id)
        await until(lambda: generation.inflight == 0, what="the request's slot to be free")


async def test_a_json_client_that_leaves_mid_answer_is_aborted_on_its_engine(fleet: Fleet) -> None:
    generation, played = fleet
    async with served(generation) as url:
        client = await _send(url, [1, 2, 3], stream=False)
        add = await played["e0"].next_add()
        pieces = [RequestPiece(add.request_id, i, [i], f"<{i}>") for i in range(3)]
        await played["e0"].send(add.reply_to, *pieces)
        collector = generation.engines._requests[add.request_id].collector
        await until(lambda: collector.delivered == 3, what="the first tokens to be taken in")
        await _leave(client)
        await _aborted(played["e0"], add.request_id)
        await until(lambda: generation.inflight == 0, what="the request's slot to be free")


async def test_a_client_that_leaves_while_waiting_for_a_slot_is_never_sent(fleet: Fleet) -> None:
    """The router runs one request at a time: the second waits in line for the slot, leaves,
    and the third, sent after, is the next one its engine sees."""
    generation, played = fleet
    engine = played["e0"]
    async with served(generation) as url:
        first = await _send(url, [1], stream=False)
        running = await engine.next_add()
        second = await _send(url, [2], stream=False)
        await until(lambda: generation.admission.waiting == 1, what="the second request to wait")
        await _leave(second)
        # At once, not when its wait for a slot runs out (``queue_timeout_s``, 30 s here).
        await until(lambda: generation.admission.waiting == 0, 10, "the second request to leave the line")
        third = await _send(url, [3], stream=False)
        await until(lambda: generation.admission.waiting == 1, what="the third request to wait")
        await engine.send(
            running.reply_to,
            RequestPiece(running.request_id, 0, [7], "<7>", finish_reason=FinishReason.LENGTH),
        )
        answer = await first.reader.readuntil(b"}}")  # type: ignore[attr-defined]
        assert b'"text":"<7>"' in answer
        message = await engine.next_frame()
        assert isinstance(message, AddRequest) and message.prompt_token_ids == [3], message
        await _leave(first)
        await _leave(third)


async def test_a_client_that_leaves_while_held_for_kv_room_leaves_the_hold_line() -> None:
    """Every engine is short of KV: the request waits at the router for room, and its client
    leaves. It leaves the line at once (not after ``max_s``), and its slot is free again."""
    async with (
        played_fleet(kv_blocks_total=BLOCKS, hold=HoldPolicy(below=2.0, max_s=60.0), max_inflight=1) as (
            generation,
            _,
        ),
        served(generation) as url,
    ):
        for view in generation.fleet.engines.values():
            report(view, running=20, used=1000)
        client = await _send(url, [1, 2, 3], stream=True)
        await until(lambda: len(generation.held or []) == 1, what="the request to be held")
        await _leave(client)
        await until(lambda: len(generation.held or []) == 0, 10, "the request to leave the hold line")
        assert generation.inflight == 0 and not generation.admission._slots.locked()
