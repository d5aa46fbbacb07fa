"""``shoal-operator render -f cluster.yaml``: every object the operator would apply, offline.

It reads InferenceCluster objects from a file (or ``-`` for stdin), checks each spec as the
operator does (the models' schema and CEL rules, and the name rule the CRD puts on
``metadata.name``) and prints their children as YAML, for ``kubectl diff -f -`` or review. No API
server is asked: what the output depends on beyond the spec is given as options (whether the
Prometheus operator's ServiceMonitor CRD exists; the cluster's uid, which owner references
name).

The output leaves out the hash the operator stamps on each child it applies
(``reconcile.APPLIED_ANNOTATION``), which names the live cluster's uid.

The engine Deployment shows the spec's replicas. During a scale-down the operator first drains
the engines that leave and writes the lower count only then, so a live cluster may briefly hold
more engines than the output says.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from typing import Any, TextIO

import yaml
from pydantic import ValidationError

from shoal_operator.cel import failures
from shoal_operator.children import Cluster, render
from shoal_operator.spec import GROUP, KIND, NAME_RULE, InferenceClusterSpec

PLACEHOLDER_UID = "00000000-0000-0000-0000-000000000000"
"""The owner references' uid when the object has none (one not yet applied)."""


class RenderError(ValueError):
    """An object that the API server or the operator would refuse."""


def clusters(documents: list[Any], namespace: str) -> Iterator[Cluster]:
    """The InferenceClusters among ``documents``, checked as the API server and the operator
    check them; other kinds are skipped."""
    for document in documents:
        if not isinstance(document, dict) or document.get("kind") != KIND:
            continue
        if str(document.get("apiVersion", "")).split("/")[0] != GROUP:
            continue
        meta = document.get("metadata") or {}
        name = str(meta.get("name", ""))
        if failures([NAME_RULE], {"metadata": {"name": name}}):
            raise RenderError(f"{name or '(no name)'}: {NAME_RULE['message']}")
        try:
            spec = InferenceClusterSpec.model_validate(document.get("spec") or {})
        except ValidationError as exc:
            raise RenderError(f"{name}: {exc}") from exc
        yield Cluster(
            name=name,
            namespace=str(meta.get("namespace") or namespace),
            uid=str(meta.get("uid") or PLACEHOLDER_UID),
            spec=spec,
        )


def render_file(stream: TextIO, namespace: str = "default", service_monitors: bool = False) -> str:
    """The YAML stream of every child of every cluster in ``stream``."""
    documents = list(yaml.safe_load_all(stream))
    children = [
        child for cluster in clusters(documents, namespace) for child in render(cluster, service_monitors)
    ]
    return yaml.safe_dump_all(children, sort_keys=False)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="shoal-operator render",
        description="Print every object the operator would apply for the InferenceClusters in a file.",
    )
    parser.add_argument("-f", "--filename", required=True, help="YAML file of InferenceClusters, - for stdin")
    parser.add_argument(
        "-n", "--namespace", default="default", help="namespace of clusters that name none (default: default)"
    )
    parser.add_argument(
        "--service-monitors",
        action="store_true",
        help="include the ServiceMonitor (as where the Prometheus operator's CRD exists)",
    )
    args = parser.parse_args(argv)
    try:
        if args.filename == "-":
            text = render_file(sys.stdin, args.namespace, args.service_monitors)
        else:
            with open(args.filename, encoding="utf-8") as stream:
                text = render_file(stream, args.namespace, args.service_monitors)
    except (OSError, yaml.YAMLError, RenderError) as exc:
        parser.exit(2, f"shoal-operator render: {exc}\n")
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
