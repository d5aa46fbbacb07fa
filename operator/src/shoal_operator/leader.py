"""Leader election on a ``coordination.k8s.io/v1`` Lease: several operator replicas run, one acts.

It follows client-go's ``leaderelection`` package. Every replica tries to take the Lease
``shoal-operator`` in the operator's own namespace. The one holding it (``holderIdentity``: its
pod name) renews ``renewTime`` every ``renew_s`` (5 s); the others take it over only once it has
not changed for ``leaseDurationSeconds`` (15 s) by their own clock: they time the record from
the moment they saw it change, never from the timestamps written in it, so clocks that disagree
between nodes do not matter. Every write is an update carrying the ``resourceVersion`` it read,
so of two replicas racing for an expired Lease the API server lets one win and refuses the other
(409 Conflict); the loser stays a standby.

A leader that has not renewed within ``renew_deadline_s`` (10 s, before anyone else may take the
Lease) steps down: ``step_down`` ends the process, so nothing it was doing goes on beside a new
leader, and Kubernetes restarts the container as a standby. A leader stopped on purpose (SIGTERM,
a rollout) releases the Lease (no holder, one second left), so a standby takes over at once
rather than after a whole lease duration.

``Election`` runs the elector in a thread with its own event loop, so renewals never wait behind
the operator's own work and kopf keeps the main thread (and its signal handling). The thread also
serves the pod's probes: readiness while the replica reaches the API server (the leader, or a
standby able to take over), and liveness, which for the leader also means that kopf's event loop
still beats (``Election.beat``): a leader whose operator hangs would otherwise hold the Lease
forever, renewing from this thread while nothing reconciles.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import kopf
from aiohttp import web

logger = logging.getLogger(__name__)

Manifest = dict[str, Any]
LEASE_NAME = "shoal-operator"
"""The Lease the replicas compete for, in the operator's own namespace."""
READINESS_PATH = "/readyz"
"""Where the probes' server answers readiness (liveness is at the ``--liveness`` URL's path)."""


@dataclass(frozen=True)
class Timing:
    """How long a Lease lasts and how often it is renewed (client-go's defaults, renewing less often)."""

    lease_s: int = 15
    """``leaseDurationSeconds``: a Lease not renewed for this long may be taken over."""
    renew_deadline_s: float = 10.0
    """A leader that has not renewed for this long steps down (shorter than ``lease_s``)."""
    renew_s: float = 5.0
    """A leader renews this often."""
    retry_s: float = 2.0
    """A standby tries this often (plus up to a fifth, so replicas do not move in step), and a
    failed renewal is retried this often until the deadline."""

    def __post_init__(self) -> None:
        if not 0 < self.retry_s <= self.renew_s < self.renew_deadline_s < self.lease_s:
            raise ValueError("want 0 < retry_s <= renew_s < renew_deadline_s < lease_s")


class LeaseError(Exception):
    """The API server refused a read or write of the Lease."""


class LeaseConflictError(LeaseError):
    """Another replica wrote the Lease first: its ``resourceVersion`` moved, or it was created."""


FAILURES = (LeaseError, aiohttp.ClientError, TimeoutError, ValueError)
"""What a round of the election can fail with (the API unreachable, refusing, or garbled)."""


def default_login() -> kopf.ConnectionInfo:
    """The credentials kopf itself would use: the pod's service account, else the kubeconfig."""
    settings = kopf.OperatorSettings()
    info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(settings=settings)
    if info is None:
        raise kopf.LoginError("no service account token and no kubeconfig: cannot reach the API server")
    return info


class LeaseClient:
    """Read, create and update one Lease, with kopf's credentials (no Kubernetes client library).

    A 401 drops the connection, so the next call logs in again: a service account token is
    rotated on disk while the pod runs."""

    def __init__(
        self,
        namespace: str,
        name: str = LEASE_NAME,
        login: Callable[[], kopf.ConnectionInfo] = default_login,
        timeout_s: float = 5.0,
    ) -> None:
        self.namespace, self.name = namespace, name
        self._login = login
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._base = ""
        self._ssl: Any = True

    def _connect(self) -> aiohttp.ClientSession:
        if self._session is None:
            info = self._login()
            self._base = info.server.rstrip("/")
            self._ssl = info.as_ssl_context() if self._base.startswith("https") else True
            headers = {"Accept": "application/json", **info.as_http_headers()}
            self._session = aiohttp.ClientSession(headers=headers, timeout=self._timeout)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _path(self, named: bool = True) -> str:
        collection = f"/apis/coordination.k8s.io/v1/namespaces/{self.namespace}/leases"
        return f"{collection}/{self.name}" if named else collection

    async def _call(self, method: str, path: str, body: Manifest | None = None) -> Manifest | None:
        session = self._connect()
        async with session.request(method, self._base + path, json=body, ssl=self._ssl) as response:
            text = await response.text()
            status = response.status
        payload = json.loads(text) if text else {}
        if status == 401:
            await self.close()
        if status == 404 and method == "GET":
            return None
        if status >= 400:
            message = payload.get("message", text) if isinstance(payload, dict) else text
            error = LeaseConflictError if status == 409 else LeaseError
            raise error(f"{method} {path}: {status} {message}")
        result: Manifest = payload
        return result

    async def get(self) -> Manifest | None:
        return await self._call("GET", self._path())

    async def create(self, spec: Manifest) -> Manifest:
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": spec,
        }
        return await self._call("POST", self._path(named=False), body) or {}

    async def update(self, lease: Manifest) -> Manifest:
        """Replace the Lease; ``lease`` carries the ``metadata.resourceVersion`` it was read at, and
        the API server refuses the write (``LeaseConflictError``) when that is no longer current."""
        return await self._call("PUT", self._path(), lease) or {}


def _micro_time() -> str:
    """Now as a Kubernetes ``MicroTime``."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Elector:
    """One replica's side of the election (client-go's ``tryAcquireOrRenew`` and its loops)."""

    def __init__(
        self,
        client: LeaseClient,
        identity: str,
        timing: Timing | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.identity = identity
        self.timing = timing or Timing()
        self._clock = clock
        self.leading = False
        self.holder = ""
        """Who held the Lease when it was last read."""
        self._observed: Manifest | None = None
        self._observed_at = 0.0
        self._contacted_at: float | None = None
        self._written_at = 0.0
        """When the last round that wrote the Lease began (the leader's deadline counts from it)."""

    def ready(self) -> bool:
        """Whether the API server answered within one lease duration (able to lead or take over)."""
        contacted = self._contacted_at
        return contacted is not None and self._clock() - contacted <= self.timing.lease_s

    def _observe(self, spec: Manifest, now: float) -> None:
        if spec != self._observed:
            self._observed, self._observed_at = spec, now
        self.holder = spec.get("holderIdentity") or ""
        self._contacted_at = now

    def _held_by_another(self, spec: Manifest, now: float) -> bool:
        holder = spec.get("holderIdentity") or ""
        duration = spec.get("leaseDurationSeconds") or self.timing.lease_s
        return bool(holder) and holder != self.identity and now < self._observed_at + duration

    def _spec(self, previous: Manifest | None) -> Manifest:
        now = _micro_time()
        previous = previous or {}
        mine = previous.get("holderIdentity") == self.identity
        transitions = int(previous.get("leaseTransitions") or 0)
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": self.timing.lease_s,
            "acquireTime": previous.get("acquireTime", now) if mine else now,
            "renewTime": now,
            "leaseTransitions": transitions if mine or not previous else transitions + 1,
        }

    async def try_acquire_or_renew(self) -> bool:
        """One round: take the Lease if it is free or expired, renew it if it is ours.

        Returns whether this replica holds it now. Fails (``FAILURES``) when the API does."""
        now = self._clock()
        lease = await self.client.get()
        try:
            if lease is None:
                written = await self.client.create(self._spec(None))
            else:
                spec = lease.get("spec") or {}
                self._observe(spec, now)
                if self._held_by_another(spec, now):
                    return False
                written = await self.client.update({**lease, "spec": self._spec(spec)})
        except LeaseConflictError:
            self._contacted_at = now
            return False
        self._observe(written.get("spec") or {}, now)
        self._written_at = now
        self.leading = True
        return True

    async def _attempt(self, timeout_s: float) -> bool:
        try:
            # ``asyncio.timeout``, not ``wait_for``: on Python 3.11 a ``wait_for`` cancelled from
            # outside as its call completes returns the result and loses the cancellation, and a
            # cancelled election (the operator stopping) would then renew on for ever.
            async with asyncio.timeout(timeout_s):
                return await self.try_acquire_or_renew()
        except FAILURES as exc:
            logger.warning(f"lease {self.client.namespace}/{self.client.name}: {exc or type(exc).__name__}")
            return False

    async def acquire(self) -> None:
        """Return once this replica leads, trying every ``retry_s``."""
        reported = ""
        while not await self._attempt(self.timing.renew_deadline_s):
            if self.holder and self.holder != reported:
                logger.info(f"{self.holder} leads; {self.identity} stands by")
                reported = self.holder
            await asyncio.sleep(self.timing.retry_s * random.uniform(1.0, 1.2))
        logger.info(f"{self.identity} leads (lease {self.client.namespace}/{self.client.name})")

    async def keep_leading(self) -> str:
        """Renew every ``renew_s`` while this replica leads; return why it lost the lead: no renewal
        within ``renew_deadline_s`` of the last one, or the Lease names another holder."""
        while True:
            await asyncio.sleep(self.timing.renew_s)
            # Counted from the start of the last round that wrote, not its answer: a slow answer
            # then brings the step-down earlier, never later than the others' takeover.
            deadline = self._written_at + self.timing.renew_deadline_s
            while (left := deadline - self._clock()) > 0:
                if await self._attempt(left):
                    break
                if self.holder not in ("", self.identity):
                    self.leading = False
                    return f"{self.holder} holds the lease now"
                await asyncio.sleep(min(self.timing.retry_s, max(deadline - self._clock(), 0.0)))
            else:
                self.leading = False
                return f"could not renew the lease within {self.timing.renew_deadline_s:g} s"

    async def release(self) -> None:
        """Hand the Lease back (no holder, one second left), so a standby takes over at once."""
        if not self.leading:
            return
        self.leading = False
        try:
            lease = await self.client.get()
            spec = (lease or {}).get("spec") or {}
            if lease is None or spec.get("holderIdentity") != self.identity:
                return
            now = _micro_time()
            released = {**spec, "holderIdentity": "", "leaseDurationSeconds": 1}
            await self.client.update({**lease, "spec": {**released, "acquireTime": now, "renewTime": now}})
            logger.info(f"{self.identity} released the lease")
        except FAILURES as exc:
            logger.warning(f"could not release the lease (a standby takes it when it expires): {exc}")


def step_down(reason: str) -> None:
    """Leave at once: end the process (status 1), so nothing this replica was doing goes on beside
    the next leader, not even kopf's graceful shutdown; Kubernetes restarts the container, which
    comes back as a standby."""
    logger.critical(f"stepping down: {reason}")
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(1)


async def serve_probes(url: str, ready: Callable[[], bool], alive: Callable[[], bool]) -> web.AppRunner:
    """Liveness at ``url`` (``http://HOST:PORT/PATH``) and readiness at ``READINESS_PATH`` there."""
    parts = urlsplit(url)

    async def liveness(_: web.Request) -> web.Response:
        if alive():
            return web.Response(text="alive\n")
        return web.Response(status=503, text="leading, but the operator's event loop has stalled\n")

    async def readiness(_: web.Request) -> web.Response:
        if ready():
            return web.Response(text="ready\n")
        return web.Response(status=503, text="the API server has not answered lately\n")

    app = web.Application()
    app.router.add_get(parts.path or "/healthz", liveness)
    app.router.add_get(READINESS_PATH, readiness)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, parts.hostname or "0.0.0.0", parts.port or 8080).start()
    return runner


class Election:
    """The elector in a thread of its own, with the pod's probes.

    ``start``; run the operator once ``wait_until_leading`` returns, calling ``beat`` from its
    event loop every few seconds; ``stop`` afterwards (it releases the Lease). When the lead is
    lost, ``on_lost`` is called from the election's thread with the reason (by default
    ``step_down``, which ends the process). A leader that has not beaten for ``stall_s`` (since
    it began to lead, or since its last beat) fails its liveness probe."""

    def __init__(
        self,
        elector: Elector,
        probes_url: str | None = None,
        on_lost: Callable[[str], None] = step_down,
        stall_s: float = 60.0,
    ) -> None:
        self.elector = elector
        self._probes_url = probes_url
        self._on_lost = on_lost
        self._stall_s = stall_s
        self._beaten_at: float | None = None
        self._leading_at: float | None = None
        self._leading = threading.Event()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="leader-election", daemon=True)

    def start(self) -> None:
        """Start electing (and serving the probes); raises what kept the probes from starting."""
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error

    def wait_until_leading(self, timeout_s: float | None = None) -> bool:
        return self._leading.wait(timeout_s)

    def beat(self) -> None:
        """The operator's event loop runs (called from it; a float written whole, no lock)."""
        self._beaten_at = time.monotonic()

    def alive(self) -> bool:
        """A standby is alive while this thread answers; the leader while the operator beats."""
        if self._leading_at is None:
            return True
        return time.monotonic() - max(self._leading_at, self._beaten_at or 0.0) <= self._stall_s

    def stop(self, timeout_s: float = 10.0) -> None:
        """Release the Lease when this replica leads, and end the thread."""
        loop, stopping = self._loop, self._stopping
        if loop is not None and stopping is not None and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the thread ended (its loop closed) meanwhile
                loop.call_soon_threadsafe(stopping.set)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop, self._stopping = asyncio.get_running_loop(), asyncio.Event()
        probes = None
        try:
            if self._probes_url:
                probes = await serve_probes(self._probes_url, self.elector.ready, self.alive)
        except OSError as exc:
            self._error = exc
        self._started.set()
        try:
            if self._error is None:
                await self._until_stopped_or_lost(self._stopping)
        finally:
            if probes is not None:
                await probes.cleanup()
            await self.elector.client.close()

    async def _until_stopped_or_lost(self, stopping: asyncio.Event) -> None:
        lead = asyncio.create_task(self._lead())
        stop = asyncio.create_task(stopping.wait())
        await asyncio.wait({lead, stop}, return_when=asyncio.FIRST_COMPLETED)
        if lead.done():
            stop.cancel()
            error = lead.exception()
            self._on_lost(f"the election failed: {error!r}" if error else lead.result())
            return
        lead.cancel()
        await asyncio.gather(lead, return_exceptions=True)
        await self.elector.release()

    async def _lead(self) -> str:
        await self.elector.acquire()
        self._leading_at = time.monotonic()
        self._leading.set()
        return await self.elector.keep_leading()
