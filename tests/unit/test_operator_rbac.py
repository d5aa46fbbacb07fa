"""The operator's RBAC: valid objects, namespaced unless it watches everything, every call the
operator's code makes is allowed (delete only on the children it prunes), and the leader
election's Lease is reachable in the operator's own namespace and nowhere else."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml

from shoal_operator import rbac
from shoal_operator.handlers import CHILD_RESOURCES
from shoal_operator.kube import PLURALS
from shoal_operator.leader import LEASE_NAME
from shoal_operator.main import main
from shoal_operator.spec import GROUP, PLURAL, VERSION


def _allows(rules: list[dict[str, Any]], group: str, resource: str, verb: str) -> bool:
    return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] for r in rules)


def _group(api_version: str) -> str:
    return api_version.rpartition("/")[0]


@pytest.mark.parametrize("watched", [["serving", "batch"], None])
def test_manifests_are_valid_kubernetes_objects(watched: list[str] | None) -> None:
    version = kubernetes_validate.latest_version()
    for manifest in rbac.manifests("shoal-system", watched):
        kubernetes_validate.validate(manifest, version, strict=True)


def test_named_namespaces_get_roles_only() -> None:
    objects = rbac.manifests("shoal-system", ["serving", "batch"])
    kinds = [(o["kind"], o["metadata"].get("namespace")) for o in objects]
    assert kinds == [
        ("ServiceAccount", "shoal-system"),
        ("Role", "serving"), ("RoleBinding", "serving"),
        ("Role", "batch"), ("RoleBinding", "batch"),
        ("Role", "shoal-system"), ("RoleBinding", "shoal-system"),  # the Lease
    ]  # fmt: skip
    (subject,) = objects[2]["subjects"]
    assert subject == {"kind": "ServiceAccount", "name": "shoal-operator", "namespace": "shoal-system"}


def test_all_namespaces_get_one_cluster_role_with_what_kopf_scans() -> None:
    objects = rbac.manifests("shoal-system", None)
    kinds = [(o["kind"], o["metadata"].get("namespace")) for o in objects]
    assert kinds == [
        ("ServiceAccount", "shoal-system"),
        ("ClusterRole", None), ("ClusterRoleBinding", None),
        ("Role", "shoal-system"), ("RoleBinding", "shoal-system"),  # the Lease
    ]  # fmt: skip
    rules = objects[1]["rules"]
    assert _allows(rules, "", "namespaces", "watch")
    assert _allows(rules, "apiextensions.k8s.io", "customresourcedefinitions", "watch")


def test_every_call_the_operator_makes_is_allowed() -> None:
    rules = rbac.RULES
    # Its clusters: read, resized by the autoscaler (patch), a legacy finalizer taken off
    # (update), the status written, and children created with blockOwnerDeletion (the
    # finalizers subresource, under OwnerReferencesPermissionEnforcement).
    for verb in ("get", "list", "watch", "patch", "update"):
        assert _allows(rules, GROUP, PLURAL, verb), verb
    assert _allows(rules, GROUP, f"{PLURAL}/status", "patch")
    assert _allows(rules, GROUP, f"{PLURAL}/finalizers", "update")
    # Every child kind: read, created, patched (merge patch and server-side apply), and pruned
    # (listed by label, deleted). Engine pods: listed and marked for removal in a scale-down.
    for (api_version, _kind), plural in PLURALS.items():
        if plural == PLURAL:
            continue
        group = _group(api_version)
        verbs = ("list", "patch") if plural == "pods" else ("get", "create", "patch", "list", "delete")
        for verb in verbs:
            assert _allows(rules, group, plural, verb), (api_version, plural, verb)
    # kopf watches the clusters and every child kind.
    for api_version, plural in [(f"{GROUP}/{VERSION}", PLURAL), *CHILD_RESOURCES]:
        for verb in ("list", "watch"):
            assert _allows(rules, _group(api_version), plural, verb), (plural, verb)


def test_delete_only_on_the_children_and_no_kopf_peering() -> None:
    children = set(PLURALS.values()) - {PLURAL, "pods"}
    for rule in rbac.RULES + rbac.CLUSTER_RULES + rbac.LEADER_ELECTION_RULES:
        if "delete" in rule["verbs"]:
            assert set(rule["resources"]) <= children, rule
        assert "kopf.dev" not in rule["apiGroups"], rule  # only the leader runs kopf: no peering


def test_the_lease_only_in_the_operators_namespace() -> None:
    # The elector reads the Lease (GET), creates it (POST) and renews it (PUT: update).
    lease_rules = rbac.LEADER_ELECTION_RULES
    assert _allows(lease_rules, "coordination.k8s.io", "leases", "create")
    (named,) = [r for r in lease_rules if r.get("resourceNames")]
    assert named["resourceNames"] == [LEASE_NAME] and set(named["verbs"]) == {"get", "update"}
    for rules in (rbac.RULES, rbac.CLUSTER_RULES):
        assert not any("leases" in r["resources"] for r in rules)
    objects = rbac.manifests("shoal-system", ["serving"])
    with_leases = [o for o in objects if any("leases" in r["resources"] for r in o.get("rules", []))]
    assert [(o["kind"], o["metadata"]["namespace"]) for o in with_leases] == [("Role", "shoal-system")]
    (binding,) = [
        o for o in objects if o["kind"] == "RoleBinding" and o["metadata"]["name"] == rbac.LEADER_ELECTION
    ]
    assert binding["roleRef"]["name"] == rbac.LEADER_ELECTION


def test_print_rbac(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--print-rbac", "shoal-system", "-n", "serving"])
    objects = list(yaml.safe_load_all(capsys.readouterr().out))
    assert objects == rbac.manifests("shoal-system", ["serving"])
