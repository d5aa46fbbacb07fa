"""Entry point of one engine: ``shoal-engine --model PATH --served-model-name NAME ...``.

Start-up order: load the model (vLLM), bind the ZeroMQ sockets, serve HTTP, then register in
Redis, so routers only see an engine that can take requests. SIGTERM reverses it: the record
turns DRAINING (routers stop sending), running requests get ``drain_timeout_s`` to finish and
are then aborted with a reason, the keys are removed, vLLM shuts down, and the process exits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from typing import Annotated

import grpc
import redis.asyncio as aioredis
import uvicorn
import uvloop
import zmq
from fastapi import FastAPI, Query, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from shoal_engine import reaper
from shoal_engine.backend import BackendDeadError, EngineBackend
from shoal_engine.config import EngineConfig
from shoal_engine.ipc.sockets import OutputSender, RequestReceiver
from shoal_engine.kv.sim_agent import SimKvAgent
from shoal_engine.metrics import EngineMetrics
from shoal_engine.migration import EngineControlServicer, MigrationError, MigrationManager
from shoal_engine.registry import EngineRegistration
from shoal_engine.serving import EngineService
from shoal_engine.sim_backend import SimConfig, SimulatedBackend
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
    add_redis_url_option,
    state_client,
)
from shoal_protos.tasks import Supervisor
from shoal_protos.tls import FleetTls, load_optional

logger = logging.getLogger("shoal.engine")


def parse_args(argv: list[str] | None = None) -> EngineConfig:
    parser = argparse.ArgumentParser(
        prog="shoal-engine", description="Shoal engine: one vLLM engine behind ZeroMQ."
    )
    parser.add_argument("--model", required=True, help="model folder (--backend sim: the step model)")
    parser.add_argument(
        "--backend",
        default="vllm",
        choices=["vllm", "sim"],
        help="vllm, or sim: vLLM replaced by a step-time model (sim_backend.py) for fleet experiments",
    )
    parser.add_argument("--sim-kv-blocks", type=int, default=4096, help="sim: KV cache size in blocks")
    parser.add_argument("--sim-speed", type=float, default=1.0, help="sim: step times divided by this")
    parser.add_argument("--sim-seed", type=int, default=0, help="sim: seed of the generated tokens")
    parser.add_argument("--sim-kv-gbps", type=float, default=8.0, help="sim: GB/s a migration's KV moves at")
    parser.add_argument("--sim-kv-bytes-per-token", type=int, default=131_072, help="sim: KV bytes per token")
    parser.add_argument("--served-model-name", required=True)
    parser.add_argument("--engine-id", default=None, help="default: <hostname>-<zmq port>")
    parser.add_argument("--cluster", default="default")
    add_redis_url_option(parser)
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address peers are told to reach this engine at (its Redis record)",
    )
    parser.add_argument(
        "--bind-host",
        default=None,
        help="address the ZeroMQ, HTTP, control and KV data sockets bind (default: --host); "
        ":: listens on every IPv6 and IPv4 address, 0.0.0.0 on every IPv4 one (gRPC: every address). "
        "The KV agent's control socket always binds --host",
    )
    parser.add_argument("--zmq-port", type=int, default=5600)
    parser.add_argument("--http-port", type=int, default=8100)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument(
        "--priority-headroom",
        type=float,
        default=0.25,
        help="fraction of the KV cache counted as used per priority request (virtual usage)",
    )
    parser.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument(
        "--no-tcmalloc",
        dest="tcmalloc",
        action="store_false",
        help="CPU build: keep glibc's allocator even where tcmalloc is installed",
    )
    parser.add_argument("--executor-backend", default=None, choices=["uni", "mp", "ray"])
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per layer (vLLM's TP)")
    parser.add_argument("--pipeline-parallel-size", type=int, default=1, help="pipeline stages (vLLM's PP)")
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="share of GPU memory vLLM may use (default: vLLM's)",
    )
    parser.add_argument("--quantization", default=None, help="vLLM quantization method (default: none)")
    parser.add_argument(
        "--revision",
        default=None,
        help="Hub revision of the model and its tokenizer; a gated model's token comes from HF_TOKEN",
    )
    parser.add_argument(
        "--vllm-args",
        action="append",
        default=[],
        metavar="TEXT",
        help="your own vLLM engine flags as one shell-quoted string, checked by vLLM's own parser, "
        'e.g. --vllm-args="--enable-chunked-prefill --kv-cache-dtype fp8" (write it with "=": '
        "a value that begins with -- is otherwise read as a flag); may repeat, the words add up. "
        "Flags Shoal sets itself (shoal_protos.vllm_flags) are refused; the sim backend ignores them",
    )
    parser.add_argument("--heartbeat-ttl", type=float, default=3.0)
    parser.add_argument("--drain-timeout", type=float, default=30.0)
    parser.add_argument("--migration", action="store_true", help="load the KV connector; serve EngineControl")
    parser.add_argument("--control-port", type=int, default=5800, help="gRPC EngineControl port")
    parser.add_argument("--kv-port", type=int, default=5900, help="KV agent data port (control: +1)")
    parser.add_argument("--kv-transport", default="tcp", choices=["tcp", "gloo", "nccl"])
    parser.add_argument("--kv-staging-mib", type=int, default=1024)
    parser.add_argument(
        "--kv-max-pairs", type=int, default=4, help="gloo/nccl pair groups kept open each way"
    )
    parser.add_argument(
        "--kv-debug-reads", action="store_true", help="serve KV reads on the agent's control socket (tests)"
    )
    parser.add_argument("--block-size", type=int, default=None, help="KV block size in tokens")
    parser.add_argument("--migration-max-stages", type=int, default=4)
    parser.add_argument("--migration-last-stage-max-blocks", type=int, default=2)
    parser.add_argument("--migration-step-timeout", type=float, default=10.0)
    parser.add_argument(
        "--migration-precopy-mib-per-s", type=int, default=0, help="pace pre-copy stages (0: unpaced)"
    )
    parser.add_argument(
        "--migration-precopy-share",
        type=float,
        default=0.0,
        help="pace pre-copy stages to send for at most this share of the time (0: unpaced)",
    )
    parser.add_argument(
        "--no-migration-warm",
        dest="migration_warm",
        action="store_false",
        help="load a moving request's whole KV at the commit, not its pre-copied blocks before the stop",
    )
    parser.add_argument(
        "--zmq-curve-key-file",
        help="the fleet's CURVE key file (encrypted frames, members only)",
    )
    parser.add_argument(
        "--fleet-tls-dir",
        help="the fleet's TLS folder (ca.crt, tls.crt, tls.key): EngineControl and KV data over mutual TLS",
    )
    args = parser.parse_args(argv)
    try:
        vllm_args = split_vllm_args(args.vllm_args)
    except VllmArgsError as exc:
        # One line, without the usage: the message names the flag and what to use instead.
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    return EngineConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        engine_id=args.engine_id or f"{socket.gethostname()}-{args.zmq_port}",
        cluster=args.cluster,
        redis_url=args.redis_url,
        host=args.host,
        bind_host=args.bind_host,
        zmq_port=args.zmq_port,
        http_port=args.http_port,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        priority_headroom=args.priority_headroom,
        scheduling_policy=args.scheduling_policy,
        dtype=args.dtype,
        enforce_eager=args.enforce_eager,
        tcmalloc=args.tcmalloc,
        executor_backend=args.executor_backend,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        quantization=args.quantization,
        revision=args.revision,
        vllm_args=vllm_args,
        heartbeat_ttl_s=args.heartbeat_ttl,
        drain_timeout_s=args.drain_timeout,
        migration=args.migration,
        control_port=args.control_port,
        kv_port=args.kv_port,
        kv_transport=args.kv_transport,
        kv_staging_mib=args.kv_staging_mib,
        kv_max_pairs=args.kv_max_pairs,
        kv_debug_reads=args.kv_debug_reads,
        block_size=args.block_size,
        migration_max_stages=args.migration_max_stages,
        migration_last_stage_max_blocks=args.migration_last_stage_max_blocks,
        migration_precopy_mib_per_s=args.migration_precopy_mib_per_s,
        migration_precopy_share=args.migration_precopy_share,
        migration_warm=args.migration_warm,
        migration_step_timeout_s=args.migration_step_timeout,
        zmq_curve_key_file=args.zmq_curve_key_file,
        fleet_tls_dir=args.fleet_tls_dir,
        backend=args.backend,
        sim_kv_blocks=args.sim_kv_blocks,
        sim_speed=args.sim_speed,
        sim_seed=args.sim_seed,
        sim_kv_gbps=args.sim_kv_gbps,
        sim_kv_bytes_per_token=args.sim_kv_bytes_per_token,
    )


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

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        # Shoal's series, then vLLM's own (its stat logger registers them, ``vllm:*``, in
        # prometheus_client's default registry, with this process's CPU and memory).
        body = generate_latest(metrics.registry) + generate_latest(REGISTRY)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    return app


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


async def run(config: EngineConfig, backend: EngineBackend) -> int:  # noqa: C901, PLR0915 (over budget)
    loop = asyncio.get_running_loop()
    metrics = EngineMetrics(config.engine_id, config.served_model_name)
    fatal: asyncio.Future[BaseException] = loop.create_future()

    def on_fatal(exc: BaseException) -> None:
        if not fatal.done():
            fatal.set_result(exc)

    # A bad key file fails here, before minutes of model loading.
    curve_keys = curve.load(config.zmq_curve_key_file) if config.zmq_curve_key_file else None
    tls = load_optional(config.fleet_tls_dir)
    logger.info("loading %s (%s backend)", config.model, config.backend)
    started = time.monotonic()
    info = await backend.start()
    metrics.kv_blocks_total.set(info.kv_blocks_total)
    logger.info("model loaded in %.1f s (max_model_len=%d)", time.monotonic() - started, info.max_model_len)

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context(io_threads=1)
    authenticator = curve.start_authenticator(ctx, curve_keys) if curve_keys is not None else None

    # A router whose link drops is gone: its requests are aborted (on the loop, which owns them).
    def fatal_on_thread(exc: BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: the engine is stopping anyway
            loop.call_soon_threadsafe(on_fatal, exc)

    sender = OutputSender(
        ctx,
        config.output_hwm,
        on_router_lost=lambda reply_to: loop.call_soon_threadsafe(service.router_lost, reply_to),
        curve_keys=curve_keys,
        on_fatal=fatal_on_thread,
    )
    service = EngineService(config.engine_id, backend, sender.send, metrics, on_fatal)

    zmq_address = config.zmq_address

    def on_request(message: AddRequest | AbortRequest) -> None:
        if isinstance(message, AddRequest):
            sender.connect(message.reply_to)
        service.on_request(message)

    receiver = RequestReceiver(ctx, config.zmq_bind, loop, on_request, curve_keys, on_fatal=fatal_on_thread)
    sender.start()
    receiver.start()

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

    redis_client = state_client(config.redis_url, config.redis_timeout_s)
    record = EngineRecord(
        engine_id=config.engine_id,
        model=config.served_model_name,
        zmq_address=zmq_address,
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
    keys = Keys(config.cluster)
    migrations: MigrationManager | None = None
    control: grpc.aio.Server | None = None
    if config.migration:
        migrations = MigrationManager(
            config,
            service,
            lambda: max(info.kv_blocks_total - backend.load().kv_blocks_used, 0),
            redis_client,
            keys,
            metrics,
            tls,
        )
        control = control_server(config, migrations, tls)
        await control.start()
    http = _HttpServer(
        uvicorn.Config(
            build_http_app(service, backend, metrics, migrations, config.drain_timeout_s, config.host),
            host=config.listen_host,
            port=config.http_port,
            log_level="warning",
            lifespan="off",
        )
    )
    # The HTTP server (probes, metrics, drain) and the warm-up loop run as long as the engine; one
    # that ends stops the engine, as a dead backend or socket thread does.
    supervisor = Supervisor(on_failure=lambda _, exc: on_fatal(exc))
    http_task = supervisor.start(http.serve(sockets=[http_socket(config)]), "http")
    registration = EngineRegistration(
        redis_client,
        keys,
        record,
        config.heartbeat_ttl_s,
        config.load_report_interval_s,
        make_report,
        metrics,
    )
    await registration.register()
    if migrations is not None:

        async def set_draining(draining: bool) -> None:
            service.set_draining(draining)
            await registration.set_state(EngineState.DRAINING if draining else EngineState.ACTIVE)

        migrations.set_draining = set_draining
    logger.info("engine %s ready: zmq %s, http %s", config.engine_id, zmq_address, record.http_address)
    warm_up = supervisor.start(migrations.warm_up_forever(), "kv-warm-up") if migrations else None

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stop_task = asyncio.create_task(stop.wait())
    await asyncio.wait([stop_task, fatal], return_when=asyncio.FIRST_COMPLETED)
    supervisor.stopping = True
    exit_code = 0
    if fatal.done():
        logger.error("stopping: a part of the engine failed: %r", fatal.result())
        exit_code = 1
    else:
        logger.info("stopping: marking DRAINING in Redis")
    stop_task.cancel()
    if warm_up is not None:
        warm_up.cancel()
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
    await registration.unregister()
    if control is not None:
        await control.stop(grace=1.0)
    if migrations is not None:
        await migrations.aclose()
    await redis_client.aclose()
    receiver.stop()
    sender.stop()
    if authenticator is not None:
        authenticator.stop()
    ctx.destroy(linger=0)  # the threads closed their sockets; never wait on a straggler
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
    if config.backend == "sim":
        sim = SimConfig(
            model=config.model,
            kv_blocks=config.sim_kv_blocks,
            block_size=config.block_size or 16,
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len or 8192,
            speed=config.sim_speed,
            seed=config.sim_seed,
            kv_bytes_per_token=config.sim_kv_bytes_per_token,
            kv_gbps=config.sim_kv_gbps,
        )
        backend = simulated = SimulatedBackend(sim)
        if config.migration:
            # vLLM's worker runs the real KV agent; the simulated engine runs one that times
            # the moves at the configured bandwidth (sped up as its steps are).
            agent = SimKvAgent(
                simulated,
                config.kv_agent_address,
                config.kv_data_bind,
                sim.block_size,
                sim.bytes_per_block,
                sim.kv_gbps * 1e9 * sim.speed,
            )
            agent.start()
    else:
        # vLLM is imported only here, so the rest of the package loads without it.
        from shoal_engine.vllm_backend import VllmBackend

        try:
            backend = VllmBackend(config)
        except VllmArgsError as exc:
            # vLLM's parser refused --vllm-args: one line, before anything loads.
            print(f"shoal-engine: error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        # vLLM's processes must not outlive this one, however it ends (see ``reaper``).
        reaper.start()
    try:
        code = uvloop.run(run(config, backend))
    finally:
        if agent is not None:
            agent.close()
    raise SystemExit(code)


if __name__ == "__main__":
    main()
