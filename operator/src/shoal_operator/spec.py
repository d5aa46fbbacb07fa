"""The ``InferenceCluster`` resource (``shoal.dev/v1alpha1``): spec and status.

These pydantic models are the single source of the custom resource definition: ``crd.py`` turns
them into the CRD's structural OpenAPI schema (descriptions, defaults, bounds, enums and the CEL
rules below), and the operator reads specs through them. Every field is documented, defaulted
where a sensible default exists, and bounded.

A rule that spans fields is written once, as a CEL expression in ``RULES``; the API server
enforces it at ``kubectl apply`` (``x-kubernetes-validations``), and the tests evaluate the same
expressions against sample objects.

The models live in three modules: ``spec_fields.py`` (the base model, patterns and the small
types several parts share), ``spec_workloads.py`` (the model served, engines, routers and the
tokenizer), and this one (the resource's names, the cluster-wide parts, the whole spec and the
status). The rest of the operator imports them from here.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from shoal_operator.spec_fields import (
    DNS_LABEL_PATTERN,
    IMAGE_PATTERN,
    KUBERNETES_TYPE,
    STRING_MAP,
    CurveKeySecret,
    PodSettings,
    SecretKeyRef,
    SpecModel,
    TokenSecret,
    cel_rules,
)
from shoal_operator.spec_workloads import (
    CPU_ENGINE_IMAGE,
    GPU_ENGINE_IMAGE,
    EngineSpec,
    ModelSpec,
    RouterSpec,
    TokenizerSpec,
)

__all__ = [
    "CPU_ENGINE_IMAGE",
    "GPU_ENGINE_IMAGE",
    "GROUP",
    "KIND",
    "KUBERNETES_TYPE",
    "MAX_NAME_LENGTH",
    "NAME_RULE",
    "PLURAL",
    "SHORT_NAMES",
    "SINGULAR",
    "VERSION",
    "AutoscalingSpec",
    "Condition",
    "DrainSpec",
    "EngineSpec",
    "FleetTlsSpec",
    "InferenceClusterSpec",
    "InferenceClusterStatus",
    "ModelSpec",
    "MonitoringSpec",
    "PodSettings",
    "RedisSpec",
    "RouterSpec",
    "ServiceMonitorSpec",
    "TokenizerSpec",
]

GROUP = "shoal.dev"
VERSION = "v1alpha1"
KIND = "InferenceCluster"
PLURAL = "inferenceclusters"
SINGULAR = "inferencecluster"
SHORT_NAMES = ["ic"]
MAX_NAME_LENGTH = 42
"""Longest cluster name: every child's name (``NAME-tokenizer``, ``NAME-redis-auth``, the Redis
StatefulSet's pods and their ``controller-revision-hash`` label) stays a valid DNS-1035 label of
at most 63 characters."""
NAME_RULE = {
    "rule": f"self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$') && "
    f"size(self.metadata.name) <= {MAX_NAME_LENGTH}",
    "message": f"metadata.name must be a DNS-1035 label of at most {MAX_NAME_LENGTH} characters "
    "(lower case letters, digits and '-', starting with a letter): the cluster's children are "
    "named after it",
}
"""The root rule of the CRD (the models never see ``metadata``; the reconciler checks it too)."""


class FleetTlsSpec(SpecModel):
    """Mutual TLS between the fleet's parts: EngineControl (drains and moves) and the KV data
    links between engines."""

    enabled: bool = Field(
        default=True,
        description="Engines take EngineControl calls and KV data only over mutual TLS, from "
        "holders of a certificate of the fleet's CA; false: both plain, open to any pod that "
        "reaches the engines' ports.",
    )
    secret_name: str | None = Field(
        default=None,
        alias="secretName",
        min_length=1,
        max_length=253,
        pattern=DNS_LABEL_PATTERN,
        description="A Secret with ca.crt, tls.crt and tls.key (cert-manager's layout), the "
        "certificate for the name shoal-fleet and for client and server use; unset: the "
        "operator makes one, <cluster>-fleet-tls, with a CA of its own.",
    )


class RedisSpec(SpecModel):
    """Where fleet state lives: a Redis the operator runs, or one you already have."""

    model_config = ConfigDict(
        json_schema_extra=cel_rules(
            (
                "self.mode == 'managed' || has(self.url) || has(self.urlSecret)",
                "redis.mode external needs redis.url or redis.urlSecret",
            ),
            ("!(has(self.url) && has(self.urlSecret))", "set only one of redis.url and redis.urlSecret"),
        )
    )

    mode: Literal["managed", "external"] = Field(
        default="managed", description="managed: a Redis StatefulSet and Service; external: url or urlSecret."
    )
    url: str | None = Field(
        default=None, pattern=r"^rediss?://", max_length=1024, description="External Redis URL (no password)."
    )
    url_secret: SecretKeyRef | None = Field(
        default=None, alias="urlSecret", description="Secret key holding the external Redis URL."
    )
    image: str = Field(
        default="redis:7.4", pattern=IMAGE_PATTERN, max_length=256, description="Image of the managed Redis."
    )


class DrainSpec(SpecModel):
    """How an engine leaves (scale-down, rollout): its requests migrate to the others first."""

    deadline_seconds: int = Field(
        default=60,
        alias="deadlineSeconds",
        ge=1,
        le=3600,
        description="How long an engine's drain may take; what is left then is recomputed elsewhere.",
    )


class AutoscalingSpec(SpecModel):
    """Built-in autoscaling of the engines between minReplicas and maxReplicas."""

    model_config = ConfigDict(
        json_schema_extra=cel_rules(
            (
                "self.metric != 'kvUsage' || self.target <= 1.0",
                "autoscaling.target is a fraction (<= 1) for metric kvUsage",
            ),
        )
    )

    enabled: bool = Field(default=False, description="Scale engines from fleet load in Redis.")
    metric: Literal["kvUsage", "queueLength"] = Field(
        default="kvUsage", description="kvUsage: mean KV cache use; queueLength: waiting requests per engine."
    )
    target: float = Field(default=0.7, gt=0, le=10_000, description="Value of the metric to hold.")
    cooldown_seconds: int = Field(
        default=300, alias="cooldownSeconds", ge=0, le=86_400, description="Least time between two changes."
    )


class ServiceMonitorSpec(SpecModel):
    """The per-cluster ServiceMonitor (made where the Prometheus operator's CRD exists)."""

    labels: dict[str, str] = Field(
        default_factory=dict,
        json_schema_extra=STRING_MAP,
        description="Labels on the ServiceMonitor (kube-prometheus-stack's Prometheus selects monitors "
        "by label, release=<its release> by default).",
    )
    interval: str = Field(
        default="15s", pattern=r"^[0-9]+(ms|s|m)$", max_length=16, description="How often Prometheus scrapes."
    )
    bearer_token_secret: TokenSecret | None = Field(
        default=None,
        alias="bearerTokenSecret",
        description="Secret key holding a raw admin key Prometheus sends as a bearer token (needed when "
        "router.adminKeysSecret guards /metrics; that Secret holds only the keys' hashes).",
    )


class MonitoringSpec(SpecModel):
    """How Prometheus finds the cluster's metrics."""

    service_monitor: ServiceMonitorSpec = Field(
        default_factory=ServiceMonitorSpec, alias="serviceMonitor", description="The ServiceMonitor."
    )


class InferenceClusterSpec(SpecModel):
    """A serving fleet: engines, routers, a tokenizer and Redis, reconciled by the operator."""

    model_config = ConfigDict(
        json_schema_extra=cel_rules(
            (
                "!self.autoscaling.enabled || self.engine.replicas >= self.engine.minReplicas",
                "with autoscaling.enabled, engine.replicas must be >= engine.minReplicas",
            ),
        )
    )

    model: ModelSpec = Field(description="The model the cluster serves.")
    engine: EngineSpec = Field(default_factory=EngineSpec, description="Engine pods.")
    router: RouterSpec = Field(default_factory=RouterSpec, description="Router pods.")
    tokenizer: TokenizerSpec = Field(default_factory=TokenizerSpec, description="Tokenizer pods.")
    redis: RedisSpec = Field(default_factory=RedisSpec, description="Fleet state store.")
    drain: DrainSpec = Field(default_factory=DrainSpec, description="Engine drain by migration.")
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec, description="Engine autoscaling.")
    monitoring: MonitoringSpec = Field(default_factory=MonitoringSpec, description="Prometheus scraping.")
    fleet_tls: FleetTlsSpec = Field(
        default_factory=FleetTlsSpec,
        alias="fleetTLS",
        description="Mutual TLS for EngineControl and the KV data links.",
    )
    zmq_curve_secret: CurveKeySecret | None = Field(
        default=None,
        alias="zmqCurveSecret",
        description="Secret key holding the fleet's CURVE key file (python -m shoal_protos.curve): "
        "router-engine ZeroMQ frames are encrypted and only fleet members connect; unset: plain.",
    )


class Condition(SpecModel):
    """A status condition (the Kubernetes convention)."""

    type: Literal["Ready", "EnginesReady", "RouterReady", "RedisReady", "Draining", "Updating"] = Field(
        description="What the condition is about."
    )
    status: Literal["True", "False", "Unknown"] = Field(description="Whether it holds.")
    reason: str = Field(default="", max_length=128, description="One CamelCase word, for machines.")
    message: str = Field(default="", max_length=4096, description="For people.")
    last_transition_time: str = Field(
        default="",
        alias="lastTransitionTime",
        max_length=64,
        description="When status last changed (RFC 3339).",
    )
    observed_generation: int = Field(
        default=0, alias="observedGeneration", ge=0, description="The spec generation this was computed for."
    )


class InferenceClusterStatus(SpecModel):
    """What the operator last saw of the cluster's children."""

    observed_generation: int = Field(
        default=0, alias="observedGeneration", ge=0, description="The spec generation last reconciled."
    )
    replicas: int = Field(default=0, ge=0, description="Engine pods that exist (the scale subresource).")
    ready_engines: int = Field(default=0, alias="readyEngines", ge=0, description="Engine pods ready.")
    selector: str = Field(default="", max_length=1024, description="Label selector of the engine pods.")
    model: str = Field(default="", max_length=128, description="Served model name.")
    ready: str = Field(
        default="Unknown", max_length=16, description="The Ready condition's status, for kubectl."
    )
    conditions: list[Condition] = Field(
        default_factory=list, description="Ready, EnginesReady, ... with reasons."
    )
