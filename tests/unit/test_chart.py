"""The Helm chart, linted and rendered by Helm itself (the Helm library the ``helm-python-sdk``
wheel carries; no cluster involved): every rendered object is a valid Kubernetes object, the
RBAC is exactly what the operator's code says it needs, values are documented and checked, and
the sample cluster is admitted by the CRD.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from helm_python.chart import Chart, lint
from helm_python.errors import HelmError
from shoal_operator import rbac
from shoal_operator.crd import CRD_PATH, ROOT

from tests.unit.admission import admit

CHART = ROOT / "charts" / "shoal"
RELEASE, NAMESPACE = "shoal", "shoal-system"


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The release's objects as ``helm template`` prints them (CRDs are installed from crds/)."""
    with Chart.load(CHART) as chart:
        rendered = chart.render(values=values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return [
        doc
        for path, text in sorted(rendered.items())
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def _rbac_of(objects: list[dict[str, Any]]) -> list[tuple[str, str, str, Any]]:
    """(kind, namespace, name, rules or roleRef and subjects) of the RBAC objects, labels aside."""
    out = []
    for obj in objects:
        if obj["kind"] in ("ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"):
            meta = obj["metadata"]
            body = obj.get("rules") or [obj.get("roleRef"), obj.get("subjects")]
            out.append((obj["kind"], meta.get("namespace", ""), meta["name"], body))
    return sorted(out, key=lambda item: item[:3])


@pytest.mark.parametrize(
    "values",
    [{}, {"operator": {"allNamespaces": True}, "sampleCluster": {"enabled": True}}],
    ids=["defaults", "all-namespaces-with-sample"],
)
def test_helm_lint_passes_strictly(values: dict[str, Any]) -> None:
    report = lint(CHART, values, strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # warnings and errors
    assert report["errors"] == [] and problems == [], report


@pytest.mark.parametrize(
    "values",
    [
        {},
        {"operator": {"watchNamespaces": ["team-a", "team-b"]}, "sampleCluster": {"enabled": True}},
        {
            "operator": {"allNamespaces": True},
            "imagePullSecrets": [{"name": "registry"}],
            "monitoring": {"podMonitor": {"enabled": True}, "serviceMonitors": False},
        },
    ],
    ids=["defaults", "two-namespaces-with-sample", "all-namespaces-with-pod-monitor"],
)
def test_every_rendered_object_is_valid_for_kubernetes(values: dict[str, Any]) -> None:
    objects = render(values)
    version = kubernetes_validate.latest_version()
    for obj in objects:
        if obj["kind"] == "InferenceCluster":
            admit(obj)  # the CRD's own schema and rules, as the API server would apply them
        elif obj["apiVersion"].startswith("monitoring.coreos.com/"):
            assert obj["kind"] == "PodMonitor"  # the Prometheus operator's kind: checked below
        else:
            kubernetes_validate.validate(obj, version, strict=True)
    names = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objects]
    assert len(names) == len(set(names))


@pytest.mark.parametrize(
    ("values", "watched"),
    [
        ({}, [NAMESPACE]),
        ({"operator": {"watchNamespaces": ["team-a", "team-b"]}}, ["team-a", "team-b"]),
        ({"operator": {"allNamespaces": True}}, None),
    ],
    ids=["release-namespace", "two-namespaces", "all-namespaces"],
)
def test_rbac_is_what_the_operator_code_asks_for(values: dict[str, Any], watched: list[str] | None) -> None:
    # The same ServiceAccount, Roles (or ClusterRole) and bindings `shoal-operator --print-rbac`
    # prints, rule for rule.
    assert _rbac_of(render(values)) == _rbac_of(rbac.manifests(NAMESPACE, watched))


def test_the_charts_rules_file_is_what_the_operator_code_generates() -> None:
    # `make crd` writes it; a change to rbac.py without it fails here.
    assert rbac.RULES_PATH.read_text() == rbac.rules_file()
    assert CRD_PATH.parent == CHART / "crds"


def test_operator_deployment() -> None:
    objects = render({"operator": {"watchNamespaces": ["team-a", "team-b"], "resyncSeconds": 30}})
    (deployment,) = by_kind(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    with Chart.load(CHART) as chart:
        app_version = chart.metadata["appVersion"]
    assert container["image"] == f"shoal/operator:{app_version}"
    assert container["args"] == [
        "--standalone",
        "--liveness=http://0.0.0.0:8080/healthz",
        "--resync-seconds=30",
        "--namespace=team-a",
        "--namespace=team-b",
    ]
    assert pod["serviceAccountName"] == rbac.SERVICE_ACCOUNT
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    # Unprivileged, read-only root filesystem; /tmp is the one writable place.
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/tmp"}
    assert container["livenessProbe"]["httpGet"]["port"] == "health"
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    (all_namespaces,) = by_kind(render({"operator": {"allNamespaces": True}}), "Deployment")
    assert "--all-namespaces" in all_namespaces["spec"]["template"]["spec"]["containers"][0]["args"]


def test_sample_cluster_only_when_asked_and_admitted_by_the_crd() -> None:
    assert by_kind(render(), "InferenceCluster") == []
    (cluster,) = by_kind(render({"sampleCluster": {"enabled": True}}), "InferenceCluster")
    stored = admit(cluster)
    assert stored["spec"]["engine"]["replicas"] == 2 and cluster["metadata"]["namespace"] == NAMESPACE


def test_no_rbac_or_service_account_when_turned_off() -> None:
    objects = render({"rbac": {"create": False}, "serviceAccount": {"create": False, "name": "mine"}})
    assert _rbac_of(objects) == []
    (deployment,) = by_kind(objects, "Deployment")
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "mine"


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"operator": {"resyncSeconds": 0}}, "resyncSeconds"),
        ({"operator": {"watchNamespaces": ["Not_A_Namespace"]}}, "watchNamespaces"),
        ({"operator": {"image": {"pullPolicy": "Sometimes"}}}, "pullPolicy"),
        ({"operator": {"replicas": 3}}, "replicas"),  # not a value: one operator runs
        ({"sampleCluster": {"enabled": True, "name": "Smol_2"}}, "name"),
    ],
)
def test_bad_values_are_refused_naming_the_field(values: dict[str, Any], field: str) -> None:
    with Chart.load(CHART) as chart, pytest.raises(HelmError) as refused:
        chart.render(values=values, name=RELEASE, namespace=NAMESPACE)
    assert field in str(refused.value)


def test_dashboards_are_config_maps_for_grafanas_sidecar() -> None:
    maps = [m for m in by_kind(render(), "ConfigMap") if "grafana_dashboard" in m["metadata"]["labels"]]
    files = sorted((CHART / "dashboards").glob("*.json"))
    assert len(maps) == len(files) == 4
    for config_map, path in zip(sorted(maps, key=lambda m: m["metadata"]["name"]), files, strict=True):
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
        ((name, text),) = config_map["data"].items()
        assert name == path.name and json.loads(text) == json.loads(path.read_text())
    folder = {
        "dashboards": {"label": "my_dashboards", "namespace": "grafana", "annotations": {"folder": "LLM"}}
    }
    (moved, *_) = [
        m for m in by_kind(render(folder), "ConfigMap") if "my_dashboards" in m["metadata"]["labels"]
    ]
    assert moved["metadata"]["namespace"] == "grafana" and moved["metadata"]["annotations"] == {
        "folder": "LLM"
    }
    assert by_kind(render({"dashboards": {"enabled": False}}), "ConfigMap") == []


def test_pod_monitor_and_service_monitor_toggles() -> None:
    assert by_kind(render(), "PodMonitor") == []
    (deployment,) = by_kind(render(), "Deployment")
    assert "--no-service-monitors" not in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    values = {
        "operator": {"watchNamespaces": ["team-a"]},
        "monitoring": {
            "serviceMonitors": False,
            "podMonitor": {"enabled": True, "labels": {"release": "kps"}},
        },
    }
    objects = render(values)
    (monitor,) = by_kind(objects, "PodMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kps"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a"]}
    assert monitor["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/managed-by": "shoal-operator"}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("http", "/metrics")
    (deployment,) = by_kind(objects, "Deployment")
    assert "--no-service-monitors" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    everywhere = {"operator": {"allNamespaces": True}, "monitoring": {"podMonitor": {"enabled": True}}}
    (monitor,) = by_kind(render(everywhere), "PodMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"any": True}


def test_every_value_is_documented_in_the_schema() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())

    def undocumented(value: Any, node: dict[str, Any], path: str) -> list[str]:
        missing = [] if node.get("description") or not path else [path]
        if isinstance(value, dict) and "properties" in node:
            for key, child in value.items():
                if key not in node["properties"]:
                    missing.append(f"{path}.{key} (not in the schema)")
                else:
                    missing += undocumented(child, node["properties"][key], f"{path}.{key}".lstrip("."))
        return missing

    assert undocumented(defaults, schema, "") == []


def test_chart_files_are_where_helm_expects_them() -> None:
    files = {p.relative_to(CHART).as_posix() for p in Path(CHART).rglob("*") if p.is_file()}
    assert {"Chart.yaml", "values.yaml", "values.schema.json", "templates/NOTES.txt"} <= files
    assert f"crds/{CRD_PATH.name}" in files
