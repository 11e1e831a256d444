"""The `baton` console script. Each subcommand imports its component lazily, so that the router
and operator run from an install without torch."""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, help). Each module exposes `add_cli_args(parser)` and `run_cli(args)`.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("baton.engine.entrypoints.cli", "start an engine (HTTP server + scheduler + detokenizer)"),
    "router": ("baton.router.cli", "start the OpenAI-compatible router"),
    "operator": ("baton.operator.cli", "run the Kubernetes operator (kopf)"),
    "bench": ("baton.engine.bench.cli", "benchmark an OpenAI endpoint, the HF baseline or KV transfer"),
    "fetch-model": ("baton.fetch.cli", "fetch an hf:// or s3:// model into a cache folder (init container)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="baton", description="Baton: PD-disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    modules = {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == chosen:  # import only the component that runs
            modules[name] = importlib.import_module(module_name)
            modules[name].add_cli_args(p)
    args = parser.parse_args(argv)
    return int(modules[args.command].run_cli(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
