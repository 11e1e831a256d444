"""Helpers shared by the router tests: a test-sized config and polling with a deadline."""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any, Callable

from baton.router.config import (
    CircuitBreakerConfig,
    HealthCheckConfig,
    RetryConfig,
    RouterConfig,
    WorkerRole,
    WorkerSpec,
)


def make_config(regular: list[str] = (), prefill: list[str | tuple[str, int]] = (), decode: list[str] = (),
                **overrides: Any) -> RouterConfig:
    """Fast timings; retries without real waiting. `overrides` replace RouterConfig fields."""
    workers = [WorkerSpec(u) for u in regular]
    for p in prefill:
        url, port = (p, None) if isinstance(p, str) else p
        workers.append(WorkerSpec(url, WorkerRole.PREFILL, port))
    workers += [WorkerSpec(u, WorkerRole.DECODE) for u in decode]
    config = RouterConfig(
        host="127.0.0.1", port=0, pd_disaggregation=bool(prefill or decode), workers=tuple(workers),
        retry=RetryConfig(max_retries=3, initial_backoff_ms=1.0, max_backoff_ms=5.0),
        circuit_breaker=CircuitBreakerConfig(failure_threshold=100),
        health=HealthCheckConfig(interval_secs=30.0, startup_check_interval_secs=0.02, timeout_secs=2.0),
        request_timeout_secs=10.0, abort_timeout_secs=2.0,
    )
    return replace(config, **overrides)


async def wait_until(predicate: Callable[[], Any], timeout: float = 5.0, interval: float = 0.01,
                     what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


def url_of(router: Any, path: str = "") -> str:
    return f"http://127.0.0.1:{router.port}{path}"
