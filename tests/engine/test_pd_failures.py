"""PD failures with real processes over Mooncake TCP.

- A prefill engine killed while the decode waits for its KV. The decode must fail exactly the
  affected requests within its heartbeat window, keep serving, give back their memory, and use a
  restarted prefill without being restarted itself.
- A decode engine killed behind the router while requests are at every stage (decoding, waiting
  for memory, in the prefill's bootstrap queue). Every client call must end promptly, the prefill
  must give everything back, the router must hold nothing, and a restarted decode serves again."""
from __future__ import annotations

import asyncio
import sys
import time

import httpx
import pytest

from baton.engine.bench.launcher import EngineProcess, engine_command, free_port
from engine_server import STARTUP_TIMEOUT_S, wait_idle_integrity
from test_pd_chaos import _wait_router_drained
from test_pd_server import COMMON, MAX_NEW, PROMPTS, _body, _post_both, pd_router
from test_scheduler_vs_hf import hf_greedy

HEARTBEAT_S = 0.5
MAX_FAILURES = 2
# kill -> failure: MAX_FAILURES heartbeats of at most HEARTBEAT_S + a 0.5 s health timeout each, plus
# scheduler polling; generous because the machine is shared
FAILURE_DEADLINE_S = 30.0


def _prefill(model_path: str, port: int, bootstrap_port: int) -> EngineProcess:
    return EngineProcess(engine_command(model_path, port, [
        "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap_port), *COMMON]), port)


async def _wait_transfer_queue(decode: str, n: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=10) as c:
        while time.monotonic() < deadline:
            if (await c.get(f"{decode}/get_server_info")).json().get("num_transfer_reqs") == n:
                return
            await asyncio.sleep(0.05)
    raise AssertionError(f"decode never had {n} requests waiting for KV")


def test_killed_prefill_fails_only_its_requests_and_a_restart_serves_again(tiny_model_factory):
    model_path = tiny_model_factory("llama")
    bootstrap_port, prefill_port, decode_port = free_port(), free_port(), free_port()
    prefill = _prefill(model_path, prefill_port, bootstrap_port)
    decode = EngineProcess(engine_command(model_path, decode_port, [
        "--disaggregation-mode", "decode", "--disaggregation-heartbeat-interval", str(HEARTBEAT_S),
        "--disaggregation-heartbeat-max-failures", str(MAX_FAILURES), *COMMON]), decode_port)
    with prefill, decode:
        prefill.wait_healthy(STARTUP_TIMEOUT_S, "waiting for the prefill engine")
        decode.wait_healthy(STARTUP_TIMEOUT_S, "waiting for the decode engine")

        async def kill_mid_transfer() -> tuple[list[httpx.Response], float, httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as c:
                pre, dec = await _post_both(c, prefill.base_url, decode.base_url, _body(PROMPTS[1], bootstrap_port))
                assert dec.status_code == 200, dec.text  # the pair works and the decode knows the prefill
                # the prefill never gets these two: they wait in the decode's transfer queue
                stranded = [asyncio.create_task(c.post(f"{decode.base_url}/generate", json=_body(p, bootstrap_port)))
                            for p in PROMPTS[2:4]]
                await _wait_transfer_queue(decode.base_url, 2)
                killed_at = time.monotonic()
                prefill.kill()
                done = await asyncio.wait_for(asyncio.gather(*stranded), FAILURE_DEADLINE_S)
                elapsed = time.monotonic() - killed_at
                health = await c.get(f"{decode.base_url}/health")
                return done, elapsed, health

        stranded, elapsed, health = asyncio.run(kill_mid_transfer())
        for r in stranded:
            assert r.status_code == 500, r.text
            message = r.json()["error"]["message"]
            assert "KV transfer failed" in message and "unreachable" in message, message
        print(f"\nprefill killed: the decode failed its {len(stranded)} waiting requests after {elapsed:.2f}s "
              f"(heartbeat {HEARTBEAT_S}s x {MAX_FAILURES})")
        assert elapsed < FAILURE_DEADLINE_S
        assert health.status_code == 200, "the decode keeps serving"
        info = wait_idle_integrity(decode.base_url, timeout_s=60)  # quarantined pages come back too
        assert info["integrity_ok"] is True, info

        prefill.start()  # same ports, a new process and Mooncake session
        prefill.wait_healthy(STARTUP_TIMEOUT_S, "waiting for the restarted prefill engine")

        async def after_restart() -> tuple[httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as c:
                return await _post_both(c, prefill.base_url, decode.base_url, _body(PROMPTS[4], bootstrap_port))

        pre, dec = asyncio.run(after_restart())
        assert pre.status_code == 200 and dec.status_code == 200, (pre.text, dec.text)
        assert dec.json()["output_ids"] == hf_greedy(model_path, PROMPTS[4], MAX_NEW)
        for engine in (prefill, decode):
            info = wait_idle_integrity(engine.base_url, timeout_s=60)
            assert info["integrity_ok"] is True, info


@pytest.fixture(scope="module")
def loaded_pair(tiny_model_factory):
    """A prefill and a decode with room for 4 running requests: under 12 long ones, the rest wait for
    memory on the decode or in the prefill's bootstrap queue."""
    model_path = tiny_model_factory("llama")
    bootstrap_port, prefill_port, decode_port = free_port(), free_port(), free_port()
    prefill = _prefill(model_path, prefill_port, bootstrap_port)
    decode = EngineProcess(engine_command(model_path, decode_port, [
        "--disaggregation-mode", "decode", "--max-running-requests", "4", *COMMON]), decode_port)
    with prefill, decode:
        prefill.wait_healthy(STARTUP_TIMEOUT_S, "waiting for the prefill engine")
        decode.wait_healthy(STARTUP_TIMEOUT_S, "waiting for the decode engine")
        yield model_path, prefill, decode, bootstrap_port


def _long_call(c: httpx.AsyncClient, base_url: str, i: int):
    return c.stream("POST", f"{base_url}/generate", json={
        "input_ids": PROMPTS[i % len(PROMPTS)], "stream": i % 2 == 0,
        "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}})


async def _until_running(c: httpx.AsyncClient, decode: EngineProcess, n: int = 4) -> None:
    deadline = time.monotonic() + 60
    while (await c.get(f"{decode.base_url}/get_server_info")).json().get("num_running_reqs", 0) < n:
        assert time.monotonic() < deadline, f"the decode never ran {n} requests"
        await asyncio.sleep(0.05)


def _assert_engines_clean(prefill: EngineProcess, decode: EngineProcess, timeout_s: float = 60) -> None:
    for engine, queues in ((prefill, ("num_bootstrap_reqs", "num_inflight_reqs")),
                           (decode, ("num_prealloc_reqs", "num_transfer_reqs"))):
        info = wait_idle_integrity(engine.base_url, timeout_s=timeout_s)
        assert info["integrity_ok"] is True, info
        assert all(info[q] == 0 for q in queues), info


def test_killed_decode_behind_the_router_ends_every_call_and_a_restart_serves_again(loaded_pair):
    model_path, prefill, decode, bootstrap_port = loaded_pair
    # the kill opens the decode's circuit breaker (default: 60 s before a trial); a short timer here,
    # so that the readmission below is up to the health check and the engines, not to that wait
    flags = ("--health-check-interval-secs", "1", "--cb-timeout-duration-secs", "2")
    with pd_router(sys.executable, "-m", "baton", "router", flags=flags,
                   prefill=prefill.base_url, bootstrap_port=bootstrap_port, decode=decode.base_url) as router:

        async def call(c: httpx.AsyncClient, i: int) -> str:
            async with _long_call(c, router.base_url, i) as r:
                text = (await r.aread()).decode(errors="replace")
            if r.status_code == 200 and '"error"' not in text:
                return "ok"  # finished before the kill (unlikely at 300 tokens)
            assert r.status_code in (200, 500, 502, 503), (r.status_code, text[-500:])
            return f"failed {r.status_code}"

        async def kill_under_load() -> tuple[list[str], float]:
            async with httpx.AsyncClient(timeout=120) as c:
                calls = [asyncio.create_task(call(c, i)) for i in range(12)]
                await _until_running(c, decode)
                decode.kill()
                killed_at = time.monotonic()
                outcomes = await asyncio.wait_for(asyncio.gather(*calls), FAILURE_DEADLINE_S)
                return outcomes, time.monotonic() - killed_at

        outcomes, elapsed = asyncio.run(kill_under_load())
        print(f"\ndecode killed: all 12 calls ended {elapsed:.2f}s later: {sorted(outcomes)}")
        assert sum(o.startswith("failed") for o in outcomes) >= 4, outcomes
        _wait_router_drained(router, prefill)
        info = wait_idle_integrity(prefill.base_url, timeout_s=60)
        assert info["integrity_ok"] is True, info
        assert info["num_bootstrap_reqs"] == 0 and info["num_inflight_reqs"] == 0, info

        decode.start()  # same port, a new process and Mooncake session
        decode.wait_healthy(STARTUP_TIMEOUT_S, "waiting for the restarted decode engine")
        body = {"input_ids": PROMPTS[4], "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}}
        start, refused = time.monotonic(), []  # the router's health check readmits the decode
        while (r := httpx.post(f"{router.base_url}/generate", json=body, timeout=120)).status_code != 200:
            refused.append((round(time.monotonic() - start, 1), r.status_code, r.text[:100]))
            assert time.monotonic() < start + 60, refused
            time.sleep(0.5)
        print(f"readmitted after {time.monotonic() - start:.1f} s; refused before that: {refused}")
        assert r.json()["output_ids"] == hf_greedy(model_path, PROMPTS[4], MAX_NEW)
        _assert_engines_clean(prefill, decode)


def test_killed_router_leaves_nothing_behind_on_either_engine(loaded_pair):
    """The router dies with requests at every stage: no abort reaches the engines, only closed
    connections. Each engine must notice its clients are gone and give everything back."""
    model_path, prefill, decode, bootstrap_port = loaded_pair
    with pd_router(sys.executable, "-m", "baton", "router", prefill=prefill.base_url,
                   bootstrap_port=bootstrap_port, decode=decode.base_url) as router:

        killed_at = [float("inf")]

        async def call(c: httpx.AsyncClient, i: int) -> tuple[BaseException | int, float]:
            try:
                async with _long_call(c, router.base_url, i) as r:
                    await r.aread()
            except httpx.TransportError as exc:
                return exc, time.monotonic()
            return r.status_code, time.monotonic()

        async def kill_under_load() -> list[tuple[BaseException | int, float]]:
            async with httpx.AsyncClient(timeout=120) as c:
                calls = [asyncio.create_task(call(c, i)) for i in range(12)]
                await _until_running(c, decode)
                killed_at[0] = time.monotonic()
                router.kill()
                return await asyncio.wait_for(asyncio.gather(*calls), FAILURE_DEADLINE_S)

        results = asyncio.run(kill_under_load())
        # a call may finish whole before the kill (the machine is shared and 300 tokens are quick);
        # every call still open when the router died must end in a closed connection, not hang
        open_at_kill = [r for r, ended in results if ended >= killed_at[0]]
        finished = [r for r, ended in results if ended < killed_at[0]]
        assert all(r == 200 for r in finished), results
        assert len(open_at_kill) >= 4 and all(isinstance(r, httpx.TransportError) for r in open_at_kill), results

    _assert_engines_clean(prefill, decode, timeout_s=FAILURE_DEADLINE_S)
    pre, dec = asyncio.run(_post_both_once(prefill.base_url, decode.base_url, _body(PROMPTS[4], bootstrap_port)))
    assert pre.status_code == 200 and dec.status_code == 200, (pre.text, dec.text)
    assert dec.json()["output_ids"] == hf_greedy(model_path, PROMPTS[4], MAX_NEW)


async def _post_both_once(prefill: str, decode: str, body: dict) -> tuple[httpx.Response, httpx.Response]:
    async with httpx.AsyncClient(timeout=120) as c:
        return await _post_both(c, prefill, decode, body)
