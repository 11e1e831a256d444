"""A real `baton serve` subprocess for API tests (loopback, free port, stopped on teardown)."""
from __future__ import annotations

import contextlib
import os
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


def greedy_concurrently(base_url: str, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Every prompt posted to /generate at once (greedy); each request's output ids, all 200s."""
    import asyncio

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            rs = await asyncio.gather(*[c.post(f"{base_url}/generate", json={
                "input_ids": p, "sampling_params": {"max_new_tokens": max_new, "temperature": 0}}) for p in prompts])
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
        return [r.json()["output_ids"] for r in rs]

    return asyncio.run(run())


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


def processes_marked(mark: str) -> list[str]:
    """Live processes whose environment has BATON_TEST_MARK=mark (a server's spawned children inherit it)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                marked = f"BATON_TEST_MARK={mark}".encode() in f.read().split(b"\0")
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marked:
            found.append(f"{pid}: {cmd}")
    return found
