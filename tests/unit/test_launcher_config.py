"""The supervisord configuration the local fleet launcher writes (no process is started)."""

from __future__ import annotations

import configparser
import shlex
import shutil
from pathlib import Path

import pytest
from supervisor.datatypes import dict_of_key_value_pairs

from shoal_fleet import launcher
from shoal_fleet.launcher import FleetConfig, FleetError, supervisord_config

PYTHON = "/opt/shoal/venv/bin/python"


@pytest.fixture
def redis_server() -> str:
    path = shutil.which("redis-server")
    if path is None:
        pytest.skip("redis-server is not on PATH; supervisord_config needs it")
    return path


@pytest.fixture
def many_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher.os, "cpu_count", lambda: 64)


def make_config(tmp_path: Path, **overrides: object) -> FleetConfig:
    fields: dict[str, object] = {
        "model_path": tmp_path / "models" / "tiny",
        "served_model_name": "tiny",
        "run_dir": tmp_path / "run",
        "engines": 3,
        "python": PYTHON,
    }
    fields.update(overrides)
    return FleetConfig(**fields)  # type: ignore[arg-type]


def parse(text: str) -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser()
    parser.read_string(text)
    return parser


def programs(parser: configparser.RawConfigParser) -> dict[str, configparser.SectionProxy]:
    prefix = "program:"
    return {name[len(prefix) :]: parser[name] for name in parser.sections() if name.startswith(prefix)}


def engines(parser: configparser.RawConfigParser) -> dict[str, configparser.SectionProxy]:
    return {name: section for name, section in programs(parser).items() if name.startswith("engine-")}


def argv(section: configparser.SectionProxy) -> list[str]:
    # supervisord splits ``command`` with shlex.split.
    return shlex.split(section["command"])


def option(args: list[str], name: str) -> str:
    assert args.count(name) == 1, f"{name} should appear once in {args}"
    return args[args.index(name) + 1]


def environment(section: configparser.SectionProxy) -> dict[str, str]:
    # The parser supervisord itself uses for ``environment=``.
    return dict_of_key_value_pairs(section.get("environment", ""))


@pytest.mark.usefixtures("redis_server", "many_cores")
def test_one_program_per_engine_and_one_of_each_other_part(tmp_path: Path) -> None:
    parser = parse(supervisord_config(make_config(tmp_path, engines=3)))

    assert sorted(programs(parser)) == ["engine-0", "engine-1", "engine-2", "redis", "router", "tokenizer"]
    for i, (name, section) in enumerate(sorted(engines(parser).items())):
        args = argv(section)
        assert args[:3] == [PYTHON, "-m", "shoal_engine.main"]
        assert option(args, "--engine-id") == name == f"engine-{i}"
        assert section["stdout_logfile"] == str(tmp_path / "run" / "logs" / f"{name}.log")


@pytest.mark.usefixtures("redis_server", "many_cores")
@pytest.mark.parametrize("count", [1, 4])
def test_engine_count_follows_the_config(tmp_path: Path, count: int) -> None:
    parser = parse(supervisord_config(make_config(tmp_path, engines=count)))
    assert sorted(engines(parser)) == [f"engine-{i}" for i in range(count)]


@pytest.mark.usefixtures("redis_server", "many_cores")
def test_engines_get_distinct_consecutive_ports(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, engines=4, engine_zmq_base_port=6100, engine_http_base_port=9100)
    parser = parse(supervisord_config(cfg))

    zmq_ports = [int(option(argv(s), "--zmq-port")) for _, s in sorted(engines(parser).items())]
    http_ports = [int(option(argv(s), "--http-port")) for _, s in sorted(engines(parser).items())]

    assert zmq_ports == [6100, 6101, 6102, 6103]
    assert http_ports == [9100, 9101, 9102, 9103]
    router_args = argv(programs(parser)["router"])
    others = {
        cfg.redis_port,
        cfg.tokenizer_port,
        int(option(router_args, "--port")),
        int(option(router_args, "--zmq-port")),
    }
    assert len(set(zmq_ports) | set(http_ports) | others) == len(zmq_ports) + len(http_ports) + len(others)


@pytest.mark.usefixtures("redis_server", "many_cores")
def test_engines_share_cluster_redis_and_model(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, cluster="blue", redis_port=6390, max_model_len=1024)
    parser = parse(supervisord_config(cfg))

    for section in engines(parser).values():
        args = argv(section)
        assert option(args, "--cluster") == "blue"
        assert option(args, "--redis-url") == "redis://127.0.0.1:6390/0"
        assert option(args, "--model") == str(cfg.model_path)
        assert option(args, "--served-model-name") == "tiny"
        assert option(args, "--max-model-len") == "1024"
    router_args = argv(programs(parser)["router"])
    assert option(router_args, "--cluster") == "blue"
    assert option(router_args, "--redis-url") == "redis://127.0.0.1:6390/0"


@pytest.mark.usefixtures("redis_server", "many_cores")
def test_max_model_len_none_leaves_the_flag_out(tmp_path: Path) -> None:
    parser = parse(supervisord_config(make_config(tmp_path, max_model_len=None)))
    for section in engines(parser).values():
        assert "--max-model-len" not in argv(section)


@pytest.mark.usefixtures("redis_server", "many_cores")
def test_engines_are_bound_to_distinct_cores(tmp_path: Path) -> None:
    parser = parse(supervisord_config(make_config(tmp_path, engines=3)))

    binds = [environment(s)["VLLM_CPU_OMP_THREADS_BIND"] for _, s in sorted(engines(parser).items())]

    assert binds == ["0", "1", "2"]


@pytest.mark.usefixtures("redis_server", "many_cores")
def test_tensor_parallel_engines_bind_a_core_per_worker_and_space_their_kv_ports(tmp_path: Path) -> None:
    """Each worker's KV agent takes two ports past the one before (``shoal_engine.kv.ranks``):
    an engine of two workers takes four, and the next engine's start past them."""
    parser = parse(supervisord_config(make_config(tmp_path, engines=2, tensor_parallel_size=2)))
    sections = [s for _, s in sorted(engines(parser).items())]
    assert [environment(s)["VLLM_CPU_OMP_THREADS_BIND"] for s in sections] == ["0|1", "2|3"]
    assert [option(argv(s), "--tensor-parallel-size") for s in sections] == ["2", "2"]
    assert [int(option(argv(s), "--kv-port")) for s in sections] == [5900, 5904]


@pytest.mark.usefixtures("redis_server")
def test_core_binding_wraps_round_robin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher.os, "cpu_count", lambda: 2)
    parser = parse(supervisord_config(make_config(tmp_path, engines=5)))

    binds = [environment(s)["VLLM_CPU_OMP_THREADS_BIND"] for _, s in sorted(engines(parser).items())]

    assert binds == ["0", "1", "0", "1", "0"]


@pytest.mark.usefixtures("redis_server", "many_cores")
def test_engine_environment(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, kv_cache_gib=2.5, extra_env={"HF_HUB_OFFLINE": "1"})
    parser = parse(supervisord_config(cfg))

    for section in engines(parser).values():
        env = environment(section)
        assert env["VLLM_TARGET_DEVICE"] == "cpu"
        assert env["VLLM_CPU_KVCACHE_SPACE"] == "2.5"
        assert env["PYTHONUNBUFFERED"] == "1"
        assert env["HF_HUB_OFFLINE"] == "1"
    assert environment(programs(parser)["router"])["HF_HUB_OFFLINE"] == "1"


@pytest.mark.usefixtures("redis_server", "many_cores")
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_enforce_eager_only_when_enabled(tmp_path: Path, enforce_eager: bool) -> None:
    parser = parse(supervisord_config(make_config(tmp_path, enforce_eager=enforce_eager)))
    for section in engines(parser).values():
        assert ("--enforce-eager" in argv(section)) is enforce_eager


@pytest.mark.usefixtures("redis_server", "many_cores")
@pytest.mark.parametrize(("restart", "expected"), [(True, "unexpected"), (False, "false")])
def test_autorestart_follows_restart(tmp_path: Path, restart: bool, expected: str) -> None:
    parser = parse(supervisord_config(make_config(tmp_path, restart=restart)))
    assert {name: s["autorestart"] for name, s in programs(parser).items()} == dict.fromkeys(
        programs(parser), expected
    )


@pytest.mark.usefixtures("redis_server", "many_cores")
def test_engine_stop_wait_covers_the_drain(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, drain_timeout_s=20.0)
    parser = parse(supervisord_config(cfg))
    for section in engines(parser).values():
        assert option(argv(section), "--drain-timeout-s") == "20.0"
        assert int(section["stopwaitsecs"]) > cfg.drain_timeout_s
        assert section["stopsignal"] == "TERM"


@pytest.mark.usefixtures("many_cores")
def test_redis_program(tmp_path: Path, redis_server: str) -> None:
    cfg = make_config(tmp_path, redis_port=6391)
    parser = parse(supervisord_config(cfg))

    args = argv(programs(parser)["redis"])

    assert args[0] == redis_server
    assert option(args, "--port") == "6391"
    assert option(args, "--bind") == cfg.host
    # No persistence: an empty --save argument after shlex splitting.
    assert option(args, "--save") == ""
    # Redis starts before the programs that need it.
    priorities = {name: int(s["priority"]) for name, s in programs(parser).items()}
    assert priorities["redis"] < min(p for name, p in priorities.items() if name != "redis")


@pytest.mark.usefixtures("redis_server", "many_cores")
def test_supervisord_sections_point_into_the_run_dir(tmp_path: Path) -> None:
    parser = parse(supervisord_config(make_config(tmp_path)))
    run = tmp_path / "run"
    assert parser["supervisord"]["nodaemon"] == "true"
    assert parser["supervisord"]["pidfile"] == str(run / "supervisord.pid")
    assert parser["unix_http_server"]["file"] == str(run / "supervisor.sock")
    assert parser["supervisorctl"]["serverurl"] == f"unix://{run / 'supervisor.sock'}"


def test_missing_redis_server_is_a_fleet_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher.shutil, "which", lambda name, *args, **kwargs: None)
    with pytest.raises(FleetError, match="redis-server"):
        supervisord_config(make_config(tmp_path))


@pytest.mark.usefixtures("redis_server", "many_cores")
def test_model_path_with_a_space_stays_one_argument(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, model_path=tmp_path / "my models" / "tiny")
    parser = parse(supervisord_config(cfg))
    for section in engines(parser).values():
        assert option(argv(section), "--model") == str(cfg.model_path)


@pytest.mark.usefixtures("redis_server", "many_cores")
@pytest.mark.parametrize(("share", "passed"), [(None, "0.05"), (0.0, "0.0"), (0.2, "0.2")])
def test_engines_pace_their_pre_copy_as_configured(tmp_path: Path, share: float | None, passed: str) -> None:
    # CPU engines: the copy shares the core that decodes, so pre-copy is paced unless told not to.
    cfg = make_config(tmp_path) if share is None else make_config(tmp_path, migration_precopy_share=share)
    for section in engines(parse(supervisord_config(cfg))).values():
        args = argv(section)
        assert args[args.index("--migration-precopy-share") + 1] == passed
