"""The operator's managed-flags rule against the real parsers of `baton serve` and `baton router`: every
flag the builders set is refused in extraArgs, and no abbreviation of one gets past the rule (argparse
would take `--kv-cache-dtyp` for `--kv-cache-dtype`)."""
from __future__ import annotations

import argparse
import re

import pytest

from baton.operator.builders.engine import engine_args
from baton.operator.builders.router import router_args
from baton.operator.naming import Role
from baton.operator.spec import parse
from baton.operator.validation import ENGINE_FLAGS_RE, ROUTER_FLAGS_RE
from baton_testing.kube.objects import isvc_body

RDMA = {"protocol": "rdma", "ibDevices": ["mlx5_0"], "rdmaResourceName": "rdma/x"}
MODEL = {"name": "tiny", "path": "/m", "dtype": "bfloat16", "kvCacheDtype": "fp8_e5m2",
         "toolCallParser": "qwen25", "reasoningParser": "qwen3"}


def engine_parser() -> argparse.ArgumentParser:
    from baton.engine.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="baton serve")
    ServerArgs.add_cli_args(parser)
    return parser


def router_parser() -> argparse.ArgumentParser:
    from baton.router.cli import add_cli_args

    parser = argparse.ArgumentParser(prog="baton router")
    add_cli_args(parser)
    return parser


def options(args: list[str]) -> set[str]:
    return {a for a in args if a.startswith("--")}


def long_flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings if s.startswith("--")}


def test_every_flag_the_builders_set_is_managed():
    engine = set()
    for mode, roles in (("disaggregated", (Role.PREFILL, Role.DECODE)), ("colocated", (Role.COLOCATED,))):
        isvc = parse(isvc_body(mode=mode, model=MODEL, **({"kvTransfer": RDMA} if mode != "colocated" else {})))
        engine |= {f for r in roles for f in options(engine_args(isvc, r))}
    assert not {f for f in engine if not re.search(ENGINE_FLAGS_RE, f)}
    assert engine <= long_flags(engine_parser())
    router = options(router_args(parse(isvc_body()))) | options(router_args(parse(isvc_body(mode="colocated"))))
    assert not {f for f in router if not re.search(ROUTER_FLAGS_RE, f)}
    assert router <= long_flags(router_parser())


@pytest.mark.parametrize("which", ["engine", "router"])
def test_the_real_parsers_refuse_abbreviations_of_managed_flags(which):
    parser, pattern = (engine_parser(), ENGINE_FLAGS_RE) if which == "engine" else (router_parser(), ROUTER_FLAGS_RE)
    managed = sorted(f for f in long_flags(parser) if re.search(pattern, f))
    assert managed
    for flag in managed:
        abbreviation = flag[:-1]
        if abbreviation in long_flags(parser) or re.search(pattern, abbreviation):
            continue  # a flag of its own (--policy / --polic...) or refused by the rule anyway
        with pytest.raises(SystemExit):
            parser.parse_args([*(["--model-path", "/m"] if which == "engine" else []), abbreviation, "x"])


def test_baton_serve_refuses_an_abbreviated_kv_cache_dtype(capsys):
    from baton.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--model-path", "/nonexistent", "--kv-cache-dtyp", "fp8_e5m2"])
    assert "unrecognized arguments: --kv-cache-dtyp" in capsys.readouterr().err
