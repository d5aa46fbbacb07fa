"""Entry point of one router: ``shoal-router --models NAME --port 8000 ...``.

One asyncio loop runs everything: uvicorn's HTTP server, the task that drains the ZeroMQ PULL
socket into per-request collectors, and the task that reads the fleet from Redis. To scale a
router, run more router processes (each with its own ``--router-id`` and ZeroMQ port); they
share the fleet's state through Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import faulthandler
import gc
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from types import FrameType

import redis.asyncio as aioredis
import uvicorn
import uvloop
import zmq.asyncio
from fastapi import FastAPI
from zmq.auth.thread import ThreadAuthenticator

from shoal_protos import curve
from shoal_protos.addresses import bare_host, stream_socket
from shoal_protos.records import Keys, state_client
from shoal_protos.settings_cli import SettingsCli
from shoal_protos.tasks import Supervisor
from shoal_protos.tls import FleetTls, load_optional
from shoal_router.api.app import create_app, with_server_send
from shoal_router.api.auth import KeyFile
from shoal_router.api.serving import Generation
from shoal_router.config import CLI_ALIASES, RouterConfig
from shoal_router.core.dispatch import EngineView
from shoal_router.core.hold import HoldPolicy
from shoal_router.core.ratelimit import Limits, RateLimiter
from shoal_router.core.rebalance import BalancePolicy, Lease, Rebalancer
from shoal_router.core.scheduling import Scheduler
from shoal_router.ipc.engines import EngineClient
from shoal_router.ipc.fleet import FleetView
from shoal_router.ipc.prefix_events import PrefixEventReader
from shoal_router.ipc.tokenizing import TokenizerClient
from shoal_router.metrics import RouterMetrics

logger = logging.getLogger("shoal.router")

STOP_WAIT_S = 5.0
"""How long each shutdown step (background tasks, then each client) may take before the router
logs what is stuck and goes on without it."""

EXIT_DEADLINE_S = 20.0
"""After a stop signal the process exits within this long, whatever hangs: past it Python's
fault handler writes every thread's stack to the log and ends the process (status 1)."""


CLI = SettingsCli(
    RouterConfig,
    prog="shoal-router",
    description="Shoal router: OpenAI-compatible API over a fleet of engines.",
    aliases=CLI_ALIASES,
)
"""The router's command line: one flag per ``RouterConfig`` field."""


def parse_args(argv: list[str] | None = None) -> RouterConfig:
    return CLI.parse(argv)


@dataclasses.dataclass(frozen=True)
class _Clients:
    """What the router holds open while it serves, closed in ``_close``."""

    ctx: zmq.asyncio.Context
    authenticator: ThreadAuthenticator | None
    engines: EngineClient
    fleet: FleetView
    redis: aioredis.Redis
    tokenizer: TokenizerClient
    fleet_tls: FleetTls | None
    metrics: RouterMetrics


def _connect(config: RouterConfig, metrics: RouterMetrics) -> _Clients:
    """The router's clients of engines, Redis and the tokenizer, not yet running."""
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
    return _Clients(ctx, authenticator, engines, fleet, redis_client, tokenizer, fleet_tls, metrics)


def _generation(config: RouterConfig, clients: _Clients) -> Generation:
    generation = Generation(
        config.router_id,
        config.models,
        clients.fleet,
        clients.engines,
        clients.metrics,
        config.max_inflight_requests,
        config.max_dispatch_attempts,
        config.max_queued_requests,
        config.queue_timeout_s,
        Scheduler(config.scheduler, config.prefix_blocks, prefix_block_tokens=config.prefix_block_tokens),
        config.session_header,
        HoldPolicy(config.hold_below, config.hold_max_s),
    )
    clients.fleet.after_poll.append(generation.release_held)
    return generation


def _rebalancer(config: RouterConfig, clients: _Clients, generation: Generation) -> Rebalancer:
    """The leader's balancing loop (``--balance``)."""
    keys = Keys(config.cluster)
    cache = generation.scheduler.prefix_cache

    def engine_views() -> Iterable[EngineView]:
        return clients.fleet.engines.values()

    return Rebalancer(
        Lease(clients.redis, keys.leader, config.router_id, config.leader_ttl_s),
        engine_views,
        clients.metrics,
        BalancePolicy(
            threshold=config.balance_threshold,
            cooldown_s=config.balance_cooldown_s,
            consolidate_below=config.consolidate_below,
            consolidate_release=config.consolidate_release,
        ),
        config.balance_interval_s,
        client=clients.redis,
        keys=keys,
        tls=clients.fleet_tls,
        shared=cache.index.shared if cache is not None else None,
    )


def _lifespan(
    config: RouterConfig, clients: _Clients, generation: Generation, supervisor: Supervisor
) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """Runs the router's background tasks while the app serves, then closes its clients."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        tasks = [
            supervisor.start(clients.engines.ingest_forever(), "zmq-ingest"),
            supervisor.start(clients.fleet.poll_forever(config.fleet_poll_interval_s), "fleet-poll"),
        ]
        if config.balance:
            tasks.append(
                supervisor.start(_rebalancer(config, clients, generation).run_forever(), "rebalance")
            )
        if generation.scheduler.prefix_cache is not None:
            reader = PrefixEventReader(
                clients.redis,
                Keys(config.cluster),
                generation.scheduler.prefix_cache.index,
                lambda: list(clients.fleet.engines),
            )
            tasks.append(supervisor.start(reader.run_forever(), "prefix-events"))
        logger.info(
            "router %s: outputs on %s, serving %s",
            config.router_id,
            clients.engines.reply_to,
            ", ".join(config.models) or "every model in the fleet",
        )
        try:
            yield
        finally:
            supervisor.stopping = True
            await _stop_tasks(tasks)
            await _close(clients)

    return lifespan


async def _close(clients: _Clients) -> None:
    await _bounded("the engine sockets", clients.engines.aclose())
    # destroy, not term: term would wait forever on any socket still open.
    if clients.authenticator is not None:
        clients.authenticator.stop()
    clients.ctx.destroy(linger=0)
    await _bounded("the tokenizer channel", clients.tokenizer.close())
    await _bounded("the Redis client", clients.redis.aclose())


def build_app(config: RouterConfig) -> FastAPI:
    """Build the app and its clients; call it on the loop that will serve it (gRPC and ZeroMQ
    asyncio objects belong to the loop they were made on)."""
    clients = _connect(config, RouterMetrics())
    # The tasks that must run as long as the router: one that ends turns /livez to 503.
    supervisor = Supervisor()
    generation = _generation(config, clients)
    return create_app(
        generation,
        clients.tokenizer,
        config.retry_after_s,
        lifespan=_lifespan(config, clients, generation, supervisor),
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
