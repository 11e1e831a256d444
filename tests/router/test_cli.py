"""Flags -> config, and `baton router` as a real process (no torch, no engine imported)."""
import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys

import aiohttp
import pytest

from baton.router.bench.__main__ import free_port as _free_port
from baton.router.cli import add_cli_args, config_from_args
from baton.router.config import PolicyName, WorkerRole, WorkerSpec


def parse(*argv: str):
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_pd_flags_follow_sglang_router():
    config = parse("--pd-disaggregation", "--prefill", "http://p1:8000", "9000", "--prefill", "http://p2:8000",
                   "--prefill", "p3:8000", "none", "--decode", "http://d1:8001", "--decode", "http://d2:8001/",
                   "--prefill-policy", "cache_aware", "--decode-policy", "power_of_two", "--policy", "random")
    assert config.workers == (
        WorkerSpec("http://p1:8000", WorkerRole.PREFILL, 9000), WorkerSpec("http://p2:8000", WorkerRole.PREFILL),
        WorkerSpec("http://p3:8000", WorkerRole.PREFILL), WorkerSpec("http://d1:8001", WorkerRole.DECODE),
        WorkerSpec("http://d2:8001", WorkerRole.DECODE))
    assert config.policy_for(WorkerRole.PREFILL) is PolicyName.CACHE_AWARE
    assert config.policy_for(WorkerRole.DECODE) is PolicyName.POWER_OF_TWO


def test_reliability_and_discovery_flags():
    config = parse("--worker-urls", "http://a:1", "--disable-retries", "--cb-failure-threshold", "4",
                   "--health-check-interval-secs", "7", "--api-key", "k", "--dp-aware", "--service-discovery",
                   "--selector", "app=baton", "--service-discovery-namespace", "ns", "--service-discovery-port", "8000")
    assert config.retry.max_retries == 1 and config.circuit_breaker.failure_threshold == 4
    assert config.health.interval_secs == 7 and config.api_key == "k" and config.dp_aware
    assert config.discovery.enabled and config.discovery.selector == {"app": "baton"}
    assert config.discovery.namespace == "ns" and config.discovery.port == 8000


def test_worker_stall_timeout_flag():
    assert parse("--worker-urls", "http://a:1").worker_stall_timeout_secs == 15.0
    assert parse("--worker-urls", "http://a:1", "--worker-stall-timeout", "0").worker_stall_timeout_secs == 0.0


def test_api_key_from_environment(monkeypatch):
    """The operator passes the key through a Secret-backed env var, never in argv."""
    monkeypatch.setenv("BATON_API_KEY", "from-env")
    assert parse("--worker-urls", "http://a:1").api_key == "from-env"
    assert parse("--worker-urls", "http://a:1", "--api-key", "flag").api_key == "flag"
    monkeypatch.delenv("BATON_API_KEY")
    assert parse("--worker-urls", "http://a:1").api_key is None


def test_engine_api_key_from_environment_apart_from_the_clients(monkeypatch):
    """The operator hands the router the service's internal key as BATON_ENGINE_API_KEY (never in argv)."""
    monkeypatch.setenv("BATON_ENGINE_API_KEY", "internal")
    config = parse("--worker-urls", "http://a:1")
    assert (config.engine_api_key, config.api_key) == ("internal", None)
    assert parse("--worker-urls", "http://a:1", "--engine-api-key", "flag").engine_api_key == "flag"
    monkeypatch.delenv("BATON_ENGINE_API_KEY")
    assert parse("--worker-urls", "http://a:1").engine_api_key is None


@pytest.mark.parametrize("argv", [
    ["--prefill", "http://p:1"],
    ["--pd-disaggregation", "--worker-urls", "http://a:1"],
    ["--pd-disaggregation", "--prefill", "http://p:1", "9000", "extra"],
    ["--service-discovery"],
])
def test_inconsistent_flags_are_refused(argv):
    with pytest.raises(ValueError):
        parse(*argv)


def test_router_modules_do_not_import_torch_or_the_engine():
    code = ("import sys, baton.router.server, baton.router.cli, baton.router.discovery.kubernetes, "
            "baton.router.bench.__main__; bad = [m for m in sys.modules if m == 'torch' or "
            "m.startswith('baton.engine')]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@contextlib.asynccontextmanager
async def _router_process(http, worker_url: str, *extra: str):
    """A `baton router` process in front of `worker_url`, ready; killed on the way out if still running."""
    port = _free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "baton.router", "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", worker_url, "--log-level", "warning", *extra,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{port}"

        async def ready() -> bool:
            try:
                async with http.get(url + "/health") as resp:
                    return resp.status == 200
            except aiohttp.ClientError:
                return False

        await _poll(ready)
        yield proc, url
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_baton_router_process_serves_and_stops_on_sigterm(fake_workers, http):
    worker = await fake_workers("w")
    async with _router_process(http, worker.url) as (proc, url):
        async with http.post(url + "/v1/completions", json={"prompt": "x"}) as resp:
            assert (await resp.json())["choices"][0]["text"] == "hello from w"
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0


async def _poll(check, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await check():
        assert loop.time() < deadline, "router process did not become ready"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("timeout_s, finishes", [(20, True), (0.5, False)])
async def test_sigterm_lets_a_relay_in_flight_finish_within_the_shutdown_timeout(fake_workers, http, timeout_s,
                                                                                 finishes):
    """--shutdown-timeout-secs: the listener closes at SIGTERM; a slow answer still in flight completes
    within the timeout and is cut beyond it."""
    worker = await fake_workers("w", delay=3.0)
    async with _router_process(http, worker.url, "--shutdown-timeout-secs", str(timeout_s)) as (proc, url):

        async def ask() -> str:
            async with http.post(url + "/v1/completions", json={"prompt": "x"}) as resp:
                return (await resp.json())["choices"][0]["text"]

        pending = asyncio.ensure_future(ask())
        await asyncio.sleep(0.5)  # the request is with the worker now
        proc.send_signal(signal.SIGTERM)
        if finishes:
            assert await asyncio.wait_for(pending, 15) == "hello from w"
        else:
            with pytest.raises((aiohttp.ClientError, ValueError)):
                await asyncio.wait_for(pending, 15)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
