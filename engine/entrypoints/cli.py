"""`baton serve`: start one engine."""
from __future__ import annotations

import argparse
import logging

from baton.engine.server_args import ServerArgs


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    ServerArgs.add_cli_args(parser)


def run_cli(args: argparse.Namespace) -> int:
    from baton.engine.entrypoints.engine import run_server
    from baton.engine.utils.logging import configure_logging

    server_args = ServerArgs.from_cli_args(args)
    configure_logging(server_args.log_level, prefix="server")
    logging.getLogger(__name__).info("starting engine: %s", server_args)  # api_key has repr=False
    run_server(server_args)
    return 0
