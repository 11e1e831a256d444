"""The docs that describe the code stay true: structure.md lists every module; metrics.md lists every
engine metric."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_structure_md_is_current():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_structure.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_metrics_md_lists_every_engine_metric():
    from baton.engine.metrics import EngineMetrics

    doc = (ROOT / "docs" / "metrics.md").read_text()
    names = {m.name for m in EngineMetrics("m", "colocated").registry.collect()}
    missing = sorted(n for n in names if f"`{n}" not in doc)
    assert not missing, f"docs/metrics.md lacks: {missing}"
