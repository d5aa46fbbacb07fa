"""Wire contracts: the ZeroMQ frames between routers and engines, and the Redis records."""

from __future__ import annotations

import json

import msgspec
import pytest

from shoal_protos.messages import (
    AbortRequest,
    AddRequest,
    EngineRequestDecoder,
    FinishReason,
    FrameType,
    OutputBatch,
    PieceError,
    RequestPiece,
    RouterRequestEncoder,
    SamplingOptions,
)
from shoal_protos.records import (
    EngineRecord,
    EngineState,
    Keys,
    LoadReport,
    engine_record_decoder,
    json_encoder,
    load_report_decoder,
)


@pytest.fixture
def encoder() -> RouterRequestEncoder:
    return RouterRequestEncoder()


@pytest.fixture
def decoder() -> EngineRequestDecoder:
    return EngineRequestDecoder()


FULL_SAMPLING = SamplingOptions(
    max_tokens=64,
    temperature=0.7,
    top_p=0.9,
    top_k=40,
    seed=1234,
    stop=["\n\n", "END"],
    stop_token_ids=[2, 50256],
    ignore_eos=True,
)


@pytest.mark.parametrize("sampling", [SamplingOptions(max_tokens=8), FULL_SAMPLING], ids=["defaults", "full"])
def test_add_request_round_trips(
    encoder: RouterRequestEncoder, decoder: EngineRequestDecoder, sampling: SamplingOptions
) -> None:
    add = AddRequest("req-1", [1, 2, 3, 70000], sampling, "tcp://10.0.0.1:5700")

    frame_type, body = encoder.add(add)
    decoded = decoder.decode(frame_type, body)

    assert frame_type == FrameType.ADD.value == b"\x00"
    assert isinstance(decoded, AddRequest)
    assert decoded == add
    assert decoded.sampling.seed == sampling.seed
    assert decoded.sampling.stop == sampling.stop


def test_priority_travels_and_an_add_without_it_decodes_as_priority_zero(
    encoder: RouterRequestEncoder, decoder: EngineRequestDecoder
) -> None:
    urgent = AddRequest("req-p", [1], SamplingOptions(max_tokens=1), "tcp://r:1", generation=2, priority=-3)
    decoded = decoder.decode(*encoder.add(urgent))
    assert isinstance(decoded, AddRequest) and decoded.priority == -3 and decoded.generation == 2
    # A router that predates the field sends the array without it: the default applies.
    older = msgspec.msgpack.encode(["req-o", [1], [1], "tcp://r:1", [], 2])
    decoded = decoder.decode(FrameType.ADD.value, older)
    assert isinstance(decoded, AddRequest) and decoded.priority == 0 and decoded.generation == 2


def test_add_request_decodes_from_memoryview(
    encoder: RouterRequestEncoder, decoder: EngineRequestDecoder
) -> None:
    # The engine's receiver hands the decoder zero-copy frame buffers.
    add = AddRequest("req-2", [5], SamplingOptions(max_tokens=1), "ipc:///tmp/r")
    frame_type, body = encoder.add(add)

    assert decoder.decode(frame_type, memoryview(body)) == add


@pytest.mark.parametrize(
    "abort",
    [AbortRequest(["a"]), AbortRequest(["a", "b", "c"], reason="router shutting down")],
    ids=["default-reason", "custom-reason"],
)
def test_abort_request_round_trips(
    encoder: RouterRequestEncoder, decoder: EngineRequestDecoder, abort: AbortRequest
) -> None:
    frame_type, body = encoder.abort(abort)
    decoded = decoder.decode(frame_type, body)

    assert frame_type == FrameType.ABORT.value == b"\x01"
    assert isinstance(decoded, AbortRequest)
    assert decoded == abort


def test_abort_default_reason_is_client_disconnect(
    encoder: RouterRequestEncoder, decoder: EngineRequestDecoder
) -> None:
    decoded = decoder.decode(*encoder.abort(AbortRequest(["x"])))
    assert isinstance(decoded, AbortRequest)
    assert decoded.reason == "client disconnected"


@pytest.mark.parametrize("frame_type", [FrameType.OUTPUTS.value, b"\x07", b"", b"\x00\x00"])
def test_unknown_frame_type_is_rejected(
    encoder: RouterRequestEncoder, decoder: EngineRequestDecoder, frame_type: bytes
) -> None:
    _, body = encoder.abort(AbortRequest(["x"]))
    with pytest.raises(msgspec.DecodeError, match="unknown frame type"):
        decoder.decode(frame_type, body)


def test_body_of_the_wrong_type_is_rejected(
    encoder: RouterRequestEncoder, decoder: EngineRequestDecoder
) -> None:
    # An ADD body under an ABORT tag must not decode into something plausible.
    _, add_body = encoder.add(AddRequest("r", [1], SamplingOptions(max_tokens=1), "tcp://x:1"))
    with pytest.raises(msgspec.DecodeError):
        decoder.decode(FrameType.ABORT.value, add_body)


def test_garbage_body_is_rejected(decoder: EngineRequestDecoder) -> None:
    with pytest.raises(msgspec.DecodeError):
        decoder.decode(FrameType.ADD.value, b"\xc1not msgpack")


def test_output_batch_round_trips_with_pieces() -> None:
    batch = OutputBatch(
        engine_id="engine-0",
        step=42,
        pieces=[
            RequestPiece("r1", 0, token_ids=[10, 11], text="hello"),
            RequestPiece(
                "r2",
                5,
                token_ids=[7],
                text=" world",
                finish_reason=FinishReason.STOP,
                stop_reason=2,
                num_prompt_tokens=9,
            ),
            RequestPiece("r3", 3, finish_reason=FinishReason.STOP, stop_reason="\n", num_prompt_tokens=4),
            RequestPiece(
                "r4",
                0,
                finish_reason=FinishReason.ERROR,
                error=PieceError("engine_draining", "going away", retryable=True),
            ),
        ],
    )

    data = msgspec.msgpack.encode(batch)
    decoded = msgspec.msgpack.decode(data, type=OutputBatch)

    assert decoded == batch
    assert decoded.pieces[1].finish_reason is FinishReason.STOP
    # A stop token id and a stop string keep their types.
    assert decoded.pieces[1].stop_reason == 2
    assert isinstance(decoded.pieces[1].stop_reason, int)
    assert decoded.pieces[2].stop_reason == "\n"
    assert decoded.pieces[3].error is not None
    assert decoded.pieces[3].error.retryable is True
    assert decoded.pieces[0].finish_reason is None


def test_output_batch_rejects_unknown_finish_reason() -> None:
    piece = RequestPiece("r", 0, finish_reason=FinishReason.STOP)
    raw = msgspec.msgpack.encode(OutputBatch("e", 1, [piece])).replace(b"stop", b"oops")
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(raw, type=OutputBatch)


def _engine_record(**overrides: object) -> EngineRecord:
    fields: dict[str, object] = {
        "engine_id": "engine-3",
        "model": "tiny",
        "zmq_address": "tcp://127.0.0.1:5603",
        "http_address": "http://127.0.0.1:8103",
        "max_model_len": 2048,
        "kv_blocks_total": 512,
        "pid": 4321,
        "hostname": "node-a",
        "protocol_version": 1,
        "started_at": 1700000000.5,
    }
    fields.update(overrides)
    return EngineRecord(**fields)  # type: ignore[arg-type]


def test_engine_record_json_round_trip_is_readable() -> None:
    record = _engine_record(state=EngineState.DRAINING)

    raw = json_encoder.encode(record)
    as_json = json.loads(raw)
    decoded = engine_record_decoder.decode(raw)

    assert decoded == record
    assert decoded.state is EngineState.DRAINING
    assert as_json["engine_id"] == "engine-3"
    assert as_json["state"] == "DRAINING"
    assert as_json["zmq_address"] == "tcp://127.0.0.1:5603"
    assert as_json["max_model_len"] == 2048
    assert as_json["started_at"] == 1700000000.5


def test_engine_record_defaults_are_omitted_and_restored() -> None:
    record = EngineRecord(
        engine_id="e",
        model="m",
        zmq_address="tcp://h:1",
        http_address="http://h:2",
        max_model_len=16,
        protocol_version=1,
        started_at=0.0,
    )

    raw = json_encoder.encode(record)
    decoded = engine_record_decoder.decode(raw)

    assert "state" not in json.loads(raw)
    assert decoded.state is EngineState.ACTIVE
    assert decoded == record


def test_engine_record_missing_required_field_is_rejected() -> None:
    as_json = json.loads(json_encoder.encode(_engine_record()))
    del as_json["zmq_address"]
    with pytest.raises(msgspec.ValidationError, match="zmq_address"):
        engine_record_decoder.decode(json.dumps(as_json))


def test_load_report_json_round_trip_is_readable() -> None:
    report = LoadReport(
        engine_id="engine-1",
        seq=17,
        time=1700000001.25,
        num_running=3,
        num_waiting=2,
        kv_blocks_used=100,
        kv_blocks_free=412,
        step_time_ms=12.5,
    )

    raw = json_encoder.encode(report)
    as_json = json.loads(raw)

    assert load_report_decoder.decode(raw) == report
    assert as_json == {
        "engine_id": "engine-1",
        "seq": 17,
        "time": 1700000001.25,
        "num_running": 3,
        "num_waiting": 2,
        "kv_blocks_used": 100,
        "kv_blocks_free": 412,
        "step_time_ms": 12.5,
    }


def test_load_report_decoder_does_not_accept_an_engine_record() -> None:
    with pytest.raises(msgspec.ValidationError):
        load_report_decoder.decode(json_encoder.encode(_engine_record()))


def test_keys_build_versioned_names() -> None:
    keys = Keys("prod-eu")
    assert keys.engines == "shoal:v1:prod-eu:engines"
    assert keys.engine("engine-0") == "shoal:v1:prod-eu:engine:engine-0"
    assert keys.load("engine-0") == "shoal:v1:prod-eu:load:engine-0"


def test_keys_of_different_clusters_do_not_collide() -> None:
    assert Keys("a").engine("x") != Keys("b").engine("x")


@pytest.mark.parametrize("cluster", ["a:b", ":", "prod:", ""])
def test_keys_reject_bad_cluster_names(cluster: str) -> None:
    with pytest.raises(ValueError, match="cluster name"):
        Keys(cluster)
