"""`baton serve`: start one engine."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from baton.engine.server_args import ServerArgs


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    ServerArgs.add_cli_args(parser)


def model_dir_problem(path: str, tokenizer_path: str | None = None) -> str | None:
    """Why `path` cannot be served, in one line, or None. Caught before any process starts: the
    loaders' own errors for a wrong path are tracebacks about hub repo ids."""
    if not os.path.isdir(path):
        return (f"--model-path {path}: no such directory (baton serves a local Hugging Face directory: "
                "config.json, *.safetensors, tokenizer files)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        return f"--model-path {path}: no config.json in it"
    if tokenizer_path is not None and not os.path.isdir(tokenizer_path):
        return f"--tokenizer-path {tokenizer_path}: no such directory"
    return None


def run_cli(args: argparse.Namespace) -> int:
    from baton.engine.entrypoints.engine import run_server
    from baton.engine.utils.logging import configure_logging

    problem = model_dir_problem(args.model_path, args.tokenizer_path)
    if problem is not None:
        print(f"baton serve: error: {problem}", file=sys.stderr)
        return 2
    try:
        server_args = ServerArgs.from_cli_args(args)
    except ValueError as e:  # flags that contradict each other or mean nothing: one line, as argparse's
        print(f"baton serve: error: {e}", file=sys.stderr)
        return 2
    configure_logging(server_args.log_level, prefix="server")
    logging.getLogger(__name__).info("starting engine: %s", server_args)  # api_key has repr=False
    try:
        run_server(server_args)
    except SystemExit as e:  # SIGTERM's drain ends here, with 0
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    else:
        code = 0
    # The engine's processes are stopped and its logs written: leave without the interpreter's
    # teardown. Triton's extension (imported by transformers' tokenizer loading) prints dozens of
    # "nanobind: leaked ..." lines there, at every stop, which read like a fault in a pod's log.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
