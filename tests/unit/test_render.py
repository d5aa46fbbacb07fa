"""``shoal-operator render``: every sample's children as the operator would apply them, each a
valid Kubernetes object for the oldest version the chart supports, and the engine pod carrying
what the spec asked for (GPUs, parallelism, the token from its Secret, placement, the cache)."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from shoal_operator import crd
from shoal_operator.render import RenderError, render_file

SAMPLES = sorted((Path(crd.ROOT) / "operator" / "samples").glob("*.yaml"))
CHART_KUBERNETES = yaml.safe_load((Path(crd.ROOT) / "charts" / "shoal" / "Chart.yaml").read_text())[
    "kubeVersion"
]


def _kubernetes_floor() -> str:
    # ">=1.29.0-0": the oldest version the chart declares.
    return CHART_KUBERNETES.removeprefix(">=").split("-")[0].rsplit(".", 1)[0]


def _render(path: Path, service_monitors: bool = True) -> list[dict[str, Any]]:
    with path.open() as stream:
        return list(yaml.safe_load_all(render_file(stream, "serving", service_monitors)))


def _engine_pod(children: list[dict[str, Any]]) -> dict[str, Any]:
    deployment = next(
        c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"].endswith("-engine")
    )
    pod: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return pod


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.stem)
def test_every_rendered_object_is_valid_for_the_charts_kubernetes(sample: Path) -> None:
    children = _render(sample)
    assert children
    for child in children:
        if child["apiVersion"].startswith("monitoring.coreos.com"):
            continue  # a custom resource: kubernetes-validate knows only Kubernetes' own kinds
        kubernetes_validate.validate(child, _kubernetes_floor(), strict=True)


def test_gated_model_on_tainted_gpu_nodes() -> None:
    pod = _engine_pod(_render(Path(crd.ROOT) / "operator" / "samples" / "gpu-gated.yaml"))
    (engine,) = pod["containers"]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert engine["image"] == "shoal/engine:0.1.0"
    args = engine["args"]
    assert args[args.index("--kv-transport") + 1] == "nccl"  # unset: follows the GPUs
    assert args[args.index("--revision") + 1] == "0e9e39f249a16976918f6564b8830bc894c89659"
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.9"
    assert "--vllm-args=--enable-chunked-prefill --max-num-batched-tokens=8192" in args
    # The token reaches the container from its Secret, never as a value or an argument.
    token = next(e for e in engine["env"] if e["name"] == "HF_TOKEN")
    assert token == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}
    assert not any("HF_TOKEN" in a or "hf-token" in a for a in args)
    assert {"name": "HF_HOME", "value": "/cache/huggingface"} in engine["env"]
    assert {"name": "cache", "persistentVolumeClaim": {"claimName": "hf-cache"}} in pod["volumes"]
    assert {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}} in pod["volumes"]
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["priorityClassName"] == "inference-critical"
    assert pod["topologySpreadConstraints"][0]["topologyKey"] == "kubernetes.io/hostname"


def test_tensor_parallel_engines_request_tp_times_pp_gpus() -> None:
    children = _render(Path(crd.ROOT) / "operator" / "samples" / "gpu-tp2.yaml")
    pod = _engine_pod(children)
    (engine,) = pod["containers"]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert engine["resources"]["requests"]["ephemeral-storage"] == "80Gi"  # the emptyDir cache
    args = engine["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert args[args.index("--pipeline-parallel-size") + 1] == "1"
    assert {"name": "cache", "emptyDir": {"sizeLimit": "80Gi"}} in pod["volumes"]
    tokenizer = next(
        c for c in children if c["metadata"]["name"] == "qwen-tp2-tokenizer" and c["kind"] == "Deployment"
    )
    assert (
        tokenizer["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["ephemeral-storage"]
        == "80Gi"
    )


def test_minimal_cpu_cluster_runs_the_cpu_image_over_tcp() -> None:
    pod = _engine_pod(_render(Path(crd.ROOT) / "operator" / "samples" / "minimal.yaml"))
    (engine,) = pod["containers"]
    assert engine["image"] == "shoal/engine-cpu:0.1.0"
    assert "nvidia.com/gpu" not in engine["resources"]["limits"]
    assert engine["args"][engine["args"].index("--kv-transport") + 1] == "tcp"
    # Probes: liveness never means "draining"; the startup budget is the spec's.
    assert engine["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert engine["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert engine["startupProbe"]["failureThreshold"] * engine["startupProbe"]["periodSeconds"] == 1200


def test_a_model_in_a_claim_is_mounted_read_only_and_loaded_from_there() -> None:
    text = """
apiVersion: shoal.dev/v1alpha1
kind: InferenceCluster
metadata: {name: local}
spec:
  model: {source: llama-8b, servedName: llama, pvc: {claimName: models}}
"""
    children = list(yaml.safe_load_all(render_file(io.StringIO(text))))
    pod = _engine_pod(children)
    (engine,) = pod["containers"]
    assert engine["args"][engine["args"].index("--model") + 1] == "/models/llama-8b"
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in engine["volumeMounts"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in pod[
        "volumes"
    ]
    tokenizer = next(
        c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"] == "local-tokenizer"
    )
    assert "llama=/models/llama-8b" in tokenizer["spec"]["template"]["spec"]["containers"][0]["args"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("kind: InferenceCluster\napiVersion: shoal.dev/v1alpha1\nmetadata: {name: " + "x" * 43 + "}\n"
         "spec: {model: {source: m, servedName: m}}", "at most 42"),
        ("kind: InferenceCluster\napiVersion: shoal.dev/v1alpha1\nmetadata: {name: x}\n"
         "spec: {model: {source: m, servedName: m}, engine: {extraArgs: [--port=1]}}", "--port=1 is set by"),
    ],
)  # fmt: skip
def test_refused_clusters_name_the_problem(text: str, message: str) -> None:
    with pytest.raises(RenderError, match=message):
        render_file(io.StringIO(text))


def test_the_command_prints_yaml_for_kubectl_diff() -> None:
    minimal = Path(crd.ROOT) / "operator" / "samples" / "minimal.yaml"
    done = subprocess.run(
        [sys.executable, "-m", "shoal_operator.render", "-f", str(minimal)],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    kinds = [doc["kind"] for doc in yaml.safe_load_all(done.stdout)]
    assert "Deployment" in kinds and "ServiceMonitor" not in kinds


@pytest.mark.parametrize(
    ("env", "bind"),
    [([], "nobind"), ([{"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "0-3|4-7"}], "0-3|4-7")],
)
def test_cpu_engines_of_two_workers_start_without_a_numa_node_each(
    tmp_path: Path, env: list[dict[str, str]], bind: str
) -> None:
    """vLLM's CPU build binds each worker to a NUMA node of its own unless told otherwise, and
    refuses to start with more workers than nodes: the operator leaves its workers unbound,
    unless the spec's env binds them itself (then its binding alone)."""
    cluster = yaml.safe_load((Path(crd.ROOT) / "operator" / "samples" / "minimal.yaml").read_text())
    cluster["spec"]["engine"] = {"tensorParallelSize": 2, "env": env}
    path = tmp_path / "cpu-tp2.yaml"
    path.write_text(yaml.safe_dump(cluster))
    (engine,) = _engine_pod(_render(path))["containers"]
    binds = [e["value"] for e in engine["env"] if e["name"] == "VLLM_CPU_OMP_THREADS_BIND"]
    assert binds == [bind]
    args = engine["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
