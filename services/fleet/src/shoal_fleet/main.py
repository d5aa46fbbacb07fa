"""``shoal-fleet``: serve a model on this machine with Redis, tokenizer, engines and router.

``make run`` calls it. It builds the model cache if needed, starts the fleet under supervisord,
waits for every part, prints the URL and a ``curl`` line, and stops everything on Ctrl-C.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from shoal_fleet.cpu import cpu_flags, native_dtype
from shoal_fleet.launcher import Fleet, FleetConfig, FleetError, write_curve_key, write_fleet_tls
from shoal_protos.settings_cli import SettingsCli

MODELS = {
    "smollm2": ("SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct"),
    "tiny": ("tiny-llama", "tiny-llama"),
}
"""Short names of the models ``make models`` builds: folder in the cache, served name."""


class FleetOptions(BaseModel):
    """``shoal-fleet``'s settings: each is a flag named after its field (``settings_cli``)."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    model: str = "smollm2"
    """smollm2, tiny (the models ``make models`` builds), or a Hugging Face model folder."""

    served_model_name: str | None = None
    """Name clients use in the OpenAI ``model`` field; None: the model's."""

    models_dir: Path = Path(".cache/models")
    """Where ``make models`` builds smollm2 and tiny."""

    engines: int = Field(default=2, ge=1)
    """Number of engines."""

    port: int = Field(default=8000, ge=1, le=65535)
    """The router's HTTP port."""

    redis_port: int = Field(default=6379, ge=1, le=65535)
    """Port of the fleet's Redis."""

    tokenizer_port: int = Field(default=50051, ge=1, le=65535)
    """Port of the tokenizer's gRPC server."""

    engine_base_port: int = Field(default=5600, ge=1, le=65535)
    """Engine i takes ZeroMQ port BASE+i, gRPC control BASE+200+i, KV BASE+300+2i (and +1),
    HTTP BASE+500+i."""

    max_model_len: int = 2048
    """Longest prompt plus output of the engines."""

    kv_cache_gib: int = 1
    """KV cache space per engine, GiB."""

    dtype: Literal["bfloat16", "float16", "float32"] | None = None
    """Engine precision; None: bfloat16 where the CPU computes it natively, else float32
    (float32 for the tiny model, whose small shapes take a bf16 CPU kernel that dies on some
    AMX CPUs)."""

    run_dir: Path = Path(".cache/run")
    """Where the supervisord configuration, logs and fleet keys go."""

    compile: bool = False
    """Let vLLM compile the model graph (slower start; off by default on the CPU)."""

    restart: bool = True
    """Restart processes that die."""

    zmq_curve: bool = False
    """Encrypt router-engine ZeroMQ with CURVE (a fleet key is made in the run dir)."""

    fleet_tls: bool = True
    """Mutual TLS on EngineControl and the KV data links, with files made in the run dir (off:
    plain)."""


CLI = SettingsCli(
    FleetOptions,
    prog="shoal-fleet",
    description=(__doc__ or "").replace("``", ""),
)
"""The launcher's command line: one flag per ``FleetOptions`` field."""


def parse_args(argv: list[str] | None = None) -> FleetConfig:
    options = CLI.parse(argv)
    if options.model in MODELS:
        folder, name = MODELS[options.model]
        path = options.models_dir / folder
    else:
        path, name = Path(options.model), Path(options.model).name
    if not (path / "config.json").exists():
        CLI.fail(f"no model at {path}; `make models` builds smollm2 and tiny")
    dtype: str
    if options.dtype:
        dtype, why = options.dtype, "asked for"
    elif options.model == "tiny":
        dtype, why = "float32", "the tiny model's"
    else:
        dtype, why = native_dtype(cpu_flags())
    print(f"engine dtype: {dtype} ({why})", flush=True)
    return fleet_config(options, path.resolve(), options.served_model_name or name, dtype)


def fleet_config(options: FleetOptions, model_path: Path, served_model_name: str, dtype: str) -> FleetConfig:
    """The fleet ``options`` ask for, its fleet key and TLS files written in its run folder."""
    run_dir = options.run_dir.resolve()
    base = options.engine_base_port
    return FleetConfig(
        model_path=model_path,
        served_model_name=served_model_name,
        run_dir=run_dir,
        engines=options.engines,
        router_port=options.port,
        redis_port=options.redis_port,
        tokenizer_port=options.tokenizer_port,
        engine_zmq_base_port=base,
        engine_http_base_port=base + 500,
        engine_control_base_port=base + 200,
        engine_kv_base_port=base + 300,
        max_model_len=options.max_model_len,
        kv_cache_gib=options.kv_cache_gib,
        dtype=dtype,
        restart=options.restart,
        zmq_curve_key_file=write_curve_key(run_dir / "fleet.key") if options.zmq_curve else None,
        fleet_tls_dir=write_fleet_tls(run_dir / "fleet-tls") if options.fleet_tls else None,
        enforce_eager=not options.compile,
    )


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    fleet = Fleet(cfg, say=lambda line: print(line, flush=True))
    # Ctrl-C reaches supervisord too (same process group); it stops every program, then exits.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: fleet.terminate())
    try:
        fleet.start(own_group=False)
        fleet.wait_ready()
    except FleetError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        fleet.stop()
        raise SystemExit(1) from None
    url = cfg.base_url
    print(
        f"\nShoal is serving {cfg.served_model_name} at {url}/v1  (Ctrl-C stops the fleet)\n"
        f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f'    -d \'{{"model": "{cfg.served_model_name}", "messages": '
        f'[{{"role": "user", "content": "What is the capital of France?"}}]}}\'\n'
        f"  logs: {fleet.log_dir}/*.log\n",
        flush=True,
    )
    code = fleet.wait()
    print("fleet stopped", flush=True)
    raise SystemExit(code)


if __name__ == "__main__":
    main()
