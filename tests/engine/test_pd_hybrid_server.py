"""A hybrid model (Gated DeltaNet + gated attention, tiny Qwen3.5) served by a real prefill and decode
(`baton serve`) over Mooncake TCP on 127.0.0.1: the recurrent state moves with the last
chunk. Greedy tokens equal HF's, directly and through both routers; client aborts at each stage and
a killed prefill leave nothing held on either side (KV pages, request rows = state slots, metadata
slots, rooms); a pair that serves different models is refused on both sides, with the reason."""
from __future__ import annotations

import asyncio
import sys
import time

import httpx
import pytest

from baton.engine.bench.launcher import EngineProcess, engine_command, free_port
from engine_server import STARTUP_TIMEOUT_S, wait_idle_integrity
from test_pd_failures import FAILURE_DEADLINE_S, HEARTBEAT_S, MAX_FAILURES, _wait_transfer_queue
from test_pd_server import (BOOTSTRAP_TIMEOUT_S, COMMON, MAX_NEW, PROMPTS, _body, _environ, _post_both,
                            assert_router_serves_pair, pd_router)
from test_scheduler_vs_hf import hf_greedy

pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine(-non-cuda) is a test dependency")


@pytest.fixture(scope="module")
def hybrid_path(tiny_model_factory) -> str:
    return tiny_model_factory("qwen3_5")


def _prefill(model_path: str, port: int, bootstrap_port: int) -> EngineProcess:
    return EngineProcess(engine_command(model_path, port, [
        "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap_port),
        "--chunked-prefill-size", "16", *COMMON]), port)


def _decode(model_path: str, port: int) -> EngineProcess:
    return EngineProcess(engine_command(model_path, port, [
        "--disaggregation-mode", "decode", "--disaggregation-heartbeat-interval", str(HEARTBEAT_S),
        "--disaggregation-heartbeat-max-failures", str(MAX_FAILURES), *COMMON]), port)


@pytest.fixture(scope="module")
def hybrid_pair(hybrid_path):
    """(prefill, bootstrap port, decode); the last test of the module kills and restarts the prefill."""
    bootstrap_port, prefill_port, decode_port = free_port(), free_port(), free_port()
    prefill, decode = _prefill(hybrid_path, prefill_port, bootstrap_port), _decode(hybrid_path, decode_port)
    with _environ(SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT=str(BOOTSTRAP_TIMEOUT_S)), prefill, decode:
        prefill.wait_healthy(STARTUP_TIMEOUT_S, "waiting for the prefill engine")
        decode.wait_healthy(STARTUP_TIMEOUT_S, "waiting for the decode engine")
        yield prefill, bootstrap_port, decode


def _assert_nothing_held(*engines: EngineProcess) -> None:
    for engine in engines:
        info = wait_idle_integrity(engine.base_url, timeout_s=60)
        assert info["integrity_ok"] is True, info
        assert info["recurrent_state_slots_used"] == 0, info


def test_hybrid_pair_matches_hf_directly_and_through_both_routers(hybrid_pair, hybrid_path):
    prefill, bootstrap_port, decode = hybrid_pair
    assert any(len(p) > 16 for p in PROMPTS), "some prompts take several chunks on the prefill"

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*[_post_both(c, prefill.base_url, decode.base_url, _body(p, bootstrap_port))
                                          for p in PROMPTS])

    for p, (pre, dec) in zip(PROMPTS, asyncio.run(run())):
        assert pre.status_code == 200 and dec.status_code == 200, (pre.text, dec.text)
        assert dec.json()["output_ids"] == hf_greedy(hybrid_path, p, MAX_NEW)
    for cmd in ((sys.executable, "-m", "baton", "router"), (sys.executable, "-m", "sglang_router.launch_router")):
        with pd_router(*cmd, prefill=prefill.base_url, bootstrap_port=bootstrap_port,
                       decode=decode.base_url) as router:
            assert_router_serves_pair(router.base_url, hybrid_path, PROMPTS[:5])
    assert httpx.get(f"{prefill.base_url}/get_server_info", timeout=10).json()["kv_transfer_bytes"] > 0
    _assert_nothing_held(prefill, decode)


def test_hybrid_pair_client_aborts_at_every_stage_leave_nothing_held(hybrid_pair, hybrid_path):
    """Clients hang up while their request waits in the prefill's bootstrap queue (the decode never
    got it), in the decode's transfer queue (the prefill never got it), and mid-stream while
    decoding; a request beside them still gets HF's tokens."""
    prefill, bootstrap_port, decode = hybrid_pair
    long = {"max_new_tokens": 200, "ignore_eos": True, "temperature": 0}

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(timeout=120) as c:
            only_prefill = asyncio.create_task(c.post(f"{prefill.base_url}/generate",
                                                      json=_body(PROMPTS[2], bootstrap_port)))
            only_decode = asyncio.create_task(c.post(f"{decode.base_url}/generate",
                                                     json=_body(PROMPTS[3], bootstrap_port)))
            await _wait_transfer_queue(decode.base_url, 1)
            body = {**_body(PROMPTS[7], bootstrap_port), "stream": True, "sampling_params": long}
            pre = asyncio.create_task(c.post(f"{prefill.base_url}/generate", json=body))
            async with c.stream("POST", f"{decode.base_url}/generate", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        break  # decoding now: hang up
            only_prefill.cancel()
            only_decode.cancel()
            await pre
            return (await _post_both(c, prefill.base_url, decode.base_url, _body(PROMPTS[6], bootstrap_port)))[1]

    beside = asyncio.run(run())
    assert beside.status_code == 200 and beside.json()["output_ids"] == hf_greedy(hybrid_path, PROMPTS[6], MAX_NEW)
    _assert_nothing_held(prefill, decode)


def test_a_pair_of_different_models_is_refused_on_both_sides(hybrid_pair, tiny_model_factory):
    """A Llama decode behind the hybrid prefill: the handshake names what differs; both engines
    answer 500 at once (no timeout), and keep nothing."""
    prefill, bootstrap_port, _ = hybrid_pair
    port = free_port()
    with _decode(tiny_model_factory("llama"), port) as other:
        other.wait_healthy(STARTUP_TIMEOUT_S, "waiting for the llama decode engine")

        async def run():
            async with httpx.AsyncClient(timeout=120) as c:
                return await _post_both(c, prefill.base_url, other.base_url, _body(PROMPTS[1], bootstrap_port))

        started = time.monotonic()
        pre, dec = asyncio.run(run())
        assert time.monotonic() - started < BOOTSTRAP_TIMEOUT_S, "refused at the handshake, not by a timeout"
        for r in (pre, dec):
            assert r.status_code == 500, r.text
            message = r.json()["error"]["message"]
            assert "geometry differs between prefill and decode" in message, message
            assert "model Qwen3_5ForCausalLM" in message and "layer_layout LFLF != FF" in message, message
        _assert_nothing_held(other)
    _assert_nothing_held(prefill)


def test_killed_hybrid_prefill_fails_only_its_requests_and_a_restart_serves_again(hybrid_pair, hybrid_path):
    """Runs last in the module: it kills the fixture's prefill, then restarts it."""
    prefill, bootstrap_port, decode = hybrid_pair

    async def kill_while_waiting() -> tuple[list[httpx.Response], float]:
        async with httpx.AsyncClient(timeout=120) as c:
            stranded = [asyncio.create_task(c.post(f"{decode.base_url}/generate", json=_body(p, bootstrap_port)))
                        for p in PROMPTS[2:4]]
            await _wait_transfer_queue(decode.base_url, 2)
            killed_at = time.monotonic()
            prefill.kill()
            done = await asyncio.wait_for(asyncio.gather(*stranded), FAILURE_DEADLINE_S)
            return done, time.monotonic() - killed_at

    stranded, elapsed = asyncio.run(kill_while_waiting())
    for r in stranded:
        assert r.status_code == 500 and "KV transfer failed" in r.json()["error"]["message"], r.text
    assert elapsed < FAILURE_DEADLINE_S
    _assert_nothing_held(decode)  # the quarantined pages came back too
    prefill.start()
    prefill.wait_healthy(STARTUP_TIMEOUT_S, "waiting for the restarted prefill engine")

    async def after_restart():
        async with httpx.AsyncClient(timeout=120) as c:
            return await _post_both(c, prefill.base_url, decode.base_url, _body(PROMPTS[4], bootstrap_port))

    pre, dec = asyncio.run(after_restart())
    assert pre.status_code == 200 and dec.status_code == 200, (pre.text, dec.text)
    assert dec.json()["output_ids"] == hf_greedy(hybrid_path, PROMPTS[4], MAX_NEW)
    _assert_nothing_held(prefill, decode)
