"""What the engine service tells its KV connector crosses vLLM as plain dicts: the typed structs
on both sides read back what was written, and refuse what neither side writes."""

from __future__ import annotations

import msgspec
import pytest

from shoal_engine.kv.params import PARAMS_KEY, ConnectorSettings, KvLoad, KvParams
from shoal_protos import engine_control_pb2 as pb
from shoal_protos.moves import OUTCOME_NAMES, MoveCode


def test_a_requests_load_reads_back_as_written() -> None:
    params = KvParams(id="r1", load=KvLoad(migration="m1", tokens=100, keep=True))
    wire = params.to_vllm()
    assert wire == {PARAMS_KEY: {"id": "r1", "load": {"migration": "m1", "tokens": 100, "keep": True}}}
    assert KvParams.from_vllm(wire) == params
    assert KvParams.from_vllm({PARAMS_KEY: {"id": "r2"}}) == KvParams(id="r2")
    assert KvParams.from_vllm(None) is None
    assert KvParams.from_vllm({"other_connector": {}}) is None


@pytest.mark.parametrize(
    "raw",
    [
        {"id": "r1", "load": {"migration": "m1", "token": 100}},  # misspelt
        {"id": "r1", "load": {"migration": "m1"}},  # missing
        {"id": "r1", "load": {"migration": "m1", "tokens": "many"}},  # wrong type
        {"load": {"migration": "m1", "tokens": 1}},  # no request id
    ],
)
def test_a_malformed_load_is_refused_where_it_is_read(raw: dict[str, object]) -> None:
    with pytest.raises(msgspec.ValidationError):
        KvParams.from_vllm({PARAMS_KEY: raw})


def test_connector_settings_read_back_and_refuse_unknown_keys() -> None:
    settings = ConnectorSettings(control_address="tcp://127.0.0.1:1", data_address="tcp://[::]:2", host="h")
    assert ConnectorSettings.from_vllm(settings.to_vllm()) == settings
    with pytest.raises(msgspec.ValidationError, match="staging_mib"):
        ConnectorSettings.from_vllm({**settings.to_vllm(), "staging_mib": 4})


def test_every_move_code_has_one_outcome() -> None:
    assert {code.outcome for code in MoveCode} == set(OUTCOME_NAMES)
    assert MoveCode.MOVED.outcome == pb.MIGRATED
    assert [code for code in MoveCode if code.outcome == pb.MIGRATED] == [MoveCode.MOVED]
