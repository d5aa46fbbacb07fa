"""The pieces of the cluster's pod templates: hardening, probes, placement, the environment and
the volumes fleet containers share (Redis, the fleet's TLS, Secrets' files, the model), and the
Deployment every stateless component but the engines runs in.
"""

from __future__ import annotations

from typing import Any

from shoal_operator.manifests import (
    FLEET_TLS_DIR,
    KEYS_DIR,
    REDIS_AUTH_KEY,
    REDIS_PORT,
    Cluster,
    Manifest,
    fleet_tls_secret_name,
    labels,
    object_meta,
    redis_auth_secret_name,
    selector,
)
from shoal_operator.spec import ModelSpec, PodSettings
from shoal_protos import tls


def resources(cpu: str, memory: str, gpus: int = 0, extra: dict[str, str] | None = None) -> dict[str, Any]:
    amounts: dict[str, Any] = {"cpu": cpu, "memory": memory, **(extra or {})}
    if gpus:
        amounts["nvidia.com/gpu"] = gpus
    return {"requests": dict(amounts), "limits": dict(amounts)}


POD_ENV = [
    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
]


SHOAL_UID = 10001
"""The unprivileged user Shoal's images run as (``docker/``)."""
REDIS_UID = 999
"""The ``redis`` user of the official Redis image."""


def pod_security(uid: int) -> Manifest:
    """No root, the runtime's default seccomp profile."""
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "fsGroup": uid,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security(read_only_root: bool = True) -> Manifest:
    """No privilege escalation, no capabilities; a read-only root filesystem where the process
    writes only to its mounted volumes (engines write caches under /tmp and are left writable)."""
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": read_only_root,
    }


_TMP_MOUNT = {"name": "tmp", "mountPath": "/tmp"}
_TMP_VOLUME = {"name": "tmp", "emptyDir": {}}


def redis_password_env(cluster: Cluster, name: str = "REDIS_PASSWORD") -> dict[str, Any]:
    ref = {"name": redis_auth_secret_name(cluster), "key": REDIS_AUTH_KEY}
    return {"name": name, "valueFrom": {"secretKeyRef": ref}}


def fleet_tls_args(
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


def redis_env(cluster: Cluster) -> list[dict[str, Any]]:
    """``REDIS_URL`` for every fleet container, which the services read from their environment
    (never from their command line, which every process on the node can read): the managed
    Redis (with the password from its Secret), a URL, or a Secret's key."""
    redis = cluster.spec.redis
    if redis.mode == "managed":
        url = f"redis://:$(REDIS_PASSWORD)@{cluster.name}-redis:{REDIS_PORT}/0"
        return [redis_password_env(cluster), {"name": "REDIS_URL", "value": url}]
    if redis.url_secret is not None:
        ref = {"name": redis.url_secret.name, "key": redis.url_secret.key}
        return [{"name": "REDIS_URL", "valueFrom": {"secretKeyRef": ref}}]
    return [{"name": "REDIS_URL", "value": redis.url}]


def secret_file(
    flag: str, secret: str, key: str, mounts: list[dict[str, Any]], volumes: list[dict[str, Any]]
) -> list[str]:
    """Mount one key of a Secret read-only as a file; returns ``[flag, path]``."""
    volume = flag.removeprefix("--").removesuffix("-file")
    folder = f"{KEYS_DIR}/{volume}"
    mounts.append({"name": volume, "mountPath": folder, "readOnly": True})
    volumes.append({"name": volume, "secret": {"secretName": secret, "items": [{"key": key, "path": key}]}})
    return [flag, f"{folder}/{key}"]


PROBE_PERIOD_S = 5


def _http_probe(port: int, path: str) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": PROBE_PERIOD_S, "timeoutSeconds": 3}


def http_probes(port: int, startup_s: int | None = None) -> dict[str, Any]:
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


MODEL_DIR = "/models"
"""Where a model's PersistentVolumeClaim is mounted (read-only) in engines and tokenizers."""
CACHE_DIR = "/cache"
"""Where the download cache is mounted; ``HF_HOME`` points below it."""


def model_path(model: ModelSpec) -> str:
    """What engines and the tokenizer load: the repository id, or the folder in the claim."""
    if model.pvc is None:
        return model.source
    return f"{MODEL_DIR}/{model.source.strip('/')}".rstrip("/") if model.source.strip("/") else MODEL_DIR


def model_volumes(model: ModelSpec) -> tuple[list[Manifest], list[Manifest], list[Manifest], dict[str, str]]:
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


def pod_settings(pod: PodSettings) -> dict[str, Any]:
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


def template_meta(cluster: Cluster, component: str, pod: PodSettings) -> Manifest:
    """A pod template's metadata: the spec's extra labels under Shoal's own (which select it)."""
    meta: Manifest = {"labels": {**pod.labels, **labels(cluster, component)}}
    if pod.annotations:
        meta["annotations"] = dict(pod.annotations)
    return meta


def deployment(
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
        "metadata": object_meta(cluster, f"{cluster.name}-{component}", component),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector(cluster, component)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": template_meta(cluster, component, pod),
                "spec": {
                    **pod_settings(pod),
                    "securityContext": pod_security(SHOAL_UID),
                    "containers": [
                        {
                            **container,
                            "securityContext": container_security(),
                            "volumeMounts": [_TMP_MOUNT, *(mounts or [])],
                        }
                    ],
                    "volumes": [_TMP_VOLUME, *(volumes or [])],
                },
            },
        },
    }
