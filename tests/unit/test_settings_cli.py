"""Each service's command line is made from its settings model (``shoal_protos.settings_cli``):
every field has its flag, a flag left out keeps the model's default, old spellings still work,
and a bad value ends the process as argparse does."""

from __future__ import annotations

import argparse
import socket
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shoal_engine import config as engine_config
from shoal_engine import main as engine_main
from shoal_fleet import main as fleet_main
from shoal_fleet.launcher import FleetConfig, engine_command, router_command, tokenizer_command
from shoal_operator import children
from shoal_operator.spec import InferenceClusterSpec
from shoal_protos.settings_cli import NONE_WORD, SettingsCli, flag_name
from shoal_router import config as router_config
from shoal_router import main as router_main
from shoal_tokenizer import config as tokenizer_config
from shoal_tokenizer import main as tokenizer_main


@dataclass(frozen=True)
class Service:
    name: str
    model: type[BaseModel]
    cli: SettingsCli[Any]
    parse: Callable[[list[str]], Any]
    """The service's ``parse_args`` (the fleet's: its options model, before it finds the model)."""
    required: dict[str, Any]
    """Values of the fields the command line must give, as the model takes them."""
    aliases: dict[str, str] = field(default_factory=dict)


SERVICES = [
    Service(
        "router",
        router_config.RouterConfig,
        router_main.CLI,
        router_main.parse_args,
        {},
        router_config.CLI_ALIASES,
    ),
    Service(
        "engine",
        engine_config.EngineConfig,
        engine_main.CLI,
        engine_main.parse_args,
        {"model": "m", "served_model_name": "m"},
        engine_config.CLI_ALIASES,
    ),
    Service(
        "tokenizer",
        tokenizer_config.TokenizerConfig,
        tokenizer_main.CLI,
        tokenizer_main.parse_args,
        {"models": {"m": "/models/m"}},
        tokenizer_config.CLI_ALIASES,
    ),
    Service("fleet", fleet_main.FleetOptions, fleet_main.CLI, fleet_main.CLI.parse, {}),
]
BY_NAME = {service.name: service for service in SERVICES}


def words(flag: str, value: Any) -> list[str]:
    """The command-line words that give ``value`` to ``flag``."""
    if isinstance(value, bool):
        return [flag if value else "--no-" + flag.removeprefix("--")]
    if value is None:
        return [flag, NONE_WORD]
    if isinstance(value, dict):
        return [word for key, item in value.items() for word in (flag, f"{key}={item}")]
    if isinstance(value, (list, tuple)):
        return [word for item in value for word in (flag, str(item))]
    return [flag, str(value)]


def required_argv(service: Service, but: str = "") -> list[str]:
    """The flags of the required fields, but field ``but``'s."""
    return [
        word
        for name, value in service.required.items()
        if name != but
        for word in words(flag_name(name), value)
    ]


def _candidates(annotation: Any, default: Any) -> Iterator[Any]:
    """Values of a field's type, some of which its constraints take."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is bool:
        yield not default
    elif origin is Literal:
        yield from args
    elif origin in (typing.Union, types.UnionType):  # X | None
        for arg in args:
            if arg is not type(None):
                yield from _candidates(arg, None)
        yield None
    elif origin is dict:
        yield {"a": "/models/a", "b": "/models/b"}
    elif origin in (list, tuple):
        yield ["a", "b"]
    elif annotation is int:
        base = default if isinstance(default, int) else 32
        yield from (base + 1, base - 1, 32, 2)
    elif annotation is float:
        base = default if isinstance(default, float) else 0.5
        yield from (base / 2, base + 0.5, 0.5, 0.05)
    elif annotation is Path:
        yield Path("/tmp/elsewhere")
    elif annotation is str:
        yield from ("other-1", "round_robin", "gloo", "x-other-header")


def set_value(service: Service, name: str) -> Any:
    """A value of field ``name`` that its model takes and that differs from its default."""
    info = service.model.model_fields[name]
    default = service.model(**service.required).model_dump()[name]
    for value in _candidates(info.annotation, default):
        try:
            settings = service.model(**{**service.required, name: value})
        except ValidationError:
            continue
        if settings.model_dump()[name] != default:
            return value
    raise AssertionError(f"no value found for {service.name}'s {name}")


def every_field() -> list[tuple[str, str]]:
    return [(service.name, name) for service in SERVICES for name in service.model.model_fields]


def actions(cli: SettingsCli[Any]) -> dict[str, argparse.Action]:
    return {action.dest: action for action in cli.parser._actions if action.dest != "help"}


@pytest.mark.parametrize("service", SERVICES, ids=lambda service: service.name)
def test_every_field_has_its_flag_and_every_flag_is_a_field(service: Service) -> None:
    flags = actions(service.cli)
    assert set(flags) == set(service.model.model_fields)
    for name, action in flags.items():
        assert flag_name(name) in action.option_strings
        assert action.help, f"{name} has no docstring"


@pytest.mark.parametrize("service", SERVICES, ids=lambda service: service.name)
def test_flags_left_out_keep_the_models_defaults(service: Service) -> None:
    parsed = service.parse(required_argv(service))
    assert parsed == service.model(**service.required)


@pytest.mark.parametrize(("service_name", "name"), every_field())
def test_every_field_is_set_by_its_flag(service_name: str, name: str) -> None:
    service = BY_NAME[service_name]
    value = set_value(service, name)
    parsed = service.parse([*required_argv(service, but=name), *words(flag_name(name), value)])
    assert getattr(parsed, name) == getattr(service.model(**{**service.required, name: value}), name)


@pytest.mark.parametrize(
    ("service_name", "old", "new"),
    [(service.name, old, new) for service in SERVICES for old, new in service.aliases.items()],
)
def test_an_old_spelling_sets_its_field(service_name: str, old: str, new: str) -> None:
    service = BY_NAME[service_name]
    value = set_value(service, new)
    parsed = service.parse([*required_argv(service, but=new), *words(old, value)])
    assert getattr(parsed, new) == getattr(service.model(**{**service.required, new: value}), new)


def test_the_spellings_manifests_use() -> None:
    router = router_main.parse_args(
        ["--model", "a", "--model", "b", "--tokenizer", "t:1", "--max-inflight", "9", "--hold-max", "0.5"]
    )
    assert router.models == ["a", "b"]
    assert (router.tokenizer_address, router.max_inflight_requests, router.hold_max_s) == ("t:1", 9, 0.5)
    engine = engine_main.parse_args(
        ["--model", "m", "--served-model-name", "m", "--drain-timeout", "7", "--no-migration-warm"]
    )
    assert (engine.drain_timeout_s, engine.migration_warm) == (7.0, False)
    tokenizer = tokenizer_main.parse_args(["--model", "a=/a", "--model", "b=/b"])
    assert tokenizer.models == {"a": Path("/a"), "b": Path("/b")}


@pytest.mark.parametrize(
    ("service_name", "argv", "flag"),
    [
        ("router", ["--port", "0"], "--port"),
        ("router", ["--max-inflight", "0"], "--max-inflight-requests"),
        ("engine", ["--zmq-port", "70000"], "--zmq-port"),
        ("engine", ["--backend", "gpu"], "--backend"),
        ("tokenizer", ["--threads", "many"], "--threads"),
        ("fleet", ["--engines", "0"], "--engines"),
    ],
)
def test_a_bad_value_ends_with_status_2_naming_the_flag(
    service_name: str, argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    service = BY_NAME[service_name]
    with pytest.raises(SystemExit) as exited:
        service.parse([*required_argv(service), *argv])
    assert exited.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"{service.cli.parser.prog}: error: argument {flag}: ")
    assert repr(argv[1]) in line


def test_a_check_over_several_fields_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        router_main.parse_args(["--consolidate-below", "0.5", "--consolidate-release", "0.4"])
    assert exited.value.code == 2
    assert capsys.readouterr().err == (
        "shoal-router: error: consolidate_release (0.4) must be above consolidate_below (0.5)\n"
    )


def test_a_missing_required_flag_is_argparses_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        engine_main.parse_args(["--model", "m"])
    assert exited.value.code == 2
    assert "the following arguments are required: --served-model-name" in capsys.readouterr().err


def test_the_default_engine_id_names_host_and_port() -> None:
    config = engine_main.parse_args(["--model", "m", "--served-model-name", "m", "--zmq-port", "5611"])
    assert config.engine_id == f"{socket.gethostname()}-5611"


def test_redis_url_defaults_to_the_environment_and_the_flag_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://:secret@redis.example:6379/0")
    assert router_main.parse_args([]).redis_url == "redis://:secret@redis.example:6379/0"
    assert router_main.parse_args(["--redis-url", "redis://other:6379/1"]).redis_url == "redis://other:6379/1"


class _Sample(BaseModel):
    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    size: int | None = Field(default=None, ge=1)
    """How big; 50% is half."""

    names: dict[str, str] = Field(default_factory=dict)
    """Names."""


def test_none_and_help_of_the_generated_flags(capsys: pytest.CaptureFixture[str]) -> None:
    cli = SettingsCli(_Sample, prog="sample", description="A sample.")
    assert cli.parse(["--size", "3"]).size == 3
    assert cli.parse(["--size", "3", "--size", "none"]).size is None
    assert "How big; 50% is half. (default: none)" in " ".join(cli.parser.format_help().split())
    with pytest.raises(SystemExit) as exited:
        cli.parse(["--names", "novalue"])
    assert exited.value.code == 2
    assert "argument --names: expects NAME=VALUE, got 'novalue'" in capsys.readouterr().err


def test_an_alias_of_no_field_is_refused() -> None:
    with pytest.raises(ValueError, match="sizes"):
        SettingsCli(_Sample, prog="sample", description="", aliases={"--count": "sizes"})


FLEET = FleetConfig(
    model_path=Path("/models/tiny"), served_model_name="tiny", run_dir=Path("/run"), engines=2
)


def test_the_launchers_engine_command_lines_parse() -> None:
    for index in range(FLEET.engines):
        config = engine_main.parse_args(engine_command(FLEET, index)[3:])
        assert config.engine_id == FLEET.engine_id(index)
        assert config.heartbeat_ttl_s == FLEET.heartbeat_ttl_s
        assert config.drain_timeout_s == FLEET.drain_timeout_s
        assert config.migration_step_timeout_s == FLEET.migration_step_timeout_s
        assert config.migration_precopy_share == FLEET.migration_precopy_share
        assert config.fleet_tls_dir is None


def test_the_launchers_router_and_tokenizer_command_lines_parse() -> None:
    router = router_main.parse_args(router_command(FLEET)[3:])
    assert router.models == ["tiny"]
    assert router.tokenizer_address == f"127.0.0.1:{FLEET.tokenizer_port}"
    assert router.engine_silence_grace_s == FLEET.engine_silence_grace_s
    tokenizer = tokenizer_main.parse_args(tokenizer_command(FLEET)[3:])
    assert tokenizer.models == {"tiny": FLEET.model_path}


OPERATOR_SAMPLES = sorted((Path(__file__).resolve().parents[2] / "operator" / "samples").glob("*.yaml"))
COMMANDS = {"shoal-engine": "engine", "shoal-router": "router", "shoal-tokenizer": "tokenizer"}


def _own_flag(flag: str, fields: set[str]) -> bool:
    return flag in fields or (flag.startswith("--no-") and "--" + flag.removeprefix("--no-") in fields)


@pytest.mark.parametrize("sample", OPERATOR_SAMPLES, ids=lambda p: p.stem)
def test_the_operators_pods_use_each_flag_by_its_field_name(sample: Path) -> None:
    """What the operator runs on Kubernetes parses, with no old spelling: each flag it passes is
    its field's own, so that a reader of the manifests finds the setting by its name."""
    obj = yaml.safe_load(sample.read_text())
    cluster = children.Cluster(
        obj["metadata"]["name"], "serving", "uid-0", InferenceClusterSpec.model_validate(obj["spec"])
    )
    seen = set()
    for child in children.render(cluster):
        if child["kind"] != "Deployment":
            continue
        for container in child["spec"]["template"]["spec"]["containers"]:
            name = COMMANDS.get(container.get("command", [""])[0])
            if name is None:
                continue
            seen.add(name)
            service = BY_NAME[name]
            args = [
                arg.replace("$(POD_NAME)", "pod-0").replace("$(POD_IP)", "10.0.0.1")
                for arg in container["args"]
            ]
            fields = {flag_name(field) for field in service.model.model_fields}
            flags = [arg.split("=", 1)[0] for arg in args if arg.startswith("--")]
            assert [flag for flag in flags if not _own_flag(flag, fields)] == [], name
            service.parse(args)
    assert seen == set(COMMANDS.values())
