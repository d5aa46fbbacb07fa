"""EngineService: per-request tasks over a backend, outputs batched per router and engine step.

The backend and the sender are fakes: ``FakeBackend`` streams exactly what a test puts on each
request's queue, ``FakeSend`` records the batches the service would hand to the sender thread.
Tests wait on conditions (a batch arrived, a stream started), never on wall-clock time, except
where a drain timeout is itself under test.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable

import msgspec
import pytest

from shoal_engine.backend import BackendDeadError, BackendOutput, BackendRequestError
from shoal_engine.kv.params import KvLoad
from shoal_engine.metrics import EngineMetrics
from shoal_engine.serving import EngineService
from shoal_protos.messages import (
    AbortRequest,
    AddRequest,
    FinishReason,
    OutputBatch,
    RequestPiece,
    SamplingOptions,
)
from shoal_sim.engine import SimConfig, SimulatedBackend

ENGINE_ID = "engine-test"
MODEL = "tiny"
ROUTER_A = "tcp://10.0.0.1:5700"
ROUTER_B = "tcp://10.0.0.2:5700"
PROMPT = [101, 102, 103, 104]
WAIT_S = 5.0

END_OF_STREAM = object()
"""Put on a request's queue to end its stream without a finish reason."""


class FakeBackend:
    """Stands in for vLLM: each request's stream yields the ``BackendOutput`` objects (or raises the
    exceptions) a test puts on that request's queue, and ends after an output with a finish reason."""

    def __init__(self) -> None:
        self.queues: dict[str, asyncio.Queue[object]] = {}
        self.started: dict[str, asyncio.Event] = {}
        self.generate_calls: list[tuple[str, list[int], SamplingOptions]] = []
        self.priorities: dict[str, int] = {}
        self.produced: dict[str, int] = {}
        self.cancelled: list[str] = []

    def _queue(self, request_id: str) -> asyncio.Queue[object]:
        return self.queues.setdefault(request_id, asyncio.Queue())

    def _started(self, request_id: str) -> asyncio.Event:
        return self.started.setdefault(request_id, asyncio.Event())

    def feed(self, request_id: str, *items: object) -> None:
        for item in items:
            self._queue(request_id).put_nowait(item)

    async def wait_started(self, *request_ids: str) -> None:
        """Until each stream waits for its first item from the test."""
        await asyncio.wait_for(asyncio.gather(*(self._started(rid).wait() for rid in request_ids)), WAIT_S)

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingOptions,
        kv_load: KvLoad | None = None,
        priority: int = 0,
        produced: int = 0,
    ) -> AsyncGenerator[BackendOutput]:
        self.generate_calls.append((request_id, prompt_token_ids, sampling))
        self.produced[request_id] = produced
        self.priorities[request_id] = priority
        queue = self._queue(request_id)
        started = self._started(request_id)

        async def stream() -> AsyncGenerator[BackendOutput]:
            started.set()
            try:
                while True:
                    item = await queue.get()
                    if item is END_OF_STREAM:
                        return
                    if isinstance(item, BaseException):
                        raise item
                    assert isinstance(item, BackendOutput)
                    yield item
                    if item.finish_reason is not None:
                        return
            except (asyncio.CancelledError, GeneratorExit):
                self.cancelled.append(request_id)  # vLLM aborts the request
                raise

        return stream()


class FakeSend:
    """Records every ``(reply_to, OutputBatch)`` the service hands over for sending."""

    def __init__(self) -> None:
        self.batches: list[tuple[str, OutputBatch]] = []
        self._changed = asyncio.Event()

    def __call__(self, reply_to: str, batch: OutputBatch) -> None:
        self.batches.append((reply_to, batch))
        self._changed.set()

    def pieces(self, request_id: str | None = None, reply_to: str | None = None) -> list[RequestPiece]:
        return [
            piece
            for address, batch in self.batches
            if reply_to is None or address == reply_to
            for piece in batch.pieces
            if request_id is None or piece.request_id == request_id
        ]

    def final(self, request_id: str) -> RequestPiece | None:
        finals = [piece for piece in self.pieces(request_id) if piece.finish_reason is not None]
        assert len(finals) <= 1, f"more than one final piece for {request_id}: {finals}"
        return finals[0] if finals else None

    async def until(self, predicate: Callable[[], bool], limit_s: float = WAIT_S) -> None:
        async with asyncio.timeout(limit_s):
            while not predicate():
                self._changed.clear()
                await self._changed.wait()

    async def wait_final(self, request_id: str, limit_s: float = WAIT_S) -> RequestPiece:
        await self.until(lambda: self.final(request_id) is not None, limit_s)
        final = self.final(request_id)
        assert final is not None
        return final


def out(
    tokens: list[int],
    text: str = "",
    finish: FinishReason | None = None,
    stop_reason: str | int | None = None,
) -> BackendOutput:
    return BackendOutput(token_ids=tokens, text=text, finish_reason=finish, stop_reason=stop_reason)


def add(request_id: str, reply_to: str = ROUTER_A, prompt: list[int] = PROMPT) -> AddRequest:
    return AddRequest(request_id, list(prompt), SamplingOptions(max_tokens=16), reply_to)


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def send() -> FakeSend:
    return FakeSend()


@pytest.fixture
def fatal() -> list[BaseException]:
    return []


@pytest.fixture
def metrics() -> EngineMetrics:
    return EngineMetrics(ENGINE_ID, MODEL)


@pytest.fixture
async def service(
    backend: FakeBackend, send: FakeSend, metrics: EngineMetrics, fatal: list[BaseException]
) -> AsyncIterator[EngineService]:
    svc = EngineService(ENGINE_ID, backend, send, metrics, fatal.append)  # type: ignore[arg-type]
    yield svc
    # Leave no request task behind on the shared event loop.
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(svc.drain(0), 0.5)


async def test_one_step_for_one_router_is_one_batch(
    service: EngineService, backend: FakeBackend, send: FakeSend
) -> None:
    service.on_request(add("r1"))
    service.on_request(add("r2"))
    await backend.wait_started("r1", "r2")

    # One engine step: the backend hands new outputs to both streams in one pass.
    backend.feed("r1", out([11], "a"))
    backend.feed("r2", out([21], "b"))
    await send.until(lambda: len(send.pieces()) >= 2)

    assert len(send.batches) == 1
    reply_to, batch = send.batches[0]
    assert reply_to == ROUTER_A
    assert batch.engine_id == ENGINE_ID
    assert sorted((p.request_id, p.token_ids, p.text) for p in batch.pieces) == [
        ("r1", [11], "a"),
        ("r2", [21], "b"),
    ]


async def test_later_steps_are_later_batches(
    service: EngineService, backend: FakeBackend, send: FakeSend
) -> None:
    service.on_request(add("r1"))
    await backend.wait_started("r1")

    backend.feed("r1", out([1]))
    await send.until(lambda: len(send.batches) == 1)
    backend.feed("r1", out([2]))
    await send.until(lambda: len(send.batches) == 2)

    steps = [batch.step for _, batch in send.batches]
    assert steps[1] > steps[0]


async def test_each_router_gets_its_own_batch(
    service: EngineService, backend: FakeBackend, send: FakeSend
) -> None:
    service.on_request(add("ra", reply_to=ROUTER_A))
    service.on_request(add("rb", reply_to=ROUTER_B))
    await backend.wait_started("ra", "rb")

    backend.feed("ra", out([1], "x"))
    backend.feed("rb", out([2], "y"))
    await send.until(lambda: len(send.pieces()) >= 2)

    by_router = {reply_to: batch for reply_to, batch in send.batches}
    assert len(send.batches) == 2
    assert set(by_router) == {ROUTER_A, ROUTER_B}
    assert [p.request_id for p in by_router[ROUTER_A].pieces] == ["ra"]
    assert [p.request_id for p in by_router[ROUTER_B].pieces] == ["rb"]
    # Both came out of the same step.
    assert by_router[ROUTER_A].step == by_router[ROUTER_B].step


async def test_pieces_carry_first_index_and_the_final_one_the_prompt_length(
    service: EngineService, backend: FakeBackend, send: FakeSend
) -> None:
    service.on_request(add("r1"))
    await backend.wait_started("r1")

    backend.feed("r1", out([5, 6], "ab"))
    await send.until(lambda: len(send.pieces("r1")) == 1)
    backend.feed("r1", out([7], "c"))
    await send.until(lambda: len(send.pieces("r1")) == 2)
    backend.feed("r1", out([8, 9, 10], "def", FinishReason.STOP, stop_reason=10))
    final = await send.wait_final("r1")

    pieces = send.pieces("r1")
    assert [p.first_index for p in pieces] == [0, 2, 3]
    assert [t for p in pieces for t in p.token_ids] == [5, 6, 7, 8, 9, 10]
    assert [p.num_prompt_tokens for p in pieces] == [0, 0, len(PROMPT)]
    assert final is pieces[-1]
    assert final.finish_reason is FinishReason.STOP
    assert final.stop_reason == 10
    assert final.error is None
    assert service.num_requests == 0


async def test_outputs_of_one_request_in_one_step_keep_their_order(
    service: EngineService, backend: FakeBackend, send: FakeSend
) -> None:
    service.on_request(add("r1"))
    await backend.wait_started("r1")

    backend.feed("r1", out([1]), out([2, 3]), out([4], finish=FinishReason.LENGTH))
    await send.wait_final("r1")

    assert [(p.first_index, p.token_ids) for p in send.pieces("r1")] == [(0, [1]), (1, [2, 3]), (3, [4])]


async def test_backend_gets_the_request_as_sent(service: EngineService, backend: FakeBackend) -> None:
    request = add("r1", prompt=[9, 8, 7])
    service.on_request(request)
    await backend.wait_started("r1")

    assert backend.generate_calls == [("r1", [9, 8, 7], request.sampling)]
    assert service.num_requests == 1


async def test_abort_cancels_the_stream_and_sends_an_abort_piece(
    service: EngineService, backend: FakeBackend, send: FakeSend
) -> None:
    service.on_request(add("r1"))
    await backend.wait_started("r1")
    backend.feed("r1", out([1, 2], "hi"))
    await send.until(lambda: len(send.pieces("r1")) == 1)

    service.on_request(AbortRequest(["r1"], reason="client went away"))
    final = await send.wait_final("r1")

    assert final.finish_reason is FinishReason.ABORT
    assert final.first_index == 2
    assert final.token_ids == []
    assert final.num_prompt_tokens == len(PROMPT)
    assert final.error is not None
    assert final.error.code == "aborted"
    assert final.error.message == "client went away"
    assert backend.cancelled == ["r1"]
    assert service.num_requests == 0


async def test_a_lost_router_has_its_requests_aborted_and_no_other(
    service: EngineService, backend: FakeBackend, send: FakeSend
) -> None:
    service.on_request(add("a1", reply_to=ROUTER_A))
    service.on_request(add("a2", reply_to=ROUTER_A))
    service.on_request(add("b1", reply_to=ROUTER_B))
    await backend.wait_started("a1", "a2", "b1")

    assert service.received == {ROUTER_A: 2, ROUTER_B: 1}  # what load reports carry
    assert service.live_by_router() == {ROUTER_A: 2, ROUTER_B: 1}
    assert service.router_lost(ROUTER_A) == 2
    assert service.received == {ROUTER_B: 1}  # a router gone is no longer counted for
    await send.wait_final("a1")
    await send.wait_final("a2")

    assert sorted(backend.cancelled) == ["a1", "a2"]
    assert service.num_requests == 1
    backend.feed("b1", out([5], "x", FinishReason.LENGTH))
    final = await send.wait_final("b1")
    assert final.finish_reason is FinishReason.LENGTH
    assert service.router_lost(ROUTER_A) == 0


async def test_abort_of_several_ids_ignores_unknown_ones(
    service: EngineService, backend: FakeBackend, send: FakeSend
) -> None:
    service.on_request(add("r1"))
    service.on_request(add("r2"))
    await backend.wait_started("r1", "r2")

    service.on_request(AbortRequest(["r1", "never-seen", "r2"]))
    await send.until(lambda: send.final("r1") is not None and send.final("r2") is not None)

    assert sorted(backend.cancelled) == ["r1", "r2"]
    assert send.pieces("never-seen") == []
    assert service.num_requests == 0


async def test_abort_of_an_unknown_request_is_a_no_op(service: EngineService, send: FakeSend) -> None:
    assert service.abort("nope", "test") is False
    assert send.batches == []


async def test_add_while_draining_gets_a_retryable_error(
    service: EngineService, backend: FakeBackend, send: FakeSend
) -> None:
    assert await service.drain(5) == 0
    assert service.draining

    service.on_request(add("late", reply_to=ROUTER_B))
    final = await send.wait_final("late")

    assert send.batches[0][0] == ROUTER_B
    assert final.finish_reason is FinishReason.ERROR
    assert final.first_index == 0
    assert final.error is not None
    assert final.error.code == "engine_draining"
    assert final.error.retryable is True
    assert backend.generate_calls == []
    assert service.num_requests == 0


async def test_duplicate_request_id_is_refused_and_the_first_goes_on(
    service: EngineService, backend: FakeBackend, send: FakeSend
) -> None:
    service.on_request(add("r1", reply_to=ROUTER_A))
    await backend.wait_started("r1")

    service.on_request(add("r1", reply_to=ROUTER_B))
    await send.until(lambda: len(send.pieces("r1", reply_to=ROUTER_B)) == 1)

    refusal = send.pieces("r1", reply_to=ROUTER_B)[0]
    assert refusal.finish_reason is FinishReason.ERROR
    assert refusal.error is not None
    assert refusal.error.code == "duplicate_request"
    assert refusal.error.retryable is False
    assert len(backend.generate_calls) == 1
    assert service.num_requests == 1

    backend.feed("r1", out([1], finish=FinishReason.STOP))
    await send.until(lambda: len(send.pieces("r1", reply_to=ROUTER_A)) == 1)
    assert send.pieces("r1", reply_to=ROUTER_A)[0].finish_reason is FinishReason.STOP


async def test_backend_request_error_ends_only_that_request(
    service: EngineService, backend: FakeBackend, send: FakeSend, fatal: list[BaseException]
) -> None:
    service.on_request(add("bad"))
    service.on_request(add("good"))
    await backend.wait_started("bad", "good")

    backend.feed("bad", out([1]), BackendRequestError("prompt too long"))
    final = await send.wait_final("bad")

    assert final.finish_reason is FinishReason.ERROR
    assert final.first_index == 1
    assert final.error is not None
    assert final.error.code == "invalid_request"
    assert final.error.message == "prompt too long"
    assert final.error.retryable is False
    assert fatal == []
    assert service.num_requests == 1  # "good" still runs


async def test_backend_death_before_any_token_is_retryable_and_fatal(
    service: EngineService, backend: FakeBackend, send: FakeSend, fatal: list[BaseException]
) -> None:
    service.on_request(add("r1"))
    await backend.wait_started("r1")
    death = BackendDeadError("engine core died")

    backend.feed("r1", death)
    final = await send.wait_final("r1")

    assert final.finish_reason is FinishReason.ERROR
    assert final.error is not None
    assert final.error.code == "engine_dead"
    assert final.error.retryable is True
    assert fatal == [death]


async def test_backend_death_after_tokens_is_retryable_from_its_first_missing_token(
    service: EngineService, backend: FakeBackend, send: FakeSend, fatal: list[BaseException]
) -> None:
    """The router continues the request elsewhere after the tokens it has (index 3 on)."""
    service.on_request(add("r1"))
    await backend.wait_started("r1")

    backend.feed("r1", out([1, 2, 3]), BackendDeadError("engine core died"))
    final = await send.wait_final("r1")

    assert final.first_index == 3
    assert final.error is not None
    assert final.error.code == "engine_dead"
    assert final.error.retryable is True
    assert len(fatal) == 1


async def test_stream_ending_without_finish_reason_is_an_error(
    service: EngineService, backend: FakeBackend, send: FakeSend
) -> None:
    service.on_request(add("r1"))
    await backend.wait_started("r1")

    backend.feed("r1", out([1]), END_OF_STREAM)
    final = await send.wait_final("r1")

    assert final.finish_reason is FinishReason.ERROR
    assert final.first_index == 1
    assert final.error is not None
    assert final.error.code == "stream_ended"
    assert service.num_requests == 0


async def test_drain_waits_for_running_requests(
    service: EngineService, backend: FakeBackend, send: FakeSend
) -> None:
    service.on_request(add("r1"))
    await backend.wait_started("r1")

    drainer = asyncio.create_task(service.drain(60))
    await asyncio.sleep(0)  # one loop pass: drain marks the service and starts waiting
    assert service.draining
    assert not drainer.done()

    backend.feed("r1", out([1], finish=FinishReason.STOP))
    aborted = await asyncio.wait_for(drainer, WAIT_S)

    assert aborted == 0
    final = send.final("r1")
    assert final is not None
    assert final.finish_reason is FinishReason.STOP
    assert backend.cancelled == []


async def test_drain_aborts_what_still_runs_after_the_timeout(
    service: EngineService, backend: FakeBackend, send: FakeSend
) -> None:
    service.on_request(add("r1"))
    service.on_request(add("r2", reply_to=ROUTER_B))
    await backend.wait_started("r1", "r2")
    backend.feed("r1", out([1]))
    await send.until(lambda: len(send.pieces("r1")) == 1)

    aborted = await asyncio.wait_for(service.drain(0.05), WAIT_S)

    assert aborted == 2
    assert service.num_requests == 0
    assert sorted(backend.cancelled) == ["r1", "r2"]
    for request_id, produced in (("r1", 1), ("r2", 0)):
        final = send.final(request_id)
        assert final is not None
        assert final.finish_reason is FinishReason.ABORT
        assert final.first_index == produced
        assert final.error is not None
        assert final.error.code == "aborted"
        assert "shut down" in final.error.message


async def test_metrics_count_tokens_and_finish_reasons(
    service: EngineService, backend: FakeBackend, send: FakeSend, metrics: EngineMetrics
) -> None:
    labels = {"engine": ENGINE_ID, "model": MODEL}
    service.on_request(add("r1"))
    service.on_request(add("r2"))
    await backend.wait_started("r1", "r2")

    backend.feed("r1", out([1, 2]), out([3], finish=FinishReason.STOP))
    await send.wait_final("r1")
    service.on_request(AbortRequest(["r2"]))
    await send.wait_final("r2")

    def value(name: str, **extra: str) -> float | None:
        return metrics.registry.get_sample_value(name, {**labels, **extra})

    assert value("shoal_engine_requests_total", finish_reason="stop") == 1
    assert value("shoal_engine_requests_total", finish_reason="abort") == 1
    assert value("shoal_engine_output_tokens_total") == 3
    assert value("shoal_engine_prompt_tokens_total") == 2 * len(PROMPT)
    assert value("shoal_engine_output_batch_pieces_count") == len(send.batches)


async def test_abort_right_after_add_still_ends_the_request(service: EngineService, send: FakeSend) -> None:
    # The receiver thread queues both frames with call_soon_threadsafe, so they can run back to back.
    service.on_request(add("r1"))
    service.on_request(AbortRequest(["r1"]))

    final = await send.wait_final("r1", limit_s=0.5)

    assert final.finish_reason is FinishReason.ABORT
    assert service.num_requests == 0


async def test_unexpected_backend_exception_still_ends_the_request(
    service: EngineService, backend: FakeBackend, send: FakeSend
) -> None:
    service.on_request(add("r1"))
    task = next(t for t in asyncio.all_tasks() if t.get_name() == "request-r1")
    await backend.wait_started("r1")

    backend.feed("r1", RuntimeError("bug in the backend"))
    try:
        final = await send.wait_final("r1", limit_s=0.5)
    finally:
        # Retrieve the task's exception now: its "never retrieved" log from a later garbage
        # collection can break pytest's report on Python 3.11.7 (AST recursion SystemError).
        if task.done() and not task.cancelled():
            task.exception()

    assert final.finish_reason is FinishReason.ERROR
    assert final.error is not None


async def test_stop_for_migration_ends_right_after_the_next_output(
    service: EngineService, backend: FakeBackend, send: FakeSend
) -> None:
    service.on_request(add("m"))
    await backend.wait_started("m")
    backend.feed("m", out([1], "a"))
    await send.until(lambda: len(send.pieces("m")) == 1)

    stopping = asyncio.create_task(service.stop_for_migration("m", align_s=WAIT_S))
    # The stop waits for the request's next output, hands it to the client, then ends the stream.
    await asyncio.sleep(0)
    assert not stopping.done()
    backend.feed("m", out([2], "b"), out([3], "c"))
    stopped = await asyncio.wait_for(stopping, WAIT_S)

    assert stopped is not None and stopped.output_ids == [1, 2]
    assert [p.token_ids for p in send.pieces("m")] == [[1], [2]]
    assert send.final("m") is None  # no final piece: the request goes on elsewhere
    assert backend.cancelled == ["m"] and service.num_requests == 0


async def test_a_move_waits_for_a_migrated_in_request_to_produce_here(
    service: EngineService, backend: FakeBackend, send: FakeSend
) -> None:
    # Arrived with outputs from another engine: its KV is not in place here before its first step.
    arrived = msgspec.structs.replace(add("arrived"), output_token_ids=[7, 8])
    service.start(arrived)
    await backend.wait_started("arrived")
    # The backend continues after the outputs it brought, and knows they are the request's own.
    assert backend.generate_calls[-1][1][-2:] == [7, 8] and backend.produced["arrived"] == 2
    assert not await service.wait_output_here("arrived", 0.05)
    waiting = asyncio.create_task(service.wait_output_here("arrived", WAIT_S))
    await asyncio.sleep(0)
    assert not waiting.done()
    backend.feed("arrived", out([9], "x"))
    assert await asyncio.wait_for(waiting, WAIT_S)
    # Once it has produced here, at once; a request not running here, never.
    assert await service.wait_output_here("arrived", 0.0)
    assert not await service.wait_output_here("elsewhere", WAIT_S)


async def test_stop_for_migration_of_a_silent_request_stops_it_where_it_is(
    service: EngineService, backend: FakeBackend, send: FakeSend
) -> None:
    service.on_request(add("q"))
    await backend.wait_started("q")
    # No output comes (it waits in vLLM's queue): the stop gives up waiting and cancels it.
    stopped = await service.stop_for_migration("q", align_s=0.05)
    assert stopped is not None and stopped.output_ids == []
    assert send.final("q") is None and backend.cancelled == ["q"]


async def test_client_abort_while_stopping_for_migration_ends_the_request(
    service: EngineService, backend: FakeBackend, send: FakeSend
) -> None:
    service.on_request(add("c"))
    await backend.wait_started("c")
    stopping = asyncio.create_task(service.stop_for_migration("c", align_s=WAIT_S))
    await asyncio.sleep(0)
    service.on_request(AbortRequest(["c"], "client left"))
    # No migration of a request whose client left: it ends with its abort piece.
    assert await asyncio.wait_for(stopping, WAIT_S) is None
    final = await send.wait_final("c")
    assert final.finish_reason == FinishReason.ABORT


async def test_request_failing_while_stopping_for_migration_is_not_moved(
    service: EngineService, backend: FakeBackend, send: FakeSend
) -> None:
    service.on_request(add("f"))
    await backend.wait_started("f")
    stopping = asyncio.create_task(service.stop_for_migration("f", align_s=WAIT_S))
    await asyncio.sleep(0)
    backend.feed("f", BackendRequestError("bad request"))
    # Its error piece went to the client: nothing is left to move.
    assert await asyncio.wait_for(stopping, WAIT_S) is None
    final = await send.wait_final("f")
    assert final.finish_reason == FinishReason.ERROR


async def test_the_cheapest_request_to_move_has_produced_a_token_and_has_tokens_to_go(
    send: FakeSend, metrics: EngineMetrics, fatal: list[BaseException]
) -> None:
    """What a balancing migration moves when it names no request: the fewest tokens (least KV)
    among requests that produced a token here and have enough left. The simulated backend runs
    the requests (two at a time, so the third waits without a token)."""
    backend = SimulatedBackend(SimConfig(speed=20.0, max_num_seqs=2))
    await backend.start()
    svc = EngineService(ENGINE_ID, backend, send, metrics, fatal.append)
    try:
        long_prompt = AddRequest("long", list(range(100)), SamplingOptions(max_tokens=2000), ROUTER_A)
        short_prompt = AddRequest("short", [7, 8, 9], SamplingOptions(max_tokens=2000), ROUTER_A)
        waiting = AddRequest("waiting", [5], SamplingOptions(max_tokens=2000), ROUTER_A)
        for add in (long_prompt, short_prompt, waiting):
            svc.on_request(add)
        deadline = asyncio.get_running_loop().time() + WAIT_S
        while not all((svc.tokens_of(rid) or 0) > size for rid, size in (("long", 100), ("short", 3))):
            assert asyncio.get_running_loop().time() < deadline, "the requests produced no token"
            await asyncio.sleep(0.005)
        assert svc.tokens_of("waiting") == 1  # its prompt only: it waits for a batch slot
        assert svc.cheapest_to_move(min_left=16) == "short"
        assert svc.cheapest_to_move(min_left=10_000) is None  # nothing has that much to go
        # A target that holds all of the long one already: nothing of it to copy.
        assert svc.cheapest_to_move(16, held=lambda ids: len(ids) if ids[:3] == [0, 1, 2] else 0) == "long"
    finally:
        await svc.drain(0)
        backend.shutdown()


async def test_a_move_takes_other_requests_before_a_priority_one_and_the_engine_counts_them(
    send: FakeSend, metrics: EngineMetrics, fatal: list[BaseException]
) -> None:
    """Moves make room for priority requests (priority below 0): the engine offers its other
    requests first, even ones with more KV to copy, and counts the priority ones for its load
    report's headroom."""
    backend = SimulatedBackend(SimConfig(speed=20.0, max_num_seqs=2))
    await backend.start()
    svc = EngineService(ENGINE_ID, backend, send, metrics, fatal.append)
    try:
        urgent = AddRequest("urgent", [7, 8, 9], SamplingOptions(max_tokens=2000), ROUTER_A, priority=-1)
        normal = AddRequest("normal", list(range(100)), SamplingOptions(max_tokens=2000), ROUTER_A)
        for add in (urgent, normal):
            svc.on_request(add)
        assert svc.num_priority == 1
        deadline = asyncio.get_running_loop().time() + WAIT_S
        while not all((svc.tokens_of(rid) or 0) > size for rid, size in (("normal", 100), ("urgent", 3))):
            assert asyncio.get_running_loop().time() < deadline, "the requests produced no token"
            await asyncio.sleep(0.005)
        assert svc.cheapest_to_move(min_left=16) == "normal"
    finally:
        await svc.drain(0)
        backend.shutdown()
    assert svc.num_priority == 0


async def test_the_request_priority_reaches_the_backend(service: EngineService, backend: FakeBackend) -> None:
    service.on_request(AddRequest("p", [1, 2], SamplingOptions(max_tokens=4), ROUTER_A, priority=-5))
    service.on_request(add("q"))
    await backend.wait_started("p", "q")
    assert backend.priorities == {"p": -5, "q": 0}
