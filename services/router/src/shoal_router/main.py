"""Entry point of one router: ``shoal-router --model NAME --port 8000 ...``.

One asyncio loop runs everything: uvicorn's HTTP server, the task that drains the ZeroMQ PULL
socket into per-request collectors, and the task that reads the fleet from Redis. To scale a
router, run more router processes (each with its own ``--router-id`` and ZeroMQ port); they
share the fleet's state through Redis.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import gc
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Iterable
from types import FrameType

import uvicorn
import uvloop
import zmq.asyncio
from fastapi import FastAPI

from shoal_protos import curve
from shoal_protos.addresses import bare_host, stream_socket
from shoal_protos.records import Keys, add_redis_url_option, state_client
from shoal_protos.tasks import Supervisor
from shoal_protos.tls import load_optional
from shoal_router.api.app import create_app, with_server_send
from shoal_router.api.auth import KeyFile
from shoal_router.api.serving import Generation
from shoal_router.config import RouterConfig
from shoal_router.core.dispatch import EngineView
from shoal_router.core.hold import HoldPolicy
from shoal_router.core.ratelimit import Limits, RateLimiter
from shoal_router.core.rebalance import BalancePolicy, Lease, Rebalancer
from shoal_router.core.scheduling import Scheduler
from shoal_router.ipc.engines import EngineClient
from shoal_router.ipc.fleet import FleetView
from shoal_router.ipc.tokenizing import TokenizerClient
from shoal_router.metrics import RouterMetrics

logger = logging.getLogger("shoal.router")

STOP_WAIT_S = 5.0
"""How long each shutdown step (background tasks, then each client) may take before the router
logs what is stuck and goes on without it."""

EXIT_DEADLINE_S = 20.0
"""After a stop signal the process exits within this long, whatever hangs: past it Python's
fault handler writes every thread's stack to the log and ends the process (status 1)."""


def parse_args(argv: list[str] | None = None) -> RouterConfig:
    parser = argparse.ArgumentParser(
        description="Shoal router: OpenAI-compatible API over a fleet of engines."
    )
    parser.add_argument("--model", action="append", default=[], help="served model name; repeatable")
    parser.add_argument("--cluster", default="default")
    parser.add_argument("--router-id", default="router-0")
    add_redis_url_option(parser)
    parser.add_argument("--tokenizer", default="127.0.0.1:50051", help="host:port of the tokenizer service")
    parser.add_argument(
        "--host", default="127.0.0.1", help="address engines are told to send outputs to (ZeroMQ)"
    )
    parser.add_argument(
        "--bind-host",
        default=None,
        help="address the HTTP and ZeroMQ sockets bind (default: --host); "
        ":: listens on every IPv6 and IPv4 address, 0.0.0.0 on every IPv4 one",
    )
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--zmq-port", type=int, default=5700)
    parser.add_argument(
        "--api-keys-file", help="keys (NAME SHA256_HEX per line) required as bearer tokens on /v1/*"
    )
    parser.add_argument("--admin-keys-file", help="keys required on /metrics and the fleet page")
    parser.add_argument("--max-inflight", type=int, default=4096, help="requests running at once")
    parser.add_argument("--max-queued", type=int, default=1024, help="requests waiting (more: 429)")
    parser.add_argument("--queue-timeout", type=float, default=30.0, help="longest wait for a slot, seconds")
    parser.add_argument(
        "--max-attempts", type=int, default=3, help="engines one request may use (it goes on when one dies)"
    )
    parser.add_argument(
        "--key-rpm", type=int, default=0, help="requests per minute per API key (0: none; rpm= in the file)"
    )
    parser.add_argument(
        "--key-tpm", type=int, default=0, help="tokens per minute per API key (0: none; tpm= in the file)"
    )
    parser.add_argument(
        "--zmq-curve-key-file", help="the fleet's CURVE key file (encrypted frames, members only)"
    )
    parser.add_argument(
        "--fleet-tls-dir",
        help="the fleet's TLS folder (ca.crt, tls.crt, tls.key), to call engines' EngineControl",
    )
    parser.add_argument(
        "--scheduler",
        default="least_load",
        help="least_load, round_robin, prefix_affinity, session_affinity, or scorer weights "
        "(prefix_affinity=2,least_load=1)",
    )
    parser.add_argument("--prefix-blocks", type=int, default=4, help="prompt blocks prefix affinity keys on")
    parser.add_argument(
        "--prefix-block-tokens", type=int, default=16, help="tokens per block of prefix affinity's hash"
    )
    parser.add_argument("--session-header", default="x-session-id", help="header session affinity keys on")
    parser.add_argument(
        "--hold-below",
        type=float,
        default=2.0,
        help="KV blocks per batch slot under which a new request waits at the router for room",
    )
    parser.add_argument(
        "--hold-max", type=float, default=1.0, help="longest wait for KV room, seconds (0: never hold)"
    )
    parser.add_argument(
        "--balance", action="store_true", help="as the cluster's leader, move requests off crowded engines"
    )
    parser.add_argument("--balance-interval", type=float, default=1.0, help="seconds between checks")
    parser.add_argument("--balance-threshold", type=float, default=0.1, help="freeness lead calling a move")
    parser.add_argument("--balance-cooldown", type=float, default=5.0, help="seconds an engine rests after")
    parser.add_argument(
        "--consolidate-below",
        type=float,
        default=0.0,
        help="with --balance: empty the least-loaded engine while the load over the rest stays below this",
    )
    parser.add_argument(
        "--consolidate-release",
        type=float,
        default=0.7,
        help="give an emptying engine back once the load over the rest passes this",
    )
    parser.add_argument(
        "--redis-restart-grace",
        type=float,
        default=10.0,
        help="seconds engines get to register again after Redis restarts empty",
    )
    parser.add_argument(
        "--engine-silence-grace",
        type=float,
        default=1.0,
        help="seconds an engine whose heartbeat lapsed keeps its requests before they go elsewhere",
    )
    args = parser.parse_args(argv)
    return RouterConfig(
        models=args.model,
        cluster=args.cluster,
        router_id=args.router_id,
        redis_url=args.redis_url,
        tokenizer_address=args.tokenizer,
        host=args.host,
        bind_host=args.bind_host,
        port=args.port,
        zmq_port=args.zmq_port,
        api_keys_file=args.api_keys_file,
        admin_keys_file=args.admin_keys_file,
        max_inflight_requests=args.max_inflight,
        max_queued_requests=args.max_queued,
        queue_timeout_s=args.queue_timeout,
        max_dispatch_attempts=args.max_attempts,
        redis_restart_grace_s=args.redis_restart_grace,
        engine_silence_grace_s=args.engine_silence_grace,
        zmq_curve_key_file=args.zmq_curve_key_file,
        fleet_tls_dir=args.fleet_tls_dir,
        key_requests_per_minute=args.key_rpm,
        key_tokens_per_minute=args.key_tpm,
        scheduler=args.scheduler,
        prefix_blocks=args.prefix_blocks,
        prefix_block_tokens=args.prefix_block_tokens,
        session_header=args.session_header,
        hold_below=args.hold_below,
        hold_max_s=args.hold_max,
        balance=args.balance,
        balance_interval_s=args.balance_interval,
        balance_threshold=args.balance_threshold,
        balance_cooldown_s=args.balance_cooldown,
        consolidate_below=args.consolidate_below,
        consolidate_release=args.consolidate_release,
    )


def build_app(config: RouterConfig) -> FastAPI:
    """Build the app and its clients; call it on the loop that will serve it (gRPC and ZeroMQ
    asyncio objects belong to the loop they were made on)."""
    metrics = RouterMetrics()
    ctx = zmq.asyncio.Context()
    curve_keys = curve.load(config.zmq_curve_key_file) if config.zmq_curve_key_file else None
    fleet_tls = load_optional(config.fleet_tls_dir)
    # The ZAP handler runs on a thread: it gets a plain context sharing this one's libzmq context.
    authenticator = (
        curve.start_authenticator(zmq.Context.shadow(ctx.underlying), curve_keys) if curve_keys else None
    )

    def link_changed(engine_id: str, up: bool) -> None:
        view = fleet.engines.get(engine_id)
        if view is not None:
            view.connected = up

    engines = EngineClient(
        ctx,
        config.reply_to,
        config.engine_send_hwm,
        on_link=link_changed,
        metrics=metrics,
        curve_keys=curve_keys,
        bind_to=config.zmq_bind,
    )
    redis_client = state_client(config.redis_url, config.redis_timeout_s)

    def engine_lost(engine_id: str, reason: str) -> None:
        failed = engines.engine_lost(engine_id, reason)
        if failed:
            logger.warning("engine %s %s: its %d requests go on elsewhere", engine_id, reason, failed)

    fleet = FleetView(
        redis_client,
        Keys(config.cluster),
        on_engine_added=lambda record: engines.connect(record.engine_id, record.zmq_address),
        on_engine_lost=engine_lost,
        restart_grace_s=config.redis_restart_grace_s,
        silence_grace_s=config.engine_silence_grace_s,
        metrics=metrics,
        reply_to=engines.reply_to,
    )
    tokenizer = TokenizerClient(config.tokenizer_address, config.tokenizer_timeout_s)
    generation = Generation(
        config.router_id,
        config.models,
        fleet,
        engines,
        metrics,
        config.max_inflight_requests,
        config.max_dispatch_attempts,
        config.max_queued_requests,
        config.queue_timeout_s,
        Scheduler(config.scheduler, config.prefix_blocks, prefix_block_tokens=config.prefix_block_tokens),
        config.session_header,
        HoldPolicy(config.hold_below, config.hold_max_s),
    )
    fleet.after_poll.append(generation.release_held)

    # The tasks that must run as long as the router: one that ends turns /livez to 503.
    supervisor = Supervisor()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        tasks = [
            supervisor.start(engines.ingest_forever(), "zmq-ingest"),
            supervisor.start(fleet.poll_forever(config.fleet_poll_interval_s), "fleet-poll"),
        ]
        if config.balance:

            def engine_views() -> Iterable[EngineView]:
                return fleet.engines.values()

            rebalancer = Rebalancer(
                Lease(redis_client, Keys(config.cluster).leader, config.router_id, config.leader_ttl_s),
                engine_views,
                metrics,
                BalancePolicy(
                    threshold=config.balance_threshold,
                    cooldown_s=config.balance_cooldown_s,
                    consolidate_below=config.consolidate_below,
                    consolidate_release=config.consolidate_release,
                ),
                config.balance_interval_s,
                client=redis_client,
                keys=Keys(config.cluster),
                tls=fleet_tls,
            )
            tasks.append(supervisor.start(rebalancer.run_forever(), "rebalance"))
        logger.info(
            "router %s: outputs on %s, serving %s",
            config.router_id,
            engines.reply_to,
            ", ".join(config.models) or "every model in the fleet",
        )
        try:
            yield
        finally:
            supervisor.stopping = True
            await _stop_tasks(tasks)
            await _bounded("the engine sockets", engines.aclose())
            # destroy, not term: term would wait forever on any socket still open.
            if authenticator is not None:
                authenticator.stop()
            ctx.destroy(linger=0)
            await _bounded("the tokenizer channel", tokenizer.close())
            await _bounded("the Redis client", redis_client.aclose())

    return create_app(
        generation,
        tokenizer,
        config.retry_after_s,
        lifespan=lifespan,
        api_keys=KeyFile(config.api_keys_file) if config.api_keys_file else None,
        admin_keys=KeyFile(config.admin_keys_file) if config.admin_keys_file else None,
        rate_limiter=RateLimiter(Limits(config.key_requests_per_minute, config.key_tokens_per_minute)),
        supervisor=supervisor,
    )


async def _stop_tasks(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel ``tasks`` and wait up to ``STOP_WAIT_S`` for them; log the stack of any still
    running."""
    for task in tasks:
        task.cancel()
    done, pending = await asyncio.wait(tasks, timeout=STOP_WAIT_S)
    for task in done:
        if not task.cancelled() and task.exception() is not None:
            logger.warning("task %s had failed: %r", task.get_name(), task.exception())
    for task in pending:
        stack = "".join(f"\n  {frame.f_code.co_filename}:{frame.f_lineno}" for frame in task.get_stack())
        logger.warning("task %s did not stop within %.0f s; at:%s", task.get_name(), STOP_WAIT_S, stack)


async def _bounded(what: str, closing: Awaitable[None]) -> None:
    try:
        async with asyncio.timeout(STOP_WAIT_S):
            await closing
    except TimeoutError:
        logger.warning("closing %s took over %.0f s; going on without it", what, STOP_WAIT_S)


class _Server(uvicorn.Server):
    """uvicorn's server with a deadline on the whole shutdown (``EXIT_DEADLINE_S``), so that a
    stop signal always ends the process, and with every thread's stack in the log when
    something held it up."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            faulthandler.dump_traceback_later(EXIT_DEADLINE_S, exit=True)
        super().handle_exit(sig, frame)


# Python's cyclic collector runs its youngest generation every 700 net allocations by default;
# the stream path allocates a few objects per SSE event, so with thousands of streams the
# collector ran hundreds of times a second and its full passes over every live request showed
# up as inter-token gaps (docs/benchmarks.md, relay).
GC_GEN0_THRESHOLD = 20_000


def _quiet_gc() -> None:
    """Keep what start-up allocated out of every future collection, and collect the young
    generation less often. Streams make little cyclic garbage: their objects go away by
    reference counting when a request ends."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)


LISTEN_SOCKETS = 16
"""The router listens on its port with this many sockets (``SO_REUSEPORT``; the kernel spreads
new connections over them). The event loop (libuv) accepts one connection per listening socket
each time it goes round, and a loop busy relaying tokens goes round a few hundred times a
second: with one socket, a burst of 512 new streams waited up to 1.6-3 s to be accepted
(``docs/benchmarks.md``, request rate)."""

_LISTEN_BACKLOG = 2048


def listening_sockets(host: str, port: int, count: int = LISTEN_SOCKETS) -> list[socket.socket]:
    """``count`` sockets listening on ``host:port`` together (``::``: IPv6 and IPv4 alike). The
    port is first bound alone, so that one another process holds is refused (``OSError``) as it
    would be with one socket, rather than shared with it; port 0 takes a free port, the same for
    all of them."""
    address = bare_host(host)
    with stream_socket(host) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((address, port))
        port = probe.getsockname()[1]
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = stream_socket(host)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((address, port))
            sock.listen(_LISTEN_BACKLOG)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def http_server(config: RouterConfig) -> uvicorn.Server:
    """The router's HTTP server over its app and clients (``build_app``: call it on the loop
    that will serve), not yet serving; it serves on ``listening_sockets``."""
    return _Server(
        uvicorn.Config(
            with_server_send(build_app(config)),
            host=config.listen_host,
            port=config.port,
            log_level="warning",
            timeout_graceful_shutdown=5,
        )
    )


async def serve(config: RouterConfig) -> None:
    server = http_server(config)
    _quiet_gc()
    await server.serve(sockets=listening_sockets(config.listen_host, config.port))


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvloop.run(serve(parse_args(argv)))


if __name__ == "__main__":
    main()
