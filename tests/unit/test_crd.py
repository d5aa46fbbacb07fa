"""The InferenceCluster CRD: generated from the spec models, valid for Kubernetes, and checking
sample objects the way the API server would (structural defaults, schema, CEL rules).

No API server runs here. ``kubernetes-validate`` checks the CRD against Kubernetes' own schema
for CustomResourceDefinition; samples are checked against the CRD's ``openAPIV3Schema`` with
defaults applied first (as the API server does), then its ``x-kubernetes-validations`` rules
are evaluated with a CEL interpreter.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pydantic
import pytest
import yaml

from shoal_operator import crd
from shoal_operator.spec import InferenceClusterSpec
from tests.unit.admission import admit, crd_manifest, crd_schema

SAMPLES = sorted((Path(crd.ROOT) / "operator" / "samples").glob("*.yaml"))


def test_checked_in_crd_is_what_the_models_generate() -> None:
    # `make crd` writes it; a model change without it fails here.
    assert crd.CRD_PATH.read_text() == crd.render()


def test_crd_is_a_valid_custom_resource_definition() -> None:
    # Kubernetes' own schema for the newest version it knows; strict: no unknown fields.
    version = kubernetes_validate.latest_version()
    assert version.startswith("1.") and int(version.split(".")[1]) >= 33
    kubernetes_validate.validate(crd_manifest(), version, strict=True)


def test_crd_has_status_scale_and_printer_columns() -> None:
    version = crd_manifest()["spec"]["versions"][0]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.engine.replicas"
    assert version["subresources"]["scale"]["labelSelectorPath"] == ".status.selector"
    assert [c["name"] for c in version["additionalPrinterColumns"]] == ["Ready", "Engines", "Model", "Age"]
    assert crd_manifest()["spec"]["names"]["shortNames"] == ["ic"]


def test_every_spec_field_is_documented() -> None:
    def undocumented(schema: dict[str, Any], path: str) -> list[str]:
        missing = [] if schema.get("description") else [path]
        for name, child in schema.get("properties", {}).items():
            missing += undocumented(child, f"{path}.{name}")
        return missing

    schema = crd_schema()["properties"]
    assert undocumented(schema["spec"], "spec") == []
    assert undocumented(schema["status"], "status") == []


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.stem)
def test_samples_are_admitted_and_read_by_the_operator(sample: Path) -> None:
    obj = yaml.safe_load(sample.read_text())
    stored = admit(obj)
    # The API server's defaults and the models' agree, field for field.
    spec = InferenceClusterSpec.model_validate(obj["spec"])
    assert spec.model_dump(by_alias=True, exclude_none=True) == stored["spec"]


MINIMAL = {
    "apiVersion": "shoal.dev/v1alpha1",
    "kind": "InferenceCluster",
    "metadata": {"name": "x"},
    "spec": {"model": {"source": "m", "servedName": "m"}},
}


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"engine": {"minReplicas": 4, "maxReplicas": 2, "replicas": 3}}, "minReplicas must be <="),
        ({"engine": {"replicas": 9}}, "replicas must be <= engine.maxReplicas"),
        (
            {"engine": {"replicas": 1, "minReplicas": 2}, "autoscaling": {"enabled": True}},
            "with autoscaling.enabled, engine.replicas must be >= engine.minReplicas",
        ),
        ({"engine": {"kvTransport": "nccl"}}, "nccl needs engine.gpus > 0"),
        ({"engine": {"gpus": 1, "kvTransport": "tcp"}}, "kvTransport tcp and gloo copy a CPU KV cache"),
        ({"engine": {"gpus": 1, "kvTransport": "gloo"}}, "kvTransport tcp and gloo copy a CPU KV cache"),
        ({"engine": {"gpus": 4, "tensorParallelSize": 2}}, "gpus must equal engine.tensorParallelSize"),
        ({"engine": {"gpus": 2, "tensorParallelSize": 2, "pipelineParallelSize": 2}}, "gpus must equal"),
        (
            {"engine": {"extraArgs": ["--enable-chunked-prefill", "--block-size=64"]}},
            "--block-size=64 is set by",
        ),
        ({"engine": {"extraArgs": ["-tp", "2"]}}, "extraArgs: -tp is set by Shoal"),
        ({"engine": {"extraArgs": ["--max_model_len", "4096"]}}, "--max_model_len is set by Shoal"),
        ({"model": {"source": "m", "servedName": "m", "cache": {}}}, "exactly one of claimName"),
        (
            {"model": {"source": "m", "servedName": "m", "cache": {"claimName": "c", "sizeLimit": "1Gi"}}},
            "exactly one of claimName",
        ),
        ({"model": {"source": "m", "servedName": "m", "revision": "a b"}}, "does not match"),
        ({"engine": {"kvTransport": "rdma"}}, "'rdma' is not one of"),
        ({"engine": {"replicas": -1}}, "-1 is less than the minimum"),
        ({"engine": {"blockSize": 24}}, "not a multiple of 16"),
        ({"engine": {"resources": {"memory": "lots"}}}, "does not match"),
        ({"redis": {"mode": "external"}}, "needs redis.url or redis.urlSecret"),
        ({"redis": {"mode": "external", "url": "redis://a", "urlSecret": {"name": "s"}}}, "only one of"),
        ({"redis": {"url": "http://a"}}, "does not match"),
        ({"autoscaling": {"target": 2}}, "is a fraction"),
        ({"model": {"source": "m"}}, "'servedName' is a required property"),
    ],
)
def test_invalid_specs_are_refused_with_the_field_named(patch: dict[str, Any], message: str) -> None:
    obj = copy.deepcopy(MINIMAL)
    for key, value in patch.items():
        obj["spec"][key] = value
    with pytest.raises(ValueError, match=message):
        admit(obj)
    # The operator's own reading refuses it too (a spec that got past an older CRD).
    with pytest.raises(pydantic.ValidationError):
        InferenceClusterSpec.model_validate(obj["spec"])


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"engine": {"pod": {"tolerations": [{"effect": 3}]}}}, "3 is not of type 'string'"),
        (
            {"engine": {"pod": {"affinity": {"nodeAffinity": {"requiredDuringScheduling": {}}}}}},
            "unknown field",
        ),
        ({"engine": {"env": [{"value": "x"}]}}, "'name' is a required property"),
        ({"router": {"pod": {"topologySpreadConstraints": [{"maxSkew": 1}]}}}, "'topologyKey' is a required"),
        ({"tokenizer": {"pod": {"imagePullSecrets": [{"name": 7}]}}}, "7 is not of type 'string'"),
    ],
)
def test_kubernetes_typed_fields_are_checked_as_in_a_pod(patch: dict[str, Any], message: str) -> None:
    # Placement and environment carry Kubernetes' own schemas: the API server refuses them at
    # apply, as it would in a pod (the operator passes them on as they are).
    obj = copy.deepcopy(MINIMAL)
    obj["spec"].update(patch)
    with pytest.raises(ValueError, match=message):
        admit(obj)


@pytest.mark.parametrize(
    ("name", "admitted"),
    [("a" * 42, True), ("a" * 43, False), ("llama-8b", True), ("8b-llama", False), ("Llama", False)],
)
def test_cluster_names_are_short_dns_labels(name: str, admitted: bool) -> None:
    # Every child's name (NAME-tokenizer, NAME-redis-auth, the Redis pods' revision label) must
    # stay a DNS-1035 label of at most 63 characters.
    obj = copy.deepcopy(MINIMAL)
    obj["metadata"]["name"] = name
    if admitted:
        admit(obj)
    else:
        with pytest.raises(ValueError, match=r"metadata\.name must be a DNS-1035 label of at most 42"):
            admit(obj)


def test_unknown_fields_are_refused_by_the_models() -> None:
    with pytest.raises(pydantic.ValidationError, match="extra"):
        InferenceClusterSpec.model_validate({**MINIMAL["spec"], "engines": 3})
