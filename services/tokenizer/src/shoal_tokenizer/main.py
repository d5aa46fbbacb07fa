"""Entry point: ``shoal-tokenizer --model NAME=PATH [--model ...] --port 50051``.

Serves the ``Tokenizer`` service and the standard gRPC health service; the health status turns
SERVING once every tokenizer is loaded and NOT_SERVING on SIGTERM, before the server stops.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shoal_protos import tokenizer_pb2_grpc as pb_grpc
from shoal_protos.grpc_errors import RefuseUndecodable
from shoal_tokenizer.config import TokenizerConfig
from shoal_tokenizer.service import TokenizerServicer, load_model

logger = logging.getLogger("shoal.tokenizer")

SERVICE_NAME = "shoal.tokenizer.v1.Tokenizer"


def parse_args(argv: list[str] | None = None) -> TokenizerConfig:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--model",
        action="append",
        required=True,
        metavar="NAME=PATH",
        help="served model name and its tokenizer folder; repeat for several models",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051)
    args = parser.parse_args(argv)
    models: dict[str, Path] = {}
    for item in args.model:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            parser.error(f"--model expects NAME=PATH, got {item!r}")
        models[name] = Path(path)
    return TokenizerConfig(models=models, host=args.host, port=args.port)


async def serve(config: TokenizerConfig) -> None:
    models = {}
    for name, path in config.models.items():
        logger.info("loading tokenizer %s from %s", name, path)
        models[name] = load_model(name, path)

    server = grpc.aio.server(
        maximum_concurrent_rpcs=config.max_concurrent_rpcs, interceptors=[RefuseUndecodable()]
    )
    pb_grpc.add_TokenizerServicer_to_server(TokenizerServicer(models), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{config.host}:{config.port}"
    server.add_insecure_port(address)
    await server.start()
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    logger.info("tokenizer serving %s on %s", ", ".join(models), address)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("stopping: health NOT_SERVING, then finishing in-flight calls")
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace=5.0)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(parse_args(argv)))


if __name__ == "__main__":
    main()
