"""ZeroMQ CURVE on the router-engine sockets: encrypted frames, and only fleet members connect.

Every member of a fleet (routers and engines) holds the same CURVE keypair, read from a key file
of two lines, the public and the secret key in Z85 (``python -m shoal_protos.curve > FILE``
writes one; on Kubernetes it is a Secret). Bound sockets (an engine's request socket, a
router's output socket) are CURVE servers with it; connecting sockets are CURVE clients that
present the same key as their own. Each process runs a ZAP handler that admits a client only
if it presents the fleet's public key, so a peer without the secret key can neither send a
frame nor read one. Off unless a key file is given.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

ZAP_DOMAIN = "shoal"


@dataclass(frozen=True, slots=True)
class CurveKeys:
    public: bytes
    secret: bytes


def generate() -> str:
    """A new key file's text."""
    public, secret = zmq.curve_keypair()
    return f"{public.decode()}\n{secret.decode()}\n"


def load(path: Path | str) -> CurveKeys:
    """The keys in a key file; ValueError saying what is wrong with it."""
    lines = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    if len(lines) != 2 or any(len(line) != 40 for line in lines):
        raise ValueError(f"{path}: want two lines, the public and the secret key (40 Z85 characters each)")
    public, secret = (line.encode() for line in lines)
    if zmq.curve_public(secret) != public:
        raise ValueError(f"{path}: the public key is not the secret key's")
    return CurveKeys(public, secret)


def serve(sock: zmq.Socket[bytes], keys: CurveKeys) -> None:
    """Make a socket about to bind a CURVE server whose clients the ZAP handler checks."""
    sock.zap_domain = ZAP_DOMAIN.encode()
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def connect_as_member(sock: zmq.Socket[bytes], keys: CurveKeys) -> None:
    """Make a socket about to connect a CURVE client presenting the fleet's key."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.public


class _FleetMembers:
    def __init__(self, public: bytes) -> None:
        self._public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self._public


def start_authenticator(ctx: zmq.Context[zmq.Socket[bytes]], keys: CurveKeys) -> ThreadAuthenticator:
    """The process's ZAP handler (one per context, started before any server socket binds);
    ``stop()`` it before the context ends."""
    authenticator = ThreadAuthenticator(ctx)
    authenticator.start()
    authenticator.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_FleetMembers(keys.public))
    return authenticator


if __name__ == "__main__":
    if len(sys.argv) != 1:
        sys.exit("usage: python -m shoal_protos.curve > KEY_FILE   (writes a new fleet key file)")
    print(generate(), end="")
