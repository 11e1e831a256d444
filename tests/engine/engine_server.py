"""A real `baton serve` subprocess for API tests (loopback, free port, stopped on teardown)."""
from __future__ import annotations

import contextlib
import time
from typing import Iterator, Optional

import httpx

from baton.engine.bench.launcher import EngineProcess, engine_command, free_port

STARTUP_TIMEOUT_S = 300  # three Python processes import torch/transformers on a shared 2-core machine


@contextlib.contextmanager
def running_engine(model_path: str, *extra: str, api_key: Optional[str] = None) -> Iterator[EngineProcess]:
    port = free_port()
    args = list(extra) + (["--api-key", api_key] if api_key else [])
    with EngineProcess(engine_command(model_path, port, args), port, api_key=api_key) as engine:
        engine.wait_healthy(STARTUP_TIMEOUT_S)
        yield engine


def wait_idle_integrity(base_url: str, headers: Optional[dict] = None, timeout_s: float = 30.0) -> dict:
    """Polls /get_server_info until the scheduler is idle, then returns its info (with integrity_ok)."""
    deadline = time.monotonic() + timeout_s
    info: dict = {}
    while time.monotonic() < deadline:
        info = httpx.get(f"{base_url}/get_server_info", headers=headers, timeout=10).json()
        if info.get("integrity_ok") is not None:
            return info
        time.sleep(0.05)
    raise AssertionError(f"engine not idle after {timeout_s}s: {info}")
