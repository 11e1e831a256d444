"""--chunked-prefill-size: by device when not given (a CPU step must stay short: docs in
server_args.py), and an explicit value, -1 included, is kept."""
from __future__ import annotations

import argparse

import pytest

from baton.engine.server_args import CPU_CHUNKED_PREFILL_SIZE, GPU_CHUNKED_PREFILL_SIZE, ServerArgs


def _from_cli(*flags: str) -> ServerArgs:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(["--model-path", "m", *flags]))


def test_the_default_is_by_device():
    assert _from_cli().chunked_prefill_size == CPU_CHUNKED_PREFILL_SIZE == 512
    assert ServerArgs(model_path="m").chunked_prefill_size == 512
    assert ServerArgs(model_path="m", device="cuda").chunked_prefill_size == GPU_CHUNKED_PREFILL_SIZE == 8192
    assert ServerArgs(model_path="m", page_size=1024).chunked_prefill_size == 1024  # at least a page


@pytest.mark.parametrize("flag,value", [("8192", 8192), ("64", 64), ("-1", -1)])
def test_an_explicit_value_is_kept(flag, value):
    args = _from_cli("--chunked-prefill-size", flag)
    assert args.chunked_prefill_size == value
    assert args.replace(port=1).chunked_prefill_size == value
