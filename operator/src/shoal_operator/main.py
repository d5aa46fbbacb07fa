"""``shoal-operator``: run the InferenceCluster operator (kopf) against the current cluster.

By default it watches the namespaces named in ``WATCH_NAMESPACE`` (comma-separated), or its own
namespace in a pod; ``--all-namespaces`` watches the whole cluster (that needs the chart's
cluster-scoped RBAC); with named namespaces the operator makes no cluster-wide read, so
namespaced Roles suffice.

Several replicas may run: they elect a leader on a Lease in the operator's namespace
(``leader.py``) and only the leader runs kopf; the others stand by and take over when it stops
renewing. ``--standalone`` skips the election, for a single replica run outside a cluster.
Liveness is served on ``--liveness`` for the pod's probe, readiness beside it at ``/readyz``
(with ``--standalone``, kopf's own liveness endpoint, and no readiness).

Every log line goes to stderr, kopf's per-object lines (handler failures, retries, warnings)
included: without a handler configured here, kopf's object logger only posts Kubernetes events.
``--log-format json`` writes one JSON object per line, with the object's namespace and name
under ``object``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import kopf
import yaml

from shoal_operator import render
from shoal_operator.handlers import register
from shoal_operator.leader import Election, Elector, LeaseClient
from shoal_operator.rbac import manifests

_SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
LOG_FORMATS = {"plain": kopf.LogFormat.FULL, "json": kopf.LogFormat.JSON}
"""``plain``: ``[time] logger [LEVEL] [namespace/name] message``; ``json``: one object a line."""

logger = logging.getLogger(__name__)


def _own_namespace() -> str | None:
    own = os.environ.get("POD_NAMESPACE", "").strip()
    if not own and _SERVICE_ACCOUNT_NAMESPACE.exists():
        own = _SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    return own or None


def _default_namespaces() -> list[str]:
    names = [n.strip() for n in os.environ.get("WATCH_NAMESPACE", "").split(",") if n.strip()]
    if not names and _SERVICE_ACCOUNT_NAMESPACE.exists():
        names = [_SERVICE_ACCOUNT_NAMESPACE.read_text().strip()]
    return names or ["default"]


def _identity() -> str:
    """The pod's name in a pod; elsewhere the host's name made unique (two runs on one host)."""
    return os.environ.get("POD_NAME", "").strip() or f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"


def configure_logging(
    log_format: str = "plain", verbose: bool = False, debug: bool = False, quiet: bool = False
) -> None:
    """Send every log line to stderr (a handler on the root logger), as ``kopf run`` does.

    Per-object lines carry the object: ``[namespace/name]`` before a plain message, and an
    ``object`` field (apiVersion, kind, namespace, name, uid) in JSON."""
    kopf.configure(
        verbose=verbose,
        debug=debug,
        quiet=quiet,
        log_format=LOG_FORMATS[log_format],
        log_prefix=None,  # kopf's choice: the prefix in plain lines, the object field in JSON
    )


def beat_while_running(
    registry: kopf.OperatorRegistry, beat: Callable[[], None], every_s: float = 5.0
) -> None:
    """Call ``beat`` from kopf's event loop every ``every_s`` while the operator runs, so the
    leader's liveness probe fails when that loop stalls (kopf's own liveness endpoint would be
    served from it; the probes here are served from the election's thread)."""

    @kopf.on.startup(registry=registry)
    async def start_beating(memo: kopf.Memo, **_: object) -> None:
        async def beating() -> None:
            while True:
                beat()
                await asyncio.sleep(every_s)

        memo["shoal_heartbeat"] = asyncio.create_task(beating())  # kopf cancels it when it stops


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "-n", "--namespace", action="append", default=None, help="namespace to watch (repeatable)"
    )
    parser.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    parser.add_argument(
        "--liveness",
        default="http://0.0.0.0:8080/healthz",
        help="liveness endpoint URL (readiness at /readyz on the same port)",
    )
    parser.add_argument(
        "--resync-seconds", type=float, default=60.0, help="reconcile every cluster this often"
    )
    parser.add_argument(
        "--standalone",
        action="store_true",
        help="no leader election: run at once (only one replica runs, e.g. outside a cluster)",
    )
    parser.add_argument(
        "--lease-namespace",
        default=None,
        help="namespace of the leader election's Lease (default: POD_NAMESPACE, else the pod's "
        "service account namespace, else default)",
    )
    parser.add_argument(
        "--no-service-monitors",
        action="store_true",
        help="make no ServiceMonitor per cluster, even where the Prometheus operator's CRD exists",
    )
    parser.add_argument("--log-format", choices=sorted(LOG_FORMATS), default="plain", help="log line format")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug lines too")
    parser.add_argument("-d", "--debug", action="store_true", help="log debug lines, asyncio's included")
    parser.add_argument("-q", "--quiet", action="store_true", help="log warnings and errors only")
    parser.add_argument(
        "--print-rbac",
        metavar="OPERATOR_NAMESPACE",
        help="print the ServiceAccount (in this namespace) and the least permissions for the watched "
        "namespaces as YAML for kubectl apply, and exit",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["render"]:
        # `shoal-operator render -f cluster.yaml`: offline, no API server (render.py).
        render.main(argv[1:])
        return
    parser = _parser()
    args = parser.parse_args(argv)
    if args.print_rbac:
        watched = None if args.all_namespaces else (args.namespace or _default_namespaces())
        print(yaml.safe_dump_all(manifests(args.print_rbac, watched), sort_keys=False), end="")
        return
    if args.resync_seconds <= 0:
        parser.error("--resync-seconds must be positive")
    configure_logging(args.log_format, verbose=args.verbose, debug=args.debug, quiet=args.quiet)
    # Watching named namespaces needs no cluster-wide reads (least privilege: namespaced Roles);
    # watching all of them lets kopf follow namespaces and CRDs as they come and go.
    namespaces = [] if args.all_namespaces else (args.namespace or _default_namespaces())
    register(
        kopf.get_default_registry(),
        resync_s=args.resync_seconds,
        scan_cluster=args.all_namespaces,
        service_monitors=not args.no_service_monitors,
        namespaces=None if args.all_namespaces else namespaces,
    )
    if args.standalone:
        kopf.run(
            clusterwide=args.all_namespaces,
            namespaces=namespaces,
            standalone=True,
            liveness_endpoint=args.liveness,
        )
        return
    lease_namespace = args.lease_namespace or _own_namespace() or "default"
    election = Election(Elector(LeaseClient(lease_namespace), _identity()), probes_url=args.liveness)
    beat_while_running(kopf.get_default_registry(), election.beat)
    election.start()
    logger.info(f"electing a leader on the lease {lease_namespace}/{election.elector.client.name}")
    try:
        election.wait_until_leading()
        # The Lease is the only coordination between replicas: kopf's own peering stays off.
        kopf.run(clusterwide=args.all_namespaces, namespaces=namespaces, standalone=True)
    finally:
        election.stop()


if __name__ == "__main__":
    main()
