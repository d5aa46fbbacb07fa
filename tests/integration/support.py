"""What the integration tests share: fleet handles, reference prompts, waiting with a deadline."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import psutil
import redis
import zmq

from shoal_engine.kv.ranks import RANK_PORT_STRIDE, rank_address
from shoal_fleet.launcher import Fleet, FleetConfig
from shoal_protos import engine_control_pb2 as pb
from shoal_protos import engine_control_pb2_grpc as pb_grpc
from shoal_protos import kv, tls
from shoal_protos.records import (
    TARGET_PHASES,
    EngineRecord,
    Keys,
    LoadReport,
    MigrationRecord,
    engine_record_decoder,
    load_report_decoder,
    migration_record_decoder,
)

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / ".cache" / "models"
TINY = "tiny-llama"
SMOL = "SmolLM2-135M-Instruct"


# The 32-stream comparison: fixed prompts of token ids, greedy, a fixed number of tokens.
def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(length)]


REFERENCE_PROMPTS = [_prompt(i, 8 + 3 * i) for i in range(32)]
REFERENCE_MAX_TOKENS = 48


STALL_S = 60.0
"""How long a test waits on the fleet (one call, or a condition the fleet should bring about)
before it calls a process stuck. A 2-core test machine under the whole suite's load stops single
processes for up to about 40 s at a time; a passing run never waits this out."""


GREEDY_IDS = {"ignore_eos": True, "return_token_ids": True}
"""``extra_body`` of the tests' greedy requests: the full length, token ids in every chunk."""


def async_client(fleet: RunningFleet) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=fleet.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


async def greedy_ids(client: openai.AsyncOpenAI, model: str, prompt: list[int], max_tokens: int) -> list[int]:
    """Token ids of one greedy completion, not streamed (a reference)."""
    reply = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=GREEDY_IDS
    )
    return list(reply.choices[0].model_extra["token_ids"])  # type: ignore[index]


@contextlib.contextmanager
def redis_server(port: int) -> Iterator[subprocess.Popen[bytes]]:
    """A throwaway ``redis-server`` on ``port`` (no persistence), stopped on exit."""
    binary = shutil.which("redis-server")
    assert binary is not None, "redis-server is not installed; `make setup` installs it"
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + STALL_S
        ping = ["redis-cli", "-p", str(port), "ping"]
        while subprocess.run(ping, check=False, capture_output=True).stdout != b"PONG\n":
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
        yield proc
    finally:
        os.kill(proc.pid, signal.SIGCONT)  # a test may have frozen it
        proc.terminate()
        proc.wait(timeout=STALL_S)


# Ports handed out below the kernel's ephemeral range (32768-60999 by default): a port the
# kernel picked for a bind to port 0 and that was closed again can go to the next such bind or
# to an outgoing connection (a router's output socket took an engine's KV port that way), while
# ports below the range are only ever bound when asked for by number.
_PORT_RANGE = (20000, 32000)
_handed_out: set[int] = set()


def free_port(count: int = 1) -> int:
    """The first of ``count`` consecutive ports nothing listens on now, none of them handed out
    before in this test session (a KV agent takes two: data and control)."""
    while True:
        first = random.randrange(_PORT_RANGE[0], _PORT_RANGE[1] - count)
        ports = range(first, first + count)
        if _handed_out.intersection(ports):
            continue
        with contextlib.ExitStack() as probes:
            try:
                for port in ports:
                    probes.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.update(ports)
        return first


@contextlib.contextmanager
def prometheus_server(folder: Path, jobs: dict[str, list[str]], interval_s: int = 1) -> Iterator[str]:
    """A real Prometheus (Debian's package) scraping ``jobs`` (name -> host:port targets) every
    ``interval_s``; yields its base URL and stops it on exit."""
    binary = shutil.which("prometheus")
    assert binary is not None, "prometheus is not installed; `make setup` installs it"
    scrape = [{"job_name": job, "static_configs": [{"targets": targets}]} for job, targets in jobs.items()]
    config = {
        "global": {"scrape_interval": f"{interval_s}s", "scrape_timeout": f"{interval_s}s"},
        "scrape_configs": scrape,
    }
    (folder / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    port = free_port()
    log = (folder / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={folder / 'prometheus.yml'}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            assert proc.poll() is None, f"prometheus exited; see {folder / 'prometheus.log'}"
            try:
                return httpx.get(url + "/-/ready", timeout=STALL_S).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, STALL_S, "Prometheus to be ready", every_s=0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=STALL_S)
        log.close()


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str, every_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(every_s)


def check_target_phases(record: MigrationRecord) -> None:
    """A migrated-in record's parts of the hand-over on its target: all four, none negative, the
    first step took time, and together they fit inside the gap the client saw (the commit came
    after the source's last token)."""
    assert record.stall_ms is not None
    assert list(record.target_phase_ms) == list(TARGET_PHASES)
    assert all(ms >= 0 for ms in record.target_phase_ms.values())
    assert record.target_phase_ms["first_step"] > 0
    assert sum(record.target_phase_ms.values()) <= record.stall_ms + 1.0


async def until(
    condition: Callable[[], bool | Awaitable[bool]], timeout_s: float = STALL_S, what: str = "a condition"
) -> None:
    """``wait_until`` for a test's event loop: the loop runs on while it waits. ``condition`` may
    be a coroutine function."""
    deadline = time.monotonic() + timeout_s
    while True:
        met = condition()
        if inspect.isawaitable(met):
            met = await met
        if met:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.02)


@dataclass
class RunningFleet:
    fleet: Fleet
    cfg: FleetConfig
    redis: redis.Redis
    keys: Keys
    channels: dict[str, grpc.Channel] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return self.cfg.base_url

    @property
    def fleet_tls(self) -> tls.FleetTls | None:
        """The fleet's TLS files, which its engines' EngineControl asks of callers (None: plain)."""
        return tls.load_optional(self.cfg.fleet_tls_dir)

    @property
    def model(self) -> str:
        return self.cfg.served_model_name

    def engine_record(self, engine_id: str) -> EngineRecord | None:
        raw = self.redis.get(self.keys.engine(engine_id))
        return engine_record_decoder.decode(raw) if raw else None

    def load_report(self, engine_id: str) -> LoadReport | None:
        raw = self.redis.get(self.keys.load(engine_id))
        return load_report_decoder.decode(raw) if raw else None

    def engine_metrics(self, engine_id: str) -> str:
        record = self.engine_record(engine_id)
        assert record is not None, f"{engine_id} is not registered"
        return httpx.get(record.http_address + "/metrics", timeout=STALL_S).text

    def control(self, engine_id: str) -> pb_grpc.EngineControlStub:
        """The engine's gRPC EngineControl (migrate, drain, list migrations), over one channel
        per address kept for the session (a fresh channel per call connects anew each time)."""
        record = self.engine_record(engine_id)
        assert record is not None and record.control_address, f"{engine_id} takes no migrations"
        channel = self.channels.get(record.control_address)
        if channel is None:
            channel = tls.channel(record.control_address, self.fleet_tls)
            self.channels[record.control_address] = channel
        return pb_grpc.EngineControlStub(channel)

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()
        self.channels.clear()

    def migrate(
        self, request_id: str, source: str, target: str = "", mode: int = pb.PRECOPY
    ) -> pb.MigrationResult:
        request = pb.MigrateRequest(
            request_id=request_id,
            target_engine_id=target,
            reason="admin",
            mode=mode,  # type: ignore[arg-type]
        )
        result: pb.MigrationResult = self.control(source).Migrate(request, timeout=60)
        return result

    def agent(self, engine_id: str, command: kv.AgentCommand, rank: int = 0) -> kv.AgentReply:
        """One call to the KV agent of an engine's worker ``rank`` (its control socket, next to
        its KV port)."""
        index = int(engine_id.rsplit("-", 1)[1])
        first = self.cfg.engine_kv_base_port + RANK_PORT_STRIDE * self.cfg.tensor_parallel_size * index
        address = rank_address(f"tcp://{self.cfg.host}:{first + 1}", rank)
        with zmq.Context() as ctx, ctx.socket(zmq.REQ) as sock:
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            sock.send(kv.encoder.encode(command))
            assert sock.poll(int(STALL_S * 1000)), f"{engine_id}'s KV agent did not answer"
            return kv.agent_reply_decoder.decode(sock.recv())

    def kv_data_address(self, engine_id: str) -> str:
        """Where the engine's KV agent takes migrated blocks, as its Redis record says."""
        record = self.engine_record(engine_id)
        assert record is not None and record.kv_address, f"{engine_id} has no KV address"
        return record.kv_address

    def migration_record(self, migration_id: str) -> MigrationRecord | None:
        raw = self.redis.get(self.keys.migration(migration_id))
        return migration_record_decoder.decode(raw) if raw else None

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


MODEL_SLICE_S = 0.02
"""How long ``run_models_until`` lets frozen models run between two looks."""


@contextlib.contextmanager
def model_frozen(fleet: RunningFleet, engine_id: str) -> Iterator[EngineRecord]:
    """The engine's model processes (vLLM's engine core, under its front end) stopped for the
    block: its requests cannot finish by themselves, while its front end goes on heartbeating,
    reporting load and taking aborts. The tiny model decodes its whole context in seconds, faster
    than a test on a loaded machine can look at a request; frozen, the request waits for it."""
    record = fleet.engine_record(engine_id)
    assert record is not None, f"{engine_id} is not registered"
    cores = psutil.Process(record.pid).children(recursive=True)
    for process in cores:
        process.suspend()
    try:
        yield record
    finally:
        for process in cores:
            with contextlib.suppress(psutil.NoSuchProcess):  # killed while frozen
                process.resume()


@contextlib.contextmanager
def models_frozen(fleet: RunningFleet, engine_ids: Iterable[str]) -> Iterator[dict[str, EngineRecord]]:
    """``model_frozen`` for several engines at once; yields their records by engine id."""
    with contextlib.ExitStack() as stack:
        yield {e: stack.enter_context(model_frozen(fleet, e)) for e in engine_ids}


def run_models_until(
    fleet: RunningFleet, engine_ids: Iterable[str], condition: Callable[[], bool], timeout_s: float, what: str
) -> float:
    """Inside ``models_frozen``: let the engines' models run ``MODEL_SLICE_S`` at a time until
    ``condition`` holds, checked while they are stopped. A test that must act on requests half
    done (kill their engine, drain it) starts them frozen and runs them this way, so a model that
    decodes a whole request in seconds cannot finish them while a loaded machine keeps the test
    from looking; the block goes on with the models stopped. Returns the longest slice the models
    ran (seconds): far over ``MODEL_SLICE_S`` when the machine left this thread unscheduled."""
    cores = model_processes(fleet, engine_ids)
    deadline = time.monotonic() + timeout_s
    longest = 0.0
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        longest = max(longest, run_slice(cores))
    return longest


def model_processes(fleet: RunningFleet, engine_ids: Iterable[str]) -> list[psutil.Process]:
    """The model processes (vLLM's, under each engine's front end) that ``model_frozen`` stops."""
    cores = []
    for engine_id in engine_ids:
        record = fleet.engine_record(engine_id)
        assert record is not None, f"{engine_id} is not registered"
        cores.extend(psutil.Process(record.pid).children(recursive=True))
    return cores


def run_slice(cores: list[psutil.Process]) -> float:
    """Let frozen model processes run ``MODEL_SLICE_S`` and stop them again; returns how long
    they ran (longer when the machine leaves this thread unscheduled)."""
    resumed = time.monotonic()
    for process in cores:
        process.resume()
    time.sleep(MODEL_SLICE_S)
    for process in cores:
        process.suspend()
    return time.monotonic() - resumed


def fleet_state(router_url: str) -> dict[str, Any]:
    """The router's ``/fleet/state``: its engines as it sees them, its requests in flight, ..."""
    state: dict[str, Any] = httpx.get(router_url + "/fleet/state", timeout=STALL_S).json()
    return state


def in_flight(fleet: RunningFleet) -> list[dict[str, Any]]:
    """The requests the router lists as in flight on ``/fleet/state`` (id, engine, tokens, ...)."""
    return list(fleet_state(fleet.base_url)["requests"])


def metric(url: str, name: str) -> float:
    """The value of the unlabelled series ``name`` on ``url``'s ``/metrics`` (0 when absent)."""
    for line in httpx.get(url + "/metrics", timeout=STALL_S).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def dispatched(fleet: RunningFleet) -> dict[str, float]:
    """Requests the router sent to each engine, from its Prometheus counter."""
    return dispatched_at(fleet.base_url)


def dispatched_at(router_url: str) -> dict[str, float]:
    """Requests the router at ``router_url`` sent to each engine, from its Prometheus counter."""
    text = httpx.get(router_url + "/metrics", timeout=STALL_S).text
    pattern = r'shoal_router_dispatched_total\{engine="([^"]+)",model="[^"]+",policy="[^"]+"\} ([0-9.e+]+)'
    counts: dict[str, float] = {}
    for engine, count in re.findall(pattern, text):
        counts[engine] = counts.get(engine, 0.0) + float(count)
    return counts


@contextlib.contextmanager
def extra_router(
    fleet: RunningFleet, router_id: str, log_dir: Path, *args: str
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Another router process on ``fleet``'s Redis, tokenizer and engines, with its own ports and
    the extra command-line ``args``; yields its base URL and process once it serves."""
    port = free_port()
    cfg = fleet.cfg
    command = [
        sys.executable, "-m", "shoal_router.main",
        "--models", fleet.model,
        "--cluster", cfg.cluster,
        "--router-id", router_id,
        "--redis-url", cfg.redis_url,
        "--tokenizer-address", f"{cfg.host}:{cfg.tokenizer_port}",
        "--host", cfg.host,
        "--port", str(port),
        "--zmq-port", str(free_port()),
        *args,
    ]  # fmt: skip
    log_path = log_dir / f"{router_id}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://{cfg.host}:{port}"

    def ready() -> bool:
        assert proc.poll() is None, log_path.read_text()
        try:
            return httpx.get(url + "/health", timeout=STALL_S).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(ready, 60, f"router {router_id} to serve", every_s=0.2)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(timeout=STALL_S)


@dataclass(frozen=True)
class SimFleet:
    """Redis, simulated engines (``sim-0``, ``sim-1``, ...) and one router, as
    ``sim_fleet`` started them."""

    url: str
    redis_url: str
    engine_urls: list[str]


@contextlib.contextmanager
def sim_fleet(
    logs: Path,
    cluster: str,
    model: str,
    engine_args: list[str],
    router_args: tuple[str, ...] = (),
    engines: int = 2,
    per_engine: Callable[[int], list[str]] | None = None,
) -> Iterator[SimFleet]:
    """A throwaway Redis, ``engines`` ``shoal-engine --backend sim`` processes serving ``model``
    (``engine_args`` after the common flags, then ``per_engine(i)``) and a router
    (``router_args`` likewise), until the block ends; it yields once the router sees every
    engine. Logs go to ``logs``."""
    redis_port = free_port()
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    processes: list[subprocess.Popen[bytes]] = []

    def spawn(command: list[str], name: str) -> None:
        with (logs / f"{name}.log").open("wb") as out:
            processes.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT))

    with redis_server(redis_port):
        try:
            engine_urls = []
            for i in range(engines):
                http_port = free_port()
                engine_urls.append(f"http://127.0.0.1:{http_port}")
                spawn(
                    [
                        sys.executable, "-m", "shoal_engine.main", "--backend", "sim",
                        "--served-model-name", model, "--engine-id", f"sim-{i}", "--cluster", cluster,
                        "--redis-url", redis_url, "--zmq-port", str(free_port()),
                        "--http-port", str(http_port), *engine_args,
                        *(per_engine(i) if per_engine else []),
                    ],
                    f"sim-{i}",
                )  # fmt: skip
            port = free_port()
            spawn(
                [
                    sys.executable, "-m", "shoal_router.main", "--models", model, "--cluster", cluster,
                    "--redis-url", redis_url, "--tokenizer-address", "127.0.0.1:1", "--port", str(port),
                    "--zmq-port", str(free_port()), *router_args,
                ],
                "router",
            )  # fmt: skip
            url = f"http://127.0.0.1:{port}"

            def ready() -> bool:
                for proc in processes:
                    assert proc.poll() is None, f"a process exited; logs in {logs}"
                try:
                    health = httpx.get(url + "/health", timeout=STALL_S).json()
                except (httpx.HTTPError, ValueError):
                    return False
                return len(health.get("engines", {})) == engines

            wait_until(ready, 120, "the router to see every simulated engine", every_s=0.2)
            yield SimFleet(url, redis_url, engine_urls)
        finally:
            for proc in processes:
                if proc.poll() is None:
                    proc.terminate()
            for proc in processes:
                proc.wait(timeout=STALL_S)
