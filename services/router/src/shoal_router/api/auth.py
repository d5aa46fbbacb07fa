"""API keys: bearer auth on the OpenAI API, and separately on ``/metrics`` and the fleet page.

Keys are never stored: a keys file holds one line per key, ``NAME SHA256_HEX`` (the SHA-256 of
the key, hex), optionally followed by the key's own rate limits ``rpm=N`` (requests per minute)
and ``tpm=N`` (prompt plus output tokens per minute) and by ``priority=-N``, the most urgent
``priority`` its requests may ask for (without it, none below 0: priority requests are for the
keys given the right), with ``#`` comments. A request's
``Authorization: Bearer <key>`` is hashed and looked up; the name it maps to is the caller's
identity. The file is read again when it changes (a Kubernetes Secret mounted as a file is
updated in place), and a file that cannot be read or parsed keeps the last good set of keys (and
says so in the log). Make a line with

    python -m shoal_router.api.auth NAME < key-file      # prints "NAME <sha256 of the key>"
"""

from __future__ import annotations

import hashlib
import logging
import re
import sys
import time
from pathlib import Path

from shoal_router.core.ratelimit import ApiKey

logger = logging.getLogger(__name__)

_LINE = re.compile(
    r"(?P<name>[A-Za-z0-9_.@:\-]{1,128})\s+(?P<digest>[0-9a-f]{64})"
    r"(?P<limits>(?:\s+(?:(?:rpm|tpm)=[0-9]{1,12}|priority=-?[0-9]{1,10}))*)"
)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def parse_keys(text: str) -> dict[str, ApiKey]:
    """``{sha256 hex: ApiKey}`` from a keys file; ValueError naming the first bad line."""
    keys: dict[str, ApiKey] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _LINE.fullmatch(line)
        if match is None:
            raise ValueError(
                f"line {number}: want NAME SHA256_HEX (64 lowercase hex digits), then optionally "
                "rpm=N tpm=N priority=-N"
            )
        limits = dict(part.split("=") for part in match["limits"].split())
        keys[match["digest"]] = ApiKey(
            match["name"],
            int(limits["rpm"]) if "rpm" in limits else None,
            int(limits["tpm"]) if "tpm" in limits else None,
            min(0, int(limits.get("priority", 0))),
        )
    return keys


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class KeyFile:
    """The keys in ``path``, re-read when the file changes (checked at most every ``recheck_s``)."""

    def __init__(self, path: Path | str, recheck_s: float = 1.0) -> None:
        self.path = Path(path)
        self._recheck_s = recheck_s
        self._keys: dict[str, ApiKey] = {}
        self._stamp: tuple[int, int] | None = None
        self._checked = 0.0
        self._load(initial=True)

    def _load(self, initial: bool = False) -> None:
        try:
            stat = self.path.stat()
            stamp = (stat.st_mtime_ns, stat.st_size)
            if stamp == self._stamp:
                return
            self._keys = parse_keys(self.path.read_text())
            self._stamp = stamp
            logger.info("read %d API keys from %s", len(self._keys), self.path)
        except (OSError, ValueError) as exc:
            if initial:
                raise ValueError(f"cannot read API keys from {self.path}: {exc}") from exc
            logger.warning("keeping the last API keys: cannot read %s: %s", self.path, exc)

    def identify(self, authorization: str | None) -> ApiKey | None:
        """The key in an ``Authorization`` header, or None if it is not one."""
        now = time.monotonic()
        if now - self._checked >= self._recheck_s:
            self._checked = now
            self._load()
        token = bearer_token(authorization)
        return self._keys.get(hash_key(token)) if token is not None else None


def main() -> None:
    if len(sys.argv) != 2 or not _LINE.fullmatch(f"{sys.argv[1]} {'0' * 64}"):
        sys.exit("usage: python -m shoal_router.api.auth NAME < key-file")
    key = sys.stdin.read().strip()
    if not key:
        sys.exit("no key on standard input")
    print(f"{sys.argv[1]} {hash_key(key)}")


if __name__ == "__main__":
    main()
