"""Fixtures shared by several test folders. Heavy imports (torch, transformers) stay inside the
fixtures, so router and operator tests run where only their extras are installed. Test doubles and
harnesses (`baton_testing`) live in tests/support, put on sys.path here: the package does not ship them.
How a run treats skips (under CI a skip fails unless the test is GPU-only) is `baton_testing.skip_policy`."""
from __future__ import annotations

import os
import sys
from typing import Any, Callable

import pytest

ENGINE_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "engine")
SUPPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "support")
if SUPPORT not in sys.path:
    sys.path.insert(0, SUPPORT)

pytest_plugins = ["baton_testing.skip_policy"]  # CI fails on a skip that is not GPU-only (docs/testing.md)


def _hf_hybrids_keep_torch_math() -> None:
    """transformers' hybrid models take fla-core's gated delta rule wherever it is installed (the GPU
    machine), also for the CPU float32 reference the tests compare with, where its Triton kernels
    cannot run: the reference keeps HF's own torch functions (inspect.unwrap: under the fallback wrapper)."""
    import importlib
    import importlib.util
    import inspect

    if importlib.util.find_spec("fla") is None:
        return
    for name in ("qwen3_next.modeling_qwen3_next", "qwen3_5.modeling_qwen3_5", "qwen3_5_moe.modeling_qwen3_5_moe"):
        try:
            module = importlib.import_module(f"transformers.models.{name}")
        except ImportError:
            continue
        for fn in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
            if hasattr(module, fn):
                setattr(module, fn, inspect.unwrap(getattr(module, fn)))


def pytest_configure(config) -> None:
    _hf_hybrids_keep_torch_math()


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory) -> Callable[..., str]:
    """make(arch, **config_overrides) -> checkpoint directory of a tiny random model, built once per
    session per arguments (tests/engine/tiny_models.py)."""
    if ENGINE_TESTS not in sys.path:
        sys.path.insert(0, ENGINE_TESTS)
    from tiny_models import make_tiny_model

    built: dict[str, str] = {}

    def make(arch: str, **overrides: Any) -> str:
        key = f"{arch}:{sorted(overrides.items())!r}"
        if key not in built:
            built[key] = make_tiny_model(arch, tmp_path_factory.mktemp(arch), **overrides)
        return built[key]

    return make
