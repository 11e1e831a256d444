"""`baton router`: flags (declared in config.py) -> RouterConfig -> run."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from baton.flags import from_args
from baton.router.config import RetryConfig, RouterConfig, WorkerRole, WorkerSpec, flag_table
from baton.router.config import parse_selector  # noqa: F401 - its callers take it from here too


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    flag_table().add_to(parser)


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
    retry = from_args(RetryConfig, args, **({"max_retries": 1} if args.disable_retries else {}))
    return from_args(RouterConfig, args, workers=tuple(workers), retry=retry)


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
