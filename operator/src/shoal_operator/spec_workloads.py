"""The spec of the cluster's workloads: the model they serve, the engines, the routers and the
tokenizer (parts of ``InferenceClusterSpec``, ``spec.py``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from shoal_operator.spec_fields import (
    DNS_SUBDOMAIN_PATTERN,
    IMAGE_PATTERN,
    QUANTITY_PATTERN,
    REVISION_PATTERN,
    KeysSecret,
    PodSettings,
    Resources,
    SpecModel,
    TokenSecret,
    cel_rules,
    kubernetes_type,
)
from shoal_protos.vllm_flags import OWNED_VLLM_FLAGS

_SCORER = r"(least_load|prefix_affinity|session_affinity|prefix_cache)(=[0-9]+(\.[0-9]+)?)?"
SCHEDULER_PATTERN = rf"^(round_robin|{_SCORER}(,{_SCORER})*)$"
"""A router scheduler profile, or scorer weights (see the router's ``core.scheduling``)."""


def _flag_names(dashes: str) -> str:
    names = {f[len(dashes) :] for f in OWNED_VLLM_FLAGS if f.startswith(dashes) and f[len(dashes)] != "-"}
    return "|".join(sorted(name.replace("_", "-").replace("-", "[-_]") for name in names))


OWNED_FLAG_PATTERN = f"^(--({_flag_names('--')})|-({_flag_names('-')}))(=.*)?$"
"""An ``extraArgs`` item that is a flag Shoal sets itself (either spelling, with or without ``=``)."""


class ModelVolume(SpecModel):
    """A PersistentVolumeClaim holding the model's files, mounted read-only."""

    claim_name: str = Field(
        alias="claimName",
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="PersistentVolumeClaim in the cluster's namespace (ReadOnlyMany, or ReadWriteOnce "
        "with every engine on one node). model.source is then the folder inside it.",
    )


class ModelCache(SpecModel):
    """Where engines and the tokenizer keep downloaded weights (``HF_HOME``)."""

    model_config = ConfigDict(
        json_schema_extra=cel_rules(
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


class ModelSpec(SpecModel):
    """The model every engine of the cluster serves."""

    model_config = ConfigDict(
        json_schema_extra=cel_rules(
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


CPU_ENGINE_IMAGE, GPU_ENGINE_IMAGE = "shoal/engine-cpu:0.1.0", "shoal/engine:0.1.0"


class EngineSpec(SpecModel):
    """The vLLM engine pods (a Deployment; scale-down removes the least-loaded engines)."""

    model_config = ConfigDict(
        json_schema_extra=cel_rules(
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
        json_schema_extra=kubernetes_type("io.k8s.api.core.v1.EnvVar", maxItems=64),
        description="Extra environment variables of the engine container.",
    )
    env_from: list[dict[str, Any]] = Field(
        default_factory=list,
        alias="envFrom",
        json_schema_extra=kubernetes_type("io.k8s.api.core.v1.EnvFromSource", maxItems=16),
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


class IngressSpec(SpecModel):
    """An optional Ingress in front of the router Service."""

    enabled: bool = Field(default=False, description="Create an Ingress for the router.")
    host: str = Field(default="", max_length=253, description="Host name the Ingress answers for.")
    class_name: str = Field(default="", alias="className", max_length=253, description="IngressClass name.")


class RouterSpec(SpecModel):
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
        "round_robin, prefix_affinity, session_affinity (the x-session-id header), prefix_cache (where "
        "the engines' prefix caches hold the prompt's first blocks, from their KV events), or scorer "
        "weights such as prefix_cache=8,least_load=1.",
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


class TokenizerSpec(SpecModel):
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
