"""A small async Kubernetes API client for the reconciler: get, list, create, server-side
apply, merge-patch, delete, discovery.

It logs in the way kopf does (the same ``kopf.ConnectionInfo``: a service account in a pod, a
kubeconfig elsewhere), so the operator has one set of credentials for watching and for writing.
Only the kinds the operator manages are known; each maps to its REST path.
"""

from __future__ import annotations

import math
import ssl
import time
from typing import Any
from urllib.parse import urlencode

import aiohttp
import kopf

from shoal_operator.reconcile import ApiError
from shoal_operator.spec import GROUP, KIND, PLURAL, VERSION

Manifest = dict[str, Any]

FIELD_MANAGER = "shoal-operator"
"""The operator's name in the objects' ``managedFields``: one manager for every child."""
APPLY_PATCH = "application/apply-patch+yaml"

PLURALS: dict[tuple[str, str], str] = {
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Service"): "services",
    ("v1", "Secret"): "secrets",
    ("v1", "Pod"): "pods",
    ("apps/v1", "StatefulSet"): "statefulsets",
    ("apps/v1", "Deployment"): "deployments",
    ("networking.k8s.io/v1", "Ingress"): "ingresses",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitors",
    (f"{GROUP}/{VERSION}", KIND): PLURAL,
}
"""REST names of the kinds the operator reads and writes."""


def _root(api_version: str) -> str:
    """Where ``api_version`` is served: the core group under ``/api``, the others under ``/apis``."""
    return "/api/v1" if api_version == "v1" else f"/apis/{api_version}"


def path(api_version: str, kind: str, namespace: str, name: str = "", subresource: str = "") -> str:
    """The REST path of a namespaced object (or of its collection when ``name`` is empty; of
    every namespace's when ``namespace`` is empty too)."""
    plural = PLURALS.get((api_version, kind))
    if plural is None:
        raise ValueError(f"the operator does not manage {kind} ({api_version})")
    parts = [_root(api_version), "namespaces" if namespace else "", namespace, plural, name, subresource]
    return "/" + "/".join(part.strip("/") for part in parts if part)


class Kube:
    """Kubernetes API calls with the credentials kopf logged in with."""

    def __init__(
        self, info: kopf.ConnectionInfo, timeout_s: float = 30.0, discovery_ttl_s: float = 60.0
    ) -> None:
        self._base = info.server.rstrip("/")
        self._headers = {"Accept": "application/json", **info.as_http_headers()}
        self._ssl: ssl.SSLContext | bool = info.as_ssl_context() if self._base.startswith("https") else True
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._discovered: dict[str, tuple[float, set[str]]] = {}
        self._discovery_ttl_s = discovery_ttl_s

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(
        self, method: str, url_path: str, body: Manifest | None = None, content_type: str = ""
    ) -> Any:
        if self._session is None:
            self._session = aiohttp.ClientSession(headers=self._headers, timeout=self._timeout)
        headers = {"Content-Type": content_type or "application/json"} if body is not None else {}
        async with self._session.request(
            method, self._base + url_path, json=body, headers=headers, ssl=self._ssl
        ) as response:
            if response.status == 404 and method == "GET":
                return None
            payload = await response.json(content_type=None) if response.content_length != 0 else {}
            if response.status >= 400:
                message = payload.get("message", "") if isinstance(payload, dict) else str(payload)
                raise ApiError(response.status, f"{method} {url_path}: {message}")
            return payload

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> Manifest | None:
        result: Manifest | None = await self._call("GET", path(api_version, kind, namespace, name))
        return result

    async def list(self, api_version: str, kind: str, namespace: str, label_selector: str) -> list[Manifest]:
        """The objects of ``kind`` in ``namespace`` whose labels match ``label_selector``."""
        query = urlencode({"labelSelector": label_selector})
        result = await self._call("GET", f"{path(api_version, kind, namespace)}?{query}")
        items: list[Manifest] = (result or {}).get("items") or []
        return items

    async def create(self, manifest: Manifest) -> Manifest:
        meta = manifest["metadata"]
        url_path = path(manifest["apiVersion"], manifest["kind"], meta["namespace"])
        query = urlencode({"fieldManager": FIELD_MANAGER})
        result: Manifest = await self._call("POST", f"{url_path}?{query}", manifest)
        return result

    async def apply(self, manifest: Manifest) -> Manifest:
        """Server-side apply of ``manifest`` as the operator's field manager: the object is
        created if absent; fields the operator applied before and ``manifest`` leaves out are
        removed (unless another manager set them too); ``force`` takes over fields someone else
        changed, since the spec is what the cluster should be."""
        meta = manifest["metadata"]
        url_path = path(manifest["apiVersion"], manifest["kind"], meta["namespace"], meta["name"])
        query = urlencode({"fieldManager": FIELD_MANAGER, "force": "true"})
        # JSON is YAML: the apply content type takes it as it is.
        result: Manifest = await self._call("PATCH", f"{url_path}?{query}", manifest, APPLY_PATCH)
        return result

    async def patch(
        self, api_version: str, kind: str, namespace: str, name: str, body: Manifest, subresource: str = ""
    ) -> Manifest:
        url_path = path(api_version, kind, namespace, name, subresource)
        result: Manifest = await self._call("PATCH", url_path, body, "application/merge-patch+json")
        return result

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        """Delete an object; its dependents go in the background (Kubernetes' default)."""
        await self._call("DELETE", path(api_version, kind, namespace, name))

    async def has_resource(self, api_version: str, plural: str) -> bool:
        """Whether the API serves ``plural`` in ``api_version``; the answer is kept for
        ``discovery_ttl_s``, so a CRD installed (or removed) after the operator started is
        seen within that time, without a restart."""
        asked_at, names = self._discovered.get(api_version, (-math.inf, set()))
        if time.monotonic() - asked_at >= self._discovery_ttl_s:
            try:
                listing = await self._call("GET", _root(api_version))
            except ApiError:
                listing = None
            names = {r.get("name", "") for r in (listing or {}).get("resources", [])}
            self._discovered[api_version] = (time.monotonic(), names)
        return plural in names
