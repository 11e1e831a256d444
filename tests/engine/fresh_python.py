"""Checks that run in a fresh Python process: Triton reads TRITON_INTERPRET=1 when it is imported (so
its interpreter cannot be switched on inside the test process), and a PTX compile check for a GPU the
machine lacks wants no state of the test process."""
from __future__ import annotations

import os
import subprocess
import sys


def run_python(script: str, interpret: bool = False, timeout: int = 600) -> str:
    """Runs `script` with this interpreter (under Triton's interpreter with `interpret`); fails the test
    with the script's output unless it exits 0. Returns its stdout."""
    env = dict(os.environ, TRITON_INTERPRET="1") if interpret else None
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout
