"""``shoal-fleet``: serve a model on this machine with Redis, tokenizer, engines and router.

``make run`` calls it. It builds the model cache if needed, starts the fleet under supervisord,
waits for every part, prints the URL and a ``curl`` line, and stops everything on Ctrl-C.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from shoal_fleet.cpu import cpu_flags, native_dtype
from shoal_fleet.launcher import Fleet, FleetConfig, FleetError, write_curve_key, write_fleet_tls

MODELS = {
    "smollm2": ("SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct"),
    "tiny": ("tiny-llama", "tiny-llama"),
}
"""Short names of the models ``make models`` builds: folder in the cache, served name."""


def parse_args(argv: list[str] | None = None) -> FleetConfig:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="smollm2", help="smollm2, tiny, or a Hugging Face model folder (default: smollm2)"
    )
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--models-dir", type=Path, default=Path(".cache/models"))
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--port", type=int, default=8000, help="router HTTP port")
    parser.add_argument("--redis-port", type=int, default=6379)
    parser.add_argument("--tokenizer-port", type=int, default=50051)
    parser.add_argument(
        "--engine-base-port",
        type=int,
        default=5600,
        help="engine i takes ZeroMQ port BASE+i, gRPC control BASE+200+i, "
        "KV BASE+300+2i (and +1), HTTP BASE+500+i",
    )
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-gib", type=int, default=1)
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        help="engine precision (default: bfloat16 where the CPU computes it natively, else "
        "float32; float32 for the tiny model, whose small shapes take a bf16 CPU kernel that "
        "dies on some AMX CPUs)",
    )
    parser.add_argument("--run-dir", type=Path, default=Path(".cache/run"))
    parser.add_argument(
        "--compile",
        action="store_true",
        help="let vLLM compile the model graph (slower start; off by default on the CPU)",
    )
    parser.add_argument("--no-restart", action="store_true", help="do not restart processes that die")
    parser.add_argument(
        "--zmq-curve",
        action="store_true",
        help="encrypt router-engine ZeroMQ with CURVE (a fleet key is made in the run dir)",
    )
    parser.add_argument(
        "--no-fleet-tls",
        dest="fleet_tls",
        action="store_false",
        help="plain EngineControl and KV data links (by default mutual TLS, with files made in the run dir)",
    )
    args = parser.parse_args(argv)
    if args.model in MODELS:
        folder, name = MODELS[args.model]
        path = args.models_dir / folder
    else:
        path, name = Path(args.model), Path(args.model).name
    if not (path / "config.json").exists():
        parser.error(f"no model at {path}; `make models` builds smollm2 and tiny")
    if args.engines < 1:
        parser.error("--engines must be at least 1")
    if args.dtype:
        dtype, why = args.dtype, "asked for"
    elif args.model == "tiny":
        dtype, why = "float32", "the tiny model's"
    else:
        dtype, why = native_dtype(cpu_flags())
    print(f"engine dtype: {dtype} ({why})", flush=True)
    return FleetConfig(
        model_path=path.resolve(),
        served_model_name=args.served_model_name or name,
        run_dir=args.run_dir.resolve(),
        engines=args.engines,
        router_port=args.port,
        redis_port=args.redis_port,
        tokenizer_port=args.tokenizer_port,
        engine_zmq_base_port=args.engine_base_port,
        engine_http_base_port=args.engine_base_port + 500,
        engine_control_base_port=args.engine_base_port + 200,
        engine_kv_base_port=args.engine_base_port + 300,
        max_model_len=args.max_model_len,
        kv_cache_gib=args.kv_cache_gib,
        dtype=dtype,
        restart=not args.no_restart,
        zmq_curve_key_file=write_curve_key(args.run_dir.resolve() / "fleet.key") if args.zmq_curve else None,
        fleet_tls_dir=write_fleet_tls(args.run_dir.resolve() / "fleet-tls") if args.fleet_tls else None,
        enforce_eager=not args.compile,
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
