"""The operator against kmock, an in-memory Kubernetes API served over HTTP (no API server can
run on these machines): the reconciler through its real HTTP client, and the kopf handlers
running in-process with kopf's real watch streams.

kmock stores objects and serves list, watch, get, create, merge-patch and delete; server-side
apply is added by ``ssa.ApplyingEmulator`` (the fields one manager applied and later leaves out
are removed). It does not run Kubernetes' controllers, so nothing fills a Deployment's status, makes pods or
garbage-collects owned objects unless a test does it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import threading
from collections.abc import AsyncIterator, Awaitable
from typing import Any, NamedTuple

import aiohttp
import kmock as kmock_lib
import kopf
import pytest

from shoal_operator.children import Cluster
from shoal_operator.drain import Drained
from shoal_operator.handlers import CHILD_RESOURCES, register
from shoal_operator.kube import PLURALS, Kube
from shoal_operator.reconcile import Reconciler
from shoal_operator.scale import DELETION_COST_ANNOTATION, EngineLoad, Leaving
from shoal_operator.spec import GROUP, KIND, PLURAL, VERSION
from shoal_protos.tls import FleetTls
from tests.integration.support import until
from tests.unit.ssa import ApplyingEmulator

WAIT_S = 30.0
"""How long a test waits for what it expects before it fails."""

pytestmark = pytest.mark.kmock(cls=ApplyingEmulator)

NS, NAME, UID = "serving", "smol", "7d0c6a52-0b5e-4b1b-9a57-4c0e1f7b2c11"
CLUSTERS = f"{GROUP}/{VERSION}/{PLURAL}"
ENGINES = "apps/v1/deployments"
STATEFULSETS = "apps/v1/statefulsets"
PODS = "v1/pods"
_ALL = {"get", "list", "watch", "create", "patch", "delete"}
_CHILD_PLURALS = {plural for _, plural in CHILD_RESOURCES} | {"servicemonitors", "secrets"}


def _cluster(**engine: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        # kmock keeps what it is given: uid, generation and resourceVersion (kopf's patches test
        # it) are set here as the API server would, and never move.
        "metadata": {"name": NAME, "namespace": NS, "uid": UID, "generation": 1, "resourceVersion": "1"},
        "spec": {
            "model": {"source": "HuggingFaceTB/SmolLM2-135M-Instruct", "servedName": "smol"},
            "engine": {"replicas": 2, **engine},
        },
    }


def _declare(api: kmock_lib.KubernetesEmulator, service_monitors: bool = False) -> None:
    """What the API server would discover: the CRD and the children's kinds."""
    for (api_version, kind), plural in PLURALS.items():
        if plural != "servicemonitors" or service_monitors:
            api.resources[f"{api_version}/{plural}"] = kmock_lib.ResourceInfo(
                kind=kind,
                namespaced=True,
                verbs=_ALL,
                subresources={"status", "scale"} if plural == PLURAL else set(),
            )
    api.resources["v1/events"] = kmock_lib.ResourceInfo(kind="Event", namespaced=True, verbs={"create"})
    # kopf lists namespaces and watches CRDs to follow what the cluster serves.
    api.resources["v1/namespaces"] = kmock_lib.ResourceInfo(kind="Namespace", namespaced=False, verbs=_ALL)
    api.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = kmock_lib.ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False, verbs=_ALL
    )
    api.objects["v1/namespaces", None, NS] = {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": NS},
    }


def _info(api: kmock_lib.KubernetesEmulator) -> kopf.ConnectionInfo:
    return kopf.ConnectionInfo(server=str(api.url).rstrip("/"), insecure=True)


def _requests(api: kmock_lib.KubernetesEmulator) -> list[Any]:
    """Every request the API served so far, in order (iterating kmock's handler yields them)."""
    return list(api)


def _writes(api: kmock_lib.KubernetesEmulator, since: int = 0) -> list[str]:
    return [
        f"{r.method.value} {r.url.path}"
        for r in _requests(api)[since:]
        if r.method.value in ("POST", "PATCH", "PUT", "DELETE")
    ]


def _children(api: kmock_lib.KubernetesEmulator) -> dict[str, dict[str, Any]]:
    """Live children by ``Kind/name``."""
    found = {}
    for (resource, _ns, name), obj in api.objects.items():
        if resource.plural in _CHILD_PLURALS and not obj.deleted:
            found[f"{obj['kind']}/{name}"] = dict(obj.raw)
    return found


@pytest.fixture
async def api(kmock: kmock_lib.KubernetesEmulator) -> kmock_lib.KubernetesEmulator:
    _declare(kmock)
    return kmock


@pytest.fixture
async def reconciler(api: kmock_lib.KubernetesEmulator) -> AsyncIterator[Reconciler]:
    kube = Kube(_info(api))
    yield Reconciler(kube)
    await kube.close()


EXPECTED_CHILDREN = {
    "ConfigMap/smol-config",
    "Deployment/smol-engine", "Service/smol-engine",
    "PodDisruptionBudget/smol-engine", "NetworkPolicy/smol-engine",
    "Deployment/smol-router", "Service/smol-router", "PodDisruptionBudget/smol-router",
    "Deployment/smol-tokenizer", "Service/smol-tokenizer", "NetworkPolicy/smol-tokenizer",
    "Secret/smol-redis-auth", "StatefulSet/smol-redis", "Service/smol-redis", "NetworkPolicy/smol-redis",
    "Secret/smol-fleet-tls",
}  # fmt: skip


async def test_create_makes_every_child_owned_by_the_cluster(
    api: kmock_lib.KubernetesEmulator, reconciler: Reconciler
) -> None:
    api.objects[CLUSTERS, NS, NAME] = _cluster()
    outcome = await reconciler.reconcile(NS, NAME)
    children = _children(api)
    assert set(children) == EXPECTED_CHILDREN
    assert sorted(outcome.created) == sorted(EXPECTED_CHILDREN) and outcome.patched == []
    for child in children.values():
        (owner,) = child["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (KIND, NAME, UID, True)
        assert child["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "shoal-operator"
    assert children["Deployment/smol-engine"]["spec"]["replicas"] == 2
    status = api.objects[CLUSTERS, NS, NAME]["status"]
    assert status["observedGeneration"] == 1 and status["ready"] == "False"
    assert {c["type"]: c["reason"] for c in status["conditions"]}["EnginesReady"] == "Starting"


async def test_a_deleted_clusters_lock_goes_with_it(
    api: kmock_lib.KubernetesEmulator, reconciler: Reconciler
) -> None:
    """One reconcile at a time per cluster, through a lock per cluster: clusters made and
    deleted by the hundred leave no lock behind; a living cluster keeps its own."""
    api.objects[CLUSTERS, NS, NAME] = _cluster()
    await reconciler.reconcile(NS, NAME)
    for i in range(100):
        outcome = await reconciler.reconcile(NS, f"gone-{i}")  # deleted (or never made)
        assert not outcome.found
    assert list(reconciler._locks) == [(NS, NAME)]


async def test_a_reconcile_that_changes_nothing_writes_nothing(
    api: kmock_lib.KubernetesEmulator, reconciler: Reconciler
) -> None:
    api.objects[CLUSTERS, NS, NAME] = _cluster()
    await reconciler.reconcile(NS, NAME)
    password = _children(api)["Secret/smol-redis-auth"]["data"]["password"]
    fleet_tls = _children(api)["Secret/smol-fleet-tls"]["data"]
    before = len(_requests(api))
    outcome = await reconciler.reconcile(NS, NAME)
    assert outcome.writes == 0
    assert _writes(api, before) == []
    # The managed Redis's generated password and the fleet's TLS files stay what they were (the
    # pods read them at start).
    assert _children(api)["Secret/smol-redis-auth"]["data"]["password"] == password
    assert _children(api)["Secret/smol-fleet-tls"]["data"] == fleet_tls


async def test_replica_change_patches_only_the_engine_deployment(
    api: kmock_lib.KubernetesEmulator, reconciler: Reconciler
) -> None:
    api.objects[CLUSTERS, NS, NAME] = _cluster()
    await reconciler.reconcile(NS, NAME)
    api.objects[CLUSTERS, NS, NAME].patch(
        {"spec": {"engine": {"replicas": 4}}, "metadata": {"generation": 2}}
    )
    before = len(_requests(api))
    outcome = await reconciler.reconcile(NS, NAME)
    assert outcome.patched == ["Deployment/smol-engine"] and outcome.created == []
    assert _children(api)["Deployment/smol-engine"]["spec"]["replicas"] == 4
    assert _writes(api, before) == [
        f"PATCH /apis/apps/v1/namespaces/{NS}/deployments/smol-engine",
        f"PATCH /apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}/{NAME}/status",  # observedGeneration 2
    ]


async def test_deleted_and_edited_children_are_put_back(
    api: kmock_lib.KubernetesEmulator, reconciler: Reconciler
) -> None:
    api.objects[CLUSTERS, NS, NAME] = _cluster()
    await reconciler.reconcile(NS, NAME)
    del api.objects["v1/services", NS, "smol-router"]
    edited = copy.deepcopy(_children(api)["Deployment/smol-router"])
    edited["spec"]["template"]["spec"]["containers"][0]["image"] = "someone/else:latest"
    edited["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = "Always"  # a default, not ours
    api.objects["apps/v1/deployments", NS, "smol-router"] = edited
    outcome = await reconciler.reconcile(NS, NAME)
    assert outcome.created == ["Service/smol-router"] and outcome.patched == ["Deployment/smol-router"]
    restored = _children(api)["Deployment/smol-router"]["spec"]["template"]["spec"]["containers"][0]
    assert restored["image"] != "someone/else:latest"


async def test_status_follows_the_children(api: kmock_lib.KubernetesEmulator, reconciler: Reconciler) -> None:
    api.objects[CLUSTERS, NS, NAME] = _cluster()
    await reconciler.reconcile(NS, NAME)
    # What the Deployment and StatefulSet controllers would report once pods are up.
    api.objects[ENGINES, NS, "smol-engine"].patch(
        {"status": {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2}}
    )
    api.objects[STATEFULSETS, NS, "smol-redis"].patch({"status": {"replicas": 1, "readyReplicas": 1}})
    api.objects["apps/v1/deployments", NS, "smol-router"].patch(
        {"status": {"replicas": 1, "readyReplicas": 1}}
    )
    outcome = await reconciler.reconcile(NS, NAME)
    assert outcome.status_written and outcome.created == [] and outcome.patched == []
    status = api.objects[CLUSTERS, NS, NAME]["status"]
    assert (status["ready"], status["readyEngines"], status["replicas"]) == ("True", 2, 2)


async def test_invalid_spec_sets_the_condition_and_touches_no_child(
    api: kmock_lib.KubernetesEmulator, reconciler: Reconciler
) -> None:
    api.objects[CLUSTERS, NS, NAME] = _cluster()
    await reconciler.reconcile(NS, NAME)
    children = _children(api)
    # The schema's CEL rule (replicas <= maxReplicas) would refuse this at kubectl apply; a spec
    # that got in anyway (a webhook off, an older schema) must not break the running fleet.
    api.objects[CLUSTERS, NS, NAME].patch(
        {"spec": {"engine": {"replicas": 9, "maxReplicas": 4}}, "metadata": {"generation": 2}}
    )
    before = len(_requests(api))
    outcome = await reconciler.reconcile(NS, NAME)
    assert "maxReplicas" in outcome.invalid
    assert _children(api) == children
    assert _writes(api, before) == [f"PATCH /apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}/{NAME}/status"]
    ready = next(c for c in api.objects[CLUSTERS, NS, NAME]["status"]["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert "spec.engine" in ready["message"]


async def test_service_monitor_only_when_its_crd_exists(
    api: kmock_lib.KubernetesEmulator, reconciler: Reconciler
) -> None:
    api.objects[CLUSTERS, NS, NAME] = _cluster()
    await reconciler.reconcile(NS, NAME)
    assert "ServiceMonitor/smol" not in _children(api)
    _declare(api, service_monitors=True)
    kube = Kube(_info(api))  # discovery is remembered per client: a new operator process
    try:
        turned_off = await Reconciler(kube, service_monitors=False).reconcile(NS, NAME)
        outcome = await Reconciler(kube).reconcile(NS, NAME)
    finally:
        await kube.close()
    assert turned_off.created == [] and turned_off.writes == 0  # --no-service-monitors
    assert [c for c in outcome.created if c.startswith("ServiceMonitor/")] != []


async def test_a_service_monitor_crd_installed_later_is_seen_without_a_restart(
    api: kmock_lib.KubernetesEmulator,
) -> None:
    api.objects[CLUSTERS, NS, NAME] = _cluster()
    kube = Kube(_info(api), discovery_ttl_s=0.2)
    try:
        reconciler = Reconciler(kube)
        await reconciler.reconcile(NS, NAME)
        assert "ServiceMonitor/smol" not in _children(api)
        _declare(api, service_monitors=True)  # the Prometheus operator installed meanwhile

        async def monitored() -> bool:
            await reconciler.reconcile(NS, NAME)
            return "ServiceMonitor/smol" in _children(api)

        await until(monitored, 10.0, "the ServiceMonitor is made")
    finally:
        await kube.close()


class DrainCall(NamedTuple):
    """One drain, with the engine Deployment, the pods' deletion costs and the cluster's
    Draining condition at that moment."""

    engines: list[Leaving]
    replicas: int
    deletion_costs: dict[str, str]
    status: str
    reason: str
    tls_ca: bytes | None = None
    """The CA of the fleet TLS files the drainer was given (read from the cluster's Secret)."""


class RecordingDrainer:
    """A drainer at the operator's own seam (the real one calls each engine's gRPC drain, tested
    with real engines in ``tests/integration/test_scale_down.py``): records each drain."""

    def __init__(self, api: kmock_lib.KubernetesEmulator) -> None:
        self.api = api
        self.calls: list[DrainCall] = []

    async def drain(
        self, cluster: Cluster, engines: list[Leaving], tls: FleetTls | None = None
    ) -> list[Drained]:
        spec = self.api.objects[ENGINES, NS, "smol-engine"]["spec"]
        draining = next(
            c for c in self.api.objects[CLUSTERS, NS, NAME]["status"]["conditions"] if c["type"] == "Draining"
        )
        costs = {
            name: pod["metadata"]["annotations"][DELETION_COST_ANNOTATION]
            for (resource, _ns, name), pod in self.api.objects.items()
            if resource.plural == "pods"
            and DELETION_COST_ANNOTATION in pod["metadata"].get("annotations", {})
        }
        ca = tls.ca if tls is not None else None
        self.calls.append(
            DrainCall(engines, spec["replicas"], costs, draining["status"], draining["reason"], ca)
        )
        return [Drained(engine.pod, migrated=2) for engine in engines]


class TableLoads:
    """Engine loads from a table, at the operator's own seam (the real reader is Redis, read in
    ``tests/integration/test_scale_down.py``)."""

    def __init__(self, loads: dict[str, EngineLoad]) -> None:
        self.loads = loads

    async def engine_loads(self, cluster: Cluster) -> dict[str, EngineLoad]:
        return dict(self.loads)


def _engine_pods(api: kmock_lib.KubernetesEmulator, names: list[str]) -> None:
    """Running, ready engine pods, as the engine ReplicaSet would make them."""
    template = copy.deepcopy(_children(api)["Deployment/smol-engine"]["spec"]["template"])
    for i, name in enumerate(names):
        api.objects[PODS, NS, name] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": template["metadata"]["labels"]},
            "spec": template["spec"],
            "status": {
                "phase": "Running",
                "podIP": f"10.1.0.{i + 1}",
                "conditions": [{"type": "Ready", "status": "True"}],
            },
        }
    # An unrelated pod in the namespace (kmock ignores label selectors: the operator filters too).
    api.objects[PODS, NS, "someone-else"] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "someone-else", "namespace": NS, "labels": {"app": "other"}},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
    }


async def test_scale_down_marks_and_drains_the_least_loaded_engines_before_the_deployment_shrinks(
    api: kmock_lib.KubernetesEmulator,
) -> None:
    kube = Kube(_info(api))
    drainer = RecordingDrainer(api)
    loads = TableLoads(
        {
            "smol-engine-a": EngineLoad(running=6),
            "smol-engine-b": EngineLoad(running=1, kv_blocks_used=40),
            "smol-engine-c": EngineLoad(running=9, waiting=3),
            "smol-engine-d": EngineLoad(running=1, kv_blocks_used=10),
            "someone-else": EngineLoad(),  # never a candidate: not an engine pod of this cluster
        }
    )
    reconciler = Reconciler(kube, drainer, loads=loads)
    try:
        api.objects[CLUSTERS, NS, NAME] = _cluster(replicas=4)
        await reconciler.reconcile(NS, NAME)
        assert drainer.calls == []  # nothing leaves on creation
        api.objects[ENGINES, NS, "smol-engine"].patch(
            {"status": {"replicas": 4, "readyReplicas": 4, "updatedReplicas": 4}}
        )
        _engine_pods(api, ["smol-engine-a", "smol-engine-b", "smol-engine-c", "smol-engine-d"])
        scale_down = {"spec": {"engine": {"replicas": 2}}, "metadata": {"generation": 2}}
        api.objects[CLUSTERS, NS, NAME].patch(scale_down)
        outcome = await reconciler.reconcile(NS, NAME)
        # The two least loaded (d: 1 request and fewer KV blocks than b), marked for the
        # ReplicaSet and drained at their pod addresses while the Deployment still had 4, with
        # the cluster saying Draining=True.
        leaving = [Leaving("smol-engine-d", "10.1.0.4:5800"), Leaving("smol-engine-b", "10.1.0.2:5800")]
        lowest = str(-(2**31))
        # With the fleet's TLS files from the Secret the operator made: the engines ask for them.
        ca = base64.b64decode(_children(api)["Secret/smol-fleet-tls"]["data"]["ca.crt"])
        assert drainer.calls == [
            DrainCall(leaving, 4, {"smol-engine-d": lowest, "smol-engine-b": lowest}, "True", "ScaleDown", ca)
        ]
        assert [d.pod for d in outcome.drained] == ["smol-engine-d", "smol-engine-b"]
        assert _children(api)["Deployment/smol-engine"]["spec"]["replicas"] == 2
        before = len(_requests(api))
        await reconciler.reconcile(NS, NAME)
        assert len(drainer.calls) == 1  # a scale-down done is not drained again
        reads = [r for r in _requests(api)[before:] if r.method.value == "GET"]
        assert not any(r.url.path.endswith("/pods") for r in reads)  # pods are listed only to shrink
    finally:
        await kube.close()


async def test_image_change_rolls_engines_through_the_deployment_surge(
    api: kmock_lib.KubernetesEmulator,
) -> None:
    """The Deployment controller surges (kmock runs none: the test sets the status it would
    report); the operator drains nothing itself (old engines drain in their preStop hooks), says
    Updating, and a scale-down asked for mid-rollout goes to the Deployment as is."""
    kube = Kube(_info(api))
    drainer = RecordingDrainer(api)
    reconciler = Reconciler(kube, drainer, loads=TableLoads({}))
    engines_path = f"PATCH /apis/apps/v1/namespaces/{NS}/deployments/smol-engine"
    try:
        api.objects[CLUSTERS, NS, NAME] = _cluster(replicas=3)
        await reconciler.reconcile(NS, NAME)
        deployment = api.objects[ENGINES, NS, "smol-engine"]
        deployment.patch({"status": {"replicas": 3, "readyReplicas": 3, "updatedReplicas": 3}})
        api.objects[CLUSTERS, NS, NAME].patch(
            {"spec": {"engine": {"image": "shoal/engine:0.2.0"}}, "metadata": {"generation": 2}}
        )
        before = len(_requests(api))
        await reconciler.reconcile(NS, NAME)
        assert engines_path in _writes(api, before)
        spec = _children(api)["Deployment/smol-engine"]["spec"]
        assert spec["template"]["spec"]["containers"][0]["image"] == "shoal/engine:0.2.0"
        assert spec["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}

        def conditions() -> dict[str, str]:
            status = api.objects[CLUSTERS, NS, NAME]["status"]
            return {c["type"]: c["status"] for c in status["conditions"]}

        # Mid-rollout: one surge engine on the new template beside three old ones.
        deployment.patch({"status": {"replicas": 4, "readyReplicas": 4, "updatedReplicas": 1}})
        await reconciler.reconcile(NS, NAME)
        assert (conditions()["Updating"], conditions()["Draining"]) == ("True", "False")
        api.objects[CLUSTERS, NS, NAME].patch(
            {"spec": {"engine": {"replicas": 2}}, "metadata": {"generation": 3}}
        )
        await reconciler.reconcile(NS, NAME)
        assert _children(api)["Deployment/smol-engine"]["spec"]["replicas"] == 2
        # Done: every pod on the new template, the old ones gone.
        deployment.patch({"status": {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2}})
        await reconciler.reconcile(NS, NAME)
        assert (conditions()["Updating"], conditions()["Draining"]) == ("False", "False")
        assert drainer.calls == []
        before = len(_requests(api))
        outcome = await reconciler.reconcile(NS, NAME)
        assert outcome.writes == 0 and _writes(api, before) == []
    finally:
        await kube.close()


# ---- the kopf handlers, running --------------------------------------------------------------


@contextlib.asynccontextmanager
async def _running_operator(api: kmock_lib.KubernetesEmulator) -> AsyncIterator[None]:
    """The operator in its own thread and event loop, as ``kopf run`` would run it (kopf stops
    every task its loop started after it, so it cannot share the test's loop)."""
    registry = kopf.OperatorRegistry()
    # kmock 0.8 cannot serve the cluster-wide namespace list kopf's scanning asks for; the
    # operator is given its namespace outright instead.
    register(registry, login=lambda: _info(api), resync_s=3600, scan_cluster=False, namespaces=[NS])
    stop, ready = threading.Event(), threading.Event()
    run = kopf.operator(registry=registry, namespaces=[NS], standalone=True, stop_flag=stop, ready_flag=ready)
    thread = threading.Thread(target=asyncio.run, args=(run,), name="kopf", daemon=True)
    thread.start()
    try:
        assert await asyncio.to_thread(ready.wait, 20), "the operator did not start"
        yield
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 20)
    assert not thread.is_alive(), "the operator did not stop"


@pytest.fixture
async def operator(api: kmock_lib.KubernetesEmulator) -> AsyncIterator[None]:
    async with _running_operator(api):
        yield


async def _post(api: kmock_lib.KubernetesEmulator, url: str, body: dict[str, Any]) -> None:
    response = await api.post(url, json=body)
    assert response.status < 300, await response.text()


async def _call(request: Awaitable[Any]) -> None:
    response = await request
    assert response.status < 300, await response.text()


@pytest.mark.usefixtures("operator")
async def test_kopf_creates_children_and_puts_a_deleted_one_back(api: kmock_lib.KubernetesEmulator) -> None:
    await _post(api, f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}", _cluster())
    await until(lambda: set(_children(api)) == EXPECTED_CHILDREN, WAIT_S, "every child exists")
    await _call(api.delete(f"/apis/apps/v1/namespaces/{NS}/deployments/smol-engine"))
    await until(lambda: "Deployment/smol-engine" in _children(api), WAIT_S, "the deleted Deployment is back")


@pytest.mark.usefixtures("operator")
async def test_kopf_scale_change_reaches_the_engine_deployment(api: kmock_lib.KubernetesEmulator) -> None:
    await _post(api, f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}", _cluster())
    await until(lambda: "Deployment/smol-engine" in _children(api), WAIT_S, "the engines exist")
    url = f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}/{NAME}"
    headers = {"Content-Type": "application/merge-patch+json"}
    await _call(api.patch(url, json={"spec": {"engine": {"replicas": 3}}}, headers=headers))
    await until(
        lambda: _children(api)["Deployment/smol-engine"]["spec"]["replicas"] == 3,
        WAIT_S,
        "the engine Deployment has 3 replicas",
    )


@pytest.mark.usefixtures("operator")
async def test_kopf_deletion_leaves_children_to_owner_references(api: kmock_lib.KubernetesEmulator) -> None:
    await _post(api, f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}", _cluster())
    await until(lambda: set(_children(api)) == EXPECTED_CHILDREN, WAIT_S, "every child exists")
    # No finalizer: deleting a cluster never waits for the operator (gone, uninstalled, or a
    # namespace being deleted with it).
    assert not api.objects[CLUSTERS, NS, NAME].get("metadata", {}).get("finalizers")
    before = len(_requests(api))
    await _call(api.delete(f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}/{NAME}"))
    assert api.objects[CLUSTERS, NS, NAME].deleted  # at once, as the API server answers
    await asyncio.sleep(0.5)  # what the operator does next, if anything, to be seen below
    cluster_path = f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}/{NAME}"
    # No child touched (the cluster itself: a status still being written).
    assert [w for w in _writes(api, before) if cluster_path not in w] == []
    assert set(_children(api)) == EXPECTED_CHILDREN  # left to Kubernetes' garbage collector


async def test_a_finalizer_an_older_operator_left_is_taken_off(api: kmock_lib.KubernetesEmulator) -> None:
    legacy = _cluster()
    legacy["metadata"]["finalizers"] = ["kopf.zalando.org/KopfFinalizerMarker"]
    api.objects[CLUSTERS, NS, NAME] = legacy
    async with _running_operator(api):
        await until(
            lambda: not api.objects[CLUSTERS, NS, NAME].get("metadata", {}).get("finalizers"),
            WAIT_S,
            "kopf's old finalizer is off the cluster",
        )


@pytest.mark.usefixtures("operator")
async def test_kopf_invalid_spec_sets_condition_and_posts_an_event(api: kmock_lib.KubernetesEmulator) -> None:
    await _post(api, f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}", _cluster(replicas=9, maxReplicas=4))

    def invalid() -> bool:
        conditions = api.objects[CLUSTERS, NS, NAME].get("status", {}).get("conditions", [])
        return any(c["type"] == "Ready" and c["reason"] == "InvalidSpec" for c in conditions)

    await until(invalid, WAIT_S, "Ready=False with reason InvalidSpec")
    assert _children(api) == {}
    await until(
        lambda: any(r.method == "POST" and r.url.path.endswith("/events") for r in _requests(api)),
        WAIT_S,
        "an InvalidSpec event is posted",
    )
    events = [r.data for r in _requests(api) if r.method == "POST" and r.url.path.endswith("/events")]
    assert any(e.get("reason") == "InvalidSpec" and e.get("type") == "Warning" for e in events)


# ---- what a real API server would make of the writes -----------------------------------------


def _spec_patch(api: kmock_lib.KubernetesEmulator, spec: dict[str, Any], generation: int) -> None:
    api.objects[CLUSTERS, NS, NAME].patch({"spec": spec, "metadata": {"generation": generation}})


async def test_an_ingress_turned_off_is_deleted(
    api: kmock_lib.KubernetesEmulator, reconciler: Reconciler
) -> None:
    api.objects[CLUSTERS, NS, NAME] = _cluster()
    _spec_patch(api, {"router": {"ingress": {"enabled": True, "host": "llm.example"}}}, 2)
    await reconciler.reconcile(NS, NAME)
    assert "Ingress/smol-router" in _children(api)
    _spec_patch(api, {"router": {"ingress": {"enabled": False}}}, 3)
    outcome = await reconciler.reconcile(NS, NAME)
    assert outcome.deleted == ["Ingress/smol-router"]
    assert "Ingress/smol-router" not in _children(api)
    # The managed Redis goes too when the cluster moves to an external one.
    _spec_patch(api, {"redis": {"mode": "external", "url": "redis://redis.shared:6379/0"}}, 4)
    outcome = await reconciler.reconcile(NS, NAME)
    assert sorted(outcome.deleted) == [
        "NetworkPolicy/smol-redis", "Secret/smol-redis-auth", "Service/smol-redis", "StatefulSet/smol-redis",
    ]  # fmt: skip
    # Something with the operator's labels that another owner holds is not the operator's to delete.
    labels = {"app.kubernetes.io/instance": NAME, "app.kubernetes.io/managed-by": "shoal-operator"}
    owners = [{"uid": "someone-else"}]
    meta = {"name": "smol-extra", "namespace": NS, "labels": labels, "ownerReferences": owners}
    stranger = {**_children(api)["ConfigMap/smol-config"], "metadata": meta}
    api.objects["v1/configmaps", NS, "smol-extra"] = stranger
    assert (await reconciler.reconcile(NS, NAME)).deleted == []


async def test_router_budget_stays_valid_from_one_router_to_two_and_back(
    api: kmock_lib.KubernetesEmulator, reconciler: Reconciler
) -> None:
    api.objects[CLUSTERS, NS, NAME] = _cluster()
    await reconciler.reconcile(NS, NAME)
    # A budget as an older operator left it, with the other limit.
    budget = api.objects["policy/v1/poddisruptionbudgets", NS, "smol-router"]
    budget.patch({"spec": {"maxUnavailable": None, "minAvailable": 1}})
    for generation, routers, allowed_down in ((2, 2, 1), (3, 1, 1), (4, 3, 2)):
        _spec_patch(api, {"router": {"replicas": routers}}, generation)
        await reconciler.reconcile(NS, NAME)
        spec = _children(api)["PodDisruptionBudget/smol-router"]["spec"]
        # The API server refuses a budget with both limits (422), and every child after it.
        assert "minAvailable" not in spec, spec
        assert spec["maxUnavailable"] == allowed_down


async def test_quantities_the_api_server_rewrites_cost_no_write(
    api: kmock_lib.KubernetesEmulator, reconciler: Reconciler
) -> None:
    api.objects[CLUSTERS, NS, NAME] = _cluster(resources={"cpu": "0.5", "memory": "2048Mi"})
    await reconciler.reconcile(NS, NAME)
    # The API server stores quantities in canonical form.
    engines = api.objects[ENGINES, NS, "smol-engine"]
    canonical = {"cpu": "500m", "memory": "2Gi"}
    container = engines["spec"]["template"]["spec"]["containers"][0]
    stored = {**container, "resources": {"requests": canonical, "limits": canonical}}
    engines.patch({"spec": {"template": {"spec": {"containers": [stored]}}}})
    await reconciler.reconcile(NS, NAME)
    before = len(_requests(api))
    outcome = await reconciler.reconcile(NS, NAME)
    assert outcome.writes == 0 and _writes(api, before) == []
    # A real change of quantity is still seen.
    _spec_patch(api, {"engine": {"resources": {"cpu": "1", "memory": "2048Mi"}}}, 2)
    assert (await reconciler.reconcile(NS, NAME)).patched == ["Deployment/smol-engine"]


async def _patch_as(api: kmock_lib.KubernetesEmulator, url: str, body: dict[str, Any], manager: str) -> None:
    """A merge patch from another writer (``kubectl edit``, a controller), over HTTP."""
    async with (
        aiohttp.ClientSession() as session,
        session.patch(
            f"{str(api.url).rstrip('/')}{url}?fieldManager={manager}",
            json=body,
            headers={"Content-Type": "application/merge-patch+json"},
        ) as response,
    ):
        assert response.status == 200, await response.text()


async def test_what_the_spec_no_longer_asks_for_leaves_the_children_and_others_fields_stay(
    api: kmock_lib.KubernetesEmulator, reconciler: Reconciler
) -> None:
    pod = {
        "nodeSelector": {"pool": "gpu"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "annotations": {"team": "search"},
    }
    api.objects[CLUSTERS, NS, NAME] = _cluster(
        pod=pod, env=[{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}]
    )
    await reconciler.reconcile(NS, NAME)
    template = _children(api)["Deployment/smol-engine"]["spec"]["template"]
    assert template["spec"]["nodeSelector"] == {"pool": "gpu"} and template["metadata"]["annotations"]
    # Someone else annotates the Deployment (as ``kubectl annotate`` or a controller would).
    engines = f"/apis/apps/v1/namespaces/{NS}/deployments/smol-engine"
    await _patch_as(api, engines, {"metadata": {"annotations": {"owner": "platform"}}}, "kubectl-annotate")
    assert (await reconciler.reconcile(NS, NAME)).writes == 0  # someone else's field is no drift
    _spec_patch(api, {"engine": {"pod": None, "env": None}}, 2)
    outcome = await reconciler.reconcile(NS, NAME)
    assert outcome.patched == ["Deployment/smol-engine"]
    deployment = _children(api)["Deployment/smol-engine"]
    template = deployment["spec"]["template"]
    # A merge patch of the rendered Deployment would have left all three in place.
    assert "nodeSelector" not in template["spec"] and "tolerations" not in template["spec"]
    assert "team" not in (template["metadata"].get("annotations") or {})
    (container,) = template["spec"]["containers"]
    assert "VLLM_LOGGING_LEVEL" not in {e["name"] for e in container["env"]}
    assert {"POD_NAME", "REDIS_URL", "HF_HOME"} <= {e["name"] for e in container["env"]}
    assert deployment["metadata"]["annotations"]["owner"] == "platform"
    # And the next reconcile finds no child to write.
    again = await reconciler.reconcile(NS, NAME)
    assert again.created == again.patched == again.deleted == []
