"""The observability tests reuse the engine tests' helpers (the tiny model, the PD pair), so
tests/engine is put on sys.path here, as tests/engine/conftest.py does for itself."""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "engine"))
sys.path.insert(0, HERE)
