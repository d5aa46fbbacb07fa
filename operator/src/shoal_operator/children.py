"""What an ``InferenceCluster`` becomes: the Kubernetes objects the operator keeps in place.

``render`` is a pure function from the resource (name, namespace, uid and its parsed spec) to the
list of child manifests; the reconciler compares them with what exists and writes only the
difference. Every child carries an owner reference to the cluster, so deleting the cluster
deletes them (Kubernetes' garbage collector, not the operator).

Children, for a cluster ``NAME``:

* ``NAME-config`` ConfigMap: the fleet settings every pod reads (model, cluster id, ports).
* ``NAME-engine`` Deployment and headless Service: vLLM engines (an engine's id is its pod
  name; it advertises its pod IP in Redis, where routers and other engines find it). Rollouts
  surge and never take an engine away before its replacement is ready; scale-down removes the
  least-loaded engines (``scale.py``). The preStop hook and SIGTERM drain an engine by migrating
  its requests to the others, within the spec's drain deadline (the pod's grace period leaves
  room after it).
* ``NAME-router`` Deployment and Service (and an Ingress when asked for): the OpenAI API.
* ``NAME-tokenizer`` Deployment and Service (gRPC).
* ``NAME-redis`` StatefulSet and Service, unless the spec points at an external Redis.
* PodDisruptionBudgets (engines leave one at a time; a router stays up), NetworkPolicies (only
  the cluster's own pods reach its engines, tokenizer and Redis), and a ServiceMonitor when the
  Prometheus operator's CRD exists.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import Any

from shoal_operator.spec import (
    CPU_ENGINE_IMAGE,
    GPU_ENGINE_IMAGE,
    GROUP,
    KIND,
    VERSION,
    EngineSpec,
    InferenceClusterSpec,
    ModelSpec,
    PodSettings,
)
from shoal_protos import tls

ENGINE_ZMQ_PORT = 5600
ENGINE_HTTP_PORT = 8100
ENGINE_CONTROL_PORT = 5800
ENGINE_KV_PORT = 5900
ROUTER_HTTP_PORT = 8000
ROUTER_ZMQ_PORT = 5700
TOKENIZER_PORT = 50051
REDIS_PORT = 6379
ANY_ADDRESS = "::"
"""What every fleet container binds: all of the pod's addresses, IPv6 and IPv4 (IPv4 alone on a
node without IPv6), so ``kubectl port-forward``, which connects to the pod's loopback, reaches
it. Each still tells its peers its pod IP (``--host``)."""
# After the drain deadline: time for the engine to report, deregister and exit.
EXIT_GRACE_S = 30

Manifest = dict[str, Any]
OPERATOR_LABELS = {"app.kubernetes.io/name": "shoal-operator"}
"""Labels of the operator's own pods (the chart sets them): engines take drain calls from them."""


@dataclass(frozen=True)
class Cluster:
    """The parts of an InferenceCluster object that children depend on."""

    name: str
    namespace: str
    uid: str
    spec: InferenceClusterSpec

    @property
    def cluster_id(self) -> str:
        """The fleet's name in Redis keys (unique per namespace and name)."""
        return f"{self.namespace}.{self.name}"


def labels(cluster: Cluster, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "shoal",
        "app.kubernetes.io/instance": cluster.name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": "shoal-operator",
    }


def selector(cluster: Cluster, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/instance": cluster.name, "app.kubernetes.io/component": component}


def engine_selector(cluster: Cluster) -> str:
    """The engines' label selector as a string (the scale subresource's ``status.selector``)."""
    return ",".join(f"{k}={v}" for k, v in selector(cluster, "engine").items())


def _meta(cluster: Cluster, name: str, component: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": cluster.namespace,
        "labels": labels(cluster, component),
        "ownerReferences": [
            {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": KIND,
                "name": cluster.name,
                "uid": cluster.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
    }


def _resources(cpu: str, memory: str, gpus: int = 0, extra: dict[str, str] | None = None) -> dict[str, Any]:
    amounts: dict[str, Any] = {"cpu": cpu, "memory": memory, **(extra or {})}
    if gpus:
        amounts["nvidia.com/gpu"] = gpus
    return {"requests": dict(amounts), "limits": dict(amounts)}


_POD_ENV = [
    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
]


SHOAL_UID = 10001
"""The unprivileged user Shoal's images run as (``docker/``)."""
REDIS_UID = 999
"""The ``redis`` user of the official Redis image."""


def _pod_security(uid: int) -> Manifest:
    """No root, the runtime's default seccomp profile."""
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "fsGroup": uid,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _container_security(read_only_root: bool = True) -> Manifest:
    """No privilege escalation, no capabilities; a read-only root filesystem where the process
    writes only to its mounted volumes (engines write caches under /tmp and are left writable)."""
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": read_only_root,
    }


_TMP_MOUNT = {"name": "tmp", "mountPath": "/tmp"}
KEYS_DIR = "/etc/shoal"
"""Where routers and engines find files mounted from Secrets (API keys, the CURVE key)."""
_TMP_VOLUME = {"name": "tmp", "emptyDir": {}}


GENERATED_KEYS_ANNOTATION = "shoal.dev/generated-keys"
"""On a Secret the operator renders without data: the keys it fills with random tokens when it
creates the Secret (and never writes again, so the values stay what the pods read)."""
GENERATED_TLS_ANNOTATION = "shoal.dev/generated-tls"
"""On a Secret the operator renders without data: filled with a new fleet CA and certificate
(``shoal_protos.tls.generate``) when it creates the Secret, and never written again."""
REDIS_AUTH_KEY = "password"


def redis_auth_secret_name(cluster: Cluster) -> str:
    return f"{cluster.name}-redis-auth"


def _redis_password_env(cluster: Cluster, name: str = "REDIS_PASSWORD") -> dict[str, Any]:
    ref = {"name": redis_auth_secret_name(cluster), "key": REDIS_AUTH_KEY}
    return {"name": name, "valueFrom": {"secretKeyRef": ref}}


def redis_auth_secret(cluster: Cluster) -> Manifest:
    """The managed Redis's password: generated by the operator when it creates the Secret."""
    meta = _meta(cluster, redis_auth_secret_name(cluster), "redis")
    meta["annotations"] = {GENERATED_KEYS_ANNOTATION: REDIS_AUTH_KEY}
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque"}


FLEET_TLS_DIR = f"{KEYS_DIR}/fleet-tls"


def fleet_tls_secret_name(cluster: Cluster) -> str | None:
    """The Secret of the fleet's TLS files, or None when the fleet's links are plain."""
    spec = cluster.spec.fleet_tls
    if not spec.enabled:
        return None
    return spec.secret_name or f"{cluster.name}-fleet-tls"


def fleet_tls_secret(cluster: Cluster) -> Manifest:
    """The fleet's TLS files, made by the operator when it creates the Secret."""
    name = fleet_tls_secret_name(cluster)
    assert name is not None
    meta = _meta(cluster, name, "engine")
    meta["annotations"] = {GENERATED_TLS_ANNOTATION: "true"}
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque"}


def _fleet_tls_args(
    cluster: Cluster, mounts: list[dict[str, Any]], volumes: list[dict[str, Any]]
) -> list[str]:
    """Mount the fleet's TLS Secret; returns the flag naming the folder ([] when plain)."""
    name = fleet_tls_secret_name(cluster)
    if name is None:
        return []
    mounts.append({"name": "fleet-tls", "mountPath": FLEET_TLS_DIR, "readOnly": True})
    items = [{"key": key, "path": key} for key in (tls.CA_FILE, tls.CERT_FILE, tls.KEY_FILE)]
    volumes.append({"name": "fleet-tls", "secret": {"secretName": name, "items": items}})
    return ["--fleet-tls-dir", FLEET_TLS_DIR]


def _redis_env(cluster: Cluster) -> list[dict[str, Any]]:
    """``REDIS_URL`` for every fleet container, which the services read from their environment
    (never from their command line, which every process on the node can read): the managed
    Redis (with the password from its Secret), a URL, or a Secret's key."""
    redis = cluster.spec.redis
    if redis.mode == "managed":
        url = f"redis://:$(REDIS_PASSWORD)@{cluster.name}-redis:{REDIS_PORT}/0"
        return [_redis_password_env(cluster), {"name": "REDIS_URL", "value": url}]
    if redis.url_secret is not None:
        ref = {"name": redis.url_secret.name, "key": redis.url_secret.key}
        return [{"name": "REDIS_URL", "valueFrom": {"secretKeyRef": ref}}]
    return [{"name": "REDIS_URL", "value": redis.url}]


PROBE_PERIOD_S = 5


def _http_probe(port: int, path: str) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": PROBE_PERIOD_S, "timeoutSeconds": 3}


def _http_probes(port: int, startup_s: int | None = None) -> dict[str, Any]:
    """Liveness on ``/livez`` (the process and its loop: never "no engine" or "draining", which
    a restart would not mend and a drain would not survive), readiness on ``/readyz`` (takes
    requests), and a startup probe allowing ``startup_s`` before liveness counts."""
    probes = {
        "readinessProbe": _http_probe(port, "/readyz"),
        "livenessProbe": {**_http_probe(port, "/livez"), "failureThreshold": 6},
    }
    if startup_s is not None:
        probes["startupProbe"] = {
            **_http_probe(port, "/livez"),
            "failureThreshold": max(1, -(-startup_s // PROBE_PERIOD_S)),
        }
    return probes


def config_map(cluster: Cluster) -> Manifest:
    spec = cluster.spec
    settings = {
        "cluster": cluster.cluster_id,
        "model": spec.model.source,
        "servedName": spec.model.served_name,
        "maxModelLen": spec.model.max_model_len,
        "kvTransport": kv_transport(spec.engine),
        "drainDeadlineSeconds": spec.drain.deadline_seconds,
    }
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(cluster, f"{cluster.name}-config", "config"),
        "data": {"fleet.json": json.dumps(settings, indent=1, sort_keys=True)},
    }


def engine_service(cluster: Cluster) -> Manifest:
    service = _service(
        cluster,
        "engine",
        [
            ("zmq", ENGINE_ZMQ_PORT),
            ("http", ENGINE_HTTP_PORT),
            ("control", ENGINE_CONTROL_PORT),
            ("kv", ENGINE_KV_PORT),
        ],
    )
    # Headless: the Service's name resolves to every engine pod, ready or not.
    service["spec"].update(clusterIP="None", publishNotReadyAddresses=True)
    return service


# Pre-copy's share of the time on CPU engines when the spec leaves it unset: their KV copy runs
# on the core that decodes (unpaced, a move slowed the source's other streams by 15-31 % in
# ``make bench-migration``); GPU engines copy beside the compute.
CPU_PRECOPY_SHARE = 0.05


def precopy_share(engine: EngineSpec) -> float:
    """The engine's ``--migration-precopy-share``: the spec's, else the default for its kind."""
    if engine.precopy_share is not None:
        return engine.precopy_share
    return CPU_PRECOPY_SHARE if engine.gpus == 0 else 0.0


CPU_BLOCK_SIZE, GPU_BLOCK_SIZE = 128, 32


def block_size(engine: EngineSpec) -> int:
    """The engine's ``--block-size``: the spec's, else the default for its kind."""
    if engine.block_size is not None:
        return engine.block_size
    return CPU_BLOCK_SIZE if engine.gpus == 0 else GPU_BLOCK_SIZE


def kv_transport(engine: EngineSpec) -> str:
    """The engine's ``--kv-transport``: the spec's, else nccl with GPUs and tcp without."""
    if engine.kv_transport is not None:
        return engine.kv_transport
    return "nccl" if engine.gpus else "tcp"


def engine_image(engine: EngineSpec) -> str:
    """The spec's engine image, else the GPU (official vLLM based) or the CPU one."""
    if engine.image is not None:
        return engine.image
    return GPU_ENGINE_IMAGE if engine.gpus else CPU_ENGINE_IMAGE


MODEL_DIR = "/models"
"""Where a model's PersistentVolumeClaim is mounted (read-only) in engines and tokenizers."""
CACHE_DIR = "/cache"
"""Where the download cache is mounted; ``HF_HOME`` points below it."""


def model_path(model: ModelSpec) -> str:
    """What engines and the tokenizer load: the repository id, or the folder in the claim."""
    if model.pvc is None:
        return model.source
    return f"{MODEL_DIR}/{model.source.strip('/')}".rstrip("/") if model.source.strip("/") else MODEL_DIR


def _model_volumes(model: ModelSpec) -> tuple[list[Manifest], list[Manifest], list[Manifest], dict[str, str]]:
    """The model's volumes, their mounts, its environment (cache, token) and the ephemeral
    storage an emptyDir cache reserves (empty when there is none)."""
    volumes: list[Manifest] = []
    mounts: list[Manifest] = []
    env: list[Manifest] = [{"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"}]
    storage: dict[str, str] = {}
    if model.pvc is not None:
        claim = {"claimName": model.pvc.claim_name, "readOnly": True}
        volumes.append({"name": "model", "persistentVolumeClaim": claim})
        mounts.append({"name": "model", "mountPath": MODEL_DIR, "readOnly": True})
    cache = model.cache
    if cache is not None and cache.claim_name is not None:
        volumes.append({"name": "cache", "persistentVolumeClaim": {"claimName": cache.claim_name}})
    elif cache is not None and cache.size_limit is not None:
        volumes.append({"name": "cache", "emptyDir": {"sizeLimit": cache.size_limit}})
        storage["ephemeral-storage"] = cache.size_limit
    else:
        volumes.append({"name": "cache", "emptyDir": {}})
    mounts.append({"name": "cache", "mountPath": CACHE_DIR})
    if model.token_secret is not None:
        ref = {"name": model.token_secret.name, "key": model.token_secret.key}
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}})
    return volumes, mounts, env, storage


def _pod_settings(pod: PodSettings) -> dict[str, Any]:
    """A component's pod spec fields for placement, as the spec gives them."""
    fields: dict[str, Any] = {
        "nodeSelector": pod.node_selector or None,
        "tolerations": pod.tolerations or None,
        "affinity": pod.affinity,
        "topologySpreadConstraints": pod.topology_spread_constraints or None,
        "priorityClassName": pod.priority_class_name,
        "runtimeClassName": pod.runtime_class_name,
        "schedulerName": pod.scheduler_name,
        "serviceAccountName": pod.service_account_name,
        "imagePullSecrets": pod.image_pull_secrets or None,
    }
    return {key: value for key, value in fields.items() if value is not None}


def _template_meta(cluster: Cluster, component: str, pod: PodSettings) -> Manifest:
    """A pod template's metadata: the spec's extra labels under Shoal's own (which select it)."""
    meta: Manifest = {"labels": {**pod.labels, **labels(cluster, component)}}
    if pod.annotations:
        meta["annotations"] = dict(pod.annotations)
    return meta


def _engine_args(cluster: Cluster) -> list[str]:
    spec, engine = cluster.spec, cluster.spec.engine
    args = [
        "--model", model_path(spec.model),
        "--served-model-name", spec.model.served_name,
        "--engine-id", "$(POD_NAME)",
        "--cluster", cluster.cluster_id,
        "--host", "$(POD_IP)",
        "--bind-host", ANY_ADDRESS,
        "--zmq-port", str(ENGINE_ZMQ_PORT),
        "--http-port", str(ENGINE_HTTP_PORT),
        "--dtype", spec.model.dtype,
        "--max-model-len", str(spec.model.max_model_len),
        "--max-num-seqs", str(engine.max_num_seqs),
        "--priority-headroom", f"{engine.priority_headroom:g}",
        "--scheduling-policy", engine.scheduling_policy,
        "--drain-timeout", str(spec.drain.deadline_seconds),
        "--migration",
        "--control-port", str(ENGINE_CONTROL_PORT),
        "--kv-port", str(ENGINE_KV_PORT),
        "--kv-transport", kv_transport(engine),
        "--block-size", str(block_size(engine)),
        "--migration-precopy-share", f"{precopy_share(engine):g}",
        "--tensor-parallel-size", str(engine.tensor_parallel_size),
        "--pipeline-parallel-size", str(engine.pipeline_parallel_size),
    ]  # fmt: skip
    if spec.model.revision is not None:
        args += ["--revision", spec.model.revision]
    if engine.gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", f"{engine.gpu_memory_utilization:g}"]
    if engine.quantization is not None:
        args += ["--quantization", engine.quantization]
    if engine.extra_args:
        # One shell-quoted word, so a value that starts with "--" stays the flag's value.
        args.append(f"--vllm-args={shlex.join(engine.extra_args)}")
    return args


def engine_deployment(cluster: Cluster) -> Manifest:
    spec, engine = cluster.spec, cluster.spec.engine
    args = _engine_args(cluster)
    shm: Manifest = {"medium": "Memory", **({"sizeLimit": engine.shm_size} if engine.shm_size else {})}
    model_volumes, mounts, model_env, storage = _model_volumes(spec.model)
    mounts = [{"name": "shm", "mountPath": "/dev/shm"}, *mounts]
    volumes: list[dict[str, Any]] = [{"name": "shm", "emptyDir": shm}, *model_volumes]
    if spec.zmq_curve_secret is not None:
        curve_secret = spec.zmq_curve_secret
        args += _secret_file("--zmq-curve-key-file", curve_secret.name, curve_secret.key, mounts, volumes)
    args += _fleet_tls_args(cluster, mounts, volumes)
    env = _POD_ENV + _redis_env(cluster) + model_env
    if engine.gpus == 0:
        env.append({"name": "VLLM_CPU_KVCACHE_SPACE", "value": str(engine.kv_cache_gib)})
    env += engine.env
    container = {
        "name": "engine",
        "image": engine_image(engine),
        "command": ["shoal-engine"],
        "args": args,
        "env": env,
        **({"envFrom": engine.env_from} if engine.env_from else {}),
        "ports": [
            {"name": "zmq", "containerPort": ENGINE_ZMQ_PORT},
            {"name": "http", "containerPort": ENGINE_HTTP_PORT},
            {"name": "control", "containerPort": ENGINE_CONTROL_PORT},
            {"name": "kv", "containerPort": ENGINE_KV_PORT},
        ],
        "resources": _resources(engine.resources.cpu, engine.resources.memory, engine.gpus, storage),
        # Loading a model takes a while (a download, then the weights): the spec's startup
        # budget before liveness counts.
        **_http_probes(ENGINE_HTTP_PORT, engine.startup_seconds),
        # Before SIGTERM: leave the rotation and migrate every request away, answering once
        # empty or at the drain deadline (the grace period covers it). An exec hook, so the call
        # comes from inside the pod: the engine refuses /drain from anywhere else.
        "lifecycle": {
            "preStop": {"exec": {"command": ["shoal-engine-prestop", "--port", str(ENGINE_HTTP_PORT)]}}
        },
        "securityContext": _container_security(read_only_root=False),
        "volumeMounts": mounts,
    }
    # Capacity never drops in a rollout: new engines are ready before old ones stop (maxSurge
    # 0: one engine at a time, drained by its preStop hook, then replaced).
    rolling = {"maxSurge": engine.max_surge, "maxUnavailable": 0 if engine.max_surge else 1}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(cluster, f"{cluster.name}-engine", "engine"),
        "spec": {
            "replicas": engine.replicas,
            "selector": {"matchLabels": selector(cluster, "engine")},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": rolling},
            "template": {
                "metadata": _template_meta(cluster, "engine", engine.pod),
                "spec": {
                    **_pod_settings(engine.pod),
                    "terminationGracePeriodSeconds": spec.drain.deadline_seconds + EXIT_GRACE_S,
                    "securityContext": _pod_security(SHOAL_UID),
                    "containers": [container],
                    "volumes": volumes,
                },
            },
        },
    }


def _secret_file(
    flag: str, secret: str, key: str, mounts: list[dict[str, Any]], volumes: list[dict[str, Any]]
) -> list[str]:
    """Mount one key of a Secret read-only as a file; returns ``[flag, path]``."""
    volume = flag.removeprefix("--").removesuffix("-file")
    folder = f"{KEYS_DIR}/{volume}"
    mounts.append({"name": volume, "mountPath": folder, "readOnly": True})
    volumes.append({"name": volume, "secret": {"secretName": secret, "items": [{"key": key, "path": key}]}})
    return [flag, f"{folder}/{key}"]


def router_deployment(cluster: Cluster) -> Manifest:
    router = cluster.spec.router
    args = [
        "--model", cluster.spec.model.served_name,
        "--cluster", cluster.cluster_id,
        "--router-id", "$(POD_NAME)",
        "--tokenizer", f"{cluster.name}-tokenizer:{TOKENIZER_PORT}",
        "--host", "$(POD_IP)",
        "--bind-host", ANY_ADDRESS,
        "--port", str(ROUTER_HTTP_PORT),
        "--zmq-port", str(ROUTER_ZMQ_PORT),
        "--scheduler", router.scheduler,
        "--hold-max", f"{router.hold_max_s:g}",
    ]  # fmt: skip
    if router.balance:
        args.append("--balance")
        if router.consolidate_below:
            args += ["--consolidate-below", f"{router.consolidate_below:g}"]
    mounts: list[dict[str, Any]] = []
    volumes: list[dict[str, Any]] = []
    for flag, secret in (
        ("--api-keys-file", router.api_keys_secret),
        ("--admin-keys-file", router.admin_keys_secret),
        ("--zmq-curve-key-file", cluster.spec.zmq_curve_secret),
    ):
        if secret is not None:
            args += _secret_file(flag, secret.name, secret.key, mounts, volumes)
    if router.balance:  # the balancer calls engines' EngineControl
        args += _fleet_tls_args(cluster, mounts, volumes)
    container = {
        "name": "router",
        "image": router.image,
        "command": ["shoal-router"],
        "args": args,
        "env": _POD_ENV + _redis_env(cluster),
        "ports": [
            {"name": "http", "containerPort": ROUTER_HTTP_PORT},
            {"name": "zmq", "containerPort": ROUTER_ZMQ_PORT},
        ],
        "resources": _resources(router.resources.cpu, router.resources.memory),
        # Live with no engine up (a cold start of GPU engines): only readiness says so.
        **_http_probes(ROUTER_HTTP_PORT),
    }
    return _deployment(cluster, "router", router.replicas, container, router.pod, mounts, volumes)


def tokenizer_deployment(cluster: Cluster) -> Manifest:
    tokenizer, model = cluster.spec.tokenizer, cluster.spec.model
    args = [
        "--model", f"{model.served_name}={model_path(model)}",
        "--host", "$(POD_IP)",
        "--bind-host", ANY_ADDRESS,
        "--port", str(TOKENIZER_PORT),
    ]  # fmt: skip
    if model.revision is not None:
        args += ["--revision", model.revision]
    volumes, mounts, model_env, storage = _model_volumes(model)
    grpc = {"grpc": {"port": TOKENIZER_PORT}, "periodSeconds": PROBE_PERIOD_S}
    container = {
        "name": "tokenizer",
        "image": tokenizer.image,
        "command": ["shoal-tokenizer"],
        "args": args,
        "env": _POD_ENV + model_env,
        "ports": [{"name": "grpc", "containerPort": TOKENIZER_PORT}],
        "resources": _resources(tokenizer.resources.cpu, tokenizer.resources.memory, extra=storage),
        # It loads the model's tokenizer (a download, for a repository id) before it serves.
        "startupProbe": {**grpc, "failureThreshold": max(1, -(-tokenizer.startup_seconds // PROBE_PERIOD_S))},
        "readinessProbe": grpc,
        "livenessProbe": {**grpc, "periodSeconds": 10, "failureThreshold": 6},
    }
    return _deployment(cluster, "tokenizer", tokenizer.replicas, container, tokenizer.pod, mounts, volumes)


def _deployment(
    cluster: Cluster,
    component: str,
    replicas: int,
    container: Manifest,
    pod: PodSettings,
    mounts: list[Manifest] | None = None,
    volumes: list[Manifest] | None = None,
) -> Manifest:
    """A Deployment of ``container`` (hardened, /tmp writable) with extra ``mounts`` of ``volumes``,
    placed as ``pod`` says."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(cluster, f"{cluster.name}-{component}", component),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector(cluster, component)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": _template_meta(cluster, component, pod),
                "spec": {
                    **_pod_settings(pod),
                    "securityContext": _pod_security(SHOAL_UID),
                    "containers": [
                        {
                            **container,
                            "securityContext": _container_security(),
                            "volumeMounts": [_TMP_MOUNT, *(mounts or [])],
                        }
                    ],
                    "volumes": [_TMP_VOLUME, *(volumes or [])],
                },
            },
        },
    }


def _service(cluster: Cluster, component: str, ports: list[tuple[str, int]]) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(cluster, f"{cluster.name}-{component}", component),
        "spec": {
            "selector": selector(cluster, component),
            "ports": [{"name": n, "port": p, "targetPort": p, "protocol": "TCP"} for n, p in ports],
        },
    }


def ingress(cluster: Cluster) -> Manifest:
    spec = cluster.spec.router.ingress
    backend = {"service": {"name": f"{cluster.name}-router", "port": {"number": ROUTER_HTTP_PORT}}}
    rule: dict[str, Any] = {"http": {"paths": [{"path": "/", "pathType": "Prefix", "backend": backend}]}}
    if spec.host:
        rule["host"] = spec.host
    body: dict[str, Any] = {"rules": [rule]}
    if spec.class_name:
        body["ingressClassName"] = spec.class_name
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "Ingress",
        "metadata": _meta(cluster, f"{cluster.name}-router", "router"),
        "spec": body,
    }


REDIS_START = f"""umask 077
printf 'requirepass "%s"\\n' "$(printf '%s' "$REDIS_PASSWORD" | sed 's/[\\\\"]/\\\\&/g')" > /data/auth.conf
exec redis-server /data/auth.conf --save '' --appendonly no --port {REDIS_PORT}
"""
"""The managed Redis's start: its password goes into a config file only its user reads (in the
pod's own volume), never on redis-server's command line, which every process on the node can
read. Fleet state is soft (records expire with heartbeats): no persistence to wait on."""


def redis_statefulset(cluster: Cluster) -> Manifest:
    container = {
        "name": "redis",
        "image": cluster.spec.redis.image,
        "command": ["sh", "-c", REDIS_START],
        # redis-cli (the readiness probe) reads its password from REDISCLI_AUTH.
        "env": [_redis_password_env(cluster), _redis_password_env(cluster, "REDISCLI_AUTH")],
        "ports": [{"name": "redis", "containerPort": REDIS_PORT}],
        "resources": _resources("1", "1Gi"),
        "readinessProbe": {"exec": {"command": ["redis-cli", "ping"]}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": REDIS_PORT}, "periodSeconds": 10},
        "securityContext": _container_security(),
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(cluster, f"{cluster.name}-redis", "redis"),
        "spec": {
            "serviceName": f"{cluster.name}-redis",
            "replicas": 1,
            "selector": {"matchLabels": selector(cluster, "redis")},
            "template": {
                "metadata": {"labels": labels(cluster, "redis")},
                "spec": {
                    "securityContext": _pod_security(REDIS_UID),
                    "containers": [container],
                    "volumes": [{"name": "data", "emptyDir": {}}],
                },
            },
        },
    }


def pod_disruption_budget(cluster: Cluster, component: str, limit: dict[str, int]) -> Manifest:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(cluster, f"{cluster.name}-{component}", component),
        "spec": {"selector": {"matchLabels": selector(cluster, component)}, **limit},
    }


def network_policy(
    cluster: Cluster,
    component: str,
    peers: tuple[str, ...],
    open_ports: tuple[int, ...] = (),
    operator_ports: tuple[int, ...] = (),
) -> Manifest:
    """Only the cluster's ``peers`` components reach ``component``; ``open_ports`` (metrics)
    from anywhere, ``operator_ports`` (the engines' control API, for drains) from the operator."""
    allowed = {
        "podSelector": {
            "matchLabels": {"app.kubernetes.io/instance": cluster.name},
            "matchExpressions": [
                {"key": "app.kubernetes.io/component", "operator": "In", "values": list(peers)}
            ],
        }
    }
    rules: list[dict[str, Any]] = [{"from": [allowed]}]
    if open_ports:
        rules.append({"ports": [{"port": p, "protocol": "TCP"} for p in open_ports]})
    if operator_ports:
        operator = {"namespaceSelector": {}, "podSelector": {"matchLabels": OPERATOR_LABELS}}
        rules.append({"from": [operator], "ports": [{"port": p, "protocol": "TCP"} for p in operator_ports]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(cluster, f"{cluster.name}-{component}", component),
        "spec": {
            "podSelector": {"matchLabels": selector(cluster, component)},
            "policyTypes": ["Ingress"],
            "ingress": rules,
        },
    }


def service_monitor(cluster: Cluster) -> Manifest:
    """Scrapes of the routers' and the engines' ``/metrics`` (both Services name the port
    ``http``), with the spec's labels (how a Prometheus picks its monitors) and, when admin keys
    guard the routers' ``/metrics``, one of them as a bearer token (engines ignore it)."""
    monitor = cluster.spec.monitoring.service_monitor
    endpoint: Manifest = {"port": "http", "path": "/metrics", "interval": monitor.interval}
    if monitor.bearer_token_secret is not None:
        ref = {"name": monitor.bearer_token_secret.name, "key": monitor.bearer_token_secret.key}
        endpoint["authorization"] = {"type": "Bearer", "credentials": ref}
    meta = _meta(cluster, cluster.name, "metrics")
    meta["labels"] = {**monitor.labels, **meta["labels"]}
    endpoints = [endpoint]
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": meta,
        "spec": {
            "selector": {"matchLabels": {"app.kubernetes.io/instance": cluster.name}},
            "namespaceSelector": {"matchNames": [cluster.namespace]},
            "endpoints": endpoints,
        },
    }


def render(cluster: Cluster, service_monitors: bool = False) -> list[Manifest]:
    """Every child of ``cluster``; ``service_monitors`` when the ServiceMonitor CRD exists."""
    spec = cluster.spec
    children = [
        config_map(cluster),
        engine_service(cluster),
        engine_deployment(cluster),
        router_deployment(cluster),
        _service(cluster, "router", [("http", ROUTER_HTTP_PORT)]),
        tokenizer_deployment(cluster),
        _service(cluster, "tokenizer", [("grpc", TOKENIZER_PORT)]),
        pod_disruption_budget(cluster, "engine", {"maxUnavailable": 1}),
        # One router may go when it is the only one (else no node could ever be drained), all
        # but one when there are several. Always maxUnavailable: a budget that switched between
        # the two limits would hold both after a merge patch, which the API server refuses.
        pod_disruption_budget(cluster, "router", {"maxUnavailable": max(1, spec.router.replicas - 1)}),
        # Engines take requests from routers and KV blocks from each other; nothing else of the
        # cluster reaches them but metrics scrapes (HTTP) and the operator's drains (control).
        network_policy(cluster, "engine", ("router", "engine"), (ENGINE_HTTP_PORT,), (ENGINE_CONTROL_PORT,)),
        network_policy(cluster, "tokenizer", ("router",)),
    ]
    if spec.router.ingress.enabled:
        children.append(ingress(cluster))
    if spec.fleet_tls.enabled and spec.fleet_tls.secret_name is None:
        children.append(fleet_tls_secret(cluster))
    if spec.redis.mode == "managed":
        children += [
            redis_auth_secret(cluster),
            redis_statefulset(cluster),
            _service(cluster, "redis", [("redis", REDIS_PORT)]),
            # The operator reads the engines' load reports to autoscale.
            network_policy(cluster, "redis", ("router", "engine"), operator_ports=(REDIS_PORT,)),
        ]
    if service_monitors:
        children.append(service_monitor(cluster))
    return children
