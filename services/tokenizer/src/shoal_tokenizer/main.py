"""Entry point: ``shoal-tokenizer --models NAME=PATH [--models ...] --port 50051``.

Serves the ``Tokenizer`` service and the standard gRPC health service; the health status turns
SERVING once every tokenizer is loaded and NOT_SERVING on SIGTERM, before the server stops.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shoal_protos import tokenizer_pb2_grpc as pb_grpc
from shoal_protos.addresses import host_port
from shoal_protos.grpc_errors import RefuseUndecodable
from shoal_protos.settings_cli import SettingsCli
from shoal_tokenizer.config import CLI_ALIASES, TokenizerConfig
from shoal_tokenizer.service import LoadedModel, TokenizerServicer, load_model

logger = logging.getLogger("shoal.tokenizer")

SERVICE_NAME = "shoal.tokenizer.v1.Tokenizer"


CLI = SettingsCli(
    TokenizerConfig,
    prog="shoal-tokenizer",
    description="Shoal tokenizer: the Tokenizer gRPC service, with the standard gRPC health service.",
    aliases=CLI_ALIASES,
)
"""The tokenizer's command line: one flag per ``TokenizerConfig`` field."""


def parse_args(argv: list[str] | None = None) -> TokenizerConfig:
    return CLI.parse(argv)


async def start_server(
    config: TokenizerConfig, models: dict[str, LoadedModel]
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """The gRPC server bound to ``bind_host`` (``[::]:port`` is dual stack in gRPC), started,
    its health SERVING."""
    server = grpc.aio.server(
        maximum_concurrent_rpcs=config.max_concurrent_rpcs,
        interceptors=[RefuseUndecodable()],
        # Room for the longest input the servicer takes (UTF-8: up to 4 bytes a character), so
        # that a longer one reaches it and gets its clear refusal rather than gRPC's.
        options=[("grpc.max_receive_message_length", 4 * config.max_input_chars + (1 << 20))],
    )
    pool = ThreadPoolExecutor(config.threads, thread_name_prefix="tokenize")
    servicer = TokenizerServicer(models, pool, config.max_input_chars)
    pb_grpc.add_TokenizerServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(host_port(config.listen_host, config.port))
    await server.start()
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return server, health_servicer


async def serve(config: TokenizerConfig) -> None:
    models = {}
    for name, path in config.models.items():
        logger.info("loading tokenizer %s from %s (revision %s)", name, path, config.revision or "default")
        models[name] = load_model(name, path, config.revision)

    server, health_servicer = await start_server(config, models)
    logger.info(
        "tokenizer serving %s on %s (%d threads)",
        ", ".join(models),
        host_port(config.listen_host, config.port),
        config.threads,
    )

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
