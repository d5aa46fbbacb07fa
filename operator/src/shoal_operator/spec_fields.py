"""The building blocks of the ``InferenceCluster`` models (``spec.py``): the base model, which
checks a model's CEL rules on load, the field patterns, and the small types several parts of the
spec share (Secret references, resources, pod settings).
"""

from __future__ import annotations

from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.config import JsonDict

from shoal_operator.cel import failures

IMAGE_PATTERN = r"^[a-z0-9]+([._/:@-][a-zA-Z0-9_.-]+)*$"
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti)?$"
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
REVISION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/-]*$"
KUBERNETES_TYPE = "x-shoal-kubernetes"
"""Schema key naming the Kubernetes API type a field holds (``crd.py`` puts that type's own
OpenAPI schema there, so the API server validates it as it validates a pod)."""


def cel_rules(*rules: tuple[str, str] | dict[str, str]) -> dict[str, Any]:
    """CEL rules for a model's schema: (expression over ``self``, message naming the fields), or
    a dict with a ``messageExpression`` where the message names a value."""
    listed = [r if isinstance(r, dict) else {"rule": r[0], "message": r[1]} for r in rules]
    return {"x-kubernetes-validations": listed}


def kubernetes_type(definition: str, **schema: Any) -> dict[str, Any]:
    """``json_schema_extra`` of a field holding Kubernetes' ``definition`` (or a list of them)."""
    return {KUBERNETES_TYPE: definition, **schema}


class SpecModel(BaseModel):
    """A part of the spec: unknown fields refused, frozen, and its CEL rules checked on load."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)

    @model_validator(mode="after")
    def _cel_rules(self) -> Self:
        extra = self.model_config.get("json_schema_extra")
        rules = extra.get("x-kubernetes-validations") if isinstance(extra, dict) else None
        if rules:
            value = self.model_dump(by_alias=True, exclude_none=True)
            broken = failures(rules, value)  # type: ignore[arg-type]
            if broken:
                raise ValueError("; ".join(broken))
        return self


class TokenSecret(SpecModel):
    """A Secret key holding a token (a Hugging Face access token, a bearer token)."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="Secret name.")
    key: str = Field(default="token", min_length=1, max_length=253, description="Key holding the token.")


class KeysSecret(SpecModel):
    """A Secret key holding an API keys file: one ``NAME SHA256_HEX`` line per key (the SHA-256
    of the key; ``python -m shoal_router.api.auth NAME < key`` prints one)."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS_LABEL_PATTERN, description="Secret name.")
    key: str = Field(default="keys", min_length=1, max_length=253, description="Key holding the file.")


class SecretKeyRef(SpecModel):
    """A key of a Secret in the cluster's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS_LABEL_PATTERN, description="Secret name.")
    key: str = Field(default="url", min_length=1, max_length=253, description="Key holding the value.")


class CurveKeySecret(SpecModel):
    """A Secret key holding the fleet's CURVE key file (``python -m shoal_protos.curve``)."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS_LABEL_PATTERN, description="Secret name.")
    key: str = Field(default="fleet.key", min_length=1, max_length=253, description="Key holding the file.")


class Resources(SpecModel):
    """Compute for one pod; requests equal limits (Guaranteed QoS, so CPU pinning holds)."""

    cpu: str = Field(default="2", pattern=QUANTITY_PATTERN, max_length=32, description="CPU cores.")
    memory: str = Field(default="8Gi", pattern=QUANTITY_PATTERN, max_length=32, description="Memory.")


STRING_MAP: JsonDict = {"maxProperties": 64, "additionalProperties": {"type": "string", "maxLength": 4096}}


class PodSettings(SpecModel):
    """Where and how a component's pods run: Kubernetes' own pod fields, validated as the API
    server validates a pod."""

    node_selector: dict[str, str] = Field(
        default_factory=dict,
        alias="nodeSelector",
        json_schema_extra=STRING_MAP,
        description="Node labels the pods must land on (a GPU node pool, for instance).",
    )
    tolerations: list[dict[str, Any]] = Field(
        default_factory=list,
        json_schema_extra=kubernetes_type("io.k8s.api.core.v1.Toleration", maxItems=32),
        description="Taints the pods tolerate (nvidia.com/gpu on tainted GPU nodes, for instance).",
    )
    affinity: dict[str, Any] | None = Field(
        default=None,
        json_schema_extra=kubernetes_type("io.k8s.api.core.v1.Affinity"),
        description="Node and pod affinity of the pods.",
    )
    topology_spread_constraints: list[dict[str, Any]] = Field(
        default_factory=list,
        alias="topologySpreadConstraints",
        json_schema_extra=kubernetes_type("io.k8s.api.core.v1.TopologySpreadConstraint", maxItems=8),
        description="How the pods spread over zones or nodes.",
    )
    priority_class_name: str | None = Field(
        default=None,
        alias="priorityClassName",
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="PriorityClass of the pods.",
    )
    runtime_class_name: str | None = Field(
        default=None,
        alias="runtimeClassName",
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="RuntimeClass of the pods (nvidia, for a GPU runtime that is not the default).",
    )
    scheduler_name: str | None = Field(
        default=None,
        alias="schedulerName",
        min_length=1,
        max_length=253,
        description="Scheduler of the pods.",
    )
    service_account_name: str | None = Field(
        default=None,
        alias="serviceAccountName",
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="ServiceAccount the pods run as; unset: the namespace's default.",
    )
    image_pull_secrets: list[dict[str, Any]] = Field(
        default_factory=list,
        alias="imagePullSecrets",
        json_schema_extra=kubernetes_type("io.k8s.api.core.v1.LocalObjectReference", maxItems=16),
        description="Secrets for pulling the images from a private registry.",
    )
    labels: dict[str, str] = Field(
        default_factory=dict, json_schema_extra=STRING_MAP, description="Extra labels on the pods."
    )
    annotations: dict[str, str] = Field(
        default_factory=dict, json_schema_extra=STRING_MAP, description="Extra annotations on the pods."
    )
