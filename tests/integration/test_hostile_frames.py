"""Hostile bytes on every socket of a running fleet crash nothing and run nothing.

vLLM has shipped CVEs for unpickling what arrives on a ZeroMQ socket; Shoal speaks msgspec and
protobuf only. Here a pickle that would create a file if anything unpickled it is sent to each
engine's request socket, the router's output socket, each engine's KV agent, every EngineControl
and Tokenizer gRPC method; then hypothesis sends generated frames (random bytes, and well-formed
requests with hostile fields: ids out of the vocabulary, negative or huge numbers, odd reply
addresses) to the ZeroMQ sockets, and random bytes to the read-only gRPC methods. Afterwards
no file was created, no process died or restarted, and both engines still serve and migrate.

The counts are bounded (a few hundred frames) so the test takes seconds.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import grpc
import httpx
import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal_protos import engine_control_pb2, kv, tokenizer_pb2
from shoal_protos.messages import AbortRequest, AddRequest, FrameType, SamplingOptions
from tests.integration.support import STALL_S, RunningFleet, wait_until
from tests.integration.test_migration import TINY_LONG, TINY_PROMPT, moved_back_to_back

pytestmark = pytest.mark.integration

FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,  # the same frames every run: a failure can be replayed
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


class _Trap:
    """Unpickling this opens ``path`` for writing, creating it: proof that something ran pickle
    on bytes it received."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def _zmq_targets(fleet: RunningFleet) -> list[tuple[str, list[bytes]]]:
    """(address, frame type tags it understands) of every ZeroMQ PULL socket of the fleet."""
    engines = [fleet.engine_record(fleet.cfg.engine_id(i)) for i in range(fleet.cfg.engines)]
    targets = [(r.zmq_address, [FrameType.ADD.value, FrameType.ABORT.value]) for r in engines if r]
    targets.append((f"tcp://{fleet.cfg.host}:{fleet.cfg.router_zmq_port}", [FrameType.OUTPUTS.value]))
    return targets


def _push(address: str, messages: list[list[bytes]]) -> None:
    with zmq.Context() as ctx, ctx.socket(zmq.PUSH) as sock:
        sock.setsockopt(zmq.LINGER, 2000)
        sock.setsockopt(zmq.SNDTIMEO, 2000)
        sock.connect(address)
        for frames in messages:
            sock.send_multipart(frames)


def _grpc_methods(fleet: RunningFleet) -> list[tuple[str, str, bool]]:
    """(address, method path, read-only) of every gRPC method the fleet serves."""
    out = []
    engine_control = engine_control_pb2.DESCRIPTOR.services_by_name["EngineControl"]
    tokenizer = tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"]
    for i in range(fleet.cfg.engines):
        record = fleet.engine_record(fleet.cfg.engine_id(i))
        assert record is not None
        for method in engine_control.methods:
            out.append(
                (
                    record.control_address,
                    f"/{engine_control.full_name}/{method.name}",
                    method.name == "ListMigrations",
                )
            )
    address = f"{fleet.cfg.host}:{fleet.cfg.tokenizer_port}"
    for method in tokenizer.methods:
        out.append((address, f"/{tokenizer.full_name}/{method.name}", True))
    return out


def _call_raw(address: str, path: str, body: bytes) -> grpc.StatusCode:
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
        try:
            call(body, timeout=STALL_S)
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[attr-defined, no-any-return]
        return grpc.StatusCode.OK


def _kv_agent_control(fleet: RunningFleet, engine_id: str) -> str:
    index = int(engine_id.rsplit("-", 1)[1])
    return f"tcp://{fleet.cfg.host}:{fleet.cfg.engine_kv_base_port + 2 * index + 1}"


def _serves_and_migrates(fleet: RunningFleet) -> None:
    """Both engines answer, and a live migration between them still works."""
    wait_until(
        lambda: httpx.get(fleet.base_url + "/health", timeout=STALL_S).status_code == 200,
        STALL_S,
        "router health",
    )
    client = fleet.openai()
    for i in range(6):
        reply = client.completions.create(model=fleet.model, prompt=[3, 4, i], max_tokens=4)
        assert reply.usage is not None and reply.usage.completion_tokens >= 1
    out = moved_back_to_back(fleet, TINY_PROMPT, TINY_LONG, 1)
    assert out.finish_reason == "length"


def test_pickle_is_never_unpickled_and_hostile_frames_crash_nothing(
    tiny_fleet: RunningFleet, tmp_path: Path
) -> None:
    marker = tmp_path / "unpickled"
    payload = pickle.dumps(_Trap(marker))
    before = tiny_fleet.fleet.pids()

    # 1. The pickle, everywhere: alone, and as the body after every type tag a socket knows.
    for address, tags in _zmq_targets(tiny_fleet):
        _push(address, [[payload], *[[tag, payload] for tag in tags], [payload, payload, payload]])
    for i in range(tiny_fleet.cfg.engines):
        with zmq.Context() as ctx, ctx.socket(zmq.REQ) as req:
            req.setsockopt(zmq.LINGER, 0)
            req.connect(_kv_agent_control(tiny_fleet, tiny_fleet.cfg.engine_id(i)))
            req.send(payload)
            assert req.poll(int(STALL_S * 1000)), "the KV agent did not answer a bad command"
            reply = kv.agent_reply_decoder.decode(req.recv())
            assert isinstance(reply, kv.AgentError) and "undecodable" in reply.message
    for address, path, _ in _grpc_methods(tiny_fleet):
        # Refused as the caller's fault: protobuf cannot parse it.
        code = _call_raw(address, path, payload)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (path, code)

    # 2. Generated frames on the ZeroMQ sockets.
    targets = _zmq_targets(tiny_fleet)
    reply_to = f"tcp://{tiny_fleet.cfg.host}:{tiny_fleet.cfg.router_zmq_port}"
    encoder = msgspec.msgpack.Encoder()
    sampling = st.builds(
        SamplingOptions,
        max_tokens=st.integers(-3, 12),
        temperature=st.floats(allow_nan=True, allow_infinity=True, width=32),
        top_p=st.floats(-1, 2),
        top_k=st.integers(-5, 10**6),
        seed=st.none() | st.integers(-(2**63), 2**63 - 1),
        stop=st.lists(st.text(max_size=8), max_size=3),
        stop_token_ids=st.lists(st.integers(-5, 10**6), max_size=3),
        ignore_eos=st.booleans(),
    )
    adds = st.builds(
        AddRequest,
        request_id=st.text(max_size=24),
        prompt_token_ids=st.lists(st.integers(-(2**31), 2**31), max_size=12),
        sampling=sampling,
        reply_to=st.sampled_from(
            [reply_to, "", "garbage", "tcp://", "ipc:///tmp/x", "tcp://256.1.1.1:99999"]
        ),
        output_token_ids=st.lists(st.integers(-10, 10**6), max_size=4),
        generation=st.integers(-5, 2**40),
    )
    frames = st.one_of(
        st.lists(st.binary(max_size=64), min_size=0, max_size=4),
        st.tuples(st.sampled_from([t for _, tags in targets for t in tags]), st.binary(max_size=128)).map(
            list
        ),
        adds.map(lambda a: [FrameType.ADD.value, encoder.encode(a)]),
        st.builds(AbortRequest, st.lists(st.text(max_size=24), max_size=3)).map(
            lambda a: [FrameType.ABORT.value, encoder.encode(a)]
        ),
    )

    @FUZZ
    @given(messages=st.lists(frames, min_size=1, max_size=4), target=st.sampled_from(targets))
    def send_generated(messages: list[list[bytes]], target: tuple[str, list[bytes]]) -> None:
        _push(target[0], [m for m in messages if m] or [[b""]])

    send_generated()

    # 3. Random bytes to the read-only gRPC methods (the others change state when their bytes
    # happen to parse; the pickle above reached them all).
    read_only = [(address, path) for address, path, safe in _grpc_methods(tiny_fleet) if safe]

    @FUZZ
    @given(body=st.binary(max_size=256), method=st.sampled_from(read_only))
    def call_generated(body: bytes, method: tuple[str, str]) -> None:
        code = _call_raw(*method, body)
        assert code != grpc.StatusCode.UNAVAILABLE, method  # the server is still there

    call_generated()

    # Nothing unpickled, nothing died or restarted, and the fleet still serves and migrates.
    assert not marker.exists()
    _serves_and_migrates(tiny_fleet)
    assert tiny_fleet.fleet.pids() == before
    assert not marker.exists()
