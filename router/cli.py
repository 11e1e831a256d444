"""`baton router`: flags (sglang-router's names where the meaning is the same) -> RouterConfig -> run."""
from __future__ import annotations

import argparse
import asyncio
import os
import logging
import signal
import sys

from baton.router.config import (
    CacheAwareConfig,
    CircuitBreakerConfig,
    DiscoveryConfig,
    HealthCheckConfig,
    PolicyName,
    RetryConfig,
    RouterConfig,
    UpstreamClient,
    WorkerRole,
    WorkerSpec,
)

POLICIES = [p.value for p in PolicyName]


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.allow_abbrev = False  # `--prefill-pol` would pass the operator's managed-flags rule
    _worker_flags(parser.add_argument_group("workers"))
    _routing_flags(parser.add_argument_group("routing"))
    _request_flags(parser.add_argument_group("requests"))
    _reliability_flags(parser.add_argument_group("retries, circuit breaker, health checks"))
    _discovery_flags(parser.add_argument_group("Kubernetes service discovery"))
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warn", "warning", "error"])


def _worker_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--host", default="0.0.0.0")
    g.add_argument("--port", type=int, default=30000)
    g.add_argument("--worker-urls", nargs="*", default=[], help="colocated engines")
    g.add_argument("--pd-disaggregation", action="store_true")
    g.add_argument("--prefill", nargs="+", action="append", default=[], metavar="URL [BOOTSTRAP_PORT]",
                   help="prefill engine, optionally with its bootstrap port (a number or 'none'); repeatable")
    g.add_argument("--decode", action="append", default=[], metavar="URL", help="decode engine; repeatable")


def _routing_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--policy", choices=POLICIES, default="cache_aware")
    g.add_argument("--prefill-policy", choices=POLICIES, default=None)
    g.add_argument("--decode-policy", choices=POLICIES, default=None)
    g.add_argument("--cache-threshold", type=float, default=0.3)
    g.add_argument("--balance-abs-threshold", type=int, default=64)
    g.add_argument("--balance-rel-threshold", type=float, default=1.5)
    g.add_argument("--max-tree-size", type=int, default=2**26, help="characters per worker in the prefix tree")
    g.add_argument("--dp-aware", action="store_true", help="route to (worker, DP rank); inject data_parallel_rank")


def _request_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: $BATON_API_KEY, so the key stays out of argv)")
    g.add_argument("--engine-api-key", default=None,
                   help="send 'Authorization: Bearer KEY' on every call to the workers, instead of the client's "
                        "header (the engines' --api-key; default: $BATON_ENGINE_API_KEY)")
    g.add_argument("--request-timeout-secs", type=float, default=1800.0)
    g.add_argument("--shutdown-timeout-secs", type=float, default=60.0,
                   help="on SIGTERM: how long the requests in flight may run on once the listener closed")
    g.add_argument("--max-payload-size", type=int, default=512 * 1024 * 1024)
    g.add_argument("--request-read-timeout-secs", type=float, default=60.0,
                   help="seconds a client has to send its first request head (else the connection is "
                        "closed) and a request's body (else 408); 0: no limit")
    g.add_argument("--max-concurrent-requests", type=int, default=-1, help="-1: unlimited")
    g.add_argument("--queue-size", type=int, default=100)
    g.add_argument("--queue-timeout-secs", type=float, default=60.0)
    g.add_argument("--upstream-client", choices=[c.value for c in UpstreamClient], default="lean",
                   help="HTTP client to workers: lean (fast) or aiohttp (reference)")


def _reliability_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--retry-max-retries", type=int, default=5, help="attempts in all, the first included")
    g.add_argument("--retry-initial-backoff-ms", type=float, default=50.0)
    g.add_argument("--retry-max-backoff-ms", type=float, default=30000.0)
    g.add_argument("--retry-backoff-multiplier", type=float, default=1.5)
    g.add_argument("--retry-jitter-factor", type=float, default=0.2)
    g.add_argument("--disable-retries", action="store_true")
    g.add_argument("--cb-failure-threshold", type=int, default=10)
    g.add_argument("--cb-success-threshold", type=int, default=3)
    g.add_argument("--cb-timeout-duration-secs", type=float, default=60.0)
    g.add_argument("--disable-circuit-breaker", action="store_true")
    g.add_argument("--health-failure-threshold", type=int, default=3)
    g.add_argument("--health-success-threshold", type=int, default=2)
    g.add_argument("--health-check-timeout-secs", type=float, default=5.0)
    g.add_argument("--health-check-interval-secs", type=float, default=60.0)
    g.add_argument("--health-check-endpoint", default="/health")
    g.add_argument("--disable-health-check", action="store_true")
    g.add_argument("--worker-startup-check-interval", type=float, default=1.0)
    g.add_argument("--worker-stall-timeout", type=float, default=15.0,
                   help="seconds a worker holding requests may leave health probes unanswered before its "
                        "requests are ended (and retried where nothing was sent yet); 0: off")


def _discovery_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--service-discovery", action="store_true")
    g.add_argument("--selector", nargs="+", default=[], metavar="KEY=VALUE")
    g.add_argument("--prefill-selector", nargs="+", default=[], metavar="KEY=VALUE")
    g.add_argument("--decode-selector", nargs="+", default=[], metavar="KEY=VALUE")
    g.add_argument("--service-discovery-namespace", default=None)
    g.add_argument("--service-discovery-port", type=int, default=80)
    g.add_argument("--service-discovery-resync-secs", type=float, default=300.0)
    g.add_argument("--service-discovery-api-server", default=None,
                   help="API server URL (e.g. kubectl proxy); default: in-cluster config, else kubeconfig")


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """Raises ValueError with a message for the user on inconsistent flags."""
    workers = [WorkerSpec(url) for url in args.worker_urls]
    workers += [_prefill_spec(values) for values in args.prefill]
    workers += [WorkerSpec(url, WorkerRole.DECODE) for url in args.decode]
    if not args.pd_disaggregation and (args.prefill or args.decode):
        raise ValueError("--prefill/--decode need --pd-disaggregation")
    if args.pd_disaggregation and args.worker_urls:
        raise ValueError("--worker-urls cannot be used with --pd-disaggregation")
    pd_selectors = args.prefill_selector or args.decode_selector
    if args.service_discovery and not (args.selector or (args.pd_disaggregation and pd_selectors)):
        raise ValueError("--service-discovery needs --selector (or --prefill-selector/--decode-selector in PD mode)")
    return RouterConfig(
        host=args.host, port=args.port, pd_disaggregation=args.pd_disaggregation, workers=tuple(workers),
        policy=PolicyName(args.policy),
        prefill_policy=PolicyName(args.prefill_policy) if args.prefill_policy else None,
        decode_policy=PolicyName(args.decode_policy) if args.decode_policy else None,
        dp_aware=args.dp_aware, api_key=args.api_key or os.environ.get("BATON_API_KEY") or None,
        engine_api_key=args.engine_api_key or os.environ.get("BATON_ENGINE_API_KEY") or None,
        request_timeout_secs=args.request_timeout_secs,
        shutdown_timeout_secs=args.shutdown_timeout_secs,
        max_payload_size=args.max_payload_size, request_read_timeout_secs=args.request_read_timeout_secs,
        max_concurrent_requests=args.max_concurrent_requests,
        queue_size=args.queue_size, queue_timeout_secs=args.queue_timeout_secs,
        cache_aware=CacheAwareConfig(args.cache_threshold, args.balance_abs_threshold, args.balance_rel_threshold,
                                     args.max_tree_size),
        discovery=DiscoveryConfig(args.service_discovery, parse_selector(args.selector),
                                  parse_selector(args.prefill_selector), parse_selector(args.decode_selector),
                                  args.service_discovery_namespace, args.service_discovery_port,
                                  args.service_discovery_resync_secs, api_server=args.service_discovery_api_server),
        upstream_client=UpstreamClient(args.upstream_client), log_level=args.log_level,
        worker_stall_timeout_secs=args.worker_stall_timeout, **_reliability(args),
    )


def _reliability(args: argparse.Namespace) -> dict:
    return {
        "retry": RetryConfig(1 if args.disable_retries else args.retry_max_retries, args.retry_initial_backoff_ms,
                             args.retry_max_backoff_ms, args.retry_backoff_multiplier, args.retry_jitter_factor),
        "circuit_breaker": CircuitBreakerConfig(not args.disable_circuit_breaker, args.cb_failure_threshold,
                                                args.cb_success_threshold, args.cb_timeout_duration_secs),
        "health": HealthCheckConfig(not args.disable_health_check, args.health_failure_threshold,
                                    args.health_success_threshold, args.health_check_timeout_secs,
                                    args.health_check_interval_secs, args.health_check_endpoint,
                                    args.worker_startup_check_interval),
    }


def parse_selector(items: list[str]) -> dict[str, str]:
    selector = {}
    for item in items:
        for part in item.split(","):
            key, sep, value = part.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"selector {part!r} is not KEY=VALUE")
            selector[key.strip()] = value.strip()
    return selector


def _prefill_spec(values: list[str]) -> WorkerSpec:
    if len(values) > 2:
        raise ValueError(f"--prefill takes URL [BOOTSTRAP_PORT], got {values}")
    port = values[1] if len(values) == 2 else "none"
    return WorkerSpec(values[0], WorkerRole.PREFILL, None if port.lower() == "none" else int(port))


def run_cli(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except (ValueError, AssertionError) as exc:
        print(f"baton router: {exc}", file=sys.stderr)
        return 2
    level = {"warn": "WARNING"}.get(args.log_level, args.log_level.upper())
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import uvloop
        uvloop.run(_serve(config))
    except ImportError:
        asyncio.run(_serve(config))
    return 0


async def _serve(config: RouterConfig) -> None:
    from baton.router.server import Router
    router = Router(config)
    await router.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await router.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="baton router", description="Baton's OpenAI-compatible PD router")
    add_cli_args(parser)
    return run_cli(parser.parse_args(argv))
