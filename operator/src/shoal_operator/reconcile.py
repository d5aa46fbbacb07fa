"""Bring one InferenceCluster's children to what ``children.render`` says, then write its status.

The reconciler is level-triggered and idempotent: every call reads the cluster and each child,
creates what is missing, patches what drifted (a child someone edited, a spec that changed), and
writes the status only when it changed. A call that finds everything in place makes no write at
all, so it can run on every event and on a timer.

Children are written by server-side apply, with one field manager (``kube.FIELD_MANAGER``): the
API server then removes a field the operator set before and no longer renders (a toleration
taken out of the spec, a PodDisruptionBudget's other limit), and leaves alone the fields other
managers set (defaults, ``clusterIP``, a controller's annotations, status). A child is applied
when it has drifted: some field the operator sets differs from the live object, or the hash of
the rendered child the operator stamps on it (``APPLIED_ANNOTATION``) is not the one it last
applied, which is how a field taken out is noticed.

A spec that does not parse (one the API server's schema let through, or written before a schema
change) sets ``Ready=False`` with reason ``InvalidSpec`` and leaves every child as it is.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import re
import secrets
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any, Protocol

from pydantic import ValidationError
from redis.exceptions import RedisError

from shoal_operator import scale
from shoal_operator import status as cluster_status
from shoal_operator.children import (
    GENERATED_KEYS_ANNOTATION,
    GENERATED_TLS_ANNOTATION,
    Cluster,
    engine_selector,
    fleet_tls_secret_name,
    render,
    selector,
)
from shoal_operator.drain import Drained, Drainer
from shoal_operator.spec import GROUP, KIND, VERSION, InferenceClusterSpec
from shoal_protos import tls

Manifest = dict[str, Any]
logger = logging.getLogger(__name__)
CLUSTER_API_VERSION = f"{GROUP}/{VERSION}"


class ApiError(Exception):
    """A Kubernetes API call that failed (``status`` is the HTTP status)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


class Api(Protocol):
    """What the reconciler needs of the Kubernetes API (``kube.Kube`` is the real one)."""

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> Manifest | None: ...

    async def list(
        self, api_version: str, kind: str, namespace: str, label_selector: str
    ) -> list[Manifest]: ...

    async def create(self, manifest: Manifest) -> Manifest: ...

    async def apply(self, manifest: Manifest) -> Manifest: ...

    async def patch(
        self, api_version: str, kind: str, namespace: str, name: str, body: Manifest, subresource: str = ""
    ) -> Manifest: ...

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None: ...

    async def has_resource(self, api_version: str, plural: str) -> bool: ...


class EngineLoads(Protocol):
    """Where the reconciler reads each engine's load (``autoscale.FleetRedis`` is the real one)."""

    async def engine_loads(self, cluster: Cluster) -> dict[str, scale.EngineLoad]: ...


@dataclass
class Outcome:
    """What one reconcile did."""

    created: list[str] = field(default_factory=list)
    patched: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    status_written: bool = False
    drained: list[Drained] = field(default_factory=list)
    invalid: str = ""
    found: bool = True

    @property
    def writes(self) -> int:
        return len(self.created) + len(self.patched) + len(self.deleted) + int(self.status_written)


_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$")
_SUFFIX: dict[str, Decimal | int] = {
    "": 1, "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"),
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}  # fmt: skip
_QUANTITY_FIELDS = {"requests", "limits", "sizeLimit"}
"""Where the API server stores quantities in its canonical form (``0.5`` as ``500m``, ``2048Mi``
as ``2Gi``): compared by value there, else an unchanged cluster would look drifted forever."""


def quantity(text: str) -> Decimal | None:
    """A Kubernetes quantity's value (``500m`` is 0.5, ``2Gi`` is 2**31), None if not one."""
    match = _QUANTITY.match(text.strip())
    if match is None:
        return None
    try:
        return Decimal(match.group(1)) * _SUFFIX[match.group(2) or ""]
    except InvalidOperation:
        return None


def _same_scalar(desired: Any, live: Any, quantities: bool) -> bool:
    if desired == live:
        return True
    if not (isinstance(desired, int | str) and isinstance(live, int | str)):
        return False
    if str(desired) == str(live):  # the API server may echo 8000 for "8000"
        return True
    if quantities:
        wanted, found = quantity(str(desired)), quantity(str(live))
        return wanted is not None and wanted == found
    return False


def drifted(desired: Any, live: Any, quantities: bool = False) -> bool:
    """True if ``live`` differs from ``desired`` in a field ``desired`` sets.

    Dicts: every key of ``desired`` must match in ``live`` (extra live keys are defaults or
    someone else's); a key ``desired`` sets to None must be absent. Lists: same length, item by
    item. Anything else: equal (numbers and their string forms count as equal, and resource
    quantities by value).
    """
    if isinstance(desired, dict):
        if not isinstance(live, dict):
            return True
        return any(
            drifted(value, live.get(key), quantities or key in _QUANTITY_FIELDS)
            for key, value in desired.items()
        )
    if isinstance(desired, list):
        if not isinstance(live, list) or len(live) != len(desired):
            return True
        return any(drifted(d, item, quantities) for d, item in zip(desired, live, strict=True))
    return not _same_scalar(desired, live, quantities)


def _with_generated_keys(manifest: Manifest) -> Manifest:
    """A Secret to create, with a random token for each key its annotation names, or a new fleet
    CA and certificate (only ever at creation: the rendered Secret carries no data, so later
    reconciles leave the values alone)."""
    annotations = manifest["metadata"].get("annotations") or {}
    if manifest["kind"] != "Secret":
        return manifest
    if annotations.get(GENERATED_TLS_ANNOTATION):
        files = tls.generate()
        return {**manifest, "data": {name: base64.b64encode(data).decode() for name, data in files.items()}}
    keys = annotations.get(GENERATED_KEYS_ANNOTATION)
    if not keys:
        return manifest
    data = {key: base64.b64encode(secrets.token_hex(32).encode()).decode() for key in keys.split(",")}
    return {**manifest, "data": data}


APPLIED_ANNOTATION = "shoal.dev/applied"
"""On every child: a hash of the child as the operator last applied it. A field the spec no
longer asks for is absent from the rendered child, so comparing fields alone would never see
it go; the hash changes."""


def stamped(manifest: Manifest) -> Manifest:
    """``manifest`` with ``APPLIED_ANNOTATION`` set to its hash."""
    digest = hashlib.sha256(json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode())
    meta = manifest["metadata"]
    annotations = {**(meta.get("annotations") or {}), APPLIED_ANNOTATION: digest.hexdigest()[:16]}
    return {**manifest, "metadata": {**meta, "annotations": annotations}}


def _owned_fields(manifest: Manifest) -> Manifest:
    """The parts of a rendered child the operator owns: labels, owners and everything but status."""
    meta = manifest["metadata"]
    fields = {
        key: value
        for key, value in manifest.items()
        if key not in ("apiVersion", "kind", "metadata", "status")
    }
    fields["metadata"] = {
        key: meta[key] for key in ("labels", "annotations", "ownerReferences") if key in meta
    }
    return fields


CHILD_KINDS = (
    ("v1", "ConfigMap"),
    ("v1", "Service"),
    ("v1", "Secret"),
    ("apps/v1", "Deployment"),
    ("apps/v1", "StatefulSet"),
    ("policy/v1", "PodDisruptionBudget"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
    ("networking.k8s.io/v1", "Ingress"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
)
"""Every kind of child ``children.render`` makes: where the reconciler looks for ones to delete."""


def _ref(manifest: Manifest) -> str:
    return f"{manifest['kind']}/{manifest['metadata']['name']}"


class Reconciler:
    """Reconciles clusters through ``api``; one reconcile per cluster at a time. A ServiceMonitor
    per cluster is made where its CRD exists, unless ``service_monitors`` is off. Engines leaving
    in a scale-down are drained by ``drainer`` and chosen by the load ``loads`` reads (without
    it, or with its Redis unreachable, not-ready pods go first, then by name)."""

    def __init__(
        self,
        api: Api,
        drainer: Drainer | None = None,
        service_monitors: bool = True,
        loads: EngineLoads | None = None,
    ) -> None:
        self._api = api
        self._drainer = drainer
        self._service_monitors = service_monitors
        self._loads = loads
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}

    async def reconcile(self, namespace: str, name: str) -> Outcome:
        key = (namespace, name)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            outcome = await self._reconcile(namespace, name)
        if not outcome.found and not lock.locked() and self._locks.get(key) is lock:
            del self._locks[key]  # the cluster is gone: its lock with it
        return outcome

    async def _reconcile(self, namespace: str, name: str) -> Outcome:
        outcome = Outcome()
        body = await self._api.get(CLUSTER_API_VERSION, KIND, namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            outcome.found = False
            return outcome
        generation = int(body["metadata"].get("generation") or 1)
        previous = body.get("status") or {}
        try:
            spec = InferenceClusterSpec.model_validate(body.get("spec") or {})
        except ValidationError as exc:
            outcome.invalid = _summary(exc)
            wanted = cluster_status.invalid(generation, outcome.invalid, previous)
            outcome.status_written = await self._write_status(namespace, name, previous, wanted)
            return outcome
        cluster = Cluster(name=name, namespace=namespace, uid=body["metadata"]["uid"], spec=spec)
        monitors = self._service_monitors and await self._api.has_resource(
            "monitoring.coreos.com/v1", "servicemonitors"
        )
        rendered = render(cluster, service_monitors=monitors)
        engines_ref = f"Deployment/{name}-engine"
        desired_engines = next(child for child in rendered if _ref(child) == engines_ref)
        engines = await self._get(desired_engines)  # read once: the plan and the apply both use it
        template_changed = engines is not None and drifted(
            desired_engines["spec"]["template"], (engines.get("spec") or {}).get("template")
        )
        pods: list[Manifest] = []
        loads: dict[str, scale.EngineLoad] = {}
        if scale.shrinking(cluster, engines):
            wanted_labels = selector(cluster, "engine").items()
            listed = await self._api.list("v1", "Pod", namespace, engine_selector(cluster))
            pods = [p for p in listed if wanted_labels <= (p["metadata"].get("labels") or {}).items()]
            loads = await self._engine_loads(cluster)
        engine_plan = scale.plan(cluster, engines, template_changed, pods, loads)
        if engine_plan.drain:
            previous = await self._drain(cluster, engine_plan, previous, outcome)
        live: dict[str, Manifest] = {}
        for child in rendered:
            ref = _ref(child)
            desired = scale.apply(child, engine_plan) if ref == engines_ref else child
            live[ref] = await self._apply(
                desired, outcome, engines if ref == engines_ref else await self._get(desired)
            )
        await self._prune(cluster, rendered, monitors, outcome)
        wanted = cluster_status.compute(
            cluster,
            generation,
            engines=live.get(engines_ref),
            router=live.get(f"Deployment/{name}-router"),
            redis=live.get(f"StatefulSet/{name}-redis"),
            previous=previous,
            engine_plan=engine_plan,
        )
        outcome.status_written |= await self._write_status(namespace, name, previous, wanted)
        return outcome

    async def _prune(
        self, cluster: Cluster, rendered: list[Manifest], monitors: bool, outcome: Outcome
    ) -> None:
        """Delete the children the spec no longer asks for (an Ingress turned off, the managed
        Redis of a cluster moved to an external one): objects of the kinds the operator makes,
        with its labels for this cluster and owned by it, that ``rendered`` does not hold."""
        wanted = {_ref(child) for child in rendered}
        owned = f"app.kubernetes.io/instance={cluster.name},app.kubernetes.io/managed-by=shoal-operator"
        for api_version, kind in CHILD_KINDS:
            if kind == "ServiceMonitor" and not monitors:
                continue
            for live in await self._api.list(api_version, kind, cluster.namespace, owned):
                meta = live["metadata"]
                owners = {ref.get("uid") for ref in meta.get("ownerReferences") or []}
                ref = f"{kind}/{meta['name']}"
                if cluster.uid not in owners or ref in wanted or meta.get("deletionTimestamp"):
                    continue
                try:
                    await self._api.delete(api_version, kind, cluster.namespace, meta["name"])
                except ApiError as exc:
                    if exc.status != 404:
                        raise
                    continue
                logger.info(
                    "deleted %s: the spec of %s/%s no longer asks for it",
                    ref,
                    cluster.namespace,
                    cluster.name,
                )
                outcome.deleted.append(ref)

    async def _engine_loads(self, cluster: Cluster) -> dict[str, scale.EngineLoad]:
        if self._loads is None:
            return {}
        try:
            return await self._loads.engine_loads(cluster)
        except (ApiError, OSError, RedisError) as exc:
            logger.warning("cannot read the engines' load (%s): not-ready pods leave first, then any", exc)
            return {}

    async def _drain(
        self, cluster: Cluster, engine_plan: scale.EnginePlan, previous: Manifest, outcome: Outcome
    ) -> Manifest:
        """Before the engine Deployment shrinks, mark the engines ``engine_plan`` chose to leave
        (the ReplicaSet deletes them first) and drain them; returns the status as it now stands
        (``Draining=True`` while they drain).

        Without a drainer the engines still drain, in their pods' preStop hook, within the same
        deadline.
        """
        for engine in engine_plan.drain:
            try:
                await self._api.patch("v1", "Pod", cluster.namespace, engine.pod, scale.leaving_mark())
            except ApiError as exc:
                if exc.status != 404:
                    raise
                continue  # gone since the listing: nothing to mark
            outcome.patched.append(f"Pod/{engine.pod}")
        if self._drainer is None:
            return previous
        # Say so first: a drain takes up to the spec's deadline.
        pods = [engine.pod for engine in engine_plan.drain]
        draining = cluster_status.draining(previous, pods)
        if await self._write_status(cluster.namespace, cluster.name, previous, draining):
            outcome.status_written = True
        fleet_tls = await self._fleet_tls(cluster)
        outcome.drained = await self._drainer.drain(cluster, engine_plan.drain, fleet_tls)
        return draining

    async def _fleet_tls(self, cluster: Cluster) -> tls.FleetTls | None:
        """The fleet's TLS files, which its engines ask of EngineControl's callers; None when the
        links are plain, or the Secret cannot be read yet (the drain then fails, and the pods'
        preStop hooks drain the engines)."""
        name = fleet_tls_secret_name(cluster)
        if name is None:
            return None
        try:
            secret = await self._api.get("v1", "Secret", cluster.namespace, name)
        except ApiError as exc:
            logger.warning("cannot read the fleet TLS Secret %s/%s: %s", cluster.namespace, name, exc)
            return None
        data = (secret or {}).get("data") or {}
        try:
            ca, cert, key = (base64.b64decode(data[k]) for k in (tls.CA_FILE, tls.CERT_FILE, tls.KEY_FILE))
        except (KeyError, ValueError):
            logger.warning("the fleet TLS Secret %s/%s lacks a file", cluster.namespace, name)
            return None
        return tls.FleetTls(ca, cert, key)

    async def _get(self, manifest: Manifest) -> Manifest | None:
        meta = manifest["metadata"]
        return await self._api.get(manifest["apiVersion"], manifest["kind"], meta["namespace"], meta["name"])

    async def _apply(self, desired: Manifest, outcome: Outcome, live: Manifest | None) -> Manifest:
        """Bring the child ``desired`` describes to it, given it as read (``live``, None: absent)."""
        desired = stamped(desired)
        generated = _with_generated_keys(desired) if live is None else desired
        if generated is not desired:
            # A Secret whose values the operator generates: created with them once, by a create
            # (its values are then no applied field, and no later apply removes them).
            try:
                created = await self._api.create(generated)
            except ApiError as exc:
                if exc.status != 409:  # 409: another writer created it just now
                    raise
                live = await self._get(desired) or {}
            else:
                outcome.created.append(_ref(desired))
                return created
        if live is not None and not drifted(_owned_fields(desired), live):
            return live
        if live is not None:
            await self._drop_other_limit(desired, live)
        applied = await self._api.apply(desired)
        (outcome.created if live is None else outcome.patched).append(_ref(desired))
        return applied

    async def _drop_other_limit(self, desired: Manifest, live: Manifest) -> None:
        """Remove a PodDisruptionBudget's limit the rendering no longer holds when the operator
        does not own it (a budget written by an operator from before server-side apply): the
        apply would leave it, and the API server refuses a budget with both limits."""
        if desired["kind"] != "PodDisruptionBudget":
            return
        spec = live.get("spec") or {}
        stale = {
            k: None for k in ("minAvailable", "maxUnavailable") if k in spec and k not in desired["spec"]
        }
        if stale:
            meta = desired["metadata"]
            await self._api.patch(
                desired["apiVersion"], desired["kind"], meta["namespace"], meta["name"], {"spec": stale}
            )

    async def _write_status(self, namespace: str, name: str, previous: Manifest, wanted: Manifest) -> bool:
        if not drifted(wanted, previous):
            return False
        await self._api.patch(
            CLUSTER_API_VERSION, KIND, namespace, name, {"status": wanted}, subresource="status"
        )
        return True


def _summary(exc: ValidationError) -> str:
    """One line per problem, each naming its field the way the spec spells it."""
    lines = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"]) or "spec"
        lines.append(f"spec.{where}: {error['msg']}" if where != "spec" else f"spec: {error['msg']}")
    return "; ".join(lines)
