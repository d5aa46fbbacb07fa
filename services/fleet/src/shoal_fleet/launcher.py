"""Run a whole Shoal fleet on one machine, without Kubernetes.

``Fleet`` writes a supervisord configuration with one program per process (Redis, the tokenizer,
N engines, the router), starts supervisord in the foreground, and waits until every part is
ready, printing a line per step:

1. Redis answers PING;
2. the tokenizer's gRPC health check says SERVING;
3. every engine has registered itself in Redis as ACTIVE;
4. the router's ``/health`` is 200.

supervisord does the supervision: logs per program under the run folder, stop on Ctrl-C or
SIGTERM with a grace period that covers an engine's drain, optional restarts. Engines are bound
one core each (``VLLM_CPU_OMP_THREADS_BIND``), round-robin over the machine's cores.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import xmlrpc.client
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import grpc
import msgspec
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from supervisor.xmlrpc import SupervisorTransport

from shoal_engine.kv.ranks import RANK_PORT_STRIDE
from shoal_fleet.cpu import cpu_flags, native_dtype
from shoal_protos import curve, tls
from shoal_protos.addresses import host_port, http_url
from shoal_protos.records import EngineState, Keys, engine_record_decoder


class FleetError(RuntimeError):
    """The fleet could not start; the message names the part and its log file."""


@dataclass(frozen=True)
class FleetConfig:
    model_path: Path
    """Folder of the Hugging Face model every engine serves."""
    served_model_name: str
    """Name clients use in the OpenAI ``model`` field."""
    run_dir: Path
    """Where the supervisord configuration, pid file and logs go."""
    engines: int = 2
    """Number of vLLM engines."""
    tensor_parallel_size: int = 1
    """vLLM workers per engine, each holding a share of every layer's heads and of the KV
    cache (on the CPU, one core each, over vLLM's shared-memory collectives)."""
    cluster: str = "local"
    """Prefix of every Redis key of this fleet."""
    host: str = "127.0.0.1"
    router_port: int = 8000
    router_zmq_port: int = 5700
    tokenizer_port: int = 50051
    redis_port: int = 6379
    engine_zmq_base_port: int = 5600
    engine_http_base_port: int = 8100
    engine_control_base_port: int = 5800
    """Engine i serves gRPC EngineControl on this port + i."""
    engine_kv_base_port: int = 5900
    """Engine i's KV agents take ports from this port + 2i x tensor_parallel_size: each worker
    of the engine two (data, then control; ``shoal_engine.kv.ranks``)."""
    zmq_curve_key_file: Path | None = None
    """The fleet's CURVE key file (``shoal_protos.curve``): router-engine frames are encrypted and
    only fleet members connect. None: plain ZeroMQ."""
    fleet_tls_dir: Path | None = None
    """The fleet's TLS folder (``shoal_protos.tls``, ``write_fleet_tls``): EngineControl and the
    KV data links are mutual TLS. None: plain."""
    migration: bool = True
    """Engines load the KV connector and can move running requests to each other."""
    migration_step_timeout_s: float = 10.0
    """Deadline of each migration step (prepare, a KV stage, commit)."""
    kv_debug_reads: bool = False
    """Engines' KV agents serve KV reads (the tests compare what moves copied); never in
    ``make run``."""
    migration_precopy_mib_per_s: int = 0
    """Pace of pre-copy stages in MiB/s (0: unpaced); the engine's --migration-precopy-mib-per-s."""
    migration_precopy_share: float = 0.05
    """Share of the time pre-copy stages may spend sending (0: unpaced); the engine's
    --migration-precopy-share. These engines decode on CPU cores that the KV copy shares, so the
    default paces it as the operator does for CPU engines (a pre-copy under one 8 MiB chunk, about
    350 tokens of SmolLM2, is not slowed at all)."""
    kv_block_size: int = 128
    """KV block size in tokens when migration is on: vLLM's CPU default. A move's last stage,
    after the stop, sends the partly filled block and the ones filled since the pre-copy; the
    target's admission hashes, looks up and allocates every block of the context, so fewer,
    larger blocks keep the stall of a long context near a short one's (the CPU build allows
    multiples of 32)."""
    max_model_len: int | None = 2048
    dtype: str = field(default_factory=lambda: native_dtype(cpu_flags())[0])
    """Weights and KV cache precision of the engines (bf16 where the CPU computes it natively)."""
    kv_cache_gib: int = 1
    """KV cache space per engine (``VLLM_CPU_KVCACHE_SPACE``)."""
    heartbeat_ttl_s: float = 3.0
    engine_silence_grace_s: float = 1.0
    """How long the router leaves the requests of an engine whose heartbeat lapsed where they are
    (``--engine-silence-grace-s``)."""
    drain_timeout_s: float = 20.0
    enforce_eager: bool = True
    """Skip vLLM's graph compilation in the engines. On the CPU this starts each engine about
    25 s sooner, and compiled bf16 kernels round SmolLM2's first-token logits into a tie that
    turns "Paris" into "L'Étoile" for the capital of France; eager mode keeps the model's answer."""
    restart: bool = True
    """Restart a process that exits unexpectedly (off in tests that kill engines on purpose)."""
    python: str = sys.executable
    extra_env: dict[str, str] = field(default_factory=dict)
    engine_args: tuple[str, ...] = ()
    """Flags added to every engine's command line (``EngineConfig``'s fields), after the
    launcher's own."""
    router_args: tuple[str, ...] = ()
    """Flags added to the router's command line (``RouterConfig``'s fields), after the
    launcher's own."""

    @property
    def redis_url(self) -> str:
        return f"redis://{host_port(self.host, self.redis_port)}/0"

    @property
    def base_url(self) -> str:
        return http_url(self.host, self.router_port)

    def engine_id(self, index: int) -> str:
        return f"engine-{index}"


def _program(
    name: str,
    command: list[str],
    log: Path,
    env: dict[str, str],
    restart: bool,
    stop_wait_s: float,
    priority: int,
    drains: bool = False,
) -> str:
    env_line = ",".join(f'{key}="{value}"' for key, value in sorted(env.items()))
    lines = [
        f"[program:{name}]",
        "command=" + shlex.join(command),
        f"priority={priority}",
        "startsecs=0",
        f"autorestart={'unexpected' if restart else 'false'}",
        "startretries=3",
        "stopsignal=TERM",
        f"stopwaitsecs={int(stop_wait_s)}",
        # An engine drains on SIGTERM and then stops vLLM's processes itself: signal only the
        # program, and SIGKILL its whole group only if it outlives stopwaitsecs.
        f"stopasgroup={'false' if drains else 'true'}",
        "killasgroup=true",
        "redirect_stderr=true",
        f"stdout_logfile={log}",
        "stdout_logfile_maxbytes=50MB",
        "stdout_logfile_backups=2",
    ]
    if env_line:
        lines.append(f"environment={env_line}")
    return "\n".join(lines) + "\n"


def _curve_args(cfg: FleetConfig) -> list[str]:
    return ["--zmq-curve-key-file", str(cfg.zmq_curve_key_file)] if cfg.zmq_curve_key_file else []


def _tls_args(cfg: FleetConfig) -> list[str]:
    return ["--fleet-tls-dir", str(cfg.fleet_tls_dir)] if cfg.fleet_tls_dir else []


def write_fleet_tls(folder: Path) -> Path:
    """New fleet TLS files in ``folder`` (the key readable by its owner only), unless they are
    there already."""
    if not (folder / tls.KEY_FILE).exists():
        tls.write(folder)
    return folder


def write_curve_key(path: Path) -> Path:
    """A new fleet CURVE key file at ``path`` (readable by its owner only), unless one is there."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)
        path.write_text(curve.generate())
    return path


def supervisord_config(cfg: FleetConfig) -> str:
    """The supervisord configuration of the whole fleet."""
    redis_bin = shutil.which("redis-server")
    if redis_bin is None:
        raise FleetError(
            "redis-server is not installed (Debian package redis-server); `make setup` installs it"
        )
    cores = os.cpu_count() or 1
    parts = [
        _supervisord_sections(cfg.run_dir),
        _redis_program(cfg, redis_bin),
        _tokenizer_program(cfg),
        *(_engine_program(cfg, i, cores) for i in range(cfg.engines)),
        _router_program(cfg),
    ]
    return "\n".join(parts)


def _supervisord_sections(run: Path) -> str:
    """supervisord's own sections: itself, its control socket and ``supervisorctl``'s."""
    return "\n".join(
        [
            "[supervisord]",
            "nodaemon=true",
            f"logfile={run / 'supervisord.log'}",
            f"pidfile={run / 'supervisord.pid'}",
            "loglevel=warn",
            "",
            "[unix_http_server]",
            f"file={run / 'supervisor.sock'}",
            "",
            "[rpcinterface:supervisor]",
            "supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface",
            "",
            "[supervisorctl]",
            f"serverurl=unix://{run / 'supervisor.sock'}",
            "",
        ]
    )


def _common_env(cfg: FleetConfig) -> dict[str, str]:
    return {"PYTHONUNBUFFERED": "1", **cfg.extra_env}


def _redis_program(cfg: FleetConfig, redis_bin: str) -> str:
    command = [
        redis_bin,
        "--bind",
        cfg.host,
        "--port",
        str(cfg.redis_port),
        "--save",
        "",
        "--appendonly",
        "no",
    ]
    return _program("redis", command, cfg.run_dir / "logs" / "redis.log", {}, cfg.restart, 10, 10)


def tokenizer_command(cfg: FleetConfig) -> list[str]:
    """The tokenizer's command line (its flags are ``TokenizerConfig``'s fields)."""
    return [
        *(cfg.python, "-m", "shoal_tokenizer.main"),
        *("--models", f"{cfg.served_model_name}={cfg.model_path}"),
        *("--host", cfg.host),
        *("--port", str(cfg.tokenizer_port)),
    ]


def _tokenizer_program(cfg: FleetConfig) -> str:
    return _program(
        "tokenizer",
        tokenizer_command(cfg),
        cfg.run_dir / "logs" / "tokenizer.log",
        _common_env(cfg),
        cfg.restart,
        10,
        20,
    )


def engine_command(cfg: FleetConfig, index: int) -> list[str]:
    """The command line of engine ``index`` (its flags are ``EngineConfig``'s fields)."""
    command = [
        *(cfg.python, "-m", "shoal_engine.main"),
        *("--model", str(cfg.model_path)),
        *("--served-model-name", cfg.served_model_name),
        *("--engine-id", cfg.engine_id(index)),
        *("--cluster", cfg.cluster),
        *("--redis-url", cfg.redis_url),
        *("--host", cfg.host),
        *("--zmq-port", str(cfg.engine_zmq_base_port + index)),
        *("--http-port", str(cfg.engine_http_base_port + index)),
        *("--heartbeat-ttl-s", str(cfg.heartbeat_ttl_s)),
        *("--drain-timeout-s", str(cfg.drain_timeout_s)),
        *("--dtype", cfg.dtype),
    ]
    if cfg.enforce_eager:
        command.append("--enforce-eager")
    if cfg.migration:
        command += [
            "--migration",
            *("--control-port", str(cfg.engine_control_base_port + index)),
            *(
                "--kv-port",
                str(cfg.engine_kv_base_port + RANK_PORT_STRIDE * cfg.tensor_parallel_size * index),
            ),
            *("--block-size", str(cfg.kv_block_size)),
            *("--migration-step-timeout-s", str(cfg.migration_step_timeout_s)),
            *("--migration-precopy-mib-per-s", str(cfg.migration_precopy_mib_per_s)),
            *("--migration-precopy-share", str(cfg.migration_precopy_share)),
        ]
        if cfg.kv_debug_reads:
            command.append("--kv-debug-reads")
    if cfg.max_model_len:
        command += ["--max-model-len", str(cfg.max_model_len)]
    if cfg.tensor_parallel_size > 1:
        command += ["--tensor-parallel-size", str(cfg.tensor_parallel_size)]
    return command + _curve_args(cfg) + _tls_args(cfg) + list(cfg.engine_args)


def _engine_program(cfg: FleetConfig, index: int, cores: int) -> str:
    env = {
        **_common_env(cfg),
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": str(cfg.kv_cache_gib),
        # One core per worker, its workers' cores apart ("0|1" for two).
        "VLLM_CPU_OMP_THREADS_BIND": "|".join(
            str((index * cfg.tensor_parallel_size + rank) % cores) for rank in range(cfg.tensor_parallel_size)
        ),
    }
    name = cfg.engine_id(index)
    return _program(
        name,
        engine_command(cfg, index),
        cfg.run_dir / "logs" / f"{name}.log",
        env,
        cfg.restart,
        cfg.drain_timeout_s + 15,
        30,
        drains=True,
    )


def router_command(cfg: FleetConfig) -> list[str]:
    """The router's command line (its flags are ``RouterConfig``'s fields)."""
    return [
        *(cfg.python, "-m", "shoal_router.main"),
        *("--models", cfg.served_model_name),
        *("--cluster", cfg.cluster),
        *("--redis-url", cfg.redis_url),
        *("--tokenizer-address", host_port(cfg.host, cfg.tokenizer_port)),
        *("--host", cfg.host),
        *("--port", str(cfg.router_port)),
        *("--zmq-port", str(cfg.router_zmq_port)),
        *("--engine-silence-grace-s", str(cfg.engine_silence_grace_s)),
        *_curve_args(cfg),
        *_tls_args(cfg),
        *cfg.router_args,
    ]


def _router_program(cfg: FleetConfig) -> str:
    return _program(
        "router",
        router_command(cfg),
        cfg.run_dir / "logs" / "router.log",
        _common_env(cfg),
        cfg.restart,
        10,
        40,
    )


class Fleet:
    """Start, wait for and stop a local fleet. Used by ``make run`` and by the tests."""

    def __init__(self, cfg: FleetConfig, say: Callable[[str], None] = print) -> None:
        self.cfg = cfg
        self._say = say
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def log_dir(self) -> Path:
        return self.cfg.run_dir / "logs"

    def start(self, own_group: bool = True) -> None:
        """Start supervisord and through it the fleet. ``own_group``: in a process group of its
        own, so that a Ctrl-C at the terminal reaches only the caller, which stops the fleet in
        order (``make run`` passes False: its fleet takes the signals with it).

        The fleet stays in its caller's session either way. Linux's autogroup scheduling shares
        the CPUs out by session first; in a session of its own, a fleet decoding on every core
        can leave its caller (a test, a benchmark's client) unscheduled for seconds on some
        kernels, where in one session the scheduler weighs each thread against the others."""
        cfg = self.cfg
        self.log_dir.mkdir(parents=True, exist_ok=True)
        conf = cfg.run_dir / "supervisord.conf"
        conf.write_text(supervisord_config(cfg))
        supervisord = shutil.which("supervisord", path=str(Path(cfg.python).parent)) or shutil.which(
            "supervisord"
        )
        if supervisord is None:
            raise FleetError("supervisord is not installed in this environment; run `make setup`")
        self._say(
            f"starting {cfg.engines} engine(s) of {cfg.served_model_name}, tokenizer, Redis and "
            f"router (logs in {self.log_dir})"
        )
        self._proc = subprocess.Popen([supervisord, "-c", str(conf)], process_group=0 if own_group else None)

    def _check_alive(self) -> None:
        if self._proc is not None and self._proc.poll() is not None:
            raise FleetError(
                f"supervisord exited with {self._proc.returncode}; see {self.cfg.run_dir}/supervisord.log"
            )

    def _rpc(self) -> xmlrpc.client.ServerProxy:
        sock = self.cfg.run_dir / "supervisor.sock"
        return xmlrpc.client.ServerProxy(
            "http://localhost", transport=SupervisorTransport(None, None, f"unix://{sock}")
        )

    def pids(self) -> dict[str, int]:
        """Each running program's pid (a program that died and was restarted has a new one)."""
        return {
            info["name"]: info["pid"]
            for info in cast(list[dict[str, Any]], self._rpc().supervisor.getAllProcessInfo())
            if info["statename"] == "RUNNING"
        }

    def restart(self, program: str) -> None:
        """Stop one program (SIGTERM, as supervisord does) and start it again; returns once it
        runs (for tests and the chaos run: a Redis restart, an engine brought back)."""
        rpc = self._rpc().supervisor
        rpc.stopProcess(program)
        rpc.startProcess(program)

    def _check_program(self, program: str) -> None:
        """Fail at once when a program gave up (FATAL) or exited and will not be restarted."""
        try:
            info = cast(dict[str, Any], self._rpc().supervisor.getProcessInfo(program))
        except (OSError, xmlrpc.client.Fault):
            return  # supervisord is still starting
        state = info["statename"]
        if state == "FATAL" or (state == "EXITED" and not self.cfg.restart):
            tail = _tail(self.log_dir / f"{program}.log")
            raise FleetError(
                f"{program} exited ({info['description']}); last lines of "
                f"{self.log_dir / program}.log:\n{tail}"
            )

    def _wait(self, what: str, ready: Callable[[], bool], deadline: float, log: str) -> None:
        started = time.monotonic()
        program = log.removesuffix(".log")
        while not ready():
            self._check_alive()
            self._check_program(program)
            if time.monotonic() > deadline:
                raise FleetError(f"{what} not ready in time; see {self.log_dir / log}")
            time.sleep(0.25)
        self._say(f"  {what} ready ({time.monotonic() - started:.1f} s)")

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        cfg = self.cfg
        deadline = time.monotonic() + timeout_s
        client = redis.Redis.from_url(cfg.redis_url)
        try:
            self._wait("redis", lambda: _redis_ping(client), deadline, "redis.log")
            self._wait(
                "tokenizer",
                lambda: _grpc_serving(host_port(cfg.host, cfg.tokenizer_port)),
                deadline,
                "tokenizer.log",
            )
            keys = Keys(cfg.cluster)
            for i in range(cfg.engines):
                engine_id = cfg.engine_id(i)
                self._wait(
                    f"{engine_id} (loading the model takes a while)",
                    lambda eid=engine_id: _engine_active(client, keys, eid),  # type: ignore[misc]
                    deadline,
                    f"{engine_id}.log",
                )
            self._wait(
                f"router (sees {cfg.engines} engine(s))",
                lambda: _router_sees(cfg.base_url, cfg.engines),
                deadline,
                "router.log",
            )
        finally:
            client.close()

    def stop(self, timeout_s: float = 60.0) -> int | None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return proc.returncode if proc else None
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait()

    def terminate(self) -> None:
        """Ask supervisord to stop every program, without waiting (safe in a signal handler
        that interrupts ``wait``: a nested ``Popen.wait`` would deadlock on its lock)."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    def wait(self) -> int:
        assert self._proc is not None
        return self._proc.wait()


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _redis_ping(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def _grpc_serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def _engine_active(client: redis.Redis, keys: Keys, engine_id: str) -> bool:
    try:
        raw = client.get(keys.engine(engine_id))
    except redis.RedisError:
        return False
    if raw is None:
        return False
    try:
        return engine_record_decoder.decode(raw).state == EngineState.ACTIVE  # type: ignore[arg-type]
    except msgspec.DecodeError:
        return False


def _router_sees(base_url: str, engines: int) -> bool:
    """The router answers /health with 200 and has every engine in its view."""
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=1.0) as reply:
            body = json.load(reply)
    except (urllib.error.URLError, OSError, ValueError):
        return False
    return sum(state == "ACTIVE" for state in body.get("engines", {}).values()) >= engines
