"""The ``InferenceCluster`` CustomResourceDefinition, generated from ``spec.py``.

``python -m shoal_operator.crd`` (``make crd``) writes it to ``CRD_PATH``, where the chart
installs it from (and the operator's RBAC rules and the Grafana dashboards next to the chart's
templates); a test fails when a checked-in file and the code drift apart.

pydantic's JSON schema becomes a Kubernetes *structural* schema: references are inlined, every
object lists its properties, ``Optional`` fields are simply not required, and titles go (the
descriptions stay). Cross-field rules travel as ``x-kubernetes-validations`` (CEL).
"""

from __future__ import annotations

import argparse
import sys
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from shoal_operator import dashboards, kubetypes, rbac
from shoal_operator.spec import (
    GROUP,
    KIND,
    KUBERNETES_TYPE,
    NAME_RULE,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
    InferenceClusterSpec,
    InferenceClusterStatus,
)

ROOT = Path(__file__).resolve().parents[3]
CRD_PATH = ROOT / "charts" / "shoal" / "files" / f"{PLURAL}.{GROUP}.yaml"

_DROP = {"title"}


def structural(schema: dict[str, Any]) -> dict[str, Any]:
    """A pydantic JSON schema (with ``$defs``) as a structural schema with nothing referenced."""
    defs = schema.get("$defs", {})

    def convert(node: dict[str, Any]) -> dict[str, Any]:
        if "$ref" in node:
            target = convert(defs[node["$ref"].rsplit("/", 1)[1]])
            # A field's own description and default win over the referenced model's.
            return {**target, **{k: v for k, v in node.items() if k not in _DROP and k != "$ref"}}
        any_of = node.get("anyOf")
        if any_of is not None:
            branches = [b for b in any_of if b.get("type") != "null"]
            if len(branches) != 1:
                raise ValueError(f"only Optional[X] unions map to a structural schema: {node}")
            rest = {k: v for k, v in node.items() if k not in _DROP and k != "anyOf"}
            if rest.get("default", "") is None:
                del rest["default"]  # absent, not null
            return convert({**branches[0], **rest})
        if KUBERNETES_TYPE in node:
            return _kubernetes_field(node)
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in _DROP or key == "$defs":
                continue
            if key == "properties":
                out[key] = {name: convert(child) for name, child in value.items()}
            elif key == "items":
                out[key] = convert(value)
            elif key == "additionalProperties":
                # A map (string to string) keeps its value schema; a model's `extra` flag does not
                # (unknown fields are pruned by the API server and refused by pydantic).
                if isinstance(value, dict) and "properties" not in node:
                    out[key] = convert(value)
            elif key in ("exclusiveMinimum", "exclusiveMaximum"):
                # JSON Schema's numeric form; OpenAPI v3.0 (Kubernetes) takes a bound and a flag.
                out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
                out[key] = True
            else:
                out[key] = value
        if out.get("type") == "object" and "properties" not in out and "additionalProperties" not in out:
            raise ValueError(f"an object without properties is not structural: {node}")
        return out

    return convert(schema)


def _kubernetes_field(node: dict[str, Any]) -> dict[str, Any]:
    """A field holding a Kubernetes type (or a list of them): that type's own schema."""
    definition = kubetypes.schema(node[KUBERNETES_TYPE])
    own = {k: v for k, v in node.items() if k not in _DROP and k not in (KUBERNETES_TYPE, "items")}
    if node.get("type") == "array":
        return {**own, "type": "array", "items": definition}
    own.pop("additionalProperties", None)
    return {**definition, **own, "type": "object"}


def _fill_defaults(model: type[BaseModel], node: dict[str, Any]) -> None:
    """Give every optional field of ``model`` with a default its whole default value.

    The API server checks a ``default`` against its node's schema and CEL rules as written,
    without first filling in the defaults of the fields inside it, so an object's default must
    already hold each of its fields (``{}`` fails every rule that reads one). The same values
    are what pydantic fills in, so the API server and the operator read a spec alike.
    """
    for name, info in model.model_fields.items():
        child = node["properties"][info.alias or name]
        if not info.is_required():
            value = info.get_default(call_default_factory=True)
            if isinstance(value, BaseModel):
                child["default"] = value.model_dump(by_alias=True, exclude_none=True, mode="json")
            elif value is not None:
                child["default"] = value
        annotation = info.annotation
        if typing.get_origin(annotation) is list:
            annotation, child = typing.get_args(annotation)[0], child["items"]
        for candidate in typing.get_args(annotation) or (annotation,):  # X, or X | None
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                _fill_defaults(candidate, child)


def _schema(model: type[InferenceClusterSpec] | type[InferenceClusterStatus]) -> dict[str, Any]:
    schema = structural(model.model_json_schema(by_alias=True, mode="validation"))
    _fill_defaults(model, schema)
    return schema


def build() -> dict[str, Any]:
    spec = _schema(InferenceClusterSpec)
    status = _schema(InferenceClusterStatus)
    status["properties"]["conditions"]["x-kubernetes-list-type"] = "map"
    status["properties"]["conditions"]["x-kubernetes-list-map-keys"] = ["type"]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": SHORT_NAMES,
                "categories": ["shoal"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "A Shoal LLM serving fleet: vLLM engines, routers, a "
                            "tokenizer and Redis, with live request migration.",
                            "required": ["spec"],
                            "x-kubernetes-validations": [NAME_RULE],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec,
                                "status": status,
                            },
                        }
                    },
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.engine.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": [
                        {"name": "Ready", "type": "string", "jsonPath": ".status.ready"},
                        {"name": "Engines", "type": "integer", "jsonPath": ".status.readyEngines"},
                        {"name": "Model", "type": "string", "jsonPath": ".spec.model.servedName"},
                        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                    ],
                }
            ],
        },
    }


def render() -> str:
    header = "# Generated by `make crd` (shoal_operator.crd) from operator/src/shoal_operator/spec.py.\n"
    return header + yaml.safe_dump(build(), sort_keys=False, width=100)


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Write what the Helm chart takes from the operator's code: the InferenceCluster "
        "CRD, the operator's RBAC rules and the Grafana dashboards"
    )
    parser.add_argument("--check", action="store_true", help="fail if a file differs")
    args = parser.parse_args()
    stale = False
    generated = {CRD_PATH: render(), rbac.RULES_PATH: rbac.rules_file(), **dashboards.files()}
    for path, text in generated.items():
        if args.check:
            if not path.exists() or path.read_text() != text:
                print(f"{path} is out of date: run `make crd`", file=sys.stderr)
                stale = True
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    if stale:
        sys.exit(1)


if __name__ == "__main__":
    main()
