"""`baton operator`: run the kopf operator with Baton's handlers.

    baton operator --all-namespaces                 # cluster-wide (what manifests/ and the chart do)
    baton operator --namespace team-a --namespace team-b
    baton operator --all-namespaces --peering baton --priority 100   # several replicas, one active
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os

from baton.operator.config import OperatorConfig


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[], metavar="NS",
                       help="watch this namespace (repeatable; glob patterns like 'team-*' work)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    peer = parser.add_mutually_exclusive_group()
    peer.add_argument("--standalone", action="store_true", default=None,
                      help="do not coordinate with other operator replicas (default without --peering)")
    peer.add_argument("--peering", metavar="NAME", default=None,
                      help="coordinate through kopf's (Cluster)KopfPeering object NAME; the highest "
                           "--priority replica is active (needs kopf's peering CRDs)")
    parser.add_argument("--priority", type=int, default=0, help="peering priority of this replica")
    parser.add_argument("--liveness", metavar="URL", default="http://0.0.0.0:8080/healthz",
                        help="liveness endpoint ('' to disable)")
    parser.add_argument("--metrics-port", type=int, default=9090, help="Prometheus /metrics port (0: off)")
    parser.add_argument("--resync-seconds", type=float, default=60.0,
                        help="period of the full reconcile + status refresh of every InferenceService")
    parser.add_argument("--retry-seconds", type=float, default=10.0, help="back-off after temporary errors")
    parser.add_argument("--no-events", action="store_true", help="do not post Kubernetes Events")
    parser.add_argument("--prometheus-url", metavar="URL", default=None,
                        help="the planner (spec.autoscaling.mode planner) reads the engines' metrics of services "
                             "with monitoring on from this Prometheus instead of scraping their pods")
    parser.add_argument("--verbose", action="store_true", help="debug logging")


def config_from_args(args: argparse.Namespace) -> OperatorConfig:
    return OperatorConfig(resync_seconds=args.resync_seconds, retry_seconds=args.retry_seconds,
                          metrics_port=args.metrics_port or None, post_events=not args.no_events,
                          prometheus_url=args.prometheus_url or None,
                          operator_namespace=os.environ.get("POD_NAMESPACE") or None)


def kopf_kwargs(args: argparse.Namespace) -> dict:
    """Keyword arguments of `kopf.operator()` for these CLI arguments."""
    if not args.all_namespaces and not args.namespace:
        raise SystemExit("baton operator: give --all-namespaces or at least one --namespace")
    return {
        "clusterwide": bool(args.all_namespaces),
        "namespaces": list(args.namespace),
        "standalone": args.peering is None,
        "peering_name": args.peering,
        "priority": args.priority,
        "liveness_endpoint": args.liveness or None,
    }


def configure_logging(verbose: bool) -> None:
    """kopf's log format, each line about an object prefixed with `[namespace/name]`."""
    import kopf

    kopf.configure(verbose=verbose, log_prefix=True)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def run_cli(args: argparse.Namespace) -> int:
    import kopf

    import baton.operator.handlers  # noqa: F401  (registers the handlers with kopf)

    kwargs = kopf_kwargs(args)
    configure_logging(args.verbose)
    asyncio.run(kopf.operator(memo=kopf.Memo(config=config_from_args(args)), **kwargs))
    return 0
