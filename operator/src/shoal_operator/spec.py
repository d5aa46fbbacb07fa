"""The ``InferenceCluster`` resource (``shoal.dev/v1alpha1``): spec and status, in one place.

These pydantic models are the single source of the custom resource definition: ``crd.py`` turns
them into the CRD's structural OpenAPI schema (descriptions, defaults, bounds, enums and the CEL
rules below), and the operator reads specs through them. Every field is documented, defaulted
where a sensible default exists, and bounded.

A rule that spans fields is written once, as a CEL expression in ``RULES``; the API server
enforces it at ``kubectl apply`` (``x-kubernetes-validations``), and the tests evaluate the same
expressions against sample objects.
"""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.config import JsonDict

from shoal_operator.cel import failures
from shoal_protos.vllm_flags import OWNED_VLLM_FLAGS

GROUP = "shoal.dev"
VERSION = "v1alpha1"
KIND = "InferenceCluster"
PLURAL = "inferenceclusters"
SINGULAR = "inferencecluster"
SHORT_NAMES = ["ic"]

IMAGE_PATTERN = r"^[a-z0-9]+([._/:@-][a-zA-Z0-9_.-]+)*$"
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti)?$"
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
REVISION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/-]*$"
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
KUBERNETES_TYPE = "x-shoal-kubernetes"
"""Schema key naming the Kubernetes API type a field holds (``crd.py`` puts that type's own
OpenAPI schema there, so the API server validates it as it validates a pod)."""
_SCORER = r"(least_load|prefix_affinity|session_affinity)(=[0-9]+(\.[0-9]+)?)?"
SCHEDULER_PATTERN = rf"^(round_robin|{_SCORER}(,{_SCORER})*)$"
"""A router scheduler profile, or scorer weights (see the router's ``core.scheduling``)."""


def _rules(*rules: tuple[str, str] | dict[str, str]) -> dict[str, Any]:
    """CEL rules for a model's schema: (expression over ``self``, message naming the fields), or
    a dict with a ``messageExpression`` where the message names a value."""
    listed = [r if isinstance(r, dict) else {"rule": r[0], "message": r[1]} for r in rules]
    return {"x-kubernetes-validations": listed}


def _kubernetes(definition: str, **schema: Any) -> dict[str, Any]:
    """``json_schema_extra`` of a field holding Kubernetes' ``definition`` (or a list of them)."""
    return {KUBERNETES_TYPE: definition, **schema}


def _flag_names(dashes: str) -> str:
    names = {f[len(dashes) :] for f in OWNED_VLLM_FLAGS if f.startswith(dashes) and f[len(dashes)] != "-"}
    return "|".join(sorted(name.replace("_", "-").replace("-", "[-_]") for name in names))


OWNED_FLAG_PATTERN = f"^(--({_flag_names('--')})|-({_flag_names('-')}))(=.*)?$"
"""An ``extraArgs`` item that is a flag Shoal sets itself (either spelling, with or without ``=``)."""


class _Spec(BaseModel):
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


class TokenSecret(_Spec):
    """A Secret key holding a token (a Hugging Face access token, a bearer token)."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="Secret name.")
    key: str = Field(default="token", min_length=1, max_length=253, description="Key holding the token.")


class ModelVolume(_Spec):
    """A PersistentVolumeClaim holding the model's files, mounted read-only."""

    claim_name: str = Field(
        alias="claimName",
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="PersistentVolumeClaim in the cluster's namespace (ReadOnlyMany, or ReadWriteOnce "
        "with every engine on one node). model.source is then the folder inside it.",
    )


class ModelCache(_Spec):
    """Where engines and the tokenizer keep downloaded weights (``HF_HOME``)."""

    model_config = ConfigDict(
        json_schema_extra=_rules(
            (
                "has(self.claimName) != has(self.sizeLimit)",
                "model.cache needs exactly one of claimName (a PersistentVolumeClaim, kept across "
                "restarts) and sizeLimit (an emptyDir of that size)",
            ),
        )
    )

    claim_name: str | None = Field(
        default=None,
        alias="claimName",
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="PersistentVolumeClaim for the download cache (ReadWriteMany when engines run on "
        "several nodes): weights are downloaded once, not on every start.",
    )
    size_limit: str | None = Field(
        default=None,
        alias="sizeLimit",
        pattern=QUANTITY_PATTERN,
        max_length=32,
        description="Size of an emptyDir for the download cache; the pods request as much "
        "ephemeral storage, so the scheduler places them where the weights fit.",
    )


class ModelSpec(_Spec):
    """The model every engine of the cluster serves."""

    model_config = ConfigDict(
        json_schema_extra=_rules(
            (
                "!has(self.pvc) || !has(self.revision)",
                "model.revision names a Hugging Face revision; a model in a PersistentVolumeClaim has none",
            ),
        )
    )

    source: str = Field(
        min_length=1,
        max_length=512,
        description="Where engines load the model from: a Hugging Face repository id, a path inside "
        "the engine image, or with model.pvc the folder inside that claim.",
    )
    served_name: str = Field(
        alias="servedName",
        min_length=1,
        max_length=128,
        description="The name clients put in the `model` field of OpenAI requests.",
    )
    revision: str | None = Field(
        default=None,
        pattern=REVISION_PATTERN,
        max_length=128,
        description="Hugging Face revision (branch, tag or commit) to load; unset: the default branch.",
    )
    token_secret: TokenSecret | None = Field(
        default=None,
        alias="tokenSecret",
        description="Secret key holding a Hugging Face token, for gated models: engines and the "
        "tokenizer get it as HF_TOKEN from the Secret (never in arguments or logs).",
    )
    pvc: ModelVolume | None = Field(
        default=None,
        description="Load the model from a PersistentVolumeClaim mounted read-only at /models "
        "instead of downloading it.",
    )
    cache: ModelCache | None = Field(
        default=None,
        description="Volume for downloaded weights; unset: an emptyDir without a limit (downloads "
        "again on every start, never into the container's own filesystem).",
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        default="bfloat16", description="Weight and activation type."
    )
    max_model_len: int = Field(
        default=2048,
        alias="maxModelLen",
        ge=128,
        le=1_048_576,
        description="Longest prompt plus output, in tokens.",
    )


class Resources(_Spec):
    """Compute for one pod; requests equal limits (Guaranteed QoS, so CPU pinning holds)."""

    cpu: str = Field(default="2", pattern=QUANTITY_PATTERN, max_length=32, description="CPU cores.")
    memory: str = Field(default="8Gi", pattern=QUANTITY_PATTERN, max_length=32, description="Memory.")


_STRING_MAP: JsonDict = {"maxProperties": 64, "additionalProperties": {"type": "string", "maxLength": 4096}}


class PodSettings(_Spec):
    """Where and how a component's pods run: Kubernetes' own pod fields, validated as the API
    server validates a pod."""

    node_selector: dict[str, str] = Field(
        default_factory=dict,
        alias="nodeSelector",
        json_schema_extra=_STRING_MAP,
        description="Node labels the pods must land on (a GPU node pool, for instance).",
    )
    tolerations: list[dict[str, Any]] = Field(
        default_factory=list,
        json_schema_extra=_kubernetes("io.k8s.api.core.v1.Toleration", maxItems=32),
        description="Taints the pods tolerate (nvidia.com/gpu on tainted GPU nodes, for instance).",
    )
    affinity: dict[str, Any] | None = Field(
        default=None,
        json_schema_extra=_kubernetes("io.k8s.api.core.v1.Affinity"),
        description="Node and pod affinity of the pods.",
    )
    topology_spread_constraints: list[dict[str, Any]] = Field(
        default_factory=list,
        alias="topologySpreadConstraints",
        json_schema_extra=_kubernetes("io.k8s.api.core.v1.TopologySpreadConstraint", maxItems=8),
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
        json_schema_extra=_kubernetes("io.k8s.api.core.v1.LocalObjectReference", maxItems=16),
        description="Secrets for pulling the images from a private registry.",
    )
    labels: dict[str, str] = Field(
        default_factory=dict, json_schema_extra=_STRING_MAP, description="Extra labels on the pods."
    )
    annotations: dict[str, str] = Field(
        default_factory=dict, json_schema_extra=_STRING_MAP, description="Extra annotations on the pods."
    )


CPU_ENGINE_IMAGE, GPU_ENGINE_IMAGE = "shoal/engine-cpu:0.1.0", "shoal/engine:0.1.0"


class EngineSpec(_Spec):
    """The vLLM engine pods (a Deployment; scale-down removes the least-loaded engines)."""

    model_config = ConfigDict(
        json_schema_extra=_rules(
            ("self.minReplicas <= self.maxReplicas", "engine.minReplicas must be <= engine.maxReplicas"),
            ("self.replicas <= self.maxReplicas", "engine.replicas must be <= engine.maxReplicas"),
            (
                "!has(self.kvTransport) || self.kvTransport != 'nccl' || self.gpus > 0",
                "engine.kvTransport nccl needs engine.gpus > 0",
            ),
            (
                "!has(self.kvTransport) || self.kvTransport == 'nccl' || self.gpus == 0",
                "engine.kvTransport tcp and gloo copy a CPU KV cache: with engine.gpus use nccl, or "
                "leave kvTransport unset",
            ),
            (
                "self.gpus == 0 || self.gpus == self.tensorParallelSize * self.pipelineParallelSize",
                "engine.gpus must equal engine.tensorParallelSize x engine.pipelineParallelSize",
            ),
            {
                "rule": f"self.extraArgs.all(a, !a.matches('{OWNED_FLAG_PATTERN}'))",
                "messageExpression": "'engine.extraArgs: ' + self.extraArgs.filter(a, "
                f"a.matches('{OWNED_FLAG_PATTERN}'))[0] + ' is set by Shoal: use the "
                "InferenceCluster field for it'",
            },
        )
    )

    replicas: int = Field(
        default=2,
        ge=0,
        le=1024,
        description="Engines running now (the scale subresource); 0 stops every engine and keeps the "
        "rest of the cluster. With autoscaling it stays within minReplicas..maxReplicas.",
    )
    min_replicas: int = Field(
        default=1, alias="minReplicas", ge=0, le=1024, description="Fewest engines autoscaling keeps."
    )
    max_replicas: int = Field(
        default=8, alias="maxReplicas", ge=1, le=1024, description="Most engines there may be."
    )
    image: str | None = Field(
        default=None,
        pattern=IMAGE_PATTERN,
        max_length=256,
        description=f"Engine image; unset: {GPU_ENGINE_IMAGE} with GPUs, {CPU_ENGINE_IMAGE} without.",
    )
    max_surge: int = Field(
        default=1,
        alias="maxSurge",
        ge=0,
        le=64,
        description="Extra engines started on the new template when the engine pod template changes; "
        "old engines stop (drained by migration) only as new ones are ready, so capacity never "
        "drops. 0 replaces engines one at a time (each drained before it goes).",
    )
    gpus: int = Field(
        default=0,
        ge=0,
        le=16,
        description="GPUs per engine (tensorParallelSize x pipelineParallelSize); 0 runs vLLM's CPU build.",
    )
    tensor_parallel_size: int = Field(
        default=1, alias="tensorParallelSize", ge=1, le=16, description="vLLM's tensor parallel size."
    )
    pipeline_parallel_size: int = Field(
        default=1, alias="pipelineParallelSize", ge=1, le=16, description="vLLM's pipeline parallel size."
    )
    gpu_memory_utilization: float | None = Field(
        default=None,
        alias="gpuMemoryUtilization",
        ge=0.05,
        le=0.99,
        description="Share of each GPU's memory vLLM may use (weights, activations, KV cache); "
        "unset: vLLM's default.",
    )
    quantization: str | None = Field(
        default=None,
        pattern=r"^[a-z0-9_-]+$",
        max_length=64,
        description="vLLM's quantization method (awq, gptq, fp8, ...); unset: from the model's config.",
    )
    extra_args: list[str] = Field(
        default_factory=list,
        alias="extraArgs",
        max_length=64,
        json_schema_extra={"items": {"type": "string", "maxLength": 512}},
        description="vLLM engine flags passed through as given (--enable-chunked-prefill, "
        "--max-num-batched-tokens=8192, --kv-cache-dtype=fp8, ...); vLLM's own parser checks "
        "them when the engine starts. Flags Shoal sets itself are refused.",
    )
    env: list[dict[str, Any]] = Field(
        default_factory=list,
        json_schema_extra=_kubernetes("io.k8s.api.core.v1.EnvVar", maxItems=64),
        description="Extra environment variables of the engine container.",
    )
    env_from: list[dict[str, Any]] = Field(
        default_factory=list,
        alias="envFrom",
        json_schema_extra=_kubernetes("io.k8s.api.core.v1.EnvFromSource", maxItems=16),
        description="ConfigMaps and Secrets whose keys become environment variables of the engine.",
    )
    shm_size: str | None = Field(
        default=None,
        alias="shmSize",
        pattern=QUANTITY_PATTERN,
        max_length=32,
        description="Size limit of /dev/shm (memory-backed; tensor-parallel workers exchange data "
        "there); unset: no limit of its own.",
    )
    startup_seconds: int = Field(
        default=1200,
        alias="startupSeconds",
        ge=30,
        le=14_400,
        description="How long an engine may take to load its model before its liveness counts.",
    )
    pod: PodSettings = Field(default_factory=PodSettings, description="Placement and pod settings.")
    resources: Resources = Field(default_factory=Resources, description="CPU and memory per engine.")
    kv_cache_gib: int = Field(
        default=4, alias="kvCacheGiB", ge=1, le=4096, description="KV cache per engine (CPU engines), GiB."
    )
    kv_transport: Literal["tcp", "gloo", "nccl"] | None = Field(
        default=None,
        alias="kvTransport",
        description="How migrations copy KV blocks between engines: tcp or gloo on CPU, nccl on GPUs. "
        "Unset: nccl with GPUs, tcp without.",
    )
    block_size: int | None = Field(
        default=None,
        alias="blockSize",
        ge=16,
        le=256,
        multiple_of=16,
        description="Tokens per KV block. Unset: 128 on CPU engines (vLLM's CPU default: fewer blocks "
        "for vLLM to hash, look up and allocate when a moved request is admitted, and faster CPU "
        "attention over long contexts) and 32 on GPU engines.",
    )
    max_num_seqs: int = Field(
        default=64, alias="maxNumSeqs", ge=1, le=4096, description="Most requests one engine batches."
    )
    priority_headroom: float = Field(
        default=0.25,
        alias="priorityHeadroom",
        ge=0.0,
        le=1.0,
        description="Fraction of an engine's KV cache routers count as used for each priority request "
        "(priority below 0) it holds, so other requests go and move elsewhere.",
    )
    precopy_share: float | None = Field(
        default=None,
        alias="precopyShare",
        ge=0.0,
        le=1.0,
        description="Share of the time a migration's pre-copy may spend sending KV while the "
        "request keeps decoding on its engine (0: unpaced). Unset: 0.05 on CPU engines, whose "
        "decoding shares the core with the copy, and unpaced on GPU engines. A drain's moves are "
        "never paced.",
    )
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        default="fcfs",
        alias="schedulingPolicy",
        description="vLLM's scheduling policy: fcfs, or priority (lower priority values first, "
        "preempting higher ones).",
    )


class IngressSpec(_Spec):
    """An optional Ingress in front of the router Service."""

    enabled: bool = Field(default=False, description="Create an Ingress for the router.")
    host: str = Field(default="", max_length=253, description="Host name the Ingress answers for.")
    class_name: str = Field(default="", alias="className", max_length=253, description="IngressClass name.")


class KeysSecret(_Spec):
    """A Secret key holding an API keys file: one ``NAME SHA256_HEX`` line per key (the SHA-256
    of the key; ``python -m shoal_router.api.auth NAME < key`` prints one)."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS_LABEL_PATTERN, description="Secret name.")
    key: str = Field(default="keys", min_length=1, max_length=253, description="Key holding the file.")


class RouterSpec(_Spec):
    """The OpenAI-compatible routers (a Deployment; they share request state in Redis)."""

    replicas: int = Field(default=1, ge=1, le=64, description="Router pods.")
    image: str = Field(
        default="shoal/router:0.1.0", pattern=IMAGE_PATTERN, max_length=256, description="Router image."
    )
    resources: Resources = Field(
        default=Resources(cpu="1", memory="1Gi"), description="CPU and memory per router."
    )
    ingress: IngressSpec = Field(default_factory=IngressSpec, description="Ingress for the router.")
    pod: PodSettings = Field(default_factory=PodSettings, description="Placement and pod settings.")
    api_keys_secret: KeysSecret | None = Field(
        default=None,
        alias="apiKeysSecret",
        description="API keys required as bearer tokens on /v1/*; unset: the API is open.",
    )
    admin_keys_secret: KeysSecret | None = Field(
        default=None,
        alias="adminKeysSecret",
        description="Keys required on /metrics and the fleet page; unset: they are open.",
    )
    scheduler: str = Field(
        default="least_load",
        pattern=SCHEDULER_PATTERN,
        max_length=200,
        description="How each request is placed on an engine: least_load (free KV per batch slot), "
        "round_robin, prefix_affinity, session_affinity (the x-session-id header), or scorer weights "
        "such as prefix_affinity=2,least_load=1.",
    )
    hold_max_s: float = Field(
        default=1.0,
        ge=0.0,
        le=60.0,
        alias="holdMaxSeconds",
        description="While every engine is short of KV cache (under 2 blocks per batch slot), a new "
        "request waits at the router for room, at most this long, instead of making an engine preempt "
        "a running one; 0 sends every request at once.",
    )
    balance: bool = Field(
        default=False,
        description="The routers elect a leader (a lease in Redis) that moves running requests from "
        "crowded engines to free ones by live migration.",
    )
    consolidate_below: float = Field(
        default=0.0,
        ge=0.0,
        le=0.65,
        alias="consolidateBelow",
        description="With balance: while the load (KV blocks and batch slots in use) over the engines "
        "that would be left stays below this fraction, the leader empties the least-loaded engine "
        "onto the others, so a scale-down removes it without moving anything; 0 turns it off. It "
        "goes back to serving above 0.7.",
    )


class TokenizerSpec(_Spec):
    """The tokenizer service (a Deployment behind a gRPC Service)."""

    replicas: int = Field(default=1, ge=1, le=16, description="Tokenizer pods.")
    image: str = Field(
        default="shoal/tokenizer:0.1.0", pattern=IMAGE_PATTERN, max_length=256, description="Tokenizer image."
    )
    resources: Resources = Field(
        default=Resources(cpu="1", memory="2Gi"), description="CPU and memory per tokenizer."
    )
    startup_seconds: int = Field(
        default=600,
        alias="startupSeconds",
        ge=30,
        le=14_400,
        description="How long a tokenizer may take to load the model's tokenizer (a download, for a "
        "repository id) before its liveness counts.",
    )
    pod: PodSettings = Field(default_factory=PodSettings, description="Placement and pod settings.")


class SecretKeyRef(_Spec):
    """A key of a Secret in the cluster's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS_LABEL_PATTERN, description="Secret name.")
    key: str = Field(default="url", min_length=1, max_length=253, description="Key holding the value.")


class CurveKeySecret(_Spec):
    """A Secret key holding the fleet's CURVE key file (``python -m shoal_protos.curve``)."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS_LABEL_PATTERN, description="Secret name.")
    key: str = Field(default="fleet.key", min_length=1, max_length=253, description="Key holding the file.")


class FleetTlsSpec(_Spec):
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


class RedisSpec(_Spec):
    """Where fleet state lives: a Redis the operator runs, or one you already have."""

    model_config = ConfigDict(
        json_schema_extra=_rules(
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


class DrainSpec(_Spec):
    """How an engine leaves (scale-down, rollout): its requests migrate to the others first."""

    deadline_seconds: int = Field(
        default=60,
        alias="deadlineSeconds",
        ge=1,
        le=3600,
        description="How long an engine's drain may take; what is left then is recomputed elsewhere.",
    )


class AutoscalingSpec(_Spec):
    """Built-in autoscaling of the engines between minReplicas and maxReplicas."""

    model_config = ConfigDict(
        json_schema_extra=_rules(
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


class ServiceMonitorSpec(_Spec):
    """The per-cluster ServiceMonitor (made where the Prometheus operator's CRD exists)."""

    labels: dict[str, str] = Field(
        default_factory=dict,
        json_schema_extra=_STRING_MAP,
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


class MonitoringSpec(_Spec):
    """How Prometheus finds the cluster's metrics."""

    service_monitor: ServiceMonitorSpec = Field(
        default_factory=ServiceMonitorSpec, alias="serviceMonitor", description="The ServiceMonitor."
    )


class InferenceClusterSpec(_Spec):
    """A serving fleet: engines, routers, a tokenizer and Redis, reconciled by the operator."""

    model_config = ConfigDict(
        json_schema_extra=_rules(
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


class Condition(_Spec):
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


class InferenceClusterStatus(_Spec):
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
