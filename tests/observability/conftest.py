"""Fixtures for the observability tests. They reuse the engine tests' helpers (the tiny model, the PD
pair), so tests/engine is put on sys.path here, as tests/engine/conftest.py does for itself."""
from __future__ import annotations

import os
import sys
from typing import Any, Callable

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "engine"))
sys.path.insert(0, HERE)

from tiny_models import make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory) -> Callable[..., str]:
    """make(arch, **config_overrides) -> checkpoint directory, built once per session per arguments."""
    built: dict[str, str] = {}

    def make(arch: str, **overrides: Any) -> str:
        key = f"{arch}:{sorted(overrides.items())!r}"
        if key not in built:
            built[key] = make_tiny_model(arch, tmp_path_factory.mktemp(arch), **overrides)
        return built[key]

    return make
