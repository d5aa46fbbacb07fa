"""What every child of an ``InferenceCluster`` shares: the cluster it belongs to, its name, labels
and owner reference, the fleet's ports, and the names of the Secrets the operator makes.

The manifests themselves are built in ``engine_pods.py`` and ``workloads.py`` (from the pod
template pieces in ``pods.py``) and in ``children.py``, which renders them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shoal_operator.spec import GROUP, KIND, VERSION, InferenceClusterSpec

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

Manifest = dict[str, Any]


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


def object_meta(cluster: Cluster, name: str, component: str) -> dict[str, Any]:
    """A child's metadata: its name and labels, and the owner reference to its cluster."""
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


KEYS_DIR = "/etc/shoal"
"""Where routers and engines find files mounted from Secrets (API keys, the CURVE key)."""
REDIS_AUTH_KEY = "password"


def redis_auth_secret_name(cluster: Cluster) -> str:
    return f"{cluster.name}-redis-auth"


FLEET_TLS_DIR = f"{KEYS_DIR}/fleet-tls"


def fleet_tls_secret_name(cluster: Cluster) -> str | None:
    """The Secret of the fleet's TLS files, or None when the fleet's links are plain."""
    spec = cluster.spec.fleet_tls
    if not spec.enabled:
        return None
    return spec.secret_name or f"{cluster.name}-fleet-tls"
