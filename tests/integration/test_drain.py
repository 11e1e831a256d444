"""Rolling each PD role under load loses nothing, with real processes: a bounded
stream of requests goes through `baton router` to a prefill and a decode engine (`baton serve`, real
Mooncake TCP on 127.0.0.1) while each role is rolled as the kubelet and the router's discovery do it:
the replacement engine joins the router, then the old one gets SIGTERM. The old engine drains (503 +
Retry-After to new work, finishes what it runs, a prefill until its KV has reached the decode) and
exits 0; the router stops picking it at the first refusal and retries elsewhere. Every request must
succeed with the full greedy output, and the engines that stay hold no leaked KV page at idle."""
from __future__ import annotations

import asyncio
import contextlib
import re
import subprocess
import sys
import time

import httpx
import pytest

from baton.engine.bench.launcher import EngineProcess, engine_command, free_port
from engine_server import STARTUP_TIMEOUT_S, wait_idle_integrity

COMMON = ["--disaggregation-transfer-backend", "mooncake", "--disaggregation-protocol", "tcp",
          "--page-size", "4", "--max-total-tokens", "2048"]
REQUESTS, CONCURRENCY, MAX_NEW = 48, 4, 24
DISTINCT = 12  # each prompt is sent REQUESTS / DISTINCT times, before and after the rolls
PROMPTS = [[(11 * (i % DISTINCT) + 5 * j) % 400 + 6 for j in range(6 + 3 * (i % DISTINCT % 5))] for i in range(REQUESTS)]


def _engine(model: str, mode: str) -> tuple[EngineProcess, int | None]:
    port = free_port()
    bootstrap = free_port() if mode == "prefill" else None
    args = ["--disaggregation-mode", mode, *COMMON]
    if bootstrap is not None:
        args += ["--disaggregation-bootstrap-port", str(bootstrap)]
    return EngineProcess(engine_command(model, port, args), port), bootstrap


@contextlib.contextmanager
def _router(prefill: EngineProcess, bootstrap: int, decode: EngineProcess):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "baton", "router", "--host", "127.0.0.1", "--port", str(port),
                             "--pd-disaggregation", "--prefill", prefill.base_url, str(bootstrap),
                             "--decode", decode.base_url, "--prefill-policy", "round_robin",
                             "--decode-policy", "round_robin", "--health-check-interval-secs", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the router did not become healthy"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=20)


async def _load(router: str, done: list[int]) -> list[httpx.Response]:
    """REQUESTS greedy requests, CONCURRENCY at a time; `done` counts the finished ones as they go."""
    queue = list(enumerate(PROMPTS))
    results: list[httpx.Response | None] = [None] * REQUESTS

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            i, prompt = queue.pop(0)
            results[i] = await client.post(f"{router}/generate", json={
                "input_ids": prompt, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0,
                                                         "ignore_eos": True}})
            done.append(i)

    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(*(worker(client) for _ in range(CONCURRENCY)))
    return results


async def _roll(router: str, done: list[int], old: EngineProcess, new: EngineProcess, role: str,
                bootstrap: int | None, after: int) -> int | None:
    """Once `after` requests are done: the replacement joins the router, the old engine gets SIGTERM
    while requests run; its exit code."""
    while len(done) < after:
        await asyncio.sleep(0.05)
    async with httpx.AsyncClient(timeout=10) as client:
        r = await client.post(f"{router}/workers", json={"url": new.base_url, "role": role,
                                                        "bootstrap_port": bootstrap})
        assert r.status_code in (200, 201), r.text
        # the SIGTERM lands while the old engine decodes something (the router now alternates between
        # the two, so the old one can be idle for a moment): its drain has a request to finish
        deadline = time.monotonic() + 10
        while role == "decode" and time.monotonic() < deadline:
            info = (await client.get(f"{old.base_url}/get_server_info")).json()
            if (info[0] if isinstance(info, list) else info).get("num_running_reqs", 0) >= 1:
                break
            await asyncio.sleep(0.01)
    old.terminate()
    return await asyncio.to_thread(old.wait_exit, 120)


@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    return tiny_model_factory("llama")


def test_rolling_each_role_under_load_loses_no_request(model_path):
    (p1, b1), (d1, _), (p2, b2), (d2, _) = (_engine(model_path, m) for m in ("prefill", "decode") * 2)
    with p1, d1, p2, d2:
        for engine in (p1, d1, p2, d2):
            engine.wait_healthy(STARTUP_TIMEOUT_S)
        with _router(p1, b1, d1) as router:
            done: list[int] = []

            async def scenario():
                load = asyncio.ensure_future(_load(router, done))
                prefill_exit = await _roll(router, done, p1, p2, "prefill", b2, after=REQUESTS // 4)
                decode_exit = await _roll(router, done, d1, d2, "decode", None, after=REQUESTS // 2)
                return await load, prefill_exit, decode_exit

            results, prefill_exit, decode_exit = asyncio.run(scenario())
        failed = [(i, r.status_code, r.text[:200]) for i, r in enumerate(results) if r.status_code != 200]
        assert not failed, failed
        outputs = [r.json()["output_ids"] for r in results]
        assert all(len(o) == MAX_NEW for o in outputs)
        for i in range(DISTINCT):  # greedy: a prompt gives the same tokens whichever pair served it
            assert len({tuple(outputs[k]) for k in range(i, REQUESTS, DISTINCT)}) == 1, i
        assert len(done) == REQUESTS
        running = 0
        for old, code in ((p1, prefill_exit), (d1, decode_exit)):
            log = old.log_tail(400)
            assert code == 0 and "draining (SIGTERM)" in log and "drained in" in log, log
            running += int(re.search(r"draining: (\d+) request\(s\) still running", log).group(1))
        assert running >= 1  # the drains had requests to finish (the decode's almost always does)
        for engine in (p2, d2):
            info = wait_idle_integrity(engine.base_url)
            assert info["integrity_ok"] is True, info
