"""The KV agent and the router's ownership rule, without vLLM.

Two real ``KvAgent`` objects (their own threads and ZeroMQ sockets over ``ipc://`` in a temporary
folder; with ``gloo``, a real two-rank gloo group over loopback) hold small synthetic KV caches,
the way vLLM's worker hands them over; the tests drive them through the control socket exactly
as the engine service does.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import zmq

from shoal_engine.kv.agent import KvAgent, Load, TableUpdate
from shoal_engine.kv.connector import ShoalConnector
from shoal_engine.kv.data_server import MAX_SOURCES
from shoal_engine.kv.ranks import worker_addresses
from shoal_engine.kv.transport import Transport, TransportError, check_backend, runs, write_message
from shoal_protos import kv, tls
from shoal_protos.messages import RequestPiece
from shoal_router.core.outputs import RequestOutputCollector
from shoal_router.ipc.engines import _owned, _Tracked
from tests.integration.support import wait_until
from tests.unit.listeners import free_ports

BLOCK = 4
LAYERS = 3
BLOCKS = 16
WIDTH = 8  # bf16 values per block per layer


def _kv(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        f"layer.{i}": torch.randn(BLOCKS, WIDTH, generator=generator).to(torch.bfloat16)
        for i in range(LAYERS)
    }


class Pair:
    """Two agents on Unix sockets; ``transport`` ``tls`` is ``tcp`` over the fleet's mutual TLS."""

    def __init__(
        self, folder: Path, transport: str = "tcp", chunk_bytes: int = 8 << 20, idle_timeout_s: float = 300.0
    ) -> None:
        fleet_tls = tls.write(folder / "tls") if transport == "tls" else None
        transport = "tcp" if transport == "tls" else transport
        self.source_kv, self.target_kv = _kv(1), _kv(2)
        self.addresses = {name: f"ipc://{folder}/{name}" for name in ("sc", "sd", "tc", "td")}
        self.source, self.target = (
            KvAgent(
                kv_caches,
                BLOCKS,
                BLOCK,
                self.addresses[control],
                self.addresses[data],
                transport=transport,
                chunk_bytes=chunk_bytes,
                timeout_s=5,
                debug_reads=True,
                idle_timeout_s=idle_timeout_s,
                tls=fleet_tls,
            )
            for kv_caches, control, data in ((self.source_kv, "sc", "sd"), (self.target_kv, "tc", "td"))
        )
        self._ctx = zmq.Context()
        self._socks: dict[str, zmq.Socket[bytes]] = {}

    def call(self, side: str, command: kv.AgentCommand) -> kv.AgentReply:
        sock = self._socks.get(side)
        if sock is None:
            sock = self._socks[side] = self._ctx.socket(zmq.REQ)
            sock.connect(self.addresses["sc" if side == "source" else "tc"])
        sock.send(kv.encoder.encode(command))
        assert sock.poll(5000), "agent did not answer"
        return kv.agent_reply_decoder.decode(sock.recv())

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(linger=0)
        self._ctx.term()
        self.source.close()
        self.target.close()


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    agents = Pair(tmp_path)
    yield agents
    agents.close()


# Chunks of two blocks: runs of consecutive block ids are split, so several messages go per send.
@pytest.fixture(params=["tcp", "gloo", "tls"])
def any_pair(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Pair]:
    agents = Pair(tmp_path, request.param, chunk_bytes=2 * LAYERS * WIDTH * 2)
    yield agents
    agents.close()


def _run(agent: KvAgent, request_id: str, block_ids: list[int], tokens: int) -> None:
    """What the connector does for a request vLLM scheduled: its table, then the step done."""
    update = TableUpdate(request_id, request_id + "-vllm", block_ids, True, tokens)
    agent.update_tables([update], [])
    agent.step_done([update])


def test_full_blocks_go_over_unchanged_and_are_injected(any_pair: Pair) -> None:
    pair = any_pair
    # Six full blocks and a partial one; ids 3, 4, 5 run on, the rest are scattered.
    _run(pair.source, "r", [9, 3, 4, 5, 0, 12, 7], tokens=6 * BLOCK + 1)
    assert pair.call("source", kv.Connect(pair.addresses["td"])) is None
    sent = pair.call("source", kv.SendBlocks("r", "m", pair.addresses["td"], 0))
    assert isinstance(sent, kv.SentBlocks)
    # Only full blocks while the request runs: the partial one still changes.
    assert (sent.next_block, sent.blocks, sent.tokens_written) == (6, 6, 6 * BLOCK + 1)
    assert sent.bytes == 6 * LAYERS * WIDTH * 2
    source = pair.call("source", kv.ReadBlocks("r", 0, 6))
    staged = pair.call("target", kv.ReadStaged("m"))
    assert isinstance(source, kv.BlockBytes) and isinstance(staged, kv.BlockBytes)
    assert staged.data == source.data and len(source.data) == 6 * LAYERS * WIDTH * 2
    # The target's request got blocks 10, 11, 1, 2, 13, 14 from vLLM: the staged bytes land there.
    assert pair.target.inject(Load("r", "m", 0, [10, 11, 1, 2, 13, 14])) == 6
    for name in pair.source_kv:
        assert torch.equal(
            pair.target_kv[name][[10, 11, 1, 2, 13, 14]], pair.source_kv[name][[9, 3, 4, 5, 0, 12]]
        )
    assert pair.target.take_load_errors() == set()


def test_a_warm_up_load_keeps_the_staging_for_the_commit(pair: Pair) -> None:
    """The warm-up before the stop loads the pre-copied blocks and leaves them staged; the
    last stage adds to the same area; the commit's load, past the blocks the prefix cache now
    holds, takes the rest and frees the area."""
    _run(pair.source, "r", [5, 6, 7], tokens=2 * BLOCK + 1)
    sent = pair.call("source", kv.SendBlocks("r", "m", pair.addresses["td"], 0))
    assert isinstance(sent, kv.SentBlocks) and sent.blocks == 2
    assert pair.target.inject(Load("warm-m", "m", 0, [10, 11], keep=True)) == 2
    status = pair.call("target", kv.AgentStatus())
    assert isinstance(status, kv.Status) and status.staged_bytes == 2 * LAYERS * WIDTH * 2
    # The stop, the last stage (the partial block), the commit: only block 2 is loaded.
    assert pair.call("source", kv.Hold("r")) is None
    last = pair.call("source", kv.SendBlocks("r", "m", pair.addresses["td"], 2, partial=True))
    assert isinstance(last, kv.SentBlocks) and last.blocks == 1
    assert pair.target.inject(Load("r", "m", 2, [13])) == 1
    for name in pair.source_kv:
        assert torch.equal(pair.target_kv[name][[10, 11, 13]], pair.source_kv[name][[5, 6, 7]])
    status = pair.call("target", kv.AgentStatus())
    assert isinstance(status, kv.Status) and status.staged_bytes == 0
    assert pair.target.take_load_errors() == set()


def test_block_ids_are_sent_in_runs_of_consecutive_ids() -> None:
    assert runs(list(enumerate([9, 3, 4, 5, 0, 12, 13])), 2) == [
        (0, 9, 1),
        (1, 3, 2),
        (3, 5, 1),
        (4, 0, 1),
        (5, 12, 2),
    ]
    assert runs(list(enumerate(range(5))), 8) == [(0, 0, 5)]
    assert runs([], 8) == []


def test_injection_copies_runs_of_consecutive_blocks() -> None:
    assert runs([(0, 5), (1, 6), (2, 9), (3, 10), (5, 11)]) == [(0, 5, 2), (2, 9, 2), (5, 11, 1)]
    assert runs([]) == []


def test_nccl_is_refused_without_a_gpu_kv_cache(tmp_path: Path) -> None:
    """On a CPU build (or with a CPU KV cache), asking for nccl fails when the agent starts,
    never mid-migration."""
    with pytest.raises(ValueError, match="nccl"):
        KvAgent(_kv(1), BLOCKS, BLOCK, f"ipc://{tmp_path}/c", f"ipc://{tmp_path}/d", transport="nccl")


@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.distributed.is_nccl_available()), reason="needs a GPU and NCCL"
)
def test_nccl_moves_gpu_blocks(tmp_path: Path) -> None:
    def gpu_kv(seed: int) -> dict[str, torch.Tensor]:
        return {name: tensor.cuda() for name, tensor in _kv(seed).items()}

    source_kv, target_kv = gpu_kv(1), gpu_kv(2)
    source = KvAgent(
        source_kv, BLOCKS, BLOCK, f"ipc://{tmp_path}/sc", f"ipc://{tmp_path}/sd", transport="nccl"
    )
    target = KvAgent(
        target_kv, BLOCKS, BLOCK, f"ipc://{tmp_path}/tc", f"ipc://{tmp_path}/td", transport="nccl"
    )
    try:
        _run(source, "r", [4, 5, 1], tokens=3 * BLOCK)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.REQ)
        sock.connect(f"ipc://{tmp_path}/sc")
        sock.send(kv.encoder.encode(kv.SendBlocks("r", "m", f"ipc://{tmp_path}/td", 0)))
        assert sock.poll(30000)
        sent = kv.agent_reply_decoder.decode(sock.recv())
        sock.close(linger=0)
        ctx.term()
        assert isinstance(sent, kv.SentBlocks) and sent.blocks == 3, sent
        assert target.inject(Load("r", "m", 0, [0, 2, 3])) == 3
        for name in source_kv:
            assert torch.equal(target_kv[name][[0, 2, 3]], source_kv[name][[4, 5, 1]])
    finally:
        source.close()
        target.close()


def test_blocks_never_staged_are_load_errors(pair: Pair) -> None:
    assert pair.target.inject(Load("r", "nothing-staged", 0, [3, 4])) == 0
    assert pair.target.take_load_errors() == {3, 4}


def test_partial_block_goes_only_for_a_held_request(pair: Pair) -> None:
    _run(pair.source, "r", [1, 2], tokens=BLOCK + 2)
    refused = pair.call("source", kv.SendBlocks("r", "m", pair.addresses["td"], 1, partial=True))
    assert isinstance(refused, kv.AgentError) and "not held" in refused.message
    assert pair.call("source", kv.Hold("r")) is None
    # Held: the partly filled block goes at once, before vLLM has taken in the stop (the step
    # it may still run writes past the BLOCK + 2 tokens sent).
    sent = pair.call("source", kv.SendBlocks("r", "m", pair.addresses["td"], 1, partial=True))
    assert isinstance(sent, kv.SentBlocks) and (sent.next_block, sent.blocks) == (2, 1)
    assert sent.tokens_written == BLOCK + 2
    # vLLM finishes the (aborted) request but keeps its blocks while it is held.
    pair.source.update_tables([], ["r"], kept=["r-vllm"])
    assert pair.source.finished_sending(["r-vllm"]) == set()
    assert pair.call("source", kv.Release("r")) is None
    # Released: vLLM may free the blocks now.
    assert pair.source.finished_sending([]) == {"r-vllm"}


def test_a_running_request_sends_its_last_block_as_far_as_it_is_written(pair: Pair) -> None:
    """A move's tail: the partly filled block goes while the request still runs (not held),
    with the tokens written so far; a later send with ``release`` lets the held blocks go."""
    _run(pair.source, "r", [1, 2], tokens=BLOCK + 2)
    tail = pair.call("source", kv.SendBlocks("r", "m", pair.addresses["td"], 1, partial=True, running=True))
    assert isinstance(tail, kv.SentBlocks) and (tail.next_block, tail.blocks, tail.tokens_written) == (
        2,
        1,
        BLOCK + 2,
    )
    staged = pair.call("target", kv.ReadStaged("m"))
    source = pair.call("source", kv.ReadBlocks("r", 1, 1))
    assert isinstance(staged, kv.BlockBytes) and isinstance(source, kv.BlockBytes)
    assert (staged.first_block, staged.data) == (1, source.data)
    # Stopped and held, its last send lets the blocks go as it ends.
    assert pair.call("source", kv.Hold("r")) is None
    pair.source.update_tables([], ["r"], kept=["r-vllm"])
    last = pair.call("source", kv.SendBlocks("r", "m", pair.addresses["td"], 1, partial=True, release=True))
    assert isinstance(last, kv.SentBlocks) and last.blocks == 1
    assert pair.source.finished_sending([]) == {"r-vllm"}


def test_a_held_request_that_finished_on_its_own_releases_nothing(pair: Pair) -> None:
    """Its last token came between the hold and the stop: vLLM freed its blocks at once (only
    aborted requests' are kept), so the release must not name it to vLLM (which would be an
    error there, fatal to the engine core)."""
    _run(pair.source, "r", [1, 2], tokens=BLOCK + 2)
    assert pair.call("source", kv.Hold("r")) is None
    pair.source.update_tables([], ["r"], kept=[])
    assert pair.source.finished_sending([]) == set()
    assert pair.call("source", kv.Release("r")) is None
    assert pair.source.finished_sending([]) == set()
    status = pair.call("source", kv.AgentStatus())
    assert isinstance(status, kv.Status) and status.tracked_requests == 0


def test_a_send_its_request_was_preempted_during_counts_for_nothing(pair: Pair) -> None:
    _run(pair.source, "r", [1, 2, 3], tokens=3 * BLOCK)
    transport = pair.source._transport
    real_send = transport.send

    def preempted_midway(*args: object, **kwargs: object) -> int:
        # vLLM preempts the request while its bytes are on the way: the blocks may be reused.
        pair.source.update_tables([], [], ["r"])
        return real_send(*args, **kwargs)  # type: ignore[arg-type]

    transport.send = preempted_midway  # type: ignore[method-assign]
    lost = pair.call("source", kv.SendBlocks("r", "m", pair.addresses["td"], 1))
    # A pre-copy stage: it says so, and the next one starts from the same block.
    assert isinstance(lost, kv.SentBlocks) and lost.preempted
    assert (lost.next_block, lost.blocks, lost.tokens_written) == (1, 0, 0) and lost.bytes > 0
    transport.send = real_send  # type: ignore[method-assign]
    # Preempted, it has no blocks until it resumes with a new table: nothing to send.
    sent = pair.call("source", kv.SendBlocks("r", "m2", pair.addresses["td"], 1))
    assert isinstance(sent, kv.SentBlocks) and sent.blocks == 0 and sent.tokens_written == 0
    # Resumed with new blocks (recomputed), it sends what the new steps wrote.
    _run(pair.source, "r", [7, 8, 9], tokens=3 * BLOCK)
    sent = pair.call("source", kv.SendBlocks("r", "m2", pair.addresses["td"], 1))
    assert isinstance(sent, kv.SentBlocks) and not sent.preempted and (sent.next_block, sent.blocks) == (3, 2)
    # The send after a migration's stop cannot be sent again: it fails the move instead.
    assert pair.call("source", kv.Hold("r")) is None
    transport.send = preempted_midway  # type: ignore[method-assign]
    failed = pair.call("source", kv.SendBlocks("r", "m2", pair.addresses["td"], 1, partial=True))
    assert isinstance(failed, kv.AgentError) and "lost its blocks" in failed.message


def test_unheld_aborted_requests_free_their_blocks_at_once(pair: Pair) -> None:
    _run(pair.source, "r", [1], tokens=2)
    pair.source.update_tables([], ["r"])
    assert pair.source.finished_sending(["r-vllm"]) == {"r-vllm"}


def test_cancelled_migration_drops_late_chunks(pair: Pair) -> None:
    _run(pair.source, "r", [1, 2], tokens=2 * BLOCK)
    assert pair.call("target", kv.FreeStaging("m")) is None
    sent = pair.call("source", kv.SendBlocks("r", "m", pair.addresses["td"], 0))
    assert isinstance(sent, kv.AgentError) and "cancelled" in sent.message
    status = pair.call("target", kv.AgentStatus())
    assert isinstance(status, kv.Status) and status.staged_bytes == 0


def _until(condition: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


@pytest.mark.parametrize("source", ["leaves", "goes quiet"])
def test_chunks_on_their_way_give_their_staging_back(tmp_path: Path, source: str) -> None:
    """Over a process group the target posts the receives of the chunks whose headers came in
    before the first chunk's bytes are in. A source that leaves after the headers, or stays and
    sends nothing until the target's timeout, lands nothing, and every arena run those chunks
    took is free again (after the target let go of the group their receives were posted on)."""
    pair = Pair(tmp_path, "gloo")
    sender = Transport("gloo", "127.0.0.1", torch.device("cpu"), 8 << 20, timeout_s=5)
    try:
        arena = pair.target._data.arena
        free = arena.free_slots()
        target = pair.addresses["td"]
        sender.connect(target)
        for first in (0, 2, 4):
            header = kv.StageHeader(
                migration_id="m",
                first_block=first,
                num_blocks=2,
                bytes_per_block=pair.target.bytes_per_block,
                via="gloo",
                more=first < 4,
            )
            write_message(sender._connections[target], header)
        _until(lambda: arena.free_slots() == free - 6, "the target did not post the three chunks")
        if source == "leaves":
            sender.close()
        # Quiet: the target gives up after its timeout (5 s) and drops the connection.
        _until(lambda: arena.free_slots() == free, "the chunks' arena runs were not given back")
        status = pair.call("target", kv.AgentStatus())
        assert isinstance(status, kv.Status) and status.staged_bytes == 0 and not status.staging_areas
    finally:
        sender.close()
        pair.close()


def test_request_not_scheduled_yet_has_nothing_to_send(pair: Pair) -> None:
    sent = pair.call("source", kv.SendBlocks("unknown", "m", pair.addresses["td"], 0))
    assert isinstance(sent, kv.SentBlocks) and sent.blocks == 0 and sent.tokens_written == 0


def _piece(generation: int, owner: str = "") -> RequestPiece:
    return RequestPiece("r", 0, token_ids=[1], generation=generation, owner=owner)


def test_router_follows_a_move_and_takes_late_tokens_from_the_old_owner() -> None:
    tracked = _Tracked(RequestOutputCollector("r"), "a")
    assert _owned(tracked, "a", _piece(0))
    assert not _owned(tracked, "b", _piece(0))  # b does not own it
    # b's first piece after the move says generation 1: the request is b's now.
    assert _owned(tracked, "b", _piece(1))
    assert (tracked.engine_id, tracked.generation, tracked.previous) == ("b", 1, "a")
    # Tokens a produced before the move may still arrive; they are kept (ordered by index).
    assert _owned(tracked, "a", _piece(0))
    # a's hand-over piece (generation 1, owner b) changes nothing.
    assert not _owned(tracked, "a", _piece(1, owner="b"))
    # After a second move, a piece two generations old is stale.
    assert _owned(tracked, "a", _piece(2, owner="a"))
    assert tracked.engine_id == "a"
    assert not _owned(tracked, "c", _piece(0))


def test_paced_send_takes_its_time_and_delivers_every_block(any_pair: Pair) -> None:
    pair = any_pair
    _run(pair.source, "r", [9, 3, 4, 5, 0, 12], tokens=6 * BLOCK)
    total = 6 * LAYERS * WIDTH * 2
    started = time.monotonic()
    # Three chunks of two blocks at a pace that makes the whole send last 0.3 s at least.
    sent = pair.call(
        "source", kv.SendBlocks("r", "m", pair.addresses["td"], 0, max_bytes_per_s=int(total / 0.3))
    )
    elapsed = time.monotonic() - started
    assert isinstance(sent, kv.SentBlocks) and (sent.blocks, sent.bytes) == (6, total)
    assert elapsed >= 0.2 - 0.01  # paced after the first two chunks (none after the last)
    source = pair.call("source", kv.ReadBlocks("r", 0, 6))
    staged = pair.call("target", kv.ReadStaged("m"))
    assert isinstance(source, kv.BlockBytes) and isinstance(staged, kv.BlockBytes)
    assert staged.data == source.data


def _same_blocks(pair: Pair, blocks: int) -> None:
    """The target's staging holds the source's first ``blocks`` blocks of request ``r``, byte for byte."""
    source = pair.call("source", kv.ReadBlocks("r", 0, blocks))
    staged = pair.call("target", kv.ReadStaged("m"))
    assert isinstance(source, kv.BlockBytes) and isinstance(staged, kv.BlockBytes)
    assert staged.data == source.data


def test_a_send_paced_by_share_waits_out_the_rest_of_its_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pair = Pair(tmp_path, chunk_bytes=2 * LAYERS * WIDTH * 2)
    try:
        _run(pair.source, "r", [9, 3, 4, 5, 0, 12], tokens=6 * BLOCK)
        # A transport whose every chunk takes 20 ms (a slow link): the agent's own seam.
        send = pair.source._transport.send

        def slow_send(*args: object) -> int:
            time.sleep(0.02)
            return send(*args)  # type: ignore[arg-type]

        monkeypatch.setattr(pair.source._transport, "send", slow_send)
        started = time.monotonic()
        sent = pair.call("source", kv.SendBlocks("r", "m", pair.addresses["td"], 0, max_busy_share=0.25))
        elapsed = time.monotonic() - started
        assert isinstance(sent, kv.SentBlocks) and (sent.next_block, sent.blocks) == (6, 6)
        # Three chunks of 20 ms sending at most a quarter of the time: the first two are each
        # followed by a wait until the time since the start is four times the time spent sending.
        assert elapsed >= 2 * 4 * 0.02 + 0.02 - 0.01
        _same_blocks(pair, 6)
    finally:
        pair.close()


def test_a_paced_send_stops_at_its_time_limit_and_the_next_goes_on(any_pair: Pair) -> None:
    pair = any_pair
    _run(pair.source, "r", [9, 3, 4, 5, 0, 12], tokens=6 * BLOCK)
    total = 6 * LAYERS * WIDTH * 2
    # At this pace the whole send would take 0.6 s: one chunk goes, then its wait passes the limit.
    first = pair.call(
        "source",
        kv.SendBlocks("r", "m", pair.addresses["td"], 0, max_bytes_per_s=int(total / 0.6), max_seconds=0.1),
    )
    assert isinstance(first, kv.SentBlocks) and 0 < first.blocks < 6
    assert first.next_block == first.blocks and first.bytes == first.blocks * LAYERS * WIDTH * 2
    _same_blocks(pair, first.blocks)
    rest = pair.call("source", kv.SendBlocks("r", "m", pair.addresses["td"], first.next_block))
    assert isinstance(rest, kv.SentBlocks) and (rest.next_block, rest.blocks) == (6, 6 - first.blocks)
    _same_blocks(pair, 6)


@pytest.mark.parametrize("backend", ["tcp", "gloo"])
def test_host_transports_are_refused_for_a_gpu_kv_cache_at_start(backend: str) -> None:
    # Asked of the check alone, which needs no GPU: gloo would start, then hand its TCP transport
    # device memory at the first migration.
    with pytest.raises(ValueError, match="host memory"):
        check_backend(backend, torch.device("cuda", 0))
    check_backend(backend, torch.device("cpu"))


def test_the_connector_asks_vllm_for_the_layout_the_agent_moves() -> None:
    # Blocks-first per layer, each block one dense page (the agent refuses anything else); on
    # CUDA, FlashAttention would otherwise get LBNHC (tests/gpu checks it takes LBHNC).
    assert ShoalConnector.get_required_kvcache_layout(None) == "LBHNC"  # type: ignore[arg-type]


def _agent(tmp_path: Path, name: str, max_pairs: int) -> tuple[KvAgent, str]:
    data = f"ipc://{tmp_path}/{name}-data"
    agent = KvAgent(
        _kv(1), BLOCKS, BLOCK, f"ipc://{tmp_path}/{name}-control", data, transport="gloo",
        timeout_s=3, max_pairs=max_pairs,
    )  # fmt: skip
    return agent, data


def test_pair_groups_are_bounded_both_ways(tmp_path: Path) -> None:
    """An engine keeps at most ``max_pairs`` pair groups to send (the least recently used goes,
    and its target lets its end go) and holds at most as many that sources opened to it."""
    (first, first_data), (second, second_data) = (_agent(tmp_path, n, max_pairs=1) for n in ("a", "b"))
    sender = Transport("gloo", "127.0.0.1", torch.device("cpu"), 8 << 20, timeout_s=3, max_pairs=1)
    other = Transport("gloo", "127.0.0.1", torch.device("cpu"), 8 << 20, timeout_s=3, max_pairs=1)
    try:
        sender.connect(first_data)
        _until(lambda: first._data._joined == 1, "the first target did not join")
        sender.connect(second_data)
        assert list(sender._groups) == [second_data]
        _until(lambda: first._data._joined == 0, "the first target kept the group its source closed")
        _until(lambda: second._data._joined == 1, "the second target did not join")
        # The second target holds its one group: another source's join is refused, and that
        # source's set-up fails within its timeout instead of opening one more communicator.
        with pytest.raises(TransportError, match="no gloo group"):
            other.connect(second_data)
        assert second._data._joined == 1 and other._groups == {}
    finally:
        sender.close()
        other.close()
        first.close()
        second.close()


def test_each_worker_of_a_parallel_engine_has_its_own_agent_ports() -> None:
    control, data = "tcp://10.0.0.5:5901", "tcp://[::]:5900"
    assert worker_addresses(control, data, 0) == (control, data)
    assert worker_addresses(control, data, 1) == ("tcp://10.0.0.5:5903", "tcp://[::]:5902")
    ports = {
        port
        for rank in range(8)
        for address in worker_addresses(control, data, rank)
        for port in [int(address.rsplit(":", 1)[1])]
    }
    assert len(ports) == 16  # no two workers (nor their two sockets) share a port


def test_a_flood_of_data_connections_is_capped() -> None:
    """A thread serves each source agent's connection: past ``MAX_SOURCES`` open at once, a new
    connection is closed as it comes (it reads the end at once), and those served stay open."""
    port = free_ports(2)
    caches = {f"layer.{i}": torch.zeros(8, 16, dtype=torch.uint8) for i in range(2)}
    agent = KvAgent(caches, 8, 4, f"tcp://127.0.0.1:{port + 1}", f"tcp://127.0.0.1:{port}", host="127.0.0.1")
    conns = []
    try:
        conns = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(MAX_SOURCES + 8)]
        for conn in conns[MAX_SOURCES:]:
            assert conn.recv(1) == b"", "a connection past the cap was served"
        served = conns[MAX_SOURCES - 1]
        served.settimeout(0.2)
        with pytest.raises(TimeoutError):
            served.recv(1)  # open: waiting for its first message
    finally:
        for conn in conns:
            conn.close()
        agent.close()


def test_kv_reads_are_not_served_unless_asked(tmp_path: Path) -> None:
    """``ReadBlocks`` and ``ReadStaged`` hand out KV bytes: an agent serves them only with
    ``debug_reads`` (the engine's ``--kv-debug-reads``, which the tests' fleets set)."""
    agent = KvAgent(_kv(1), BLOCKS, BLOCK, f"ipc://{tmp_path}/c", f"ipc://{tmp_path}/d")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.connect(f"ipc://{tmp_path}/c")
    try:
        for command in (kv.ReadBlocks("r", 0, 1), kv.ReadStaged("m")):
            sock.send(kv.encoder.encode(command))
            assert sock.poll(10_000)
            reply = kv.agent_reply_decoder.decode(sock.recv())
            assert isinstance(reply, kv.AgentError) and "--kv-debug-reads" in reply.message, reply
    finally:
        sock.close(linger=0)
        ctx.term()
        agent.close()


@pytest.mark.parametrize("transport", ["tcp", "gloo", "tls"])
def test_an_idle_source_connection_is_closed_and_the_next_move_connects_again(
    tmp_path: Path, transport: str
) -> None:
    """The target closes a source's connection that stays idle past its timeout (connections of
    engines that left do not pile up); the source sees it closed and connects again for its
    next move, which goes through."""
    pair = Pair(tmp_path, transport, idle_timeout_s=0.5)

    def sources() -> int:
        status = pair.call("target", kv.AgentStatus())
        assert isinstance(status, kv.Status)
        return status.sources

    try:
        _run(pair.source, "r", [9, 3, 4, 5], tokens=4 * BLOCK)
        assert pair.call("source", kv.Connect(pair.addresses["td"])) is None
        wait_until(lambda: sources() == 1, 10, "the target to serve the connection")
        wait_until(lambda: sources() == 0, 10, "the target to close the idle connection")
        sent = pair.call("source", kv.SendBlocks("r", "m", pair.addresses["td"], 0))
        assert isinstance(sent, kv.SentBlocks) and sent.blocks == 4, sent
        staged = pair.call("target", kv.ReadStaged("m"))
        source = pair.call("source", kv.ReadBlocks("r", 0, 4))
        assert isinstance(staged, kv.BlockBytes) and isinstance(source, kv.BlockBytes)
        assert staged.data == source.data
    finally:
        pair.close()


@pytest.mark.parametrize("stranger", ["plain", "no certificate", "another CA"])
def test_a_stranger_gets_nothing_from_a_tls_data_port(tmp_path: Path, stranger: str) -> None:
    """With the fleet's TLS, a source that holds no certificate of the fleet's CA is dropped at
    the handshake: its chunk is staged nowhere, and the agent's own moves still go through."""
    pair = Pair(tmp_path, "tls")
    path = pair.addresses["td"].removeprefix("ipc://")
    header = kv.StageHeader(migration_id="m", first_block=0, num_blocks=1, bytes_per_block=LAYERS * WIDTH * 2)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(10)
    try:
        conn.connect(path)
        if stranger != "plain":
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
            if stranger == "another CA":
                other = tls.write(tmp_path / "other")
                context.load_cert_chain(tmp_path / "other" / tls.CERT_FILE, tmp_path / "other" / tls.KEY_FILE)
                assert other.ca != tls.FleetTls.load(tmp_path / "tls").ca
            conn = context.wrap_socket(conn, server_hostname=tls.FLEET_NAME)
        # TLS 1.3 finishes the client's side of the handshake before the server checks the
        # client's certificate: the refusal shows on the first read, as the connection's end
        # (or its reset, or the server's alert).
        with contextlib.suppress(OSError):
            write_message(conn, header)
            conn.sendall(bytes(LAYERS * WIDTH * 2))
        try:
            answer = conn.recv(1)
        except OSError:
            answer = b""
        assert answer == b""
        status = pair.call("target", kv.AgentStatus())
        assert isinstance(status, kv.Status) and status.staging_areas == {} and status.staged_bytes == 0
        # The fleet's own source still gets its blocks over.
        _run(pair.source, "r", [9, 3], tokens=2 * BLOCK)
        sent = pair.call("source", kv.SendBlocks("r", "m2", pair.addresses["td"], 0))
        assert isinstance(sent, kv.SentBlocks) and sent.blocks == 2, sent
    finally:
        conn.close()
        pair.close()
