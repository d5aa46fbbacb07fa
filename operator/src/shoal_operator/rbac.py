"""The operator's permissions, least privilege: namespaced Roles unless it watches every namespace.

The rules list exactly the calls the operator makes: read and write its clusters and their
status, read/watch and create/patch each kind of child (never delete: owner references do that),
read a Secret holding an external Redis URL (autoscaling), post events, and kopf's peering.
Watching named namespaces, it needs no cluster-wide read at all (``main`` turns kopf's namespace
and CRD scanning off then), so each watched namespace gets a Role and a RoleBinding; with
``--all-namespaces`` one ClusterRole adds namespaces and CRDs (what kopf scans) and cluster-wide
peering. ``shoal-operator --print-rbac`` prints them for ``kubectl apply``.
"""

from __future__ import annotations

from typing import Any

from shoal_operator.spec import GROUP, PLURAL

Manifest = dict[str, Any]
SERVICE_ACCOUNT = "shoal-operator"
WRITE = ["get", "list", "watch", "create", "patch"]

RULES: list[Manifest] = [
    {"apiGroups": [GROUP], "resources": [PLURAL], "verbs": ["get", "list", "watch", "patch"]},
    {"apiGroups": [GROUP], "resources": [f"{PLURAL}/status"], "verbs": ["get", "patch"]},
    {"apiGroups": [""], "resources": ["configmaps", "services"], "verbs": WRITE},
    {"apiGroups": ["apps"], "resources": ["statefulsets", "deployments"], "verbs": WRITE},
    {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"], "verbs": WRITE},
    {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies", "ingresses"], "verbs": WRITE},
    {
        "apiGroups": ["monitoring.coreos.com"],
        "resources": ["servicemonitors"],
        "verbs": ["get", "create", "patch"],
    },
    # An external Redis URL kept in a Secret (the autoscaler reads the fleet's load there).
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]},
    {"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create"]},
    {"apiGroups": ["kopf.dev"], "resources": ["kopfpeerings"], "verbs": ["get", "list", "watch", "patch"]},
]
"""What the operator does in a namespace it watches."""

CLUSTER_RULES: list[Manifest] = [
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get", "list", "watch"]},
    {
        "apiGroups": ["apiextensions.k8s.io"],
        "resources": ["customresourcedefinitions"],
        "verbs": ["list", "watch"],
    },
    {
        "apiGroups": ["kopf.dev"],
        "resources": ["clusterkopfpeerings"],
        "verbs": ["get", "list", "watch", "patch"],
    },
]
"""What it adds when it watches every namespace."""


def _labels() -> dict[str, str]:
    return {"app.kubernetes.io/name": "shoal-operator", "app.kubernetes.io/component": "operator"}


def manifests(namespace: str, watched: list[str] | None) -> list[Manifest]:
    """ServiceAccount in ``namespace`` and its permissions: a Role and RoleBinding in each of
    ``watched``, or (``None``: every namespace) one ClusterRole and ClusterRoleBinding."""
    subject = {"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": namespace}
    account = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": SERVICE_ACCOUNT, "namespace": namespace, "labels": _labels()},
    }
    rbac = "rbac.authorization.k8s.io/v1"
    if watched is None:
        return [
            account,
            {
                "apiVersion": rbac,
                "kind": "ClusterRole",
                "metadata": {"name": SERVICE_ACCOUNT, "labels": _labels()},
                "rules": RULES + CLUSTER_RULES,
            },
            {
                "apiVersion": rbac,
                "kind": "ClusterRoleBinding",
                "metadata": {"name": SERVICE_ACCOUNT, "labels": _labels()},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": SERVICE_ACCOUNT,
                },
                "subjects": [subject],
            },
        ]
    out = [account]
    for each in watched:
        meta = {"name": SERVICE_ACCOUNT, "namespace": each, "labels": _labels()}
        out.append({"apiVersion": rbac, "kind": "Role", "metadata": meta, "rules": RULES})
        out.append(
            {
                "apiVersion": rbac,
                "kind": "RoleBinding",
                "metadata": dict(meta),
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": SERVICE_ACCOUNT},
                "subjects": [subject],
            }
        )
    return out
