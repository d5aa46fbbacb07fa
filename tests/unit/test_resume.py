"""A request whose engine fails goes on elsewhere: the router's handle over real ZeroMQ sockets.

The test plays two engines with plain PULL/PUSH sockets (the frames are the real ones), and
fails an engine the way the router's link monitor and heartbeat check do
(``EngineClient.fail_requests``). The handle must send the prompt plus the delivered tokens to
the other engine under a higher ownership generation, ignore late pieces of the failed engine,
and give its reader every token exactly once, in order.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from shoal_protos.messages import (
    AbortRequest,
    AddRequest,
    EngineRequestDecoder,
    FinishReason,
    PieceError,
    RequestPiece,
    SamplingOptions,
)
from shoal_router.api.serving import Generation, GenerationHandle
from shoal_router.core.outputs import RequestDelta
from shoal_router.errors import EngineFailedError, NoEngineError
from tests.integration.support import until
from tests.unit.played_engines import MODEL, PlayedEngine, played_fleet


@pytest.fixture
async def setup() -> AsyncIterator[tuple[Generation, dict[str, PlayedEngine]]]:
    async with played_fleet() as (generation, played):
        yield generation, played


async def start(generation: Generation, engine_id: str) -> GenerationHandle:
    """Start a request on ``engine_id`` (the other engine is taken out of dispatch meanwhile)."""
    others = [view for eid, view in generation.fleet.engines.items() if eid != engine_id]
    for view in others:
        view.connected = False
    try:
        return await generation.start(MODEL, [1, 2, 3], SamplingOptions(max_tokens=8))
    finally:
        for view in others:
            view.connected = True


async def read_all(deltas: AsyncIterator[RequestDelta], into: list[RequestDelta]) -> None:
    async for delta in deltas:
        into.append(delta)


@dataclass
class Streaming:
    """A request on e0 whose reader has its first token (10)."""

    handle: GenerationHandle
    add: AddRequest
    got: list[RequestDelta]
    reader: asyncio.Task[None]


async def streaming_on_e0(generation: Generation, played: dict[str, PlayedEngine]) -> Streaming:
    handle = await start(generation, "e0")
    add = await played["e0"].next_add()
    got: list[RequestDelta] = []
    reader = asyncio.create_task(read_all(handle.deltas(), got))
    await played["e0"].send(add.reply_to, RequestPiece(handle.request_id, 0, [10], "a"))
    await until(lambda: len(got) == 1)
    return Streaming(handle, add, got, reader)


async def test_a_request_whose_engine_dies_goes_on_after_its_delivered_tokens(
    setup: tuple[Generation, dict[str, PlayedEngine]],
) -> None:
    generation, played = setup
    e0, e1 = played["e0"], played["e1"]
    handle = await start(generation, "e0")
    add = await e0.next_add()
    assert add.output_token_ids == [] and add.generation == 0
    await e0.send(add.reply_to, RequestPiece(handle.request_id, 0, [10, 11, 12], "abc"))
    got: list[RequestDelta] = []
    reader = asyncio.create_task(read_all(handle.deltas(), got))
    await until(lambda: sum(len(d.token_ids) for d in got) == 3)

    generation.engines.fail_requests("e0", "dropped its connection")
    resumed = await e1.next_add()

    assert resumed.request_id == handle.request_id
    assert resumed.prompt_token_ids == [1, 2, 3]
    assert resumed.output_token_ids == [10, 11, 12]
    assert resumed.generation == 1
    # A late piece of the failed engine (it was still sending when its link dropped) is ignored,
    # even where it would fill the next index.
    await e0.send(add.reply_to, RequestPiece(handle.request_id, 3, [99], "X"))
    await e1.send(
        resumed.reply_to,
        RequestPiece(handle.request_id, 3, [13, 14], "de", generation=1),
        RequestPiece(handle.request_id, 5, [15], "f", finish_reason=FinishReason.LENGTH, generation=1),
    )
    await asyncio.wait_for(reader, timeout=5)

    tokens = [t for delta in got for t in delta.token_ids]
    assert tokens == [10, 11, 12, 13, 14, 15]
    assert "".join(delta.text for delta in got) == "abcdef"
    assert got[-1].finish_reason is FinishReason.LENGTH
    assert all(delta.error is None for delta in got)
    resumed_count = generation.metrics.resumed.labels(MODEL, "engine_lost")._value.get()
    assert resumed_count == 1


async def test_tokens_sent_with_the_failure_reach_the_reader_before_the_next_engine_continues(
    setup: tuple[Generation, dict[str, PlayedEngine]],
) -> None:
    """The engine's vLLM core died: its last piece carries tokens, then the error."""
    generation, played = setup
    handle = await start(generation, "e0")
    add = await played["e0"].next_add()
    await played["e0"].send(
        add.reply_to,
        RequestPiece(handle.request_id, 0, [10, 11], "ab"),
        RequestPiece(
            handle.request_id,
            2,
            finish_reason=FinishReason.ERROR,
            error=PieceError("engine_dead", "engine core died", retryable=True),
        ),
    )
    got: list[RequestDelta] = []
    reader = asyncio.create_task(read_all(handle.deltas(), got))
    resumed = await played["e1"].next_add()
    assert resumed.output_token_ids == [10, 11]
    await played["e1"].send(
        resumed.reply_to,
        RequestPiece(handle.request_id, 2, [12], "c", finish_reason=FinishReason.STOP, generation=1),
    )
    await asyncio.wait_for(reader, timeout=5)
    assert [t for delta in got for t in delta.token_ids] == [10, 11, 12]


async def test_with_no_engine_left_the_stream_ends_with_an_error_after_its_tokens(
    setup: tuple[Generation, dict[str, PlayedEngine]],
) -> None:
    generation, played = setup
    handle = await start(generation, "e0")
    add = await played["e0"].next_add()
    await played["e0"].send(add.reply_to, RequestPiece(handle.request_id, 0, [10], "a"))
    got: list[RequestDelta] = []
    deltas = handle.deltas()
    got.append(await asyncio.wait_for(anext(deltas), timeout=5))
    generation.fleet.engines["e1"].connected = False  # the only other engine is unreachable

    generation.engines.fail_requests("e0", "dropped its connection")

    with pytest.raises(EngineFailedError) as failed:
        await asyncio.wait_for(read_all(deltas, got), timeout=5)
    assert failed.value.code == "engine_lost"
    assert "no other engine could continue it" in failed.value.message
    assert [t for delta in got for t in delta.token_ids] == [10]
    assert generation.inflight == 0, "the failed request still holds its slot"


async def test_attempts_are_bounded(setup: tuple[Generation, dict[str, PlayedEngine]]) -> None:
    """With ``max_attempts`` 2, the second engine's failure ends the stream with an error."""
    generation, played = setup
    generation.max_attempts = 2
    running = await streaming_on_e0(generation, played)
    handle, got, reader = running.handle, running.got, running.reader
    generation.engines.fail_requests("e0", "died")
    second = await played["e1"].next_add()
    assert second.output_token_ids == [10]
    await played["e1"].send(second.reply_to, RequestPiece(handle.request_id, 1, [11], "b", generation=1))
    await until(lambda: len(got) == 2)
    generation.engines.fail_requests("e1", "died")
    with pytest.raises(EngineFailedError) as failed:
        await asyncio.wait_for(reader, timeout=5)
    assert failed.value.code == "engine_lost"
    assert "no other engine" not in failed.value.message
    assert [t for delta in got for t in delta.token_ids] == [10, 11]
    assert generation.metrics.resumed.labels(MODEL, "engine_lost")._value.get() == 1


async def test_a_refusal_before_the_first_token_with_no_engine_left_is_a_503(
    setup: tuple[Generation, dict[str, PlayedEngine]],
) -> None:
    generation, played = setup
    handle = await start(generation, "e0")
    add = await played["e0"].next_add()
    generation.fleet.engines["e1"].connected = False
    await played["e0"].send(
        add.reply_to,
        RequestPiece(
            handle.request_id,
            0,
            finish_reason=FinishReason.ERROR,
            error=PieceError("engine_draining", "draining", retryable=True),
        ),
    )
    with pytest.raises(NoEngineError):
        await asyncio.wait_for(anext(handle.deltas()), timeout=5)


async def test_an_engine_lost_by_its_heartbeat_is_told_to_abort_what_goes_on_elsewhere(
    setup: tuple[Generation, dict[str, PlayedEngine]],
) -> None:
    """A stalled engine may wake up: it gets an ABORT for the requests another engine continues."""
    generation, played = setup
    running = await streaming_on_e0(generation, played)
    handle, got, reader = running.handle, running.got, running.reader

    generation.engines.engine_lost("e0", "stopped heartbeating")

    frames = await asyncio.wait_for(played["e0"].pull.recv_multipart(), timeout=5)
    abort = EngineRequestDecoder().decode(frames[0], frames[1])
    assert isinstance(abort, AbortRequest) and abort.request_ids == [handle.request_id]
    resumed = await played["e1"].next_add()
    assert resumed.output_token_ids == [10]
    await played["e1"].send(
        resumed.reply_to,
        RequestPiece(handle.request_id, 1, [11], "b", finish_reason=FinishReason.STOP, generation=1),
    )
    await asyncio.wait_for(reader, timeout=5)
    assert [t for delta in got for t in delta.token_ids] == [10, 11]
