"""The operator's RBAC: valid objects, namespaced unless it watches everything, and every call
the operator's code makes is allowed (and no delete is)."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml
from shoal_operator import rbac
from shoal_operator.handlers import CHILD_RESOURCES
from shoal_operator.kube import PLURALS
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
    ]  # fmt: skip
    (subject,) = objects[2]["subjects"]
    assert subject == {"kind": "ServiceAccount", "name": "shoal-operator", "namespace": "shoal-system"}


def test_all_namespaces_get_one_cluster_role_with_what_kopf_scans() -> None:
    objects = rbac.manifests("shoal-system", None)
    assert [o["kind"] for o in objects] == ["ServiceAccount", "ClusterRole", "ClusterRoleBinding"]
    rules = objects[1]["rules"]
    assert _allows(rules, "", "namespaces", "watch")
    assert _allows(rules, "apiextensions.k8s.io", "customresourcedefinitions", "watch")


def test_every_call_the_operator_makes_is_allowed_and_no_delete() -> None:
    rules = rbac.RULES
    # The reconciler reads, creates and patches every kind it manages, and patches the status.
    for (api_version, _kind), plural in PLURALS.items():
        group = _group(api_version)
        if plural == PLURAL:  # read, resized by the autoscaler, its status written
            assert group == GROUP and _allows(rules, group, f"{PLURAL}/status", "patch")
            assert _allows(rules, group, PLURAL, "get") and _allows(rules, group, PLURAL, "patch")
            continue
        # Secrets: read (and the generated one created, tested below); engine pods: listed and
        # marked for removal in a scale-down.
        verbs = {"secrets": ("get",), "pods": ("list", "patch")}.get(plural, ("get", "create", "patch"))
        for verb in verbs:
            assert _allows(rules, group, plural, verb), (api_version, plural, verb)
    # kopf watches the clusters and every child kind.
    for api_version, plural in [(f"{GROUP}/{VERSION}", PLURAL), *CHILD_RESOURCES]:
        for verb in ("list", "watch"):
            assert _allows(rules, _group(api_version), plural, verb), (plural, verb)
    assert not any("delete" in r["verbs"] for r in rbac.RULES + rbac.CLUSTER_RULES)


def test_print_rbac(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--print-rbac", "shoal-system", "-n", "serving"])
    objects = list(yaml.safe_load_all(capsys.readouterr().out))
    assert objects == rbac.manifests("shoal-system", ["serving"])
