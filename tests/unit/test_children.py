"""The children an InferenceCluster renders to: valid Kubernetes objects with the right fields.

Each sample cluster in ``operator/samples`` is rendered, and every built-in child is checked with
``kubernetes-validate`` (strict: an unknown or misspelt field fails) against a current Kubernetes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from shoal_operator import children
from shoal_operator.crd import ROOT
from shoal_operator.spec import InferenceClusterSpec

SAMPLES = sorted((ROOT / "operator" / "samples").glob("*.yaml"))
UID = "0d8f5c1e-7b1a-4d39-9a0e-3f7c2b8e6a51"


def cluster_of(sample: Path, namespace: str = "serving") -> children.Cluster:
    obj = yaml.safe_load(sample.read_text())
    spec = InferenceClusterSpec.model_validate(obj["spec"])
    return children.Cluster(obj["metadata"]["name"], namespace, UID, spec)


def by_kind(rendered: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [c for c in rendered if c["kind"] == kind]


def one(rendered: list[dict[str, Any]], kind: str, component: str) -> dict[str, Any]:
    found = [
        c
        for c in by_kind(rendered, kind)
        if c["metadata"]["labels"]["app.kubernetes.io/component"] == component
    ]
    assert len(found) == 1, (kind, component, found)
    return found[0]


def args_port(args: list[str], flag: str) -> int:
    return int(args[args.index(flag) + 1])


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.stem)
def test_every_child_is_a_valid_kubernetes_object_owned_by_the_cluster(sample: Path) -> None:
    cluster = cluster_of(sample)
    rendered = children.render(cluster, service_monitors=True)
    version = kubernetes_validate.latest_version()
    for child in rendered:
        if child["kind"] != "ServiceMonitor":  # not a built-in kind: checked below
            kubernetes_validate.validate(child, version, strict=True)
        meta = child["metadata"]
        assert meta["namespace"] == "serving"
        (owner,) = meta["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
            "InferenceCluster",
            cluster.name,
            UID,
            True,
        )
    names = [(c["kind"], c["metadata"]["name"]) for c in rendered]
    assert len(names) == len(set(names))
    monitor = one(rendered, "ServiceMonitor", "metrics")
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"


def test_engines_follow_the_spec() -> None:
    cluster = cluster_of(ROOT / "operator" / "samples" / "minimal.yaml")
    rendered = children.render(cluster)
    engines = one(rendered, "Deployment", "engine")
    spec = engines["spec"]
    assert spec["replicas"] == cluster.spec.engine.replicas == 2
    assert one(rendered, "Service", "engine")["spec"]["clusterIP"] == "None"
    # The selector matches the pods, and the scale subresource's selector string says the same.
    labels = spec["template"]["metadata"]["labels"]
    assert all(labels[k] == v for k, v in spec["selector"]["matchLabels"].items())
    assert (
        dict(kv.split("=") for kv in children.engine_selector(cluster).split(","))
        == (spec["selector"]["matchLabels"])
    )
    # A draining engine gets its deadline, then time to exit.
    pod = spec["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == cluster.spec.drain.deadline_seconds + children.EXIT_GRACE_S
    (container,) = pod["containers"]
    args = container["args"]
    assert args[args.index("--engine-id") + 1] == "$(POD_NAME)"
    assert args[args.index("--drain-timeout-s") + 1] == str(cluster.spec.drain.deadline_seconds)
    assert args[args.index("--cluster") + 1] == "serving.smol"
    assert "--migration" in args
    # The preStop hook drains by migration before SIGTERM, from inside the pod, on the engine's
    # own HTTP port.
    hook = container["lifecycle"]["preStop"]["exec"]["command"]
    assert hook[0] == "shoal-engine-prestop"
    assert int(hook[hook.index("--port") + 1]) == args_port(args, "--http-port")
    env = env_of(container)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    # A CPU engine's pre-copy shares the core that decodes: paced to 5 % of the time by default.
    assert args[args.index("--migration-precopy-share") + 1] == "0.05"
    # And its KV in vLLM's CPU block size: fewer blocks to admit when a request moves in.
    assert args[args.index("--block-size") + 1] == "128"
    # The managed Redis wants the password from the Secret the operator generates.
    assert env["REDIS_PASSWORD"] == {"secretKeyRef": {"name": "smol-redis-auth", "key": "password"}}
    assert env["REDIS_URL"] == "redis://:$(REDIS_PASSWORD)@smol-redis:6379/0"
    names = [e["name"] for e in container["env"]]
    assert names.index("REDIS_PASSWORD") < names.index("REDIS_URL")  # defined before it is used
    # The services read REDIS_URL from their environment: never on a command line, where every
    # process on the node could read the password.
    for each in ("engine", "router"):
        deployment = one(rendered, "Deployment", each)
        (service,) = deployment["spec"]["template"]["spec"]["containers"]
        assert not [a for a in service["args"] if "REDIS" in a or "redis://" in a], service["args"]
        assert "REDIS_URL" in env_of(service)
    redis_container = one(rendered, "StatefulSet", "redis")["spec"]["template"]["spec"]["containers"][0]
    # Its password in a file, not on redis-server's command line (the start script itself is run
    # with the real redis-server in tests/integration/test_redis_security.py).
    assert redis_container["command"] == ["sh", "-c", children.REDIS_START]
    assert "args" not in redis_container and "REDIS_PASSWORD)" not in children.REDIS_START
    # Mutual TLS between the fleet's parts, from a Secret the operator fills at creation: the
    # engines serve EngineControl and KV data with it, the balancing router calls with it.
    tls_secret = one(rendered, "Secret", "engine")
    assert tls_secret["metadata"]["name"] == "smol-fleet-tls" and "data" not in tls_secret
    assert tls_secret["metadata"]["annotations"] == {children.GENERATED_TLS_ANNOTATION: "true"}
    assert args[args.index("--fleet-tls-dir") + 1] == children.FLEET_TLS_DIR
    pod = one(rendered, "Deployment", "engine")["spec"]["template"]["spec"]
    assert {"name": "fleet-tls", "mountPath": children.FLEET_TLS_DIR, "readOnly": True} in container[
        "volumeMounts"
    ]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "fleet-tls"]
    assert volume["secret"]["secretName"] == "smol-fleet-tls"
    assert [i["key"] for i in volume["secret"]["items"]] == ["ca.crt", "tls.crt", "tls.key"]
    assert env_of(redis_container)["REDISCLI_AUTH"] == env["REDIS_PASSWORD"]
    secret = one(rendered, "Secret", "redis")
    assert "data" not in secret and "stringData" not in secret
    assert secret["metadata"]["annotations"] == {children.GENERATED_KEYS_ANNOTATION: "password"}
    assert container["resources"]["requests"] == container["resources"]["limits"]  # Guaranteed QoS
    # Managed Redis, no Ingress unless asked for; one router may be evicted when it is alone.
    assert one(rendered, "StatefulSet", "redis")["spec"]["replicas"] == 1
    assert by_kind(rendered, "Ingress") == []
    assert one(rendered, "PodDisruptionBudget", "router")["spec"] == {
        "selector": {"matchLabels": children.selector(cluster, "router")},
        "maxUnavailable": 1,
    }


def test_gpu_engines_ask_for_gpus_and_the_router_gets_its_ingress() -> None:
    rendered = children.render(cluster_of(ROOT / "operator" / "samples" / "gpu-autoscaled.yaml"))
    (container,) = one(rendered, "Deployment", "engine")["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "VLLM_CPU_KVCACHE_SPACE" not in env_of(container)
    assert container["args"][container["args"].index("--kv-transport") + 1] == "nccl"
    # GPU engines copy KV beside the compute: pre-copy is not paced unless the spec says so.
    assert container["args"][container["args"].index("--migration-precopy-share") + 1] == "0"
    assert container["args"][container["args"].index("--block-size") + 1] == "32"
    assert container["args"][container["args"].index("--scheduling-policy") + 1] == "priority"
    assert container["args"][container["args"].index("--priority-headroom") + 1] == "0.25"
    rule = one(rendered, "Ingress", "router")["spec"]["rules"][0]
    assert rule["host"] == "llm.example.internal"
    assert rule["http"]["paths"][0]["backend"]["service"]["name"] == "llama-8b-router"
    # Two routers: one may go, and one limit only (maxUnavailable), whatever the count.
    assert set(one(rendered, "PodDisruptionBudget", "router")["spec"]) == {"selector", "maxUnavailable"}
    assert one(rendered, "PodDisruptionBudget", "router")["spec"]["maxUnavailable"] == 1


def test_external_redis_comes_from_the_secret_and_no_redis_is_run() -> None:
    rendered = children.render(cluster_of(ROOT / "operator" / "samples" / "external-redis.yaml"))
    assert [c for c in rendered if c["metadata"]["labels"]["app.kubernetes.io/component"] == "redis"] == []
    for component in ("engine", "router"):
        (container,) = one(rendered, "Deployment", component)["spec"]["template"]["spec"]["containers"]
        assert env_of(container)["REDIS_URL"] == {"secretKeyRef": {"name": "fleet-redis", "key": "url"}}


def _peers(cluster_name: str, *components: str) -> dict[str, Any]:
    return {
        "from": [
            {
                "podSelector": {
                    "matchLabels": {"app.kubernetes.io/instance": cluster_name},
                    "matchExpressions": [
                        {"key": "app.kubernetes.io/component", "operator": "In", "values": list(components)}
                    ],
                }
            }
        ]
    }


def test_only_the_clusters_routers_and_engines_reach_its_engines() -> None:
    cluster = cluster_of(ROOT / "operator" / "samples" / "minimal.yaml")
    rendered = children.render(cluster)
    policy = one(rendered, "NetworkPolicy", "engine")["spec"]
    assert policy["podSelector"]["matchLabels"] == children.selector(cluster, "engine")
    same, metrics, operator = policy["ingress"]
    assert same == _peers("smol", "router", "engine")
    assert one(rendered, "NetworkPolicy", "tokenizer")["spec"]["ingress"] == [_peers("smol", "router")]
    assert one(rendered, "NetworkPolicy", "redis")["spec"]["ingress"][0] == _peers("smol", "router", "engine")
    assert metrics == {"ports": [{"port": children.ENGINE_HTTP_PORT, "protocol": "TCP"}]}
    # The operator drains engines before a scale-down: their control port, from its pods only.
    assert operator == {
        "from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": children.OPERATOR_LABELS}}],
        "ports": [{"port": children.ENGINE_CONTROL_PORT, "protocol": "TCP"}],
    }


def test_every_pod_runs_unprivileged() -> None:
    rendered = children.render(cluster_of(ROOT / "operator" / "samples" / "minimal.yaml"))
    workloads = by_kind(rendered, "StatefulSet") + by_kind(rendered, "Deployment")
    assert {w["metadata"]["labels"]["app.kubernetes.io/component"] for w in workloads} == {
        "engine",
        "router",
        "tokenizer",
        "redis",
    }
    for workload in workloads:
        component = workload["metadata"]["labels"]["app.kubernetes.io/component"]
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        (container,) = pod["containers"]
        security = container["securityContext"]
        assert security["allowPrivilegeEscalation"] is False and security["capabilities"] == {"drop": ["ALL"]}
        # Engines write compile and model caches; everything else only to its mounted volumes.
        assert security["readOnlyRootFilesystem"] is (component != "engine"), component
        if security["readOnlyRootFilesystem"]:
            mounted = {m["name"] for m in container["volumeMounts"]}
            assert mounted and mounted <= {v["name"] for v in pod["volumes"]}
    # Services bind the pod's own address, not every interface.
    tokenizer = one(rendered, "Deployment", "tokenizer")["spec"]["template"]["spec"]["containers"][0]
    args = tokenizer["args"]
    assert args[args.index("--host") + 1] == "$(POD_IP)" and "POD_IP" in env_of(tokenizer)


def test_router_api_keys_come_from_secrets() -> None:
    obj = yaml.safe_load((ROOT / "operator" / "samples" / "minimal.yaml").read_text())
    obj["spec"]["router"] = {
        "apiKeysSecret": {"name": "llm-keys"},
        "adminKeysSecret": {"name": "ops", "key": "k"},
    }
    cluster = children.Cluster("smol", "serving", UID, InferenceClusterSpec.model_validate(obj["spec"]))
    deployment = one(children.render(cluster), "Deployment", "router")
    kubernetes_validate.validate(deployment, kubernetes_validate.latest_version(), strict=True)
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    assert args[args.index("--api-keys-file") + 1] == "/etc/shoal/api-keys/keys"
    assert args[args.index("--admin-keys-file") + 1] == "/etc/shoal/admin-keys/k"
    secrets = {v["name"]: v["secret"] for v in pod["volumes"] if "secret" in v}
    assert secrets == {
        "api-keys": {"secretName": "llm-keys", "items": [{"key": "keys", "path": "keys"}]},
        "admin-keys": {"secretName": "ops", "items": [{"key": "k", "path": "k"}]},
    }
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["api-keys"]["readOnly"] and mounts["api-keys"]["mountPath"] == "/etc/shoal/api-keys"
    # Without them, the API is open: no flag, no Secret volume.
    plain = one(
        children.render(cluster_of(ROOT / "operator" / "samples" / "minimal.yaml")), "Deployment", "router"
    )
    assert "--api-keys-file" not in plain["spec"]["template"]["spec"]["containers"][0]["args"]


def test_the_curve_key_reaches_routers_and_engines_from_its_secret() -> None:
    obj = yaml.safe_load((ROOT / "operator" / "samples" / "minimal.yaml").read_text())
    obj["spec"]["zmqCurveSecret"] = {"name": "fleet-curve"}
    cluster = children.Cluster("smol", "serving", UID, InferenceClusterSpec.model_validate(obj["spec"]))
    rendered = children.render(cluster)
    for kind, component in (("Deployment", "router"), ("Deployment", "engine")):
        workload = one(rendered, kind, component)
        kubernetes_validate.validate(workload, kubernetes_validate.latest_version(), strict=True)
        pod = workload["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        args = container["args"]
        assert args[args.index("--zmq-curve-key-file") + 1] == "/etc/shoal/zmq-curve-key/fleet.key"
        (volume,) = [v for v in pod["volumes"] if v["name"] == "zmq-curve-key"]
        assert volume["secret"] == {
            "secretName": "fleet-curve",
            "items": [{"key": "fleet.key", "path": "fleet.key"}],
        }
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "zmq-curve-key"]
        assert mount["readOnly"] and mount["mountPath"] == "/etc/shoal/zmq-curve-key"
    plain = children.render(cluster_of(ROOT / "operator" / "samples" / "minimal.yaml"))
    for kind, component in (("Deployment", "router"), ("Deployment", "engine")):
        assert (
            "--zmq-curve-key-file"
            not in one(plain, kind, component)["spec"]["template"]["spec"]["containers"][0]["args"]
        )


def test_the_routers_scheduler_and_balancing_come_from_the_spec() -> None:
    obj = yaml.safe_load((ROOT / "operator" / "samples" / "minimal.yaml").read_text())
    plain = children.render(cluster_of(ROOT / "operator" / "samples" / "minimal.yaml"))
    args = one(plain, "Deployment", "router")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--scheduler") + 1] == "least_load" and "--balance" not in args
    assert args[args.index("--hold-max-s") + 1] == "1"
    obj["spec"]["router"] = {
        "scheduler": "prefix_affinity=2,least_load=1",
        "balance": True,
        "holdMaxSeconds": 0,
    }
    cluster = children.Cluster("smol", "serving", UID, InferenceClusterSpec.model_validate(obj["spec"]))
    args = one(children.render(cluster), "Deployment", "router")["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    assert args[args.index("--scheduler") + 1] == "prefix_affinity=2,least_load=1" and "--balance" in args
    assert args[args.index("--hold-max-s") + 1] == "0"
    assert "--consolidate-below" not in args
    obj["spec"]["router"] = {"balance": True, "consolidateBelow": 0.4}
    cluster = children.Cluster("smol", "serving", UID, InferenceClusterSpec.model_validate(obj["spec"]))
    args = one(children.render(cluster), "Deployment", "router")["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    assert args[args.index("--consolidate-below") + 1] == "0.4"
    obj["spec"]["router"] = {"balance": True, "consolidateBelow": 0.9}  # past the release point
    with pytest.raises(ValueError, match="consolidateBelow"):
        InferenceClusterSpec.model_validate(obj["spec"])
    for bad in ("fastest", "round_robin,least_load", "least_load=-1"):
        obj["spec"]["router"] = {"scheduler": bad}
        with pytest.raises(ValueError, match="scheduler"):
            InferenceClusterSpec.model_validate(obj["spec"])


@pytest.mark.parametrize(("gpus", "share", "passed"), [(0, 0.0, "0"), (0, 0.2, "0.2"), (1, 0.1, "0.1")])
def test_a_precopy_share_in_the_spec_reaches_the_engines(gpus: int, share: float, passed: str) -> None:
    obj = yaml.safe_load((ROOT / "operator" / "samples" / "minimal.yaml").read_text())
    obj["spec"].setdefault("engine", {}).update({"gpus": gpus, "precopyShare": share})
    cluster = children.Cluster("smol", "serving", UID, InferenceClusterSpec.model_validate(obj["spec"]))
    deployment = one(children.render(cluster), "Deployment", "engine")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["args"][container["args"].index("--migration-precopy-share") + 1] == passed


@pytest.mark.parametrize(("gpus", "size"), [(0, 64), (1, 128)])
def test_a_block_size_in_the_spec_reaches_the_engines(gpus: int, size: int) -> None:
    obj = yaml.safe_load((ROOT / "operator" / "samples" / "minimal.yaml").read_text())
    obj["spec"].setdefault("engine", {}).update({"gpus": gpus, "blockSize": size})
    cluster = children.Cluster("smol", "serving", UID, InferenceClusterSpec.model_validate(obj["spec"]))
    deployment = one(children.render(cluster), "Deployment", "engine")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["args"][container["args"].index("--block-size") + 1] == str(size)


def _with(sample: str, **spec: Any) -> children.Cluster:
    cluster = cluster_of(ROOT / "operator" / "samples" / sample)
    merged = {**cluster.spec.model_dump(by_alias=True, exclude_none=True), **spec}
    return children.Cluster(cluster.name, cluster.namespace, UID, InferenceClusterSpec.model_validate(merged))


def test_the_service_monitor_takes_its_labels_interval_and_bearer_token_from_the_spec() -> None:
    plain = one(children.render(_with("minimal.yaml"), service_monitors=True), "ServiceMonitor", "metrics")
    (endpoint,) = plain["spec"]["endpoints"]
    assert endpoint == {"port": "http", "path": "/metrics", "interval": "15s"}
    monitor_spec = {
        "labels": {"release": "kube-prometheus-stack", "app.kubernetes.io/instance": "not-ours"},
        "interval": "30s",
        "bearerTokenSecret": {"name": "metrics-reader", "key": "admin-key"},
    }
    cluster = _with("minimal.yaml", monitoring={"serviceMonitor": monitor_spec})
    monitor = one(children.render(cluster, service_monitors=True), "ServiceMonitor", "metrics")
    labels = monitor["metadata"]["labels"]
    # kube-prometheus-stack's Prometheus selects monitors by ``release``; Shoal's own labels
    # (which prune and select by) win over the spec's.
    assert labels["release"] == "kube-prometheus-stack"
    assert labels["app.kubernetes.io/instance"] == cluster.name
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["interval"] == "30s"
    assert endpoint["authorization"] == {
        "type": "Bearer",
        "credentials": {"name": "metrics-reader", "key": "admin-key"},
    }


@pytest.mark.parametrize("component", ["engine", "router", "tokenizer"])
def test_every_fleet_container_binds_all_addresses_and_advertises_its_pod_ip(component: str) -> None:
    rendered = children.render(cluster_of(ROOT / "operator" / "samples" / "minimal.yaml"))
    (container,) = one(rendered, "Deployment", component)["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    # ``kubectl port-forward`` connects to the pod's loopback: a socket on the pod IP alone
    # would refuse it.
    assert args[args.index("--bind-host") + 1] == "::"
    assert args[args.index("--host") + 1] == "$(POD_IP)"


@pytest.mark.parametrize("fleet_tls", [{"enabled": False}, {"secretName": "from-cert-manager"}])
def test_fleet_tls_off_or_from_a_secret_of_ones_own(fleet_tls: dict[str, Any]) -> None:
    model = {"source": "SmolLM2", "servedName": "smol"}
    spec = {"model": model, "router": {"balance": True}, "fleetTLS": fleet_tls}
    cluster = children.Cluster("smol", "serving", UID, InferenceClusterSpec.model_validate(spec))
    rendered = children.render(cluster)
    # The operator makes no Secret of its own either way.
    assert [s["metadata"]["name"] for s in by_kind(rendered, "Secret")] == ["smol-redis-auth"]
    for component in ("engine", "router"):
        (container,) = one(rendered, "Deployment", component)["spec"]["template"]["spec"]["containers"]
        volumes = one(rendered, "Deployment", component)["spec"]["template"]["spec"].get("volumes", [])
        named = [v["secret"]["secretName"] for v in volumes if v["name"] == "fleet-tls"]
        if fleet_tls.get("enabled") is False:
            assert "--fleet-tls-dir" not in container["args"] and named == []
        else:
            assert container["args"][container["args"].index("--fleet-tls-dir") + 1] == children.FLEET_TLS_DIR
            assert named == ["from-cert-manager"]
