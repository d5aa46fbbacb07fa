"""Leader election on a Lease (``shoal_operator.leader``) against kmock, an in-memory Kubernetes
API served over HTTP, with lease durations of a second.

kmock 0.8 serves no PUT and keeps no ``resourceVersion``, both of which the election rests on, so
``LeaseAPI`` below adds them for Leases, as the API server behaves: a create sets
``resourceVersion``, each update must carry the current one (else 409 Conflict) and moves it on.
The optimistic concurrency checked here is therefore this fake's, written to the API server's
documented rule, not the API server's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import kmock as kmock_lib
import kopf
import pytest
from aiohttp import web

from shoal_operator import leader, main
from shoal_operator.leader import Election, Elector, LeaseClient, LeaseConflictError, Timing
from tests.integration.support import until

WAIT_S = 10.0
"""How long a test waits for what it expects before it fails."""

NS = "shoal-system"
LEASES = "coordination.k8s.io/v1/leases"
FAST = Timing(lease_s=1, renew_deadline_s=0.6, renew_s=0.2, retry_s=0.1)
_LEASE_PATH = re.compile(r"^/apis/coordination\.k8s\.io/v1/namespaces/([^/]+)/leases/([^/]+)$")


class LeaseAPI(kmock_lib.KubernetesEmulator):
    """kmock with Lease updates as the API server makes them (see the module docstring), and a
    way to cut one replica off: its renewals (updates naming it the holder) fail with 503."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.version = 0
        self.refused: set[str] = set()

    async def _handle(self, request: kmock_lib.Request) -> web.StreamResponse:
        found = _LEASE_PATH.match(request.url.path)
        if request.method == kmock_lib.method.PUT and found:
            return self._update(found.group(1), found.group(2), request.data)
        if request.action == kmock_lib.action.CREATE and request.url.path.endswith("/leases"):
            self.version += 1
            request.data.setdefault("metadata", {})["resourceVersion"] = str(self.version)
        return await super()._handle(request)

    def _update(self, namespace: str, name: str, body: dict[str, Any]) -> web.StreamResponse:
        try:
            stored = self.objects[LEASES, namespace, name]
        except KeyError:  # its __contains__ takes the resource parsed, its [] the resource as text
            stored = None
        if stored is None or stored.deleted:
            return _status(404, "NotFound", f"leases {name!r} not found")
        if (body.get("spec") or {}).get("holderIdentity") in self.refused:
            return _status(503, "ServiceUnavailable", "cut off")
        current = stored["metadata"].get("resourceVersion")
        if body.get("metadata", {}).get("resourceVersion") != current:
            return _status(409, "Conflict", "the object has been modified; please apply your changes")
        self.version += 1
        written = {**body, "metadata": {**body["metadata"], "resourceVersion": str(self.version)}}
        stored.create(written)  # a new version in the object's history
        return web.json_response(written)


def _status(code: int, reason: str, message: str) -> web.Response:
    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code, "reason": reason}
    return web.json_response({**body, "message": message}, status=code)


@pytest.fixture
async def api(kmock: kmock_lib.KubernetesEmulator) -> kmock_lib.KubernetesEmulator:
    kmock.resources[LEASES] = kmock_lib.ResourceInfo(
        kind="Lease", namespaced=True, verbs={"get", "create", "update"}
    )
    return kmock


pytestmark = pytest.mark.kmock(cls=LeaseAPI)


@pytest.fixture
async def electors(api: LeaseAPI) -> AsyncIterator[Callable[[str], Elector]]:
    made: list[Elector] = []

    def make(identity: str) -> Elector:
        info = kopf.ConnectionInfo(server=str(api.url).rstrip("/"), insecure=True)
        made.append(Elector(LeaseClient(NS, login=lambda: info), identity, timing=FAST))
        return made[-1]

    yield make
    for each in made:
        await each.client.close()


def _lease(api: LeaseAPI) -> dict[str, Any]:
    return dict(api.objects[LEASES, NS, leader.LEASE_NAME].raw)


def _holders(api: LeaseAPI) -> list[str]:
    """Every holder the Lease named, version by version, repeats collapsed."""
    names: list[str] = []
    for version in api.objects[LEASES, NS, leader.LEASE_NAME].history:
        holder = (version or {}).get("spec", {}).get("holderIdentity", "")
        if not names or names[-1] != holder:
            names.append(holder)
    return names


@contextlib.asynccontextmanager
async def _leading(elector: Elector) -> AsyncIterator[asyncio.Task[str]]:
    """The elector acquiring, then renewing, as a task (cancelled on the way out)."""

    async def run() -> str:
        await elector.acquire()
        return await elector.keep_leading()

    task = asyncio.create_task(run())
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_of_two_electors_exactly_one_leads(api: LeaseAPI, electors: Callable[[str], Elector]) -> None:
    a, b = electors("operator-a"), electors("operator-b")
    async with _leading(a) as run_a, _leading(b) as run_b:
        await until(lambda: a.leading or b.leading, WAIT_S, "one of them leads")
        first = _lease(api)
        # Three lease durations: the leader keeps renewing and the other never takes over.
        await asyncio.sleep(3 * FAST.lease_s)
        assert [a.leading, b.leading].count(True) == 1
        assert not run_a.done() and not run_b.done()
    winner = "operator-a" if a.leading else "operator-b"
    lease = _lease(api)
    assert lease["spec"]["holderIdentity"] == winner and lease["spec"]["leaseDurationSeconds"] == 1
    assert lease["spec"]["renewTime"] > first["spec"]["renewTime"]  # renewed
    assert lease["spec"]["acquireTime"] == first["spec"]["acquireTime"]
    assert lease["spec"]["leaseTransitions"] == 0
    assert _holders(api) == [winner]


async def test_a_leader_cut_off_steps_down_before_the_standby_takes_over(
    api: LeaseAPI, electors: Callable[[str], Elector]
) -> None:
    a, b = electors("operator-a"), electors("operator-b")
    async with _leading(a) as run_a:
        await until(lambda: a.leading, WAIT_S, "a leads")
        async with _leading(b):
            await asyncio.sleep(2 * FAST.lease_s)
            assert not b.leading
            api.refused.add("operator-a")  # a's renewals fail from now on, as in a partition
            cut = time.monotonic()
            reason = await asyncio.wait_for(asyncio.shield(run_a), 5)
            stepped_down = time.monotonic()
            await until(lambda: b.leading, WAIT_S, "b takes over")
            took_over = time.monotonic()
    assert "could not renew" in reason and not a.leading
    # a gives up within its renew deadline of its last renewal, before the lease runs out, and
    # b waits for the whole lease duration from the last change it saw.
    assert stepped_down - cut <= FAST.renew_deadline_s + 0.3
    assert took_over > stepped_down
    assert took_over - cut >= FAST.lease_s - FAST.renew_s
    lease = _lease(api)
    assert lease["spec"]["holderIdentity"] == "operator-b" and lease["spec"]["leaseTransitions"] == 1
    assert _holders(api) == ["operator-a", "operator-b"]


async def test_the_standby_takes_over_when_the_leader_stops_renewing(
    api: LeaseAPI, electors: Callable[[str], Elector]
) -> None:
    a, b = electors("operator-a"), electors("operator-b")
    assert await a.try_acquire_or_renew()  # leads once, then renews nothing (a hung process)
    acquired = time.monotonic()
    async with _leading(b):
        await until(lambda: b.leading, WAIT_S, "b takes over")
        assert time.monotonic() - acquired >= FAST.lease_s
        # The old leader, were it to wake, sees it lost the lease and does not take it back.
        assert not await a.try_acquire_or_renew()
        assert a.holder == "operator-b"
    assert _holders(api) == ["operator-a", "operator-b"]


async def test_an_update_with_a_stale_resource_version_is_refused(
    api: LeaseAPI, electors: Callable[[str], Elector]
) -> None:
    a = electors("operator-a")
    assert await a.try_acquire_or_renew()
    stale = await a.client.get()
    assert stale is not None
    assert await a.try_acquire_or_renew()  # renewed: the resourceVersion moved on
    current = await a.client.get()
    assert current is not None
    assert current["metadata"]["resourceVersion"] != stale["metadata"]["resourceVersion"]
    taken = {**stale, "spec": {**stale["spec"], "holderIdentity": "operator-b"}}
    with pytest.raises(LeaseConflictError):
        await a.client.update(taken)
    assert _lease(api)["spec"]["holderIdentity"] == "operator-a"


async def test_two_standbys_racing_for_an_expired_lease_one_wins(
    api: LeaseAPI, electors: Callable[[str], Elector]
) -> None:
    a, b, c = electors("operator-a"), electors("operator-b"), electors("operator-c")
    assert await a.try_acquire_or_renew()
    assert not await b.try_acquire_or_renew() and not await c.try_acquire_or_renew()  # a holds it
    await asyncio.sleep(FAST.lease_s + 0.1)  # a never renews: expired for both
    won = await asyncio.gather(b.try_acquire_or_renew(), c.try_acquire_or_renew())
    assert won.count(True) == 1
    assert _holders(api) == ["operator-a", "operator-b" if won[0] else "operator-c"]


async def test_a_released_lease_is_taken_at_once(api: LeaseAPI, electors: Callable[[str], Elector]) -> None:
    a, b = electors("operator-a"), electors("operator-b")
    assert await a.try_acquire_or_renew()
    assert not await b.try_acquire_or_renew()
    await a.release()
    assert not a.leading and _lease(api)["spec"]["holderIdentity"] == ""
    assert await b.try_acquire_or_renew()  # no waiting out the lease
    assert _holders(api) == ["operator-a", "", "operator-b"]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def _get(url: str) -> int:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status


async def test_election_thread_serves_probes_steps_down_and_releases(
    api: LeaseAPI, electors: Callable[[str], Elector]
) -> None:
    port = _free_port()
    lost: list[str] = []
    probes = f"http://127.0.0.1:{port}/healthz"
    election = Election(electors("operator-a"), probes, on_lost=lost.append, stall_s=0.5)
    assert election.alive()
    election.start()
    assert await asyncio.to_thread(election.wait_until_leading, 10)
    assert await _get(f"http://127.0.0.1:{port}/healthz") == 200
    assert await _get(f"http://127.0.0.1:{port}/readyz") == 200
    # Leading, the operator's loop must beat: a leader that stalls fails its liveness probe (and is
    # restarted) rather than hold the Lease doing nothing.
    await asyncio.sleep(0.7)
    assert await _get(f"http://127.0.0.1:{port}/healthz") == 503
    election.beat()
    assert await _get(f"http://127.0.0.1:{port}/healthz") == 200
    api.refused.add("operator-a")
    await until(lambda: bool(lost), WAIT_S, "the leader steps down")
    assert "could not renew" in lost[0]
    await asyncio.to_thread(election.stop)

    # A second one is stopped while leading: it hands the Lease back.
    api.refused.clear()
    second = Election(electors("operator-b"))
    second.start()
    assert await asyncio.to_thread(second.wait_until_leading, 10)
    await asyncio.to_thread(second.stop)
    assert _lease(api)["spec"]["holderIdentity"] == ""


async def test_a_standby_is_ready_and_not_leading(api: LeaseAPI, electors: Callable[[str], Elector]) -> None:
    a, b = electors("operator-a"), electors("operator-b")
    port = _free_port()
    election = Election(b, f"http://127.0.0.1:{port}/healthz", on_lost=lambda _: None)
    async with _leading(a):
        await until(lambda: a.leading, WAIT_S, "a leads")
        assert not b.ready()
        election.start()
        try:
            await until(b.ready, WAIT_S, "the standby has reached the API server")
            assert await _get(f"http://127.0.0.1:{port}/readyz") == 200
            await asyncio.sleep(2 * FAST.lease_s)
            assert not election.wait_until_leading(0) and a.leading
        finally:
            await asyncio.to_thread(election.stop)


def test_timing_is_checked() -> None:
    with pytest.raises(ValueError, match="renew_deadline_s"):
        Timing(lease_s=10, renew_deadline_s=15)


class _FakeElection:
    made: list[_FakeElection] = []

    def __init__(self, elector: Elector, probes_url: str | None = None) -> None:
        self.elector, self.probes_url, self.calls = elector, probes_url, ["made"]
        _FakeElection.made.append(self)

    def start(self) -> None:
        self.calls.append("start")

    def wait_until_leading(self) -> bool:
        self.calls.append("leading")
        return True

    def stop(self) -> None:
        self.calls.append("stop")

    def beat(self) -> None:
        pass


def test_main_runs_kopf_only_once_elected_and_standalone_skips_the_election(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runs: list[dict[str, Any]] = []
    _FakeElection.made.clear()
    monkeypatch.setattr(main.kopf, "run", lambda **kwargs: runs.append(kwargs))
    monkeypatch.setattr(main.kopf, "configure", lambda **_: None)
    monkeypatch.setattr(main, "register", lambda *_, **__: None)
    monkeypatch.setattr(main.kopf, "get_default_registry", kopf.OperatorRegistry)
    monkeypatch.setattr(main, "Election", _FakeElection)
    monkeypatch.setenv("POD_NAME", "shoal-operator-7c9f-abcde")
    monkeypatch.setenv("POD_NAMESPACE", "shoal-system")

    main.main(["-n", "serving"])
    (election,) = _FakeElection.made
    assert election.calls == ["made", "start", "leading", "stop"]
    assert election.elector.identity == "shoal-operator-7c9f-abcde"
    assert election.elector.client.namespace == "shoal-system"
    assert election.probes_url == "http://0.0.0.0:8080/healthz"
    (elected,) = runs
    # Only the leader runs kopf, without kopf's own peering; the probes are the election's.
    assert elected["standalone"] is True and elected["namespaces"] == ["serving"]
    assert "liveness_endpoint" not in elected

    main.main(["-n", "serving", "--standalone"])
    assert len(_FakeElection.made) == 1
    assert runs[1]["standalone"] is True and runs[1]["liveness_endpoint"] == "http://0.0.0.0:8080/healthz"


async def test_the_operator_beats_while_kopf_runs(api: LeaseAPI) -> None:
    registry = kopf.OperatorRegistry()
    info = kopf.ConnectionInfo(server=str(api.url).rstrip("/"), insecure=True)
    kopf.on.login(registry=registry)(lambda **_: info)
    beats: list[float] = []
    main.beat_while_running(registry, lambda: beats.append(time.monotonic()), every_s=0.1)
    stop, ready = threading.Event(), threading.Event()
    run = kopf.operator(registry=registry, namespaces=[NS], standalone=True, stop_flag=stop, ready_flag=ready)
    thread = threading.Thread(target=asyncio.run, args=(run,), name="kopf", daemon=True)
    thread.start()
    try:
        assert await asyncio.to_thread(ready.wait, 20), "the operator did not start"
        await until(lambda: len(beats) >= 3, WAIT_S, "three beats from kopf's loop")
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 20)
    assert not thread.is_alive()
    after = len(beats)
    await asyncio.sleep(0.3)
    assert len(beats) == after  # the beating stops with the operator


class _GatedClient:
    """A Lease client at the operator's own seam: ``get`` answers (no Lease yet) once ``gate``
    is set; ``create`` writes at once."""

    namespace, name = NS, leader.LEASE_NAME

    def __init__(self) -> None:
        self.gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def get(self) -> dict[str, Any] | None:
        await self.gate
        return None

    async def create(self, spec: dict[str, Any]) -> dict[str, Any]:
        return {"metadata": {"resourceVersion": "1"}, "spec": spec}


async def test_a_round_cancelled_as_its_call_completes_stays_cancelled() -> None:
    """The election stops when cancelled, even when the cancellation meets a round's answer in
    the same turn of the loop (Python 3.11's ``wait_for`` returned the answer then and lost the
    cancellation, and a stopping operator's election renewed on for ever)."""
    client = _GatedClient()
    elector = Elector(client, "operator-a", timing=FAST)  # type: ignore[arg-type]
    attempt = asyncio.create_task(elector._attempt(5.0))
    await asyncio.sleep(0)  # the round waits on its call
    client.gate.set_result(None)
    attempt.cancel()  # in the same turn as the answer
    with pytest.raises(asyncio.CancelledError):
        await attempt
