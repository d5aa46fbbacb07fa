"""Shared fleets for the integration tests, started once per session by the launcher's own code.

* ``tiny_fleet``: two engines of the tiny random Llama (fast; its text is noise, its greedy
  token ids are deterministic).
* ``smol_fleet``: two engines of SmolLM2-135M-Instruct, for answers whose text matters.

Engines of both load Shoal's KV connector, so requests can move between them.

Both fleets and the offline vLLM reference run start together at the beginning of the session,
so their model loads overlap. Every wait has a deadline.

* ``own_tiny_fleet``, ``own_smol_fleet``: the same, a module's own, for the tests that kill or
  stop fleet processes (marked ``destructive``, and run last).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path

import httpx
import pytest
import redis
import redis.asyncio as aioredis
from _pytest.reports import TestReport

from shoal_fleet.launcher import Fleet, FleetConfig, write_curve_key, write_fleet_tls
from shoal_protos.records import Keys
from tests.integration.support import (
    MODELS,
    REFERENCE_MAX_TOKENS,
    REFERENCE_PROMPTS,
    SMOL,
    STALL_S,
    TINY,
    RunningFleet,
    free_port,
    redis_server,
)

# Log folders of the running fleets: a failed test's report carries their service lines, so a
# failure on a machine where the logs are gone afterwards can still be read.
_LOG_DIRS: list[Path] = []


def _service_lines(log: Path, keep: int = 40) -> str:
    lines = [
        line
        for line in log.read_text(errors="replace").splitlines()
        # Shoal's own lines and problems; vLLM's "(Process pid=N)" lines only when they are errors.
        if (" shoal" in line or "WARNING" in line or "ERROR" in line or "Traceback" in line)
        and (not line.startswith("(") or "ERROR" in line)
    ]
    return "\n".join(lines[-keep:])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, TestReport, TestReport]:
    report: TestReport = yield
    if report.failed and item.get_closest_marker("integration") is not None:
        for folder in _LOG_DIRS:
            for log in sorted(folder.glob("*.log")):
                report.sections.append((f"{folder.parent.name}/{log.name}", _service_lines(log)))
    return report


def _config(
    name: str,
    model_dir: str,
    served: str,
    run_dir: Path,
    engines: int,
    offset: int,
    dtype: str = "bfloat16",
    max_model_len: int = 2048,
    kv_block_size: int = 32,
) -> FleetConfig:
    return FleetConfig(
        dtype=dtype,
        max_model_len=max_model_len,
        model_path=MODELS / model_dir,
        served_model_name=served,
        run_dir=run_dir / name,
        engines=engines,
        cluster=f"test-{name}",
        router_port=18000 + offset,
        router_zmq_port=15700 + offset,
        tokenizer_port=15050 + offset,
        redis_port=16379 + offset,
        engine_zmq_base_port=15600 + 10 * offset,
        engine_http_base_port=16100 + 10 * offset,
        engine_control_base_port=16200 + 10 * offset,
        engine_kv_base_port=16300 + 10 * offset,
        enforce_eager=True,
        kv_block_size=kv_block_size,
        restart=False,
        heartbeat_ttl_s=3.0,
        # Room for a frozen engine, woken, to write its heartbeat again on a loaded machine.
        engine_silence_grace_s=2.0,
        drain_timeout_s=5.0,
        migration_step_timeout_s=3.0,
        # The migration tests compare the bytes a move copied.
        kv_debug_reads=True,
    )


def _fleet_config(kind: str, run_dir: Path, name: str, offset: int) -> FleetConfig:
    """The configuration of a ``tiny`` or ``smol`` fleet called ``name``, on ports of its own
    (``offset``)."""
    if kind == "tiny":
        # The tiny model's whole context: its streams must outlast a client the machine leaves
        # unscheduled for a few seconds (the tiny model decodes 2,000 tokens in about as long).
        # float32: on CPUs with AMX, vLLM's CPU build dies with SIGILL on the tiny model's first
        # bf16 step (its small shapes take a kernel SmolLM2's do not).
        # 128-token blocks, the fleet's default: the router counts each engine's demand in them.
        return _config(
            name,
            "tiny-llama",
            TINY,
            run_dir,
            engines=2,
            offset=offset,
            max_model_len=8192,
            dtype="float32",
            kv_block_size=128,
        )
    # float32: greedy decoding in bf16 is not batch-invariant (a near-tie flips with the shape of
    # the batch, and many concurrent streams moving between engines change it); in float32 such
    # ties are some ten thousand times rarer.
    # The CPU build's smallest blocks (32 tokens): the tests' short streams then span several
    # blocks, so their moves pre-copy full blocks before the stop.
    # The SmolLM2 fleet speaks CURVE between its router and engines, and mutual TLS on
    # EngineControl and the KV data links, as the operator's fleets do (every test on it runs
    # through the encrypted links); the tiny fleet stays plain for the hostile-frames test.
    cfg = _config(name, "SmolLM2-135M-Instruct", SMOL, run_dir, engines=2, offset=offset, dtype="float32")
    return dataclasses.replace(
        cfg,
        zmq_curve_key_file=write_curve_key(run_dir / f"{name}-fleet.key"),
        fleet_tls_dir=write_fleet_tls(run_dir / f"{name}-tls"),
    )


@contextlib.contextmanager
def _running(configs: dict[str, FleetConfig]) -> Iterator[dict[str, RunningFleet]]:
    """Start the fleets (together), wait until each serves and has run a step; stop them after."""
    fleets = {
        name: Fleet(cfg, say=lambda line: print(line, file=sys.stderr)) for name, cfg in configs.items()
    }
    running: dict[str, RunningFleet] = {}
    try:
        for fleet in fleets.values():
            fleet.start()
        for name, fleet in fleets.items():
            _LOG_DIRS.append(fleet.log_dir)
            fleet.wait_ready(timeout_s=600)
            cfg = configs[name]
            running[name] = RunningFleet(fleet, cfg, redis.Redis.from_url(cfg.redis_url), Keys(cfg.cluster))
        for name, each in running.items():
            _warm_up(name, each)
        yield running
    finally:
        for each in running.values():
            each.close()
        for fleet in fleets.values():
            fleet.stop()
            if fleet.log_dir in _LOG_DIRS:
                _LOG_DIRS.remove(fleet.log_dir)


@pytest.fixture(scope="session")
def _fleets(
    tmp_path_factory: pytest.TempPathFactory, _reference_job: tuple[subprocess.Popen[bytes], Path]
) -> Iterator[dict[str, RunningFleet]]:
    # Depends on the reference job only so that it starts first and loads alongside the fleets.
    run_dir = tmp_path_factory.mktemp("fleets")
    configs = {
        name: _fleet_config(name, run_dir, name, offset) for name, offset in [("tiny", 0), ("smol", 1)]
    }
    with _running(configs) as running:
        yield running


def _warm_up(name: str, fleet: RunningFleet) -> None:
    """A few short requests at once, so that every engine has run a step before the tests time
    anything (a fresh engine's first steps can be slow while the machine is busy)."""
    started = time.monotonic()

    def one(_: int) -> int:
        body = {"model": fleet.model, "prompt": [1, 2, 3], "max_tokens": 4}
        return httpx.post(fleet.base_url + "/v1/completions", json=body, timeout=300).status_code

    with concurrent.futures.ThreadPoolExecutor(2 * fleet.cfg.engines) as pool:
        statuses = list(pool.map(one, range(2 * fleet.cfg.engines)))
    assert statuses == [200] * len(statuses), statuses
    print(f"  {name}: warm-up requests answered in {time.monotonic() - started:.1f} s", file=sys.stderr)


@pytest.fixture(scope="session")
def tiny_fleet(_fleets: dict[str, RunningFleet]) -> RunningFleet:
    return _fleets["tiny"]


@pytest.fixture(scope="session")
def smol_fleet(_fleets: dict[str, RunningFleet]) -> RunningFleet:
    return _fleets["smol"]


# Fleets of a module's own, for the tests that kill or stop fleet processes (``destructive``):
# the shared fleets serve every other test whole, whatever order the tests run in. One at a time
# (each goes with its module), on ports apart from the shared fleets'.


@pytest.fixture(scope="module")
def own_tiny_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningFleet]:
    run_dir = tmp_path_factory.mktemp("own-fleet")
    with _running({"tiny-own": _fleet_config("tiny", run_dir, "tiny-own", 2)}) as running:
        yield running["tiny-own"]


@pytest.fixture(scope="module")
def own_smol_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningFleet]:
    run_dir = tmp_path_factory.mktemp("own-fleet")
    with _running({"smol-own": _fleet_config("smol", run_dir, "smol-own", 3)}) as running:
        yield running["smol-own"]


@pytest.fixture(scope="module")
def own_tp_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningFleet]:
    """Two tiny-model engines of two vLLM workers each (tensor parallel, a core per worker)."""
    run_dir = tmp_path_factory.mktemp("own-fleet")
    cfg = dataclasses.replace(_fleet_config("tiny", run_dir, "tiny-tp", 4), tensor_parallel_size=2)
    with _running({"tiny-tp": cfg}) as running:
        yield running["tiny-tp"]


@pytest.fixture(scope="session")
def _reference_job(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """Start the offline reference run early; ``reference_token_ids`` collects it."""
    folder = tmp_path_factory.mktemp("reference")
    job, out = folder / "job.json", folder / "out.json"
    job.write_text(
        json.dumps(
            {
                "model": str(MODELS / "tiny-llama"),
                "prompts": REFERENCE_PROMPTS,
                "max_tokens": REFERENCE_MAX_TOKENS,
            }
        )
    )
    log = (folder / "reference.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("reference.py")), str(job), str(out)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    yield proc, out
    if proc.poll() is None:
        proc.kill()
    log.close()


@pytest.fixture(scope="session")
def reference_token_ids(_reference_job: tuple[subprocess.Popen[bytes], Path]) -> list[list[int]]:
    proc, out = _reference_job
    code = proc.wait(timeout=600)
    assert code == 0, f"offline vLLM reference run failed ({code}); see {out.parent / 'reference.log'}"
    token_ids: list[list[int]] = json.loads(out.read_text())["token_ids"]
    return token_ids


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    """A Redis server of the test module's own (a module may name another, a fixed port say)."""
    port = free_port()
    with redis_server(port):
        yield f"redis://127.0.0.1:{port}/0"


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """A client of the module's Redis, on an empty database. Its calls give up after
    ``STALL_S``, as the services' own clients give up after theirs: a reply lost to a cancelled
    call fails the test instead of hanging it (and the code under test's clean-up with it)."""
    client = aioredis.Redis.from_url(redis_url, socket_timeout=STALL_S, socket_connect_timeout=STALL_S)
    await client.flushdb()
    yield client
    await client.aclose()
