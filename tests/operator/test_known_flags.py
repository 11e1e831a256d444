"""operator/known_flags.py is what the real parsers accept (scripts/gen_flags.py writes it), and
the rules built on it refuse unknown and abbreviated flags in extraArgs while letting real ones through."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os

import pytest

from baton.operator import known_flags
from baton.operator.validation import ENGINE_KNOWN_RE, ROUTER_KNOWN_RE, _only_known

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _generator():
    spec = importlib.util.spec_from_file_location("gen_flags", os.path.join(ROOT, "scripts", "gen_flags.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _parser_flags(module_name: str) -> tuple[str, ...]:
    """Every long option the subcommand's real parser accepts, without the leading dashes."""
    parser = argparse.ArgumentParser()
    importlib.import_module(module_name).add_cli_args(parser)
    return tuple(sorted(o[2:] for a in parser._actions for o in a.option_strings
                        if o.startswith("--") and o != "--help"))


def test_the_flag_lists_are_the_parsers_own():
    assert known_flags.ENGINE_FLAGS == _parser_flags("baton.engine.entrypoints.cli"), \
        "stale: run .venv/bin/python scripts/gen_flags.py"
    assert known_flags.ROUTER_FLAGS == _parser_flags("baton.router.cli"), \
        "stale: run .venv/bin/python scripts/gen_flags.py"
    with open(os.path.join(ROOT, "operator", "known_flags.py")) as f:
        assert f.read() == _generator().render_known_flags()


@pytest.mark.parametrize("args, ok", [
    (["--enable-mixed-chunk", "--max-running-requests", "8", "--schedule-policy=lpm"], True),
    (["--kv-cache-dtyp", "fp8_e5m2"], False),  # argparse would have taken the prefix
    (["--max-running", "8"], False),
    (["--speculative-algorithm", "NGRAM", "--mamba-track-interval", "64"], True),
    (["-1"], True),  # a value, not a flag
])
def test_engine_args(args, ok):
    assert _only_known(ENGINE_KNOWN_RE)(args) is ok


def test_router_args():
    assert _only_known(ROUTER_KNOWN_RE)(["--request-timeout-secs", "30"])
    assert not _only_known(ROUTER_KNOWN_RE)(["--request-timeout", "30"])
