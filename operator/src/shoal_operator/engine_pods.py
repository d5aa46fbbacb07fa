"""The engines' Deployment: vLLM engines, one per pod, and what their spec leaves to their kind.

An engine's id is its pod name; it advertises its pod IP in Redis, where routers and other
engines find it. Rollouts surge and never take an engine away before its replacement is ready;
scale-down removes the least-loaded engines (``scale.py``). The preStop hook and SIGTERM drain an
engine by migrating its requests to the others, within the spec's drain deadline (the pod's
grace period leaves room after it).
"""

from __future__ import annotations

import shlex
from typing import Any

from shoal_operator.manifests import (
    ANY_ADDRESS,
    ENGINE_CONTROL_PORT,
    ENGINE_HTTP_PORT,
    ENGINE_KV_PORT,
    ENGINE_ZMQ_PORT,
    Cluster,
    Manifest,
    object_meta,
    selector,
)
from shoal_operator.pods import (
    POD_ENV,
    SHOAL_UID,
    container_security,
    fleet_tls_args,
    http_probes,
    model_path,
    model_volumes,
    pod_security,
    pod_settings,
    redis_env,
    resources,
    secret_file,
    template_meta,
)
from shoal_operator.spec import CPU_ENGINE_IMAGE, GPU_ENGINE_IMAGE, EngineSpec

# After the drain deadline: time for the engine to report, deregister and exit.
EXIT_GRACE_S = 30

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
        "--drain-timeout-s", str(spec.drain.deadline_seconds),
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


CPU_BIND = "VLLM_CPU_OMP_THREADS_BIND"
"""Where vLLM's CPU build binds each worker's threads: ``nobind``, ``auto``, or cores per worker
separated by ``|``."""


def engine_deployment(cluster: Cluster) -> Manifest:
    spec, engine = cluster.spec, cluster.spec.engine
    args = _engine_args(cluster)
    shm: Manifest = {"medium": "Memory", **({"sizeLimit": engine.shm_size} if engine.shm_size else {})}
    model_vols, mounts, model_env, storage = model_volumes(spec.model)
    mounts = [{"name": "shm", "mountPath": "/dev/shm"}, *mounts]
    volumes: list[dict[str, Any]] = [{"name": "shm", "emptyDir": shm}, *model_vols]
    if spec.zmq_curve_secret is not None:
        curve_secret = spec.zmq_curve_secret
        args += secret_file("--zmq-curve-key-file", curve_secret.name, curve_secret.key, mounts, volumes)
    args += fleet_tls_args(cluster, mounts, volumes)
    env = POD_ENV + redis_env(cluster) + model_env
    if engine.gpus == 0:
        env.append({"name": "VLLM_CPU_KVCACHE_SPACE", "value": str(engine.kv_cache_gib)})
        workers = engine.tensor_parallel_size * engine.pipeline_parallel_size
        if workers > 1 and not any(e.get("name") == CPU_BIND for e in engine.env):
            # vLLM's CPU build binds each worker's threads to a NUMA node of its own by default,
            # and refuses to start with more workers than the pod has NUMA nodes; the pod's
            # cores are not known here, so its workers share them unbound unless the spec's env
            # names a binding ("0-3|4-7").
            env.append({"name": CPU_BIND, "value": "nobind"})
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
        "resources": resources(engine.resources.cpu, engine.resources.memory, engine.gpus, storage),
        # Loading a model takes a while (a download, then the weights): the spec's startup
        # budget before liveness counts.
        **http_probes(ENGINE_HTTP_PORT, engine.startup_seconds),
        # Before SIGTERM: leave the rotation and migrate every request away, answering once
        # empty or at the drain deadline (the grace period covers it). An exec hook, so the call
        # comes from inside the pod: the engine refuses /drain from anywhere else.
        "lifecycle": {
            "preStop": {"exec": {"command": ["shoal-engine-prestop", "--port", str(ENGINE_HTTP_PORT)]}}
        },
        "securityContext": container_security(read_only_root=False),
        "volumeMounts": mounts,
    }
    # Capacity never drops in a rollout: new engines are ready before old ones stop (maxSurge
    # 0: one engine at a time, drained by its preStop hook, then replaced).
    rolling = {"maxSurge": engine.max_surge, "maxUnavailable": 0 if engine.max_surge else 1}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(cluster, f"{cluster.name}-engine", "engine"),
        "spec": {
            "replicas": engine.replicas,
            "selector": {"matchLabels": selector(cluster, "engine")},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": rolling},
            "template": {
                "metadata": template_meta(cluster, "engine", engine.pod),
                "spec": {
                    **pod_settings(engine.pod),
                    "terminationGracePeriodSeconds": spec.drain.deadline_seconds + EXIT_GRACE_S,
                    "securityContext": pod_security(SHOAL_UID),
                    "containers": [container],
                    "volumes": volumes,
                },
            },
        },
    }
