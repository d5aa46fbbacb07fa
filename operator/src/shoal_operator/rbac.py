"""The operator's permissions, least privilege: namespaced Roles unless it watches every namespace.

The rules list exactly the calls the operator makes, rule by rule:

* its clusters: read and watch them, patch them (the autoscaler resizes ``spec.engine``), and
  update them (an update takes off a finalizer older operators left on a cluster); their status,
  read and patched; their ``finalizers`` subresource, update: with the
  OwnerReferencesPermissionEnforcement admission plugin (on by default in OpenShift), creating a
  child whose owner reference blocks the owner's deletion (``blockOwnerDeletion``) needs it;
* each kind of child (ConfigMaps, Services, Secrets, StatefulSets, Deployments,
  PodDisruptionBudgets, NetworkPolicies, Ingresses, ServiceMonitors): read, create and patch
  (merge patches, and server-side apply, which is a PATCH of ``application/apply-patch+yaml``),
  list and delete (the reconciler prunes the children a spec no longer asks for: it lists them
  by label and deletes the ones left over), and watch for the kinds kopf watches; a deleted
  cluster's children still go with their owner references, not with the operator;
* engine pods: listed and marked when a scale-down chooses them (pod-deletion-cost);
* events: posted for warnings.

Watching named namespaces, it needs no cluster-wide read at all (``main`` turns kopf's namespace
and CRD scanning off then), so each watched namespace gets a Role and a RoleBinding; with
``--all-namespaces`` one ClusterRole adds namespaces and CRDs (what kopf scans). Apart from
these, a Role in the operator's own namespace lets the replicas elect their leader on a Lease
(``leader.py``): create it, and read and update that one Lease, in no other namespace. kopf's
own peering is off (only the leader runs kopf), so nothing here is for it.
``shoal-operator --print-rbac`` prints them for ``kubectl apply``; the Helm chart takes the same
rules from ``RULES_PATH``, which ``make crd`` writes from this module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from shoal_operator.leader import LEASE_NAME
from shoal_operator.spec import GROUP, PLURAL

Manifest = dict[str, Any]
SERVICE_ACCOUNT = "shoal-operator"
LEADER_ELECTION = f"{SERVICE_ACCOUNT}-leader-election"
"""Name of the Role and RoleBinding for the Lease, in the operator's own namespace."""
WATCHED = ["get", "list", "watch", "create", "patch", "delete"]
"""A child kind kopf watches: read, watch, write, and prune."""
UNWATCHED = ["get", "list", "create", "patch", "delete"]
"""A child kind the operator writes but does not watch."""

RULES: list[Manifest] = [
    # update: taking a legacy finalizer off a cluster.
    {"apiGroups": [GROUP], "resources": [PLURAL], "verbs": ["get", "list", "watch", "patch", "update"]},
    {"apiGroups": [GROUP], "resources": [f"{PLURAL}/status"], "verbs": ["get", "patch"]},
    # Children whose owner reference sets blockOwnerDeletion, under OwnerReferencesPermissionEnforcement.
    {"apiGroups": [GROUP], "resources": [f"{PLURAL}/finalizers"], "verbs": ["update"]},
    # list and delete: pruning children the spec no longer asks for (reconcile.py); patch: merge
    # patches and server-side apply (application/apply-patch+yaml).
    {"apiGroups": [""], "resources": ["configmaps", "services"], "verbs": WATCHED},
    {"apiGroups": ["apps"], "resources": ["statefulsets", "deployments"], "verbs": WATCHED},
    {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"], "verbs": WATCHED},
    {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies", "ingresses"], "verbs": WATCHED},
    {"apiGroups": ["monitoring.coreos.com"], "resources": ["servicemonitors"], "verbs": UNWATCHED},
    # The managed Redis's password (created once, never read back into a pod spec), and an
    # external Redis URL kept in a Secret (the autoscaler reads the fleet's load there).
    {"apiGroups": [""], "resources": ["secrets"], "verbs": UNWATCHED},
    # Scale-down: list the engine pods and mark the ones chosen to leave (pod-deletion-cost).
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "patch"]},
    {"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create"]},
]
"""What the operator does in a namespace it watches."""

CLUSTER_RULES: list[Manifest] = [
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get", "list", "watch"]},
    {
        "apiGroups": ["apiextensions.k8s.io"],
        "resources": ["customresourcedefinitions"],
        "verbs": ["list", "watch"],
    },
]
"""What it adds when it watches every namespace."""

LEADER_ELECTION_RULES: list[Manifest] = [
    # A create names no object, so it cannot be limited to one name; reads and updates are.
    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
    {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        "resourceNames": [LEASE_NAME],
        "verbs": ["get", "update"],
    },
]
"""What the replicas need in the operator's own namespace to elect their leader."""


RULES_PATH = Path(__file__).resolve().parents[3] / "charts" / "shoal" / "files" / "operator-rules.yaml"


def rules_file() -> str:
    """The chart's copy of the rules: ``namespaced`` for each watched namespace's Role,
    ``cluster`` added to the ClusterRole when the operator watches every namespace, and
    ``leaderElection`` for the Role in the operator's own namespace."""
    header = "# Generated by `make crd` from operator/src/shoal_operator/rbac.py: do not edit.\n"
    rules = {"namespaced": RULES, "cluster": CLUSTER_RULES, "leaderElection": LEADER_ELECTION_RULES}
    return header + yaml.safe_dump(rules, sort_keys=False)


def _labels() -> dict[str, str]:
    return {"app.kubernetes.io/name": "shoal-operator", "app.kubernetes.io/component": "operator"}


_RBAC = "rbac.authorization.k8s.io/v1"


def _role(
    kind: str, name: str, namespace: str | None, rules: list[Manifest], subject: Manifest
) -> list[Manifest]:
    """A Role (or ClusterRole, ``namespace`` None) and the binding that gives it to ``subject``."""
    meta: Manifest = {"name": name, "labels": _labels()}
    if namespace is not None:
        meta = {"name": name, "namespace": namespace, "labels": _labels()}
    return [
        {"apiVersion": _RBAC, "kind": kind, "metadata": meta, "rules": rules},
        {
            "apiVersion": _RBAC,
            "kind": f"{kind}Binding",
            "metadata": dict(meta),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": name},
            "subjects": [subject],
        },
    ]


def manifests(namespace: str, watched: list[str] | None) -> list[Manifest]:
    """ServiceAccount in ``namespace`` and its permissions: a Role and RoleBinding in each of
    ``watched``, or (``None``: every namespace) one ClusterRole and ClusterRoleBinding; and in
    ``namespace`` a Role and RoleBinding for the leader election's Lease."""
    subject = {"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": namespace}
    account = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": SERVICE_ACCOUNT, "namespace": namespace, "labels": _labels()},
    }
    out = [account]
    if watched is None:
        out += _role("ClusterRole", SERVICE_ACCOUNT, None, RULES + CLUSTER_RULES, subject)
    else:
        for each in watched:
            out += _role("Role", SERVICE_ACCOUNT, each, RULES, subject)
    out += _role("Role", LEADER_ELECTION, namespace, LEADER_ELECTION_RULES, subject)
    return out
