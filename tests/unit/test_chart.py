"""The Helm chart, linted and rendered by Helm itself (the Helm library the ``helm-python-sdk``
wheel carries): every rendered object is a valid Kubernetes object, the RBAC is exactly what the
operator's code says it needs, values are documented and checked, the CRD is a template kept on
uninstall, and the sample cluster is admitted by the CRD. Most renders involve no cluster (as
``helm template``); the checks that ``lookup`` drives (missing namespaces, the sample cluster
before its CRD) render against kmock, an in-memory Kubernetes API, as ``helm install`` would.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import kmock as kmock_lib
import kubernetes_validate
import pytest
import yaml
from helm_python.chart import Chart, lint
from helm_python.config import Config
from helm_python.errors import HelmError

from shoal_operator import rbac
from shoal_operator.crd import CRD_PATH, ROOT
from tests.unit.admission import admit

CHART = ROOT / "charts" / "shoal"
RELEASE, NAMESPACE = "shoal", "shoal-system"


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The release's objects as ``helm template`` prints them (the CRD among them)."""
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
    [
        {},
        {"operator": {"allNamespaces": True}, "sampleCluster": {"enabled": True}},
        {"operator": {"watchNamespaces": ["team-a"], "createNamespaces": True, "replicas": 1}},
    ],
    ids=["defaults", "all-namespaces-with-sample", "created-namespace-one-replica"],
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
        {
            "operator": {"watchNamespaces": ["team-a", NAMESPACE], "createNamespaces": True, "replicas": 1},
            "crds": {"install": False},
        },
    ],
    ids=[
        "defaults",
        "two-namespaces-with-sample",
        "all-namespaces-with-pod-monitor",
        "created-namespace-one-replica-no-crd",
    ],
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
    assert CRD_PATH.parent == CHART / "files"


def test_operator_deployment() -> None:
    objects = render({"operator": {"watchNamespaces": ["team-a", "team-b"], "resyncSeconds": 30}})
    (deployment,) = by_kind(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    with Chart.load(CHART) as chart:
        app_version = chart.metadata["appVersion"]
    assert container["image"] == f"shoal/operator:{app_version}"
    # No --standalone: the replicas elect their leader.
    assert container["args"] == [
        "--liveness=http://0.0.0.0:8080/healthz",
        "--resync-seconds=30",
        "--log-format=plain",
        "--namespace=team-a",
        "--namespace=team-b",
    ]
    assert pod["serviceAccountName"] == rbac.SERVICE_ACCOUNT
    # Two replicas, one leading; a rollout starts a new pod (a standby) before it stops an old one.
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}
    assert env == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    (spread,) = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert spread["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert (
        spread["podAffinityTerm"]["labelSelector"]["matchLabels"]
        == deployment["spec"]["selector"]["matchLabels"]
    )
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
    mine = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}}
    values = {"operator": {"affinity": mine, "logFormat": "json", "replicas": 1}}
    (own,) = by_kind(render(values), "Deployment")
    assert own["spec"]["template"]["spec"]["affinity"] == mine and own["spec"]["replicas"] == 1
    assert "--log-format=json" in own["spec"]["template"]["spec"]["containers"][0]["args"]


@pytest.mark.parametrize(("replicas", "budgets"), [(1, 0), (2, 1), (3, 1)])
def test_a_disruption_budget_keeps_one_operator_when_several_run(replicas: int, budgets: int) -> None:
    objects = render({"operator": {"replicas": replicas}})
    found = by_kind(objects, "PodDisruptionBudget")
    assert len(found) == budgets
    if found:
        (deployment,) = by_kind(objects, "Deployment")
        assert found[0]["spec"]["minAvailable"] == 1
        assert found[0]["spec"]["selector"] == deployment["spec"]["selector"]


def test_the_lease_role_is_in_the_release_namespace_only() -> None:
    objects = render({"operator": {"watchNamespaces": ["team-a"]}})
    leases = [
        (o["kind"], o["metadata"]["namespace"])
        for o in by_kind(objects, "Role")
        if any("leases" in rule["resources"] for rule in o["rules"])
    ]
    assert leases == [("Role", NAMESPACE)]


def test_the_crd_is_a_template_installed_and_upgraded_and_kept_on_uninstall() -> None:
    (crd,) = by_kind(render(), "CustomResourceDefinition")
    generated = yaml.safe_load(CRD_PATH.read_text())
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert crd["metadata"]["labels"]["app.kubernetes.io/part-of"] == "shoal"
    assert {k: v for k, v in crd.items() if k != "metadata"} == {
        k: v for k, v in generated.items() if k != "metadata"
    }
    assert crd["metadata"]["name"] == generated["metadata"]["name"]
    assert by_kind(render({"crds": {"install": False}}), "CustomResourceDefinition") == []


def test_watched_namespaces_are_created_only_on_request_and_kept() -> None:
    watched = {"watchNamespaces": ["team-a", NAMESPACE, "team-b"]}
    assert by_kind(render({"operator": watched}), "Namespace") == []  # the default: they must exist
    created = by_kind(render({"operator": {**watched, "createNamespaces": True}}), "Namespace")
    # Not the release namespace: Helm (--create-namespace) or its owner makes that one.
    assert [n["metadata"]["name"] for n in created] == ["team-a", "team-b"]
    for namespace in created:
        assert namespace["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    everywhere = {"operator": {"allNamespaces": True, "createNamespaces": True}}
    assert by_kind(render(everywhere), "Namespace") == []


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
        ({"operator": {"replicas": 0}}, "replicas"),
        ({"operator": {"logFormat": "xml"}}, "logFormat"),
        ({"operator": {"createNamespaces": "yes"}}, "createNamespaces"),
        ({"crds": {"install": "yes"}}, "install"),
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
    # The CRD is a plain file a template renders (crds/ would be installed once, never upgraded).
    assert f"files/{CRD_PATH.name}" in files
    assert not any(name.startswith("crds/") for name in files)


# ---- rendered against an API server (kmock): what `lookup` decides ----------------------------


def _namespace(name: str, release: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if release is not None:  # what Helm writes on the objects of a release
        meta["annotations"] = {
            "meta.helm.sh/release-name": release,
            "meta.helm.sh/release-namespace": NAMESPACE,
        }
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": meta}


@pytest.fixture
async def cluster(kmock: kmock_lib.KubernetesEmulator) -> kmock_lib.KubernetesEmulator:
    """An API server holding kube-system and the release namespace. kmock 0.8 cannot serve a
    cluster-scoped object by name (it reads /api/v1/namespaces/NAME as a namespace), so each
    namespace that exists is a fixed answer at its path; any other is 404."""
    kmock.resources["v1/namespaces"] = kmock_lib.ResourceInfo(
        kind="Namespace", namespaced=False, verbs={"get"}
    )
    kmock.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = kmock_lib.ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False, verbs={"get"}
    )
    for name in ("kube-system", NAMESPACE):
        kmock[f"get /api/v1/namespaces/{name}"] << _namespace(name)
    return kmock


async def _install_render(api: kmock_lib.KubernetesEmulator, values: dict[str, Any]) -> list[dict[str, Any]]:
    """Render as `helm install` does, ``lookup`` asking ``api`` (in a thread: Helm's call blocks,
    and kmock answers on this event loop)."""

    def run() -> dict[str, str]:
        server = str(api.url).rstrip("/")
        with Config(kube_apiserver=server, namespace=NAMESPACE) as config, Chart.load(CHART) as chart:
            return config.render(chart, values, name=RELEASE, namespace=NAMESPACE, is_install=True)

    rendered = await asyncio.to_thread(run)
    return [
        doc
        for path, text in sorted(rendered.items())
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


async def test_a_missing_watched_namespace_stops_the_install_naming_it_and_both_fixes(
    cluster: kmock_lib.KubernetesEmulator,
) -> None:
    cluster["get /api/v1/namespaces/team-a"] << _namespace("team-a")
    values = {"operator": {"watchNamespaces": ["team-a", "serving", "batch"]}}
    with pytest.raises(HelmError) as refused:
        await _install_render(cluster, values)
    message = str(refused.value)
    assert "namespaces serving, batch not found" in message and "team-a" not in message
    assert "kubectl create namespace serving batch" in message
    assert "operator.createNamespaces=true" in message
    # Once they exist, the same install goes through.
    for name in ("serving", "batch"):
        cluster[f"get /api/v1/namespaces/{name}"] << _namespace(name)
    objects = await _install_render(cluster, values)
    assert {o["metadata"]["namespace"] for o in by_kind(objects, "Role")} >= {"team-a", "serving", "batch"}


async def test_the_release_namespace_alone_needs_no_lookup(cluster: kmock_lib.KubernetesEmulator) -> None:
    objects = await _install_render(cluster, {})
    assert by_kind(objects, "Namespace") == []
    assert not any("/namespaces/" in r.url.path for r in cluster)  # nothing looked up


async def test_without_a_cluster_to_ask_the_install_is_not_stopped(
    kmock: kmock_lib.KubernetesEmulator,
) -> None:
    # Where lookup finds nothing at all (not even kube-system), as under `helm template` and
    # client-side dry runs, the namespaces cannot be checked and the render goes on.
    kmock.resources["v1/namespaces"] = kmock_lib.ResourceInfo(
        kind="Namespace", namespaced=False, verbs={"get"}
    )
    objects = await _install_render(kmock, {"operator": {"watchNamespaces": ["serving"]}})
    roles = sorted(o["metadata"]["namespace"] for o in by_kind(objects, "Role"))
    assert roles == sorted(["serving", NAMESPACE])  # the watched namespace's, and the Lease's


async def test_created_namespaces_leave_one_the_release_does_not_own(
    cluster: kmock_lib.KubernetesEmulator,
) -> None:
    cluster["get /api/v1/namespaces/theirs"] << _namespace("theirs")  # made by someone else
    cluster["get /api/v1/namespaces/ours"] << _namespace("ours", release=RELEASE)  # an upgrade
    values = {"operator": {"watchNamespaces": ["theirs", "ours", "new"], "createNamespaces": True}}
    objects = await _install_render(cluster, values)
    # Helm refuses to adopt a namespace another owner made: it is left out, not fought over.
    assert [n["metadata"]["name"] for n in by_kind(objects, "Namespace")] == ["ours", "new"]


async def test_the_sample_cluster_waits_for_its_crd(cluster: kmock_lib.KubernetesEmulator) -> None:
    values = {"sampleCluster": {"enabled": True}}
    with pytest.raises(HelmError) as refused:
        await _install_render(cluster, values)
    assert "the InferenceCluster CRD is not in the cluster yet" in str(refused.value)
    crd = yaml.safe_load(CRD_PATH.read_text())
    cluster[f"get /apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd['metadata']['name']}"] << crd
    (sample,) = by_kind(await _install_render(cluster, values), "InferenceCluster")
    assert sample["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
