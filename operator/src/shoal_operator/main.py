"""``shoal-operator``: run the InferenceCluster operator (kopf) against the current cluster.

By default it watches the namespaces named in ``WATCH_NAMESPACE`` (comma-separated), or its own
namespace in a pod; ``--all-namespaces`` watches the whole cluster (that needs the chart's
cluster-scoped RBAC); with named namespaces the operator makes no cluster-wide read, so
namespaced Roles suffice. Liveness is served on ``--liveness`` for the pod's probe.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import kopf
import yaml

from shoal_operator.handlers import register
from shoal_operator.rbac import manifests

_POD_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def _default_namespaces() -> list[str]:
    names = [n.strip() for n in os.environ.get("WATCH_NAMESPACE", "").split(",") if n.strip()]
    if not names and _POD_NAMESPACE.exists():
        names = [_POD_NAMESPACE.read_text().strip()]
    return names or ["default"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "-n", "--namespace", action="append", default=None, help="namespace to watch (repeatable)"
    )
    parser.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    parser.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="liveness endpoint URL")
    parser.add_argument(
        "--resync-seconds", type=float, default=60.0, help="reconcile every cluster this often"
    )
    parser.add_argument(
        "--standalone", action="store_true", help="skip kopf's peering (only one operator replica runs)"
    )
    parser.add_argument(
        "--no-service-monitors",
        action="store_true",
        help="make no ServiceMonitor per cluster, even where the Prometheus operator's CRD exists",
    )
    parser.add_argument(
        "--print-rbac",
        metavar="OPERATOR_NAMESPACE",
        help="print the ServiceAccount (in this namespace) and the least permissions for the watched "
        "namespaces as YAML for kubectl apply, and exit",
    )
    args = parser.parse_args(argv)
    if args.print_rbac:
        watched = None if args.all_namespaces else (args.namespace or _default_namespaces())
        print(yaml.safe_dump_all(manifests(args.print_rbac, watched), sort_keys=False), end="")
        return
    if args.resync_seconds <= 0:
        parser.error("--resync-seconds must be positive")
    # Watching named namespaces needs no cluster-wide reads (least privilege: namespaced Roles);
    # watching all of them lets kopf follow namespaces and CRDs as they come and go.
    register(
        kopf.get_default_registry(),
        resync_s=args.resync_seconds,
        scan_cluster=args.all_namespaces,
        service_monitors=not args.no_service_monitors,
    )
    kopf.run(
        clusterwide=args.all_namespaces,
        namespaces=[] if args.all_namespaces else (args.namespace or _default_namespaces()),
        standalone=args.standalone,
        liveness_endpoint=args.liveness,
    )


if __name__ == "__main__":
    main()
