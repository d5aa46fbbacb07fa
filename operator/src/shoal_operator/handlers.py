"""The kopf handlers: every event about a cluster or one of its children reconciles the cluster.

* The cluster is created, its spec changes, or the operator starts (resume): reconcile it.
* Clusters with ``autoscaling.enabled`` are sized from their load every ``autoscale_s`` seconds
  (see ``autoscale``); the new engine count goes through the same reconcile.
* A timer reconciles every cluster every ``resync_s`` seconds, so drift nobody announced (a
  missed event, a child edited while the operator was down) is put right.
* The engine count goes down: the least-loaded engines are chosen, marked for the ReplicaSet to
  remove first, and drained (they leave the rotation and migrate their requests away, see
  ``scale`` and ``drain``); then the engine Deployment shrinks.
* A child (found by its ``managed-by`` label) is modified or deleted: reconcile its cluster. A
  deleted child comes back at once; a child whose replica counts change moves the status.
* The cluster is deleted: nothing to do. Every child has an owner reference to the cluster and
  Kubernetes' garbage collector removes them. (kopf puts a finalizer on each cluster for the
  resync timer and takes it off when the cluster is deleted: the deletion waits for a running
  operator.)

kopf keeps its own bookkeeping in ``shoal.dev/`` annotations (never in ``status``, which the
schema declares in full), and posts Kubernetes events only for warnings.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import kopf
from redis.exceptions import RedisError

from shoal_operator.autoscale import Autoscaler, FleetRedis
from shoal_operator.children import Cluster
from shoal_operator.drain import Drainer, GrpcDrainer
from shoal_operator.kube import Kube
from shoal_operator.reconcile import ApiError, Outcome, Reconciler
from shoal_operator.spec import GROUP, PLURAL, VERSION

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


@dataclass
class _State:
    kube: Kube | None = None
    reconciler: Reconciler | None = None
    autoscaler: Autoscaler | None = None


def register(
    registry: kopf.OperatorRegistry,
    login: Callable[[], kopf.ConnectionInfo] | None = None,
    resync_s: float = 60.0,
    scan_cluster: bool = True,
    drainer: Drainer | None = None,
    autoscale_s: float = 15.0,
    redis_url: Callable[[Cluster], Awaitable[str]] | None = None,
    service_monitors: bool = True,
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
    """
    state = _State()

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="shoal.dev")
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="shoal.dev")
        settings.posting.level = logging.WARNING
        settings.scanning.disabled = not scan_cluster

    @kopf.on.login(registry=registry)
    def connect(**kwargs: Any) -> kopf.ConnectionInfo | None:
        info = (
            login()
            if login is not None
            else (kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs))
        )
        if info is not None:
            state.kube = Kube(info)
            fleet = FleetRedis(state.kube, redis_url)
            state.reconciler = Reconciler(state.kube, drainer or GrpcDrainer(), service_monitors, fleet)
            state.autoscaler = Autoscaler(state.kube, fleet=fleet)
        return info

    @kopf.on.cleanup(registry=registry)
    async def close(**_: Any) -> None:
        if state.autoscaler is not None:
            await state.autoscaler.close()
        if state.kube is not None:
            await state.kube.close()

    async def reconcile(
        namespace: str, name: str, logger: logging.Logger | logging.LoggerAdapter[Any]
    ) -> Outcome:
        if state.reconciler is None:
            raise kopf.TemporaryError("not logged in to the API server yet", delay=RETRY_DELAY_S)
        try:
            outcome = await state.reconciler.reconcile(namespace, name)
        except ApiError as exc:
            raise kopf.TemporaryError(
                f"reconcile of {namespace}/{name} failed: {exc}", delay=RETRY_DELAY_S
            ) from exc
        if outcome.created or outcome.patched:
            logger.info(f"created {outcome.created or 'nothing'}, patched {outcome.patched or 'nothing'}")
        return outcome

    @kopf.on.resume(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.create(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.update(GROUP, VERSION, PLURAL, field="spec", registry=registry)
    async def cluster_changed(
        name: str, namespace: str, body: kopf.Body, logger: logging.LoggerAdapter[Any], **_: Any
    ) -> None:
        outcome = await reconcile(namespace, name, logger)
        if outcome.invalid and outcome.status_written:
            kopf.warn(body, reason="InvalidSpec", message=outcome.invalid)

    @kopf.timer(GROUP, VERSION, PLURAL, interval=resync_s, initial_delay=resync_s, registry=registry)
    async def resync(name: str, namespace: str, logger: logging.LoggerAdapter[Any], **_: Any) -> None:
        await reconcile(namespace, name, logger)

    def autoscaled(spec: kopf.Spec, **_: Any) -> bool:
        return bool((spec.get("autoscaling") or {}).get("enabled"))

    @kopf.timer(GROUP, VERSION, PLURAL, interval=autoscale_s, when=autoscaled, registry=registry)
    async def autoscale(body: kopf.Body, logger: logging.LoggerAdapter[Any], **_: Any) -> None:
        if state.autoscaler is None:
            raise kopf.TemporaryError("not logged in to the API server yet", delay=RETRY_DELAY_S)
        try:
            replicas = await state.autoscaler.step(dict(body), time.time())
        except (ApiError, RedisError, OSError) as exc:
            logger.warning(f"cannot autoscale: {exc}")
            return
        if replicas is not None:
            logger.info(f"autoscaling: engines set to {replicas}")

    @kopf.on.delete(GROUP, VERSION, PLURAL, optional=True, registry=registry)
    def cluster_deleted(name: str, namespace: str, logger: logging.LoggerAdapter[Any], **_: Any) -> None:
        logger.info(f"{namespace}/{name} deleted: its children go with their owner references")

    async def child_event(
        event: kopf.RawEvent,
        namespace: str,
        labels: kopf.Labels,
        logger: logging.LoggerAdapter[Any],
        **_: Any,
    ) -> None:
        owner = labels.get("app.kubernetes.io/instance")
        if owner and event.get("type") in ("MODIFIED", "DELETED"):
            await reconcile(namespace, owner, logger)

    for api_version, plural in CHILD_RESOURCES:
        group, _, version = api_version.rpartition("/")
        kopf.on.event(group, version, plural, labels=MANAGED, registry=registry)(child_event)
