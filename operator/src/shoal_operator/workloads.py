"""The cluster's workloads besides the engines: the routers (the OpenAI API), the tokenizer
(gRPC), and the managed Redis unless the spec points at an external one.
"""

from __future__ import annotations

from typing import Any

from shoal_operator.manifests import (
    ANY_ADDRESS,
    REDIS_PORT,
    ROUTER_HTTP_PORT,
    ROUTER_ZMQ_PORT,
    TOKENIZER_PORT,
    Cluster,
    Manifest,
    labels,
    object_meta,
    selector,
)
from shoal_operator.pods import (
    POD_ENV,
    PROBE_PERIOD_S,
    REDIS_UID,
    container_security,
    deployment,
    fleet_tls_args,
    http_probes,
    model_path,
    model_volumes,
    pod_security,
    redis_env,
    redis_password_env,
    resources,
    secret_file,
)


def router_deployment(cluster: Cluster) -> Manifest:
    router = cluster.spec.router
    args = [
        "--models", cluster.spec.model.served_name,
        "--cluster", cluster.cluster_id,
        "--router-id", "$(POD_NAME)",
        "--tokenizer-address", f"{cluster.name}-tokenizer:{TOKENIZER_PORT}",
        "--host", "$(POD_IP)",
        "--bind-host", ANY_ADDRESS,
        "--port", str(ROUTER_HTTP_PORT),
        "--zmq-port", str(ROUTER_ZMQ_PORT),
        "--scheduler", router.scheduler,
        "--hold-max-s", f"{router.hold_max_s:g}",
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
            args += secret_file(flag, secret.name, secret.key, mounts, volumes)
    if router.balance:  # the balancer calls engines' EngineControl
        args += fleet_tls_args(cluster, mounts, volumes)
    container = {
        "name": "router",
        "image": router.image,
        "command": ["shoal-router"],
        "args": args,
        "env": POD_ENV + redis_env(cluster),
        "ports": [
            {"name": "http", "containerPort": ROUTER_HTTP_PORT},
            {"name": "zmq", "containerPort": ROUTER_ZMQ_PORT},
        ],
        "resources": resources(router.resources.cpu, router.resources.memory),
        # Live with no engine up (a cold start of GPU engines): only readiness says so.
        **http_probes(ROUTER_HTTP_PORT),
    }
    return deployment(cluster, "router", router.replicas, container, router.pod, mounts, volumes)


def tokenizer_deployment(cluster: Cluster) -> Manifest:
    tokenizer, model = cluster.spec.tokenizer, cluster.spec.model
    args = [
        "--models", f"{model.served_name}={model_path(model)}",
        "--host", "$(POD_IP)",
        "--bind-host", ANY_ADDRESS,
        "--port", str(TOKENIZER_PORT),
    ]  # fmt: skip
    if model.revision is not None:
        args += ["--revision", model.revision]
    volumes, mounts, model_env, storage = model_volumes(model)
    grpc = {"grpc": {"port": TOKENIZER_PORT}, "periodSeconds": PROBE_PERIOD_S}
    container = {
        "name": "tokenizer",
        "image": tokenizer.image,
        "command": ["shoal-tokenizer"],
        "args": args,
        "env": POD_ENV + model_env,
        "ports": [{"name": "grpc", "containerPort": TOKENIZER_PORT}],
        "resources": resources(tokenizer.resources.cpu, tokenizer.resources.memory, extra=storage),
        # It loads the model's tokenizer (a download, for a repository id) before it serves.
        "startupProbe": {**grpc, "failureThreshold": max(1, -(-tokenizer.startup_seconds // PROBE_PERIOD_S))},
        "readinessProbe": grpc,
        "livenessProbe": {**grpc, "periodSeconds": 10, "failureThreshold": 6},
    }
    return deployment(cluster, "tokenizer", tokenizer.replicas, container, tokenizer.pod, mounts, volumes)


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
        "env": [redis_password_env(cluster), redis_password_env(cluster, "REDISCLI_AUTH")],
        "ports": [{"name": "redis", "containerPort": REDIS_PORT}],
        "resources": resources("1", "1Gi"),
        "readinessProbe": {"exec": {"command": ["redis-cli", "ping"]}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": REDIS_PORT}, "periodSeconds": 10},
        "securityContext": container_security(),
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": object_meta(cluster, f"{cluster.name}-redis", "redis"),
        "spec": {
            "serviceName": f"{cluster.name}-redis",
            "replicas": 1,
            "selector": {"matchLabels": selector(cluster, "redis")},
            "template": {
                "metadata": {"labels": labels(cluster, "redis")},
                "spec": {
                    "securityContext": pod_security(REDIS_UID),
                    "containers": [container],
                    "volumes": [{"name": "data", "emptyDir": {}}],
                },
            },
        },
    }
