"""Kubernetes' own OpenAPI schemas of the pod fields an InferenceCluster passes through.

Placement (tolerations, affinity, topology spread), image pull secrets and the engines' extra
environment are Kubernetes types. The CRD carries their schemas as Kubernetes publishes them,
so the API server checks them at ``kubectl apply`` as it checks a pod's, instead of accepting
any map and failing later when the Deployment is written.

The schemas come from the OpenAPI documents ``kubernetes-validate`` ships, for the oldest
Kubernetes version the chart supports (``KUBERNETES_VERSION``: a field newer than that would be
pruned by an older API server). They are turned into structural schemas: references inlined,
``null`` types dropped, integer-or-string and quantity fields marked as the API server expects,
and keys a CRD may not carry removed. Only ``crd.py`` (``make crd``) uses this module.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

KUBERNETES_VERSION = "1.29.0"
"""The chart's ``kubeVersion`` floor."""

_INT_OR_STRING = {
    "io.k8s.apimachinery.pkg.util.intstr.IntOrString",
    "io.k8s.apimachinery.pkg.api.resource.Quantity",
}
_KEPT_EXTENSIONS = {"x-kubernetes-list-type", "x-kubernetes-list-map-keys", "x-kubernetes-map-type"}


@functools.cache
def _definitions() -> dict[str, Any]:
    import kubernetes_validate  # a development dependency: only `make crd` needs it

    folder = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    document = json.loads((folder / f"v{KUBERNETES_VERSION}-local" / "_definitions.json").read_text())
    definitions: dict[str, Any] = document["$defs"]
    return definitions


def schema(definition: str) -> dict[str, Any]:
    """The structural schema of the Kubernetes type ``definition`` (``io.k8s.api.core.v1.X``).

    Descriptions keep their first sentence: whole, Kubernetes' pod reference copied three times
    over (engines, routers, tokenizer) would make the CRD larger than the 256 KiB annotation
    ``kubectl apply`` keeps.
    """
    return _convert(_definitions()[definition])


def _convert(node: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    if ref is not None:
        name = ref.rsplit("/", 1)[1]
        described = {"description": _first_sentence(node["description"])} if "description" in node else {}
        if name in _INT_OR_STRING:
            return {**described, "x-kubernetes-int-or-string": True}
        return {**_convert(_definitions()[name]), **described}
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "type":
            kinds = [value] if isinstance(value, str) else [v for v in value if v != "null"]
            out["type"] = kinds[0]
        elif key == "properties":
            out[key] = {name: _convert(child) for name, child in value.items()}
        elif key == "items":
            out[key] = _convert(value)
        elif key == "additionalProperties":
            if isinstance(value, dict):
                out[key] = _convert(value)
        elif key == "description":
            out[key] = _first_sentence(value)
        elif key in ("required", "enum", "format") or key in _KEPT_EXTENSIONS:
            out[key] = value
    if "properties" in out or "additionalProperties" in out:
        out["type"] = "object"
    return out


def _first_sentence(text: str) -> str:
    head, dot, _ = text.partition(". ")
    return head + dot.strip() if dot else text
