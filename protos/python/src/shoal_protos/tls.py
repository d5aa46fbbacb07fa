"""Mutual TLS for the fleet's links between its own parts: EngineControl (gRPC) and the KV data
connections between engines' agents.

A fleet's TLS material is one folder with the three files a ``kubernetes.io/tls`` Secret holds
and cert-manager writes: ``ca.crt`` (the fleet's certificate authority), ``tls.crt`` and
``tls.key`` (a certificate the CA signed, for the name ``FLEET_NAME``). Every part presents it
and accepts only peers whose certificate the CA signed, so a pod that can reach an engine's
ports but holds no certificate of the fleet cannot drain it, move its requests or push KV into
it, and nothing on the wire can be read. Peers are dialled by address (pod IPs), so clients
check the certificate against ``FLEET_NAME`` rather than the address.

``generate`` makes a new CA and certificate (ECDSA P-256): the operator does at a cluster's
creation (its Secret), the launcher for a local fleet, ``python -m shoal_protos.tls DIR`` by
hand.
"""

from __future__ import annotations

import argparse
import datetime
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

FLEET_NAME = "shoal-fleet"
"""The name on every fleet certificate, which clients check in place of the peer's address."""
CA_FILE, CERT_FILE, KEY_FILE = "ca.crt", "tls.crt", "tls.key"
VALID_DAYS = 3650


class TlsError(Exception):
    """The fleet's TLS folder is missing a file or holds something that is not PEM."""


@dataclass(frozen=True)
class FleetTls:
    """A fleet's TLS material: the CA, and the certificate and key this part presents."""

    ca: bytes
    cert: bytes
    key: bytes
    folder: Path | None = None
    """Where the files are (Python's ``ssl`` loads a key pair from files only)."""

    @classmethod
    def load(cls, folder: str | Path) -> FleetTls:
        folder = Path(folder)
        try:
            parts = [(folder / name).read_bytes() for name in (CA_FILE, CERT_FILE, KEY_FILE)]
        except OSError as exc:
            raise TlsError(f"fleet TLS folder {folder}: {exc}") from exc
        for name, data in zip((CA_FILE, CERT_FILE, KEY_FILE), parts, strict=True):
            if b"-----BEGIN " not in data:
                raise TlsError(f"fleet TLS folder {folder}: {name} is not PEM")
        ca, cert, key = parts
        return cls(ca, cert, key, folder=folder)

    # ---- gRPC ---------------------------------------------------------------------------------

    def server_credentials(self) -> grpc.ServerCredentials:
        """Serve with this certificate; refuse a client that presents none the CA signed."""
        return grpc.ssl_server_credentials([(self.key, self.cert)], self.ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)

    # ---- KV data connections (Python's ``ssl``) -------------------------------------------------

    def server_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.verify_mode = ssl.CERT_REQUIRED
        self._load(context)
        return context

    def client_context(self) -> ssl.SSLContext:
        """Checks the server's certificate against ``FLEET_NAME`` (``server_hostname``)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        self._load(context)
        return context

    def _load(self, context: ssl.SSLContext) -> None:
        if self.folder is None:
            raise TlsError("TLS sockets need the fleet's TLS files on disk (FleetTls.load)")
        context.load_verify_locations(cadata=self.ca.decode())
        context.load_cert_chain(self.folder / CERT_FILE, self.folder / KEY_FILE)


CHANNEL_OPTIONS = (("grpc.ssl_target_name_override", FLEET_NAME),)


def aio_channel(address: str, tls: FleetTls | None) -> grpc.aio.Channel:
    """A channel to another part's gRPC server: mutual TLS when the fleet has it, else plain."""
    if tls is None:
        return grpc.aio.insecure_channel(address)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=list(CHANNEL_OPTIONS))


def channel(address: str, tls: FleetTls | None) -> grpc.Channel:
    """``aio_channel`` for blocking callers."""
    if tls is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, tls.channel_credentials(), options=list(CHANNEL_OPTIONS))


def load_optional(folder: str | Path | None) -> FleetTls | None:
    """The fleet's TLS from ``folder``, or None when none is given (the links stay plain)."""
    return FleetTls.load(folder) if folder else None


# ---- making the material ------------------------------------------------------------------------


_CA_USAGE = x509.KeyUsage(
    digital_signature=False,
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=False,
    key_cert_sign=True,
    crl_sign=True,
    encipher_only=False,
    decipher_only=False,
)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def generate(days: int = VALID_DAYS) -> dict[str, bytes]:
    """A new fleet CA and a certificate it signed for ``FLEET_NAME``, as the files' contents."""
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(hours=1), now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("shoal fleet CA"))
        .issuer_name(_name("shoal fleet CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_CA_USAGE, critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(FLEET_NAME))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(FLEET_NAME)]), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    return {
        CA_FILE: ca.public_bytes(pem),
        CERT_FILE: cert.public_bytes(pem),
        KEY_FILE: key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    }


def write(folder: str | Path, files: dict[str, bytes] | None = None) -> FleetTls:
    """Write new (or the given) fleet TLS files into ``folder``, the key readable by its owner
    only; returns them loaded."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in (files or generate()).items():
        path = folder / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if name == KEY_FILE else 0o644)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
    return FleetTls.load(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description="Make a fleet's TLS files (ca.crt, tls.crt, tls.key).")
    parser.add_argument("folder", help="where to write them")
    parser.add_argument("--days", type=int, default=VALID_DAYS, help="how long they are valid")
    args = parser.parse_args()
    write(args.folder, generate(args.days))
    print(f"wrote {CA_FILE}, {CERT_FILE} and {KEY_FILE} to {args.folder}")


if __name__ == "__main__":
    main()
