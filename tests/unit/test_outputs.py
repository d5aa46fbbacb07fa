"""RequestOutputCollector: ordering, repeats, coalescing and the one-slot mailbox."""

from __future__ import annotations

import asyncio

from shoal_protos.messages import FinishReason, PieceError, RequestPiece
from shoal_router.core.outputs import RequestDelta, RequestOutputCollector

RID = "req-1"


def piece(first_index: int, tokens: list[int], text: str | None = None, **kwargs: object) -> RequestPiece:
    """A piece whose text is one character per token, so text and tokens can be checked together."""
    if text is None:
        text = "".join(chr(ord("a") + t % 26) for t in tokens)
    return RequestPiece(RID, first_index, token_ids=list(tokens), text=text, **kwargs)  # type: ignore[arg-type]


def take(collector: RequestOutputCollector) -> RequestDelta:
    delta = collector.get_nowait()
    assert delta is not None, "expected a delta"
    return delta


def test_empty_collector_has_nothing() -> None:
    collector = RequestOutputCollector(RID)
    assert collector.get_nowait() is None
    assert collector.delivered == 0
    assert not collector.finished


def test_in_order_pieces_coalesce_into_one_delta() -> None:
    collector = RequestOutputCollector(RID)
    collector.put("e0", piece(0, [0, 1]))
    collector.put("e0", piece(2, [2]))
    collector.put("e0", piece(3, [3, 4]))

    delta = take(collector)

    assert delta.token_ids == [0, 1, 2, 3, 4]
    assert delta.text == "abcde"
    assert delta.engine_id == "e0"
    assert not delta.finished
    assert collector.delivered == 5
    # The slot is empty again until the next put.
    assert collector.get_nowait() is None


def test_reads_split_the_stream_without_losing_or_repeating_tokens() -> None:
    collector = RequestOutputCollector(RID)
    collector.put("e0", piece(0, [0, 1]))
    first = take(collector)
    collector.put("e0", piece(2, [2, 3]))
    second = take(collector)

    assert first.token_ids == [0, 1]
    assert second.token_ids == [2, 3]
    assert second.text == "cd"


def test_early_piece_is_held_until_the_gap_is_filled() -> None:
    collector = RequestOutputCollector(RID)
    collector.put("e0", piece(0, [0, 1]))
    assert take(collector).token_ids == [0, 1]

    collector.put("e0", piece(4, [4, 5]))  # tokens 2..3 are still missing
    assert collector.get_nowait() is None
    assert collector.delivered == 2

    collector.put("e0", piece(2, [2, 3]))
    delta = take(collector)

    assert delta.token_ids == [2, 3, 4, 5]
    assert delta.text == "cdef"
    assert collector.delivered == 6


def test_several_held_pieces_follow_on_in_order() -> None:
    collector = RequestOutputCollector(RID)
    collector.put("e0", piece(3, [3], finish_reason=FinishReason.STOP, num_prompt_tokens=2))
    collector.put("e0", piece(1, [1, 2]))
    assert collector.get_nowait() is None

    collector.put("e0", piece(0, [0]))
    delta = take(collector)

    assert delta.token_ids == [0, 1, 2, 3]
    assert delta.finished
    assert delta.finish_reason is FinishReason.STOP
    assert collector.finished


def test_held_final_piece_does_not_finish_early() -> None:
    collector = RequestOutputCollector(RID)
    collector.put("e0", piece(2, [], finish_reason=FinishReason.LENGTH))
    assert not collector.finished
    assert collector.get_nowait() is None


def test_full_repeat_is_dropped() -> None:
    collector = RequestOutputCollector(RID)
    collector.put("e0", piece(0, [0, 1, 2]))
    take(collector)

    collector.put("e1", piece(0, [0, 1, 2]))
    collector.put("e1", piece(1, [1, 2]))

    assert collector.get_nowait() is None
    assert collector.delivered == 3


def test_partial_overlap_is_trimmed_by_tokens() -> None:
    collector = RequestOutputCollector(RID)
    collector.put("e0", piece(0, [0, 1, 2]))
    take(collector)

    collector.put("e1", piece(1, [1, 2, 3, 4]))
    delta = take(collector)

    assert delta.token_ids == [3, 4]
    # The text of a partly repeated piece cannot be split by token, so it is dropped.
    assert delta.text == ""
    assert delta.engine_id == "e1"
    assert collector.delivered == 5


def test_finish_carries_reason_stop_reason_and_prompt_tokens() -> None:
    collector = RequestOutputCollector(RID)
    collector.put("e0", piece(0, [0]))
    collector.put("e0", piece(1, [1], finish_reason=FinishReason.STOP, stop_reason="\n", num_prompt_tokens=7))

    delta = take(collector)

    assert delta.token_ids == [0, 1]
    assert delta.finished
    assert delta.finish_reason is FinishReason.STOP
    assert delta.stop_reason == "\n"
    assert delta.num_prompt_tokens == 7
    assert delta.error is None
    assert collector.finished


def test_final_piece_without_tokens_is_accepted() -> None:
    collector = RequestOutputCollector(RID)
    collector.put("e0", piece(0, [0, 1]))
    collector.put("e0", piece(2, [], finish_reason=FinishReason.LENGTH, num_prompt_tokens=3))

    delta = take(collector)

    assert delta.token_ids == [0, 1]
    assert delta.finish_reason is FinishReason.LENGTH
    assert delta.num_prompt_tokens == 3


def test_nothing_is_accepted_after_finish() -> None:
    collector = RequestOutputCollector(RID)
    collector.put("e0", piece(0, [0], finish_reason=FinishReason.STOP))
    take(collector)

    collector.put("e0", piece(1, [1, 2]))
    collector.put("e0", piece(1, [], finish_reason=FinishReason.ABORT))
    collector.fail(PieceError("engine_dead", "late"))

    assert collector.get_nowait() is None
    assert collector.delivered == 1


def test_fail_ends_the_request_with_an_error_delta() -> None:
    collector = RequestOutputCollector(RID)
    collector.put("e0", piece(0, [0, 1]))
    error = PieceError("engine_dead", "engine e0 disappeared")

    collector.fail(error)
    delta = take(collector)

    # Tokens that arrived before the failure are still handed out, in the same delta.
    assert delta.token_ids == [0, 1]
    assert delta.finish_reason is FinishReason.ERROR
    assert delta.error == error
    assert delta.engine_id == ""
    assert collector.finished


def test_fail_after_finish_is_ignored() -> None:
    collector = RequestOutputCollector(RID)
    collector.put("e0", piece(0, [0], finish_reason=FinishReason.STOP))
    collector.fail(PieceError("engine_dead", "late"))

    delta = take(collector)
    assert delta.finish_reason is FinishReason.STOP
    assert delta.error is None


async def test_get_waits_until_a_put() -> None:
    collector = RequestOutputCollector(RID)
    reader = asyncio.create_task(collector.get())
    # Let the reader run up to its wait; get() has no other await, so one pass is enough.
    await asyncio.sleep(0)
    assert not reader.done()

    collector.put("e0", piece(0, [0, 1]))
    delta = await asyncio.wait_for(reader, timeout=5)

    assert delta.token_ids == [0, 1]
    assert collector.get_nowait() is None


async def test_get_returns_at_once_when_something_is_pending() -> None:
    collector = RequestOutputCollector(RID)
    collector.put("e0", piece(0, [0]))
    delta = await asyncio.wait_for(collector.get(), timeout=5)
    assert delta.token_ids == [0]


async def test_get_after_a_read_waits_for_new_output() -> None:
    collector = RequestOutputCollector(RID)
    collector.put("e0", piece(0, [0]))
    await collector.get()

    reader = asyncio.create_task(collector.get())
    await asyncio.sleep(0)
    assert not reader.done()

    collector.put("e0", piece(1, [1], finish_reason=FinishReason.STOP))
    delta = await asyncio.wait_for(reader, timeout=5)
    assert delta.token_ids == [1]
    assert delta.finished


async def test_a_held_piece_does_not_wake_the_reader() -> None:
    collector = RequestOutputCollector(RID)
    reader = asyncio.create_task(collector.get())
    await asyncio.sleep(0)

    collector.put("e0", piece(1, [1]))
    await asyncio.sleep(0)
    assert not reader.done()

    collector.put("e0", piece(0, [0]))
    delta = await asyncio.wait_for(reader, timeout=5)
    assert delta.token_ids == [0, 1]


def test_reopen_after_a_retryable_failure() -> None:
    collector = RequestOutputCollector(RID)
    collector.put("e0", piece(3, [3]))  # held; must not survive the retry
    collector.put(
        "e0",
        RequestPiece(
            RID,
            0,
            finish_reason=FinishReason.ERROR,
            error=PieceError("engine_draining", "draining", retryable=True),
        ),
    )
    failed = take(collector)
    assert failed.error is not None
    assert failed.error.retryable

    collector.reopen()

    assert not collector.finished
    assert collector.get_nowait() is None
    collector.put("e1", piece(0, [0, 1, 2]))
    delta = take(collector)
    assert delta.token_ids == [0, 1, 2]
    assert delta.engine_id == "e1"
    assert collector.delivered == 3


def test_reopen_drops_an_unread_failure_without_tokens() -> None:
    collector = RequestOutputCollector(RID)
    collector.fail(PieceError("engine_dead", "gone", retryable=True))
    collector.reopen()
    assert collector.get_nowait() is None
    assert not collector.finished


def test_reopen_after_tokens_continues_from_the_first_missing_index() -> None:
    collector = RequestOutputCollector(RID)
    collector.put("e0", piece(0, [10, 11], generation=2))
    collector.put("e0", piece(4, [14]))  # held: produced by the engine that then died
    collector.fail(PieceError("engine_lost", "gone", retryable=True), generation=2)
    assert take(collector).error is not None

    collector.reopen()

    assert collector.token_ids == [10, 11]
    assert collector.generation == 2
    collector.put("e0", piece(1, [11, 12], generation=2))  # a late repeat is trimmed
    collector.put("e1", piece(3, [13, 14], generation=3))
    delta = take(collector)
    assert delta.token_ids == [12, 13, 14]
    assert collector.token_ids == [10, 11, 12, 13, 14]
    assert collector.generation == 3


def test_reopen_keeps_unread_tokens_and_drops_only_the_failure() -> None:
    collector = RequestOutputCollector(RID)
    collector.put("e0", piece(0, [0, 1]))
    collector.fail(PieceError("engine_lost", "gone", retryable=True))

    collector.reopen()

    delta = take(collector)
    assert delta.token_ids == [0, 1]
    assert delta.error is None and delta.finish_reason is None
    assert not collector.finished


def test_held_piece_overlapping_the_filled_gap_is_trimmed_and_delivered() -> None:
    collector = RequestOutputCollector(RID)
    collector.put("e1", piece(3, [3, 4, 5]))  # early: held
    collector.put("e0", piece(0, [0, 1, 2, 3, 4]))  # fills the gap and overlaps the held piece

    delta = take(collector)

    assert delta.token_ids == [0, 1, 2, 3, 4, 5]
    assert collector.delivered == 6


def test_a_delta_keeps_when_its_oldest_tokens_reached_the_router() -> None:
    """The start of the delay the router adds (``shoal_router_relay_delay_seconds``): a merged
    delta is as old as its oldest piece, held pieces included; a failure the router made itself
    has no arrival."""
    collector = RequestOutputCollector("r")
    collector.put("e0", piece(0, [0]), arrived=10.0)
    collector.put("e0", piece(1, [1]), arrived=11.0)
    assert take(collector).arrived == 10.0
    collector.put("e0", piece(3, [3]), arrived=12.0)  # held: token 2 is missing
    collector.put("e0", piece(2, [2]), arrived=13.0)
    delta = take(collector)
    assert delta.token_ids == [2, 3] and delta.arrived == 12.0
    collector.fail(PieceError("engine_lost", "gone", retryable=True))
    assert take(collector).arrived == 0.0


async def test_push_takes_the_output_while_the_reader_waits_and_never_the_last_piece() -> None:
    collector = RequestOutputCollector(RID)
    pushed: list[RequestDelta] = []
    reader = asyncio.create_task(collector.get())
    await asyncio.sleep(0)
    collector.push = pushed.append

    collector.put("e0", piece(0, [0, 1]))
    collector.put("e0", piece(2, [2]))
    assert [delta.token_ids for delta in pushed] == [[0, 1], [2]]
    await asyncio.sleep(0)
    assert not reader.done()

    collector.put("e0", piece(3, [3], finish_reason=FinishReason.STOP))
    delta = await asyncio.wait_for(reader, timeout=5)
    assert delta.token_ids == [3] and delta.finished
    assert collector.token_ids == [0, 1, 2, 3]


async def test_with_a_ready_list_the_pieces_before_a_flush_go_out_as_one() -> None:
    collector = RequestOutputCollector(RID)
    pushed: list[RequestDelta] = []
    ready: list[RequestOutputCollector] = []
    collector.ready = ready
    reader = asyncio.create_task(collector.get())
    await asyncio.sleep(0)
    collector.push = pushed.append

    collector.put("e0", piece(0, [0]))
    collector.put("e0", piece(1, [1]))
    assert pushed == [] and ready == [collector]  # listed once
    collector.flush()
    assert [delta.token_ids for delta in pushed] == [[0, 1]]
    assert [delta.text for delta in pushed] == ["ab"]

    # Listed, and then the push stepped aside (its client is behind): the flush wakes the reader.
    collector.put("e0", piece(2, [2]))
    collector.push = None
    collector.flush()
    delta = await asyncio.wait_for(reader, timeout=5)
    assert delta.token_ids == [2]
    assert len(pushed) == 1


async def test_a_flush_after_the_reader_woke_leaves_the_output_to_it() -> None:
    collector = RequestOutputCollector(RID)
    pushed: list[RequestDelta] = []
    collector.ready = []
    reader = asyncio.create_task(collector.get())
    await asyncio.sleep(0)
    collector.push = pushed.append

    collector.put("e0", piece(0, [0]))
    collector.put("e0", piece(1, [1], finish_reason=FinishReason.LENGTH))  # wakes the reader
    collector.flush()
    assert pushed == []
    delta = await asyncio.wait_for(reader, timeout=5)
    assert delta.token_ids == [0, 1] and delta.finished
