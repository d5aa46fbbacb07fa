"""The fleet's mutual TLS on EngineControl: the engine's real gRPC server (``control_server``)
with a stand-in migration manager (Shoal's own seam), called by the clients the fleet uses."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import grpc
import grpc.aio
import pytest

from shoal_engine import main as engine_main
from shoal_operator.reconcile import _with_generated_keys
from shoal_protos import engine_control_pb2 as pb
from shoal_protos import engine_control_pb2_grpc as pb_grpc
from shoal_protos import tls
from shoal_protos.addresses import host_port
from tests.unit.listeners import free_ports


class _Manager:
    """Answers ListMigrations with nothing: what the tests look at is who gets an answer."""

    def history(self, limit: int) -> list[pb.MigrationResult]:
        return []


async def _list(address: str, fleet_tls: tls.FleetTls | None) -> grpc.StatusCode:
    async with tls.aio_channel(address, fleet_tls) as channel:
        try:
            await pb_grpc.EngineControlStub(channel).ListMigrations(pb.ListMigrationsRequest(), timeout=5)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


@pytest.fixture
def fleet(tmp_path: Path) -> tls.FleetTls:
    return tls.write(tmp_path / "fleet")


async def test_engine_control_answers_only_holders_of_a_fleet_certificate(
    fleet: tls.FleetTls, tmp_path: Path
) -> None:
    port = free_ports()
    config = engine_main.parse_args(
        [
            *("--model", "sim", "--served-model-name", "m", "--backend", "sim", "--migration"),
            *("--host", "127.0.0.1"),
            *("--control-port", str(port), "--fleet-tls-dir", str(fleet.folder)),
        ]
    )
    assert config.fleet_tls_dir == str(fleet.folder)
    server = engine_main.control_server(config, _Manager(), fleet)  # type: ignore[arg-type]
    await server.start()
    address = host_port("127.0.0.1", port)
    other = tls.write(tmp_path / "other")  # a certificate of another CA
    # Another CA's certificate, trusting the fleet's CA: the engine refuses the client.
    stranger = tls.FleetTls(fleet.ca, other.cert, other.key)
    try:
        assert await _list(address, fleet) == grpc.StatusCode.OK
        assert await _list(address, None) == grpc.StatusCode.UNAVAILABLE  # plain
        assert await _list(address, other) == grpc.StatusCode.UNAVAILABLE  # trusts another CA
        assert await _list(address, stranger) == grpc.StatusCode.UNAVAILABLE

        # The blocking channel the tests and benchmarks use (off the loop that serves).
        def blocking_call() -> int:
            with tls.channel(address, fleet) as channel:
                stub = pb_grpc.EngineControlStub(channel)
                return len(stub.ListMigrations(pb.ListMigrationsRequest(), timeout=5).migrations)

        assert await asyncio.to_thread(blocking_call) == 0
    finally:
        await server.stop(None)


def test_a_plain_engine_control_is_what_an_engine_without_the_files_serves() -> None:
    config = engine_main.parse_args(
        ["--model", "sim", "--served-model-name", "m", "--backend", "sim", "--migration"]
    )
    assert config.fleet_tls_dir is None
    server = engine_main.control_server(config, _Manager())  # type: ignore[arg-type]
    assert isinstance(server, grpc.aio.Server)


def test_a_folder_without_the_files_fails_at_load(tmp_path: Path, fleet: tls.FleetTls) -> None:
    with pytest.raises(tls.TlsError, match=r"ca\.crt"):
        tls.FleetTls.load(tmp_path)
    (tmp_path / "bad").mkdir()
    for name in (tls.CA_FILE, tls.CERT_FILE, tls.KEY_FILE):
        (tmp_path / "bad" / name).write_text("not a certificate")
    with pytest.raises(tls.TlsError, match="not PEM"):
        tls.FleetTls.load(tmp_path / "bad")


def test_the_operator_fills_a_new_fleet_tls_secret_once(fleet: tls.FleetTls) -> None:
    """The rendered Secret carries no data; at its creation the operator fills it with a new CA
    and certificate, which load as the engines load them from the mounted Secret."""
    from shoal_operator.children import GENERATED_TLS_ANNOTATION

    rendered = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "c-fleet-tls", "annotations": {GENERATED_TLS_ANNOTATION: "true"}},
        "type": "Opaque",
    }
    created = _with_generated_keys(rendered)
    files = {name: base64.b64decode(value) for name, value in created["data"].items()}
    assert set(files) == {tls.CA_FILE, tls.CERT_FILE, tls.KEY_FILE}
    again = _with_generated_keys(rendered)
    assert again["data"][tls.KEY_FILE] != created["data"][tls.KEY_FILE]  # a new one per cluster
    assert b"PRIVATE KEY" in files[tls.KEY_FILE] and b"CERTIFICATE" in files[tls.CA_FILE]
