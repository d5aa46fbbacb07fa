"""The kopf handlers: every event about a cluster or one of its children reconciles the cluster.

* The cluster is created, its spec changes, or the operator starts (resume): reconcile it.
* Clusters with ``autoscaling.enabled`` are sized from their load every ``autoscale_s`` seconds
  (see ``autoscale``); the new engine count goes through the same reconcile.
* Every ``resync_s`` seconds every cluster is reconciled, so drift nobody announced (a missed
  event, a child edited while the operator was down) is put right.
* The engine count goes down: the least-loaded engines are chosen, marked for the ReplicaSet to
  remove first, and drained (they leave the rotation and migrate their requests away, see
  ``scale`` and ``drain``); then the engine Deployment shrinks.
* A child (found by its ``managed-by`` label) is modified or deleted: reconcile its cluster. A
  deleted child comes back at once; a child whose replica counts change moves the status.
* The cluster is deleted: nothing to do. Every child has an owner reference to the cluster and
  Kubernetes' garbage collector removes them. The operator puts no finalizer on a cluster, so a
  deletion never waits for it (an operator that is gone, ``helm uninstall``, a namespace being
  deleted). That is why the periodic work is two loops of the operator's own that list the
  clusters, not kopf timers: kopf holds every object with a timer behind its finalizer. A
  finalizer an older operator left (kopf's) is taken off by kopf the first time it sees the
  cluster, since no handler asks for one.

kopf keeps its own bookkeeping in ``shoal.dev/`` annotations (never in ``status``, which the
schema declares in full), and posts Kubernetes events only for warnings.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import kopf
from redis.exceptions import RedisError

from shoal_operator.autoscale import Autoscaler, FleetRedis
from shoal_operator.children import Cluster
from shoal_operator.drain import Drainer, GrpcDrainer
from shoal_operator.kube import Kube
from shoal_operator.reconcile import CLUSTER_API_VERSION, ApiError, Manifest, Outcome, Reconciler
from shoal_operator.spec import GROUP, KIND, PLURAL, VERSION

MANAGED = {"app.kubernetes.io/managed-by": "shoal-operator"}
CHILD_RESOURCES = (
    ("v1", "configmaps"),
    ("v1", "services"),
    ("apps/v1", "statefulsets"),
    ("apps/v1", "deployments"),
    ("policy/v1", "poddisruptionbudgets"),
    ("networking.k8s.io/v1", "networkpolicies"),
    ("networking.k8s.io/v1", "ingresses"),
)
"""The children's resources the operator watches (all carry the ``managed-by`` label)."""
RETRY_DELAY_S = 5.0
logger = logging.getLogger(__name__)


async def _every(first_s: float, period_s: float, work: Callable[[], Awaitable[None]]) -> None:
    """Run ``work`` every ``period_s`` seconds, first after ``first_s``, until cancelled. A
    failure is logged with its traceback and the next round runs as usual: one bad round must
    not end the loop unseen."""
    await asyncio.sleep(first_s)
    while True:
        try:
            await work()
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("%s failed; it runs again in %g s", getattr(work, "__name__", "work"), period_s)
        await asyncio.sleep(period_s)


@dataclass
class _Operator:
    """What the handlers share: the settings ``register`` was given, the API client, reconciler
    and autoscaler made at login, and the periodic loops.

    The handlers stay in ``register``, each a few lines over this: kopf names a handler by its
    qualified name (``register.<locals>.cluster_changed``) and keeps that name in a cluster's
    annotations while the handler is retried."""

    login: Callable[[], kopf.ConnectionInfo] | None
    drainer: Drainer | None
    redis_url: Callable[[Cluster], Awaitable[str]] | None
    service_monitors: bool
    namespaces: Sequence[str] | None
    kube: Kube | None = None
    reconciler: Reconciler | None = None
    autoscaler: Autoscaler | None = None
    loops: list[asyncio.Task[None]] = field(default_factory=list)

    def connect(self, **kwargs: Any) -> kopf.ConnectionInfo | None:
        info = (
            self.login()
            if self.login is not None
            else (kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs))
        )
        if info is not None:
            self.kube = Kube(info)
            fleet = FleetRedis(self.kube, self.redis_url)
            drainer = self.drainer or GrpcDrainer()
            self.reconciler = Reconciler(self.kube, drainer, self.service_monitors, fleet)
            self.autoscaler = Autoscaler(self.kube, fleet=fleet)
        return info

    def start_loops(self, resync_s: float, autoscale_s: float) -> None:
        self.loops = [
            asyncio.create_task(_every(resync_s, resync_s, self.resync), name="shoal-resync"),
            asyncio.create_task(_every(autoscale_s, autoscale_s, self.autoscale), name="shoal-autoscale"),
        ]

    async def close(self) -> None:
        for task in self.loops:
            task.cancel()
        await asyncio.gather(*self.loops, return_exceptions=True)
        if self.autoscaler is not None:
            await self.autoscaler.close()
        if self.kube is not None:
            await self.kube.close()

    async def reconcile(
        self, namespace: str | None, name: str, logger: logging.Logger | logging.LoggerAdapter[Any]
    ) -> Outcome:
        assert namespace is not None, "InferenceClusters and their children are namespaced"
        if self.reconciler is None:
            raise kopf.TemporaryError("not logged in to the API server yet", delay=RETRY_DELAY_S)
        try:
            outcome = await self.reconciler.reconcile(namespace, name)
        except ApiError as exc:
            raise kopf.TemporaryError(
                f"reconcile of {namespace}/{name} failed: {exc}", delay=RETRY_DELAY_S
            ) from exc
        if outcome.created or outcome.patched:
            logger.info(f"created {outcome.created or 'nothing'}, patched {outcome.patched or 'nothing'}")
        return outcome

    async def listed(self) -> list[Manifest]:
        if self.kube is None:
            return []
        if self.namespaces is None:
            return await self.kube.list(CLUSTER_API_VERSION, KIND, "", "")
        return [c for ns in self.namespaces for c in await self.kube.list(CLUSTER_API_VERSION, KIND, ns, "")]

    async def resync(self) -> None:
        for body in await self.listed():
            meta = body["metadata"]
            try:
                await self.reconcile(meta["namespace"], meta["name"], logger)
            except kopf.TemporaryError as exc:
                logger.warning("resync of %s/%s: %s", meta["namespace"], meta["name"], exc)

    async def autoscale(self) -> None:
        if self.autoscaler is None:
            return
        for body in await self.listed():
            if not ((body.get("spec") or {}).get("autoscaling") or {}).get("enabled"):
                continue
            meta = body["metadata"]
            try:
                replicas = await self.autoscaler.step(body, time.time())
            except (ApiError, RedisError, OSError) as exc:
                logger.warning("cannot autoscale %s/%s: %s", meta["namespace"], meta["name"], exc)
                continue
            if replicas is not None:
                logger.info(
                    "%s/%s: autoscaling set the engines to %d", meta["namespace"], meta["name"], replicas
                )


def _configure(settings: kopf.OperatorSettings, scan_cluster: bool) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="shoal.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="shoal.dev")
    settings.posting.level = logging.WARNING
    settings.scanning.disabled = not scan_cluster


def register(
    registry: kopf.OperatorRegistry,
    login: Callable[[], kopf.ConnectionInfo] | None = None,
    resync_s: float = 60.0,
    scan_cluster: bool = True,
    drainer: Drainer | None = None,
    autoscale_s: float = 15.0,
    redis_url: Callable[[Cluster], Awaitable[str]] | None = None,
    service_monitors: bool = True,
    namespaces: Sequence[str] | None = None,
) -> None:
    """Register the operator's handlers in ``registry``.

    ``login`` returns the API server's address and credentials; by default the pod's service
    account, else the kubeconfig (as ``kopf run`` finds them). ``scan_cluster=False`` stops kopf
    from listing namespaces and watching CRDs (it then watches exactly the namespaces it is given).
    ``drainer`` empties the engines a scale-down removes (default: their gRPC drain).
    ``autoscale_s`` is how often autoscaled clusters are sized from their load in Redis, found at
    ``redis_url(cluster)`` (default: the managed Redis Service, or the spec's URL or Secret); the
    same load chooses the engines a scale-down removes.
    ``service_monitors=False``: no ServiceMonitor per cluster, even where its CRD exists.
    ``namespaces`` are the ones watched (None: every namespace), where the periodic loops list
    the clusters.
    """
    operator = _Operator(login, drainer, redis_url, service_monitors, namespaces)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        _configure(settings, scan_cluster)

    @kopf.on.login(registry=registry)
    def connect(**kwargs: Any) -> kopf.ConnectionInfo | None:
        return operator.connect(**kwargs)

    @kopf.on.startup(registry=registry)
    async def start_loops(**_: Any) -> None:
        operator.start_loops(resync_s, autoscale_s)

    @kopf.on.cleanup(registry=registry)
    async def close(**_: Any) -> None:
        await operator.close()

    @kopf.on.resume(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.create(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.update(GROUP, VERSION, PLURAL, field="spec", registry=registry)
    async def cluster_changed(
        name: str,
        namespace: str | None,
        body: kopf.Body,
        logger: logging.Logger | logging.LoggerAdapter[Any],
        **_: Any,
    ) -> None:
        outcome = await operator.reconcile(namespace, name, logger)
        if outcome.invalid and outcome.status_written:
            kopf.warn(body, reason="InvalidSpec", message=outcome.invalid)

    @kopf.on.delete(GROUP, VERSION, PLURAL, optional=True, registry=registry)
    def cluster_deleted(
        name: str, namespace: str | None, logger: logging.Logger | logging.LoggerAdapter[Any], **_: Any
    ) -> None:
        logger.info(f"{namespace}/{name} deleted: its children go with their owner references")

    async def child_event(
        event: kopf.RawEvent,
        namespace: str | None,
        labels: kopf.Labels,
        logger: logging.Logger | logging.LoggerAdapter[Any],
        **_: Any,
    ) -> None:
        owner = labels.get("app.kubernetes.io/instance")
        if owner and event.get("type") in ("MODIFIED", "DELETED"):
            await operator.reconcile(namespace, owner, logger)

    for api_version, plural in CHILD_RESOURCES:
        group, _, version = api_version.rpartition("/")
        kopf.on.event(group, version, plural, labels=MANAGED, registry=registry)(child_event)
