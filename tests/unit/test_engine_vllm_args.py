"""The engine's vLLM settings: parallelism, memory, quantization, revision and the user's own
vLLM flags (``--vllm-args``), from the command line to the ``AsyncEngineArgs`` vLLM would start
with. Nothing is loaded: the arguments are built, never started."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from shoal_engine.config import EngineConfig
from shoal_engine.main import main, parse_args
from shoal_engine.vllm_args import VllmArgsError
from shoal_protos.vllm_flags import OWNED_VLLM_FLAGS, owned_flag

COMMON = ["--model", "m", "--served-model-name", "m"]
USER_FLAGS = (
    "--enable-chunked-prefill --max-num-batched-tokens 8192 --kv-cache-dtype fp8 --no-enable-prefix-caching"
)


@pytest.fixture(scope="module")
def backend() -> ModuleType:
    # vLLM is imported only by the tests that build vLLM's arguments.
    from shoal_engine import vllm_backend

    return vllm_backend


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one line ``parse_args`` exits with (status 2)."""
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    assert exited.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_defaults_leave_vllm_its_own() -> None:
    config = parse_args(COMMON)
    assert (config.tensor_parallel_size, config.pipeline_parallel_size) == (1, 1)
    assert config.gpu_memory_utilization is None
    assert config.quantization is None
    assert config.revision is None
    assert config.vllm_args == ()


@pytest.mark.parametrize(
    ("argv", "field", "value"),
    [
        (["--tensor-parallel-size", "4"], "tensor_parallel_size", 4),
        (["--pipeline-parallel-size", "2"], "pipeline_parallel_size", 2),
        (["--gpu-memory-utilization", "0.85"], "gpu_memory_utilization", 0.85),
        (["--quantization", "awq"], "quantization", "awq"),
        (["--revision", "refs/pr/7"], "revision", "refs/pr/7"),
        ([f"--vllm-args={USER_FLAGS}"], "vllm_args", tuple(USER_FLAGS.split())),
        (["--vllm-args", "--max-num-batched-tokens 8192"], "vllm_args", ("--max-num-batched-tokens", "8192")),
        (["--vllm-args=--enforce-eager-x"], "vllm_args", ("--enforce-eager-x",)),
        (
            ["--vllm-args=--kv-cache-dtype fp8", "--vllm-args", "--seed 3 --tokenizer 'my dir'"],
            "vllm_args",
            ("--kv-cache-dtype", "fp8", "--seed", "3", "--tokenizer", "my dir"),
        ),
    ],
)
def test_each_flag_reaches_the_config(argv: list[str], field: str, value: object) -> None:
    assert getattr(parse_args([*COMMON, *argv]), field) == value


@pytest.mark.parametrize(
    "argv",
    [
        ["--tensor-parallel-size", "0"],
        ["--pipeline-parallel-size", "0"],
        ["--gpu-memory-utilization", "1.5"],
        ["--gpu-memory-utilization", "0"],
        ["--quantization", ""],
        ["--revision", ""],
    ],
)
def test_out_of_range_values_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    line = refused([*COMMON, *argv], capsys)
    assert line.startswith(f"shoal-engine: error: argument {argv[0]}: ")


@pytest.mark.parametrize(
    ("words", "flag"),
    [
        ("--block-size 32", "--block-size"),
        ("--block_size 32", "--block-size"),
        ("--block-size=32", "--block-size"),
        ("--block_size=32", "--block-size"),
        ("--enable-chunked-prefill --max-num-seqs 8", "--max-num-seqs"),
        ("-tp 2", "--tensor-parallel-size"),
        ("-tp=2", "--tensor-parallel-size"),
        ("-tp2", "--tensor-parallel-size"),
        ("-qawq", "--quantization"),
        ("--device-memory-utilization 0.5", "--gpu-memory-utilization"),
        ("--no-enforce-eager", "--enforce-eager"),
        ("--kv-transfer-config.kv_role kv_both", "--kv-transfer-config"),
        ("--tokenizer_revision=v2", "--tokenizer-revision"),
        ("--served-model-name other", "--served-model-name"),
        ("--port 9000", "--port"),
    ],
)
def test_a_flag_shoal_sets_is_refused_by_name(
    words: str, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = refused([*COMMON, f"--vllm-args={words}"], capsys)
    assert line.startswith(f"shoal-engine: error: --vllm-args: {flag} is set by Shoal (")


def test_the_refusal_says_what_to_use_instead(capsys: pytest.CaptureFixture[str]) -> None:
    line = refused([*COMMON, "--vllm-args=--block-size 32"], capsys)
    assert (
        line
        == "shoal-engine: error: --vllm-args: --block-size is set by Shoal (use shoal-engine's --block-size)"
    )
    line = refused([*COMMON, "--vllm-args=--distributed-executor-backend mp"], capsys)
    assert "use shoal-engine's --executor-backend" in line


def test_a_token_flag_is_refused_without_echoing_the_token(capsys: pytest.CaptureFixture[str]) -> None:
    line = refused([*COMMON, "--vllm-args=--hf-token hf_secret"], capsys)
    assert "HF_TOKEN environment variable" in line
    assert "hf_secret" not in line


def test_unbalanced_quotes_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    line = refused([*COMMON, "--vllm-args=--tokenizer 'x"], capsys)
    assert line == "shoal-engine: error: --vllm-args: No closing quotation"


@pytest.mark.parametrize(
    ("arg", "flag"),
    [
        ("--model", "--model"),
        ("--model=x", "--model"),
        ("--max_model_len=4096", "--max-model-len"),
        ("--enable_log_requests", "--enable-log-requests"),
        ("--no-enable-log-requests", "--enable-log-requests"),
        ("-pp", "--pipeline-parallel-size"),
        ("-q", "--quantization"),
        ("--model-impl", None),
        ("--speculative-config.model", None),
        ("--enable-chunked-prefill", None),
        ("8192", None),
        ("-O3", None),
        ("fp8", None),
    ],
)
def test_owned_flag_names_the_flag_an_argument_sets(arg: str, flag: str | None) -> None:
    assert owned_flag(arg) == flag


def test_the_owned_list_is_a_plain_tuple_of_flags() -> None:
    assert isinstance(OWNED_VLLM_FLAGS, tuple)
    assert all(isinstance(flag, str) and flag.startswith("-") for flag in OWNED_VLLM_FLAGS)
    assert len(set(OWNED_VLLM_FLAGS)) == len(OWNED_VLLM_FLAGS)
    assert all(owned_flag(flag) is not None for flag in OWNED_VLLM_FLAGS)


def full_config(**overrides: Any) -> EngineConfig:
    """A config that sets every vLLM setting the engine owns."""
    fields: dict[str, Any] = {
        "model": "m",
        "served_model_name": "served",
        "engine_id": "e0",
        "max_model_len": 4096,
        "block_size": 32,
        "executor_backend": "mp",
        "migration": True,
        "tensor_parallel_size": 2,
        "pipeline_parallel_size": 3,
        "gpu_memory_utilization": 0.8,
        "quantization": "awq",
        "revision": "v2",
    }
    fields.update(overrides)
    return EngineConfig(**fields)


def test_the_engine_args_carry_shoal_settings(backend: ModuleType) -> None:
    args = backend.build_engine_args(full_config())
    assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (2, 3)
    assert args.gpu_memory_utilization == 0.8
    assert args.quantization == "awq"
    assert (args.revision, args.tokenizer_revision) == ("v2", "v2")
    assert (args.model, args.served_model_name, args.block_size) == ("m", ["served"], 32)
    assert args.kv_transfer_config.kv_connector == "ShoalConnector"
    # A block the connector could not load is computed again, never a failed request.
    assert args.kv_transfer_config.kv_load_failure_policy == "recompute"


def test_unset_settings_keep_vllm_defaults(backend: ModuleType) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = backend.build_engine_args(EngineConfig(model="m", served_model_name="m", engine_id="e0"))
    defaults = AsyncEngineArgs(model="m")
    assert args.gpu_memory_utilization == defaults.gpu_memory_utilization
    assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (1, 1)
    assert args.quantization is None
    assert args.revision is None and args.tokenizer_revision is None


def test_the_user_flags_are_applied_through_vllms_parser(backend: ModuleType) -> None:
    config = parse_args([*COMMON, f"--vllm-args={USER_FLAGS} --seed=7", "--tensor-parallel-size", "2"])
    args = backend.build_engine_args(config)
    assert args.enable_chunked_prefill is True
    assert args.max_num_batched_tokens == 8192  # vLLM's parser turned the word into a number
    assert args.kv_cache_dtype == "fp8"
    assert args.enable_prefix_caching is False
    assert args.seed == 7
    assert args.tensor_parallel_size == 2
    # What the user did not name keeps vLLM's default.
    assert args.max_logprobs == type(args)(model="m").max_logprobs


def test_only_the_fields_the_user_named_are_returned(backend: ModuleType) -> None:
    assert backend.user_engine_args([]) == {}
    assert backend.user_engine_args(["--kv-cache-dtype", "fp8", "--enable-chunked-prefill"]) == {
        "kv_cache_dtype": "fp8",
        "enable_chunked_prefill": True,
    }
    # A value equal to vLLM's default still counts as named.
    assert backend.user_engine_args(["--no-trust-remote-code"]) == {"trust_remote_code": False}


@pytest.mark.parametrize(
    ("words", "message"),
    [
        (["--no-such-flag"], "--vllm-args: unrecognized arguments: --no-such-flag"),
        (["--enable-auto-tool-choice"], "--vllm-args: unrecognized arguments: --enable-auto-tool-choice"),
        (["--kv-cache-dtype", "fp7"], "--vllm-args: argument --kv-cache-dtype: invalid choice: 'fp7'"),
        (["--max-num-batched-tokens", "many"], "--vllm-args: argument --max-num-batched-tokens: invalid"),
        (["--help"], "--vllm-args: unrecognized arguments: --help"),
    ],
)
def test_vllms_parser_refuses_what_vllm_serve_would(
    backend: ModuleType, words: list[str], message: str
) -> None:
    with pytest.raises(VllmArgsError) as refusal:
        backend.user_engine_args(words)
    assert str(refusal.value).startswith(message)


@pytest.mark.parametrize(
    ("words", "flag"),
    [
        (["--tensor-parallel", "2"], "--tensor-parallel-size"),  # an abbreviation vLLM accepts
        (["--block", "32"], "--block-size"),
    ],
)
def test_owned_fields_are_refused_however_vllm_read_them(
    backend: ModuleType, words: list[str], flag: str
) -> None:
    with pytest.raises(VllmArgsError, match=f"^--vllm-args: {flag} is set by Shoal"):
        backend.user_engine_args(words)


def test_owned_fields_in_a_config_file_are_refused(backend: ModuleType, tmp_path: Path) -> None:
    config_file = tmp_path / "vllm.yaml"
    config_file.write_text("max-num-batched-tokens: 4096\nmax-num-seqs: 8\n")
    with pytest.raises(VllmArgsError, match=r"^--vllm-args: --max-num-seqs is set by Shoal"):
        backend.user_engine_args(["--config", str(config_file)])


def test_every_field_shoal_sets_is_owned_under_every_name_vllm_gives_it(backend: ModuleType) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser(add_help=False))
    names = {action.dest: action.option_strings for action in parser._actions}
    fields = {field.name for field in dataclasses.fields(AsyncEngineArgs)}
    for field in backend.shoal_engine_args(full_config()):
        assert field in fields
        assert set(names[field]) <= set(OWNED_VLLM_FLAGS), field
    # And every owned flag is still one of vLLM's (a rename would slip through).
    spellings = {name for options in names.values() for name in options}
    assert set(OWNED_VLLM_FLAGS) - spellings == {"--host", "--port"}


def test_a_refused_flag_stops_the_engine_before_anything_loads(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main([*COMMON, "--vllm-args=--no-such-flag"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "shoal-engine: error: --vllm-args: unrecognized arguments: --no-such-flag" in err


def test_a_gpu_engine_takes_its_staging_and_pairs_out_of_vllms_budget(backend: ModuleType) -> None:
    """Allocated after vLLM's memory profile, the staging arena and the NCCL pair groups would
    sit on top of what ``gpu_memory_utilization`` gives vLLM: their share comes off it."""
    gib = 1 << 30
    config = full_config(kv_staging_mib=1024, kv_max_pairs=4)  # 0.8 asked
    reserve = gib + 4 * backend.NCCL_PAIR_RESERVE
    assert backend.migration_budget(config, 80 * gib) == pytest.approx(0.8 - reserve / (80 * gib), abs=1e-4)
    # Unset, vLLM's own default is what the share comes off.
    unset = full_config(gpu_memory_utilization=None)
    from vllm.config import CacheConfig

    assert CacheConfig().gpu_memory_utilization == backend.VLLM_GPU_MEMORY_UTILIZATION
    expected = backend.VLLM_GPU_MEMORY_UTILIZATION - reserve / (24 * gib)
    assert backend.migration_budget(unset, 24 * gib) == pytest.approx(expected, abs=1e-4)
    # A device the reserve would all but fill is refused at start, with the numbers.
    with pytest.raises(VllmArgsError, match="--kv-staging-mib 1024"):
        backend.migration_budget(config, gib)


def test_kv_events_are_shoals_unless_the_user_publishes_their_own(backend: ModuleType) -> None:
    from vllm.config import KVEventsConfig

    ours = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint="ipc:///tmp/x/events")
    config = parse_args(COMMON)
    assert backend.build_engine_args(config, ours).kv_events_config is ours
    assert backend.build_engine_args(config).kv_events_config is None
    events = '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5561","topic":"kv"}'
    theirs = f"--kv-events-config '{events}'"
    config = parse_args([*COMMON, f"--vllm-args={theirs}"])
    args = backend.build_engine_args(config, ours)
    assert args.kv_events_config.endpoint == "tcp://*:5561"
    # The engine reads the user's publisher on this host, under their topic.
    assert backend.kv_events_source(args.kv_events_config) == ("tcp://127.0.0.1:5561", "kv")
    assert backend.kv_events_source(KVEventsConfig(enable_kv_cache_events=False)) is None
    # One that connects out to a broker of the user's: nothing to read here.
    remote = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://broker:5557")
    assert backend.kv_events_source(remote) is None
