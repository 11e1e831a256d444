"""Integration tests run real engines and routers together; they reuse the engine tests' helpers
(tests/engine is put on sys.path: pytest runs with --import-mode=importlib)."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "engine"))

from tiny_models import make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> str:
    return make_tiny_model("qwen3", tmp_path_factory.mktemp("qwen3"))
