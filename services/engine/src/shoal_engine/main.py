"""Entry point of one engine: ``shoal-engine --model PATH --served-model-name NAME ...``.

Start-up order: load the model (vLLM), bind the ZeroMQ sockets, serve HTTP, then register in
Redis, so routers only see an engine that can take requests. SIGTERM reverses it: the record
turns DRAINING (routers stop sending), running requests get ``drain_timeout_s`` to finish and
are then aborted with a reason, the keys are removed, vLLM shuts down, and the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Annotated, Any

import grpc
import redis.asyncio as aioredis
import uvicorn
import uvloop
import zmq
from fastapi import FastAPI, Query, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from zmq.auth.thread import ThreadAuthenticator

from shoal_engine import reaper
from shoal_engine.backend import BackendDeadError, BackendInfo, EngineBackend
from shoal_engine.config import CLI_ALIASES, EngineConfig
from shoal_engine.ipc.sockets import OutputSender, RequestReceiver
from shoal_engine.metrics import EngineMetrics
from shoal_engine.migration import EngineControlServicer, MigrationError, MigrationManager
from shoal_engine.registry import EngineRegistration
from shoal_engine.serving import EngineService
from shoal_engine.vllm_args import VllmArgsError, split_vllm_args
from shoal_protos import curve
from shoal_protos import engine_control_pb2_grpc as pb_grpc
from shoal_protos.addresses import is_loopback, listen_tcp, same_ip
from shoal_protos.grpc_errors import RefuseUndecodable
from shoal_protos.messages import PROTOCOL_VERSION, AbortRequest, AddRequest
from shoal_protos.records import (
    EngineRecord,
    EngineState,
    Keys,
    LoadReport,
    state_client,
)
from shoal_protos.settings_cli import SettingsCli
from shoal_protos.tasks import Supervisor
from shoal_protos.tls import FleetTls, load_optional

if TYPE_CHECKING:
    from shoal_engine.prefix_cache import PrefixCacheFeed
    from shoal_sim.kv_agent import SimKvAgent

logger = logging.getLogger("shoal.engine")


CLI = SettingsCli(
    EngineConfig,
    prog="shoal-engine",
    description="Shoal engine: one vLLM engine behind ZeroMQ.",
    aliases=CLI_ALIASES,
)
"""The engine's command line: one flag per ``EngineConfig`` field."""


def parse_args(argv: list[str] | None = None) -> EngineConfig:
    values = CLI.values(argv)
    try:
        values["vllm_args"] = split_vllm_args(values.get("vllm_args", ()))
    except VllmArgsError as exc:
        # One line, without the usage: the message names the flag and what to use instead.
        CLI.fail(str(exc))
    return CLI.settings(values)


def _same_host(peer: str, own_address: str) -> bool:
    """Whether a peer address is this host: loopback, or the address the engine serves on. A
    dual-stack listener (``--bind-host ::``) sees IPv4 peers as ``::ffff:a.b.c.d``: they count as
    the IPv4 address they are."""
    try:
        ipaddress.ip_address(peer)
    except ValueError:
        return False
    return is_loopback(peer) or same_ip(peer, own_address)


class _HttpServer(uvicorn.Server):
    """uvicorn that leaves signals to ``run``: SIGTERM must drain before HTTP stops."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def build_http_app(
    service: EngineService,
    backend: EngineBackend,
    metrics: EngineMetrics,
    migrations: MigrationManager | None = None,
    drain_deadline_s: float = 0.0,
    own_address: str = "127.0.0.1",
) -> FastAPI:
    app = FastAPI(title="Shoal engine", docs_url=None, redoc_url=None)

    if migrations is not None:
        _add_drain_route(app, migrations, drain_deadline_s, own_address)
    _add_probes(app, service, backend)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        # Shoal's series, then vLLM's own (its stat logger registers them, ``vllm:*``, in
        # prometheus_client's default registry, with this process's CPU and memory).
        body = generate_latest(metrics.registry) + generate_latest(REGISTRY)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    return app


def _add_drain_route(
    app: FastAPI, migrations: MigrationManager, drain_deadline_s: float, own_address: str
) -> None:
    @app.get("/drain")
    async def drain_for_removal(
        request: Request,
        rejoin_after_s: Annotated[float, Query(ge=0, le=3600)] = 0.0,
    ) -> Response:
        """The pod's preStop hook: leave the rotation and move every running request to
        other engines, answering once the engine is empty or the drain deadline passed.
        SIGTERM follows and finds nothing left to move. ``rejoin_after_s`` > 0 serves again
        after that long if no shutdown came.

        Only callers inside the engine's own pod may drain it (the hook runs there and calls
        the pod's own address); the port is open to the cluster for metrics, and anyone
        else gets 403. Operators and other engines drain through the gRPC control API."""
        peer = request.client.host if request.client else ""
        if not _same_host(peer, own_address):
            return JSONResponse(
                {
                    "error": {
                        "message": "only the engine's own pod may call /drain",
                        "type": "permission_error",
                        "code": "forbidden",
                    }
                },
                status_code=403,
            )
        try:
            result = await migrations.drain_for_removal(drain_deadline_s, rejoin_after_s)
        except MigrationError as exc:
            return JSONResponse(
                {"error": {"message": str(exc), "type": "conflict", "code": "cannot_drain"}},
                status_code=409,
            )
        return JSONResponse({"migrated": result.migrated, "remaining": result.remaining})


def _add_probes(app: FastAPI, service: EngineService, backend: EngineBackend) -> None:
    async def ready_state() -> Response:
        try:
            await backend.check_health()
        except BackendDeadError as exc:
            return JSONResponse({"status": "dead", "error": str(exc)}, status_code=503)
        if service.draining:
            return JSONResponse({"status": "draining", "requests": service.num_requests}, status_code=503)
        return JSONResponse({"status": "ok", "requests": service.num_requests})

    # What ``/readyz`` answers, under its first name; launchers and older manifests probe it.
    @app.get("/health")
    async def health() -> Response:
        return await ready_state()

    @app.get("/livez")
    async def liveness() -> Response:
        """200 while the process runs (the handler runs on the event loop, so an answer shows
        that the loop turns) and its backend can still serve, draining or not: a drain may
        outlast the probe's failure threshold, and a restart then would reload the model. 503
        once the backend is dead, which no wait mends."""
        try:
            await backend.check_health()
        except BackendDeadError as exc:
            return JSONResponse({"status": "dead", "error": str(exc)}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/readyz")
    async def readiness() -> Response:
        """200 while the engine takes requests; 503 while it drains or once its backend is dead."""
        return await ready_state()


def http_socket(config: EngineConfig) -> socket.socket:
    """The HTTP server's listening socket, made here rather than by uvicorn: asyncio makes a
    socket bound to ``::`` IPv6-only, and ``--bind-host ::`` must take IPv4 connections too."""
    return listen_tcp(config.listen_host, config.http_port, backlog=2048)


def control_server(
    config: EngineConfig, migrations: MigrationManager, tls: FleetTls | None = None
) -> grpc.aio.Server:
    """The EngineControl gRPC server, bound (``[::]:port`` is dual stack in gRPC) but not started:
    mutual TLS with the fleet's certificates when it has them."""
    control = grpc.aio.server(interceptors=[RefuseUndecodable()])
    pb_grpc.add_EngineControlServicer_to_server(EngineControlServicer(migrations), control)
    if tls is None:
        control.add_insecure_port(config.control_bind)
    else:
        control.add_secure_port(config.control_bind, tls.server_credentials())
    return control


@dataclasses.dataclass
class _Parts:
    """What a running engine holds open, stopped in order by ``_close``."""

    ctx: zmq.Context[zmq.Socket[bytes]]
    authenticator: ThreadAuthenticator | None
    sender: OutputSender
    receiver: RequestReceiver
    service: EngineService
    redis: aioredis.Redis
    migrations: MigrationManager | None = None
    control: grpc.aio.Server | None = None


async def _load_model(config: EngineConfig, backend: EngineBackend, metrics: EngineMetrics) -> BackendInfo:
    logger.info("loading %s (%s backend)", config.model, config.backend)
    started = time.monotonic()
    info = await backend.start()
    metrics.kv_blocks_total.set(info.kv_blocks_total)
    logger.info("model loaded in %.1f s (max_model_len=%d)", time.monotonic() - started, info.max_model_len)
    return info


def _open_sockets(
    config: EngineConfig,
    backend: EngineBackend,
    metrics: EngineMetrics,
    curve_keys: curve.CurveKeys | None,
    on_fatal: Callable[[BaseException], None],
) -> _Parts:
    """The request and output sockets, running, and the service between them."""
    loop = asyncio.get_running_loop()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context(io_threads=1)
    authenticator = curve.start_authenticator(ctx, curve_keys) if curve_keys is not None else None

    # A router whose link drops is gone: its requests are aborted (on the loop, which owns them).
    def fatal_on_thread(exc: BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: the engine is stopping anyway
            loop.call_soon_threadsafe(on_fatal, exc)

    def router_lost_on_thread(reply_to: str) -> None:
        loop.call_soon_threadsafe(service.router_lost, reply_to)

    sender = OutputSender(
        ctx,
        config.output_hwm,
        on_router_lost=router_lost_on_thread,
        curve_keys=curve_keys,
        on_fatal=fatal_on_thread,
    )
    service = EngineService(config.engine_id, backend, sender.send, metrics, on_fatal)

    def on_request(message: AddRequest | AbortRequest) -> None:
        if isinstance(message, AddRequest):
            sender.connect(message.reply_to)
        service.on_request(message)

    receiver = RequestReceiver(ctx, config.zmq_bind, loop, on_request, curve_keys, on_fatal=fatal_on_thread)
    sender.start()
    receiver.start()
    redis_client = state_client(config.redis_url, config.redis_timeout_s)
    return _Parts(ctx, authenticator, sender, receiver, service, redis_client)


def _load_reporter(
    config: EngineConfig,
    backend: EngineBackend,
    service: EngineService,
    metrics: EngineMetrics,
    info: BackendInfo,
) -> Callable[[int], LoadReport]:
    def make_report(seq: int) -> LoadReport:
        load = backend.load()
        # Our own count is exact; vLLM's split is as of its last step.
        active = service.num_requests
        running = min(load.num_running, active)
        metrics.running.set(running)
        metrics.waiting.set(active - running)
        used = load.kv_blocks_used if active else 0
        metrics.kv_blocks_used.set(used)
        return LoadReport(
            engine_id=config.engine_id,
            seq=seq,
            time=time.time(),
            num_running=running,
            num_waiting=active - running,
            kv_blocks_used=used,
            kv_blocks_free=max(info.kv_blocks_total - used, 0),
            step_time_ms=load.step_time_ms,
            kv_blocks_reserved=min(
                info.kv_blocks_total,
                round(config.priority_headroom * info.kv_blocks_total * service.num_priority),
            ),
            received=dict(service.received),
            live=service.live_by_router(),
        )

    return make_report


def _engine_record(config: EngineConfig, info: BackendInfo) -> EngineRecord:
    return EngineRecord(
        engine_id=config.engine_id,
        model=config.served_model_name,
        zmq_address=config.zmq_address,
        http_address=config.http_address,
        max_model_len=info.max_model_len,
        kv_blocks_total=info.kv_blocks_total,
        kv_block_size=info.kv_block_size,
        max_num_seqs=config.max_num_seqs,
        pid=os.getpid(),
        hostname=socket.gethostname(),
        protocol_version=PROTOCOL_VERSION,
        started_at=time.time(),
        control_address=config.control_address if config.migration else "",
        kv_address=config.kv_data_address if config.migration else "",
    )


async def _start_migrations(
    config: EngineConfig,
    parts: _Parts,
    backend: EngineBackend,
    info: BackendInfo,
    keys: Keys,
    metrics: EngineMetrics,
    tls: FleetTls | None,
) -> None:
    """``--migration``: the migration manager and its EngineControl server, started."""
    service = parts.service
    migrations = MigrationManager(
        config,
        service,
        lambda: max(info.kv_blocks_total - backend.load().kv_blocks_used, 0),
        parts.redis,
        keys,
        metrics,
        tls,
    )
    control = control_server(config, migrations, tls)
    await control.start()
    parts.migrations, parts.control = migrations, control


def _http_server(
    config: EngineConfig, parts: _Parts, backend: EngineBackend, metrics: EngineMetrics
) -> _HttpServer:
    app = build_http_app(
        parts.service, backend, metrics, parts.migrations, config.drain_timeout_s, config.host
    )
    return _HttpServer(
        uvicorn.Config(
            app, host=config.listen_host, port=config.http_port, log_level="warning", lifespan="off"
        )
    )


def _let_migrations_drain(
    migrations: MigrationManager, parts: _Parts, registration: EngineRegistration
) -> None:
    async def set_draining(draining: bool) -> None:
        parts.service.set_draining(draining)
        await registration.set_state(EngineState.DRAINING if draining else EngineState.ACTIVE)

    migrations.set_draining = set_draining


async def _until_stopped(fatal: asyncio.Future[BaseException]) -> int:
    """Wait for SIGTERM, SIGINT or a part's failure; the exit status: 1 after a failure."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stop_task = asyncio.create_task(stop.wait())
    waiting: list[asyncio.Future[Any]] = [stop_task, fatal]
    await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    stop_task.cancel()
    if fatal.done():
        logger.error("stopping: a part of the engine failed: %r", fatal.result())
        return 1
    logger.info("stopping: marking DRAINING in Redis")
    return 0


async def _drain(
    config: EngineConfig, parts: _Parts, registration: EngineRegistration, exit_code: int
) -> None:
    """Leave the rotation, then move or finish what runs (nothing after a failure)."""
    migrations, service = parts.migrations, parts.service
    if migrations is not None:
        migrations.stop_rejoining()
    try:
        await registration.set_state(EngineState.DRAINING)
    except (aioredis.RedisError, OSError) as exc:
        logger.warning("cannot mark DRAINING in Redis: %s", exc)
    drain_s = config.drain_timeout_s if exit_code == 0 else 0.0
    if migrations is not None and drain_s > 0 and service.num_requests:
        # Move what runs to other engines first; what cannot move finishes here (or is aborted).
        started = time.monotonic()
        moved = await migrations.drain(drain_s)
        logger.info("drain moved %d requests away (%d could not move)", moved.migrated, moved.failed)
        drain_s = max(0.0, drain_s - (time.monotonic() - started))
    aborted = await service.drain(drain_s)
    if aborted:
        logger.warning("aborted %d requests still running at shutdown", aborted)


async def _close(parts: _Parts, registration: EngineRegistration) -> None:
    await registration.unregister()
    if parts.control is not None:
        await parts.control.stop(grace=1.0)
    if parts.migrations is not None:
        await parts.migrations.aclose()
    await parts.redis.aclose()
    parts.receiver.stop()
    parts.sender.stop()
    if parts.authenticator is not None:
        parts.authenticator.stop()
    parts.ctx.destroy(linger=0)  # the threads closed their sockets; never wait on a straggler


def _prefix_cache_feed(
    config: EngineConfig, kv_events: tuple[str, str], parts: _Parts, info: BackendInfo, keys: Keys
) -> PrefixCacheFeed:
    """``--prefix-events``: read vLLM's KV events from ``kv_events`` (endpoint, topic) and
    publish the prefix cache's content to Redis. Its socket connects now, before the engine
    takes requests, so no event of theirs is missed."""
    # vLLM's event types: imported with the vLLM backend only.
    from shoal_engine.prefix_cache import CachedBlocks, KvEventSubscriber, PrefixCacheFeed, PrefixPublisher

    endpoint, topic = kv_events
    blocks = CachedBlocks(info.kv_block_size)
    changed = asyncio.Event()
    publisher = PrefixPublisher(
        parts.redis,
        keys,
        config.engine_id,
        blocks,
        changed,
        config.prefix_snapshot_interval_s,
        ttl_s=max(config.heartbeat_ttl_s, 2 * config.prefix_snapshot_interval_s),
    )
    logger.info("prefix-cache events from %s go to Redis", endpoint)
    return PrefixCacheFeed(KvEventSubscriber(endpoint, topic, blocks, changed), publisher, blocks)


async def run(config: EngineConfig, backend: EngineBackend, kv_events: tuple[str, str] | None = None) -> int:
    loop = asyncio.get_running_loop()
    metrics = EngineMetrics(config.engine_id, config.served_model_name)
    fatal: asyncio.Future[BaseException] = loop.create_future()

    def on_fatal(exc: BaseException) -> None:
        if not fatal.done():
            fatal.set_result(exc)

    # A bad key file fails here, before minutes of model loading.
    curve_keys = curve.load(config.zmq_curve_key_file) if config.zmq_curve_key_file else None
    tls = load_optional(config.fleet_tls_dir)
    info = await _load_model(config, backend, metrics)
    parts = _open_sockets(config, backend, metrics, curve_keys, on_fatal)
    record = _engine_record(config, info)
    keys = Keys(config.cluster)
    if config.migration:
        await _start_migrations(config, parts, backend, info, keys, metrics, tls)
    http = _http_server(config, parts, backend, metrics)
    # The HTTP server (probes, metrics, drain) and the warm-up loop run as long as the engine; one
    # that ends stops the engine, as a dead backend or socket thread does.
    supervisor = Supervisor(on_failure=lambda _, exc: on_fatal(exc))
    http_task = supervisor.start(http.serve(sockets=[http_socket(config)]), "http")
    feed = _prefix_cache_feed(config, kv_events, parts, info, keys) if kv_events else None
    if feed is not None:
        feed.start(supervisor)
        if parts.migrations is not None:  # moves here skip the blocks this engine holds
            parts.migrations.target.held_prefix = feed.held_prefix
    registration = EngineRegistration(
        parts.redis,
        keys,
        record,
        config.heartbeat_ttl_s,
        config.load_report_interval_s,
        _load_reporter(config, backend, parts.service, metrics, info),
        metrics,
    )
    await registration.register()
    migrations = parts.migrations
    if migrations is not None:
        _let_migrations_drain(migrations, parts, registration)
    logger.info("engine %s ready: zmq %s, http %s", config.engine_id, record.zmq_address, record.http_address)
    warm_up = supervisor.start(migrations.warm_up_forever(), "kv-warm-up") if migrations else None

    exit_code = await _until_stopped(fatal)
    supervisor.stopping = True
    if warm_up is not None:
        warm_up.cancel()
    await _drain(config, parts, registration, exit_code)
    if feed is not None:
        await feed.close()
    await _close(parts, registration)
    http.should_exit = True
    await http_task
    backend.shutdown()
    logger.info("engine %s stopped", config.engine_id)
    return exit_code


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = parse_args(argv)
    backend: EngineBackend
    agent: SimKvAgent | None = None
    # Where vLLM publishes its KV events, for the prefix-cache feed (vLLM backend only).
    kv_events: tuple[str, str] | None = None
    if config.backend == "sim":
        # The simulated engine is not part of the product: its package is imported only here.
        from shoal_sim.engine import simulated_engine

        backend, agent = simulated_engine(config)
    else:
        # vLLM is imported only here, so the rest of the package loads without it.
        from shoal_engine.vllm_backend import VllmBackend

        try:
            vllm = VllmBackend(config)
        except VllmArgsError as exc:
            # vLLM's parser refused --vllm-args: one line, before anything loads.
            print(f"shoal-engine: error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        backend, kv_events = vllm, vllm.kv_events
        # vLLM's processes must not outlive this one, however it ends (see ``reaper``).
        reaper.start()
    try:
        code = uvloop.run(run(config, backend, kv_events))
    finally:
        if agent is not None:
            agent.close()
    raise SystemExit(code)


if __name__ == "__main__":
    main()
