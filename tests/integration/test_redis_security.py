"""Fleet state over a Redis that wants TLS and a password: an engine's registration and a router's
fleet view share state through ``rediss://:PASSWORD@host:port/0?ssl_ca_certs=CA`` (the URL the
services take as ``--redis-url``; on Kubernetes, ``spec.redis.urlSecret``), and a client with the
wrong password, no TLS, or no trust in the server's certificate gets nothing.

The Redis server is Debian's, started with a certificate the test signs with its own CA."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from redis.exceptions import AuthenticationError, ConnectionError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shoal_engine.metrics import EngineMetrics
from shoal_engine.registry import EngineRegistration
from shoal_operator.children import REDIS_PORT, REDIS_START
from shoal_protos.records import EngineRecord, Keys, LoadReport, state_client
from shoal_router.ipc.fleet import FleetView
from tests.integration.support import STALL_S, free_port

pytestmark = pytest.mark.integration

PASSWORD = "s3cret-fleet-state"
LOOPBACK = ipaddress.ip_address("127.0.0.1")


def _certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 signed by it: (ca, cert, key) files."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "shoal test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "redis")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(LOOPBACK)]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = folder / "ca.pem", folder / "redis.pem", folder / "redis.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    os.chmod(paths[2], 0o600)
    return paths


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    """A Redis with TLS only (no plain port) and a password; yields its port and the CA file."""
    folder = tmp_path_factory.mktemp("tls-redis")
    ca, cert, key = _certificates(folder)
    port = free_port()
    binary = shutil.which("redis-server")
    assert binary is not None, "redis-server is not installed; `make setup` installs it"
    command = [
        binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
        "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca),
        "--tls-auth-clients", "no", "--requirepass", PASSWORD, "--save", "", "--appendonly", "no",
    ]  # fmt: skip
    log = (folder / "redis.log").open("wb")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + STALL_S
        while not _answers(port, ca):
            assert proc.poll() is None, (folder / "redis.log").read_text()
            assert time.monotonic() < deadline, "the TLS Redis did not start"
            time.sleep(0.05)
        yield port, ca
    finally:
        proc.terminate()
        proc.wait(timeout=STALL_S)
        log.close()


def _url(port: int, ca: Path, password: str = PASSWORD) -> str:
    return f"rediss://:{password}@127.0.0.1:{port}/0?ssl_ca_certs={ca}"


def _answers(port: int, ca: Path) -> bool:
    async def ping() -> bool:
        client = state_client(_url(port, ca), 1.0)
        try:
            return bool(await client.ping())
        except (RedisError, OSError):
            return False
        finally:
            await client.aclose()

    return asyncio.run(ping())


async def test_an_engine_and_a_router_share_state_over_tls_with_a_password(
    tls_redis: tuple[int, Path],
) -> None:
    port, ca = tls_redis
    keys = Keys("secured")
    record = EngineRecord(
        engine_id="engine-tls",
        model="m",
        zmq_address="tcp://127.0.0.1:1",
        http_address="http://127.0.0.1:2",
        max_model_len=64,
        protocol_version=1,
        started_at=time.time(),
    )

    def report(seq: int) -> LoadReport:
        return LoadReport(engine_id="engine-tls", seq=seq, time=time.time(), num_running=2, kv_blocks_free=8)

    engine_side = state_client(_url(port, ca), 1.0)
    router_side = state_client(_url(port, ca), 1.0)
    registration = EngineRegistration(
        engine_side, keys, record, 3.0, 0.05, report, EngineMetrics("engine-tls", "m")
    )
    added: list[EngineRecord] = []
    fleet = FleetView(router_side, keys, added.append, lambda *_: None)
    await registration.register()
    try:
        deadline = time.monotonic() + STALL_S
        while "engine-tls" not in fleet.engines or fleet.engines["engine-tls"].report is None:
            assert time.monotonic() < deadline, "the router never saw the engine and its load"
            await fleet.refresh()
            await asyncio.sleep(0.05)
        assert [r.engine_id for r in added] == ["engine-tls"]
        report_seen = fleet.engines["engine-tls"].report
        assert report_seen is not None and report_seen.num_running == 2
    finally:
        await registration.unregister()
        await engine_side.aclose()
        await router_side.aclose()


@pytest.mark.parametrize("how", ["wrong password", "no password", "no TLS", "untrusted certificate"])
async def test_clients_without_the_password_tls_or_trust_get_nothing(
    tls_redis: tuple[int, Path], how: str
) -> None:
    port, ca = tls_redis
    url, error = {
        "wrong password": (_url(port, ca, "guess"), AuthenticationError),
        "no password": (f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}", AuthenticationError),
        "no TLS": (f"redis://:{PASSWORD}@127.0.0.1:{port}/0", ConnectionError),
        "untrusted certificate": (f"rediss://:{PASSWORD}@127.0.0.1:{port}/0", ConnectionError),
    }[how]
    client = state_client(url, 1.0)
    try:
        # A TLS port read as plain text may close the connection or just never answer.
        with pytest.raises((error, RedisTimeoutError)):
            await client.set(Keys("secured").engines, b"x")
    finally:
        await client.aclose()


def test_the_managed_redis_takes_its_password_from_a_file_not_its_command_line(tmp_path: Path) -> None:
    """The operator's managed Redis starts with ``REDIS_START`` (``sh -c``, its image's shell):
    run here with the real redis-server, the password (with the characters a config file
    quotes) works, a wrong one does not, and no process's command line carries it."""
    password = 'pa ss"w\\ord'
    port = free_port()
    script = REDIS_START.replace("/data/", f"{tmp_path}/").replace(f"--port {REDIS_PORT}", f"--port {port}")
    env = {**os.environ, "REDIS_PASSWORD": password}
    proc = subprocess.Popen(["sh", "-c", script], env=env, cwd=tmp_path)
    try:
        client = redis.Redis(port=port, password=password, socket_timeout=STALL_S)
        deadline = time.monotonic() + STALL_S
        while True:
            try:
                assert client.ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None, "redis-server did not start"
                assert time.monotonic() < deadline, "redis-server did not answer"
                time.sleep(0.05)
        with pytest.raises(AuthenticationError):
            redis.Redis(port=port, password="guess", socket_timeout=STALL_S).ping()
        # ``exec``: the shell became redis-server, whose command line names the file only.
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert b"redis-server" in cmdline and password.encode() not in cmdline, cmdline
        assert oct((tmp_path / "auth.conf").stat().st_mode & 0o777) == oct(0o600)
    finally:
        proc.terminate()
        proc.wait(timeout=STALL_S)
