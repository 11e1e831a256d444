"""Engine tests import their helpers as `from tiny_models import make_tiny_model` (pytest runs with
--import-mode=importlib, so this folder is put on sys.path here). `tiny_model_factory` lives in
tests/conftest.py."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import baton_testing.fake_kv_transfer  # noqa: E402,F401  registers the in-process "fake" KV transfer backend
