"""Admission of InferenceCluster objects the way the API server does it, from the checked-in CRD:
structural defaults, then the ``openAPIV3Schema``, then the ``x-kubernetes-validations`` rules
with a CEL interpreter (no API server runs here)."""

from __future__ import annotations

import copy
from typing import Any

import jsonschema
import yaml

from shoal_operator import crd
from shoal_operator.cel import failures, typed


def crd_manifest() -> dict[str, Any]:
    return yaml.safe_load(crd.CRD_PATH.read_text())


def crd_schema() -> dict[str, Any]:
    schema: dict[str, Any] = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def defaulted(value: Any, schema: dict[str, Any]) -> Any:
    """Structural defaulting: absent properties with a default get it, then their own."""
    if schema.get("type") == "object" and isinstance(value, dict):
        out = dict(value)
        for name, child in schema.get("properties", {}).items():
            if name not in out and "default" in child:
                out[name] = copy.deepcopy(child["default"])
            if name in out:
                out[name] = defaulted(out[name], child)
        return out
    if schema.get("type") == "array" and isinstance(value, list):
        return [defaulted(v, schema.get("items", {})) for v in value]
    return value


def rule_failures(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Every broken ``x-kubernetes-validations`` rule, anywhere in ``value``."""
    broken = []
    if schema.get("type") == "object" and isinstance(value, dict):
        rules = schema.get("x-kubernetes-validations")
        if rules:
            broken += [f"{path}: {m}" for m in failures(rules, typed(value, schema))]
        for name, child in schema.get("properties", {}).items():
            if name in value:
                broken += rule_failures(value[name], child, f"{path}.{name}")
    return broken


def unknown_fields(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Fields the schema does not declare: ``kubectl apply`` asks for strict field validation
    (its default since Kubernetes 1.27), so the API server refuses them instead of pruning."""
    if schema.get("x-kubernetes-preserve-unknown-fields") or path == ".metadata":
        return []
    if schema.get("type") == "object" and isinstance(value, dict):
        properties = schema.get("properties")
        if properties is None:
            values = schema.get("additionalProperties", {})
            return [e for k, v in value.items() for e in unknown_fields(v, values, f"{path}.{k}")]
        found = [f'unknown field "{path[1:]}.{k}"' for k in value if k not in properties]
        return found + [
            e
            for k, v in value.items()
            if k in properties
            for e in unknown_fields(v, properties[k], f"{path}.{k}")
        ]
    if schema.get("type") == "array" and isinstance(value, list):
        return [
            e for i, v in enumerate(value) for e in unknown_fields(v, schema.get("items", {}), f"{path}[{i}]")
        ]
    return []


def admit(obj: dict[str, Any]) -> dict[str, Any]:
    """What the API server would store, or ValueError with its complaints."""
    schema = crd_schema()
    stored = defaulted(obj, schema)
    errors = unknown_fields(stored, schema)
    errors += [e.message for e in jsonschema.Draft4Validator(schema).iter_errors(stored)]
    errors += rule_failures(stored, schema)
    if errors:
        raise ValueError("; ".join(errors))
    return stored
