"""SGLang's operational routes on a real engine: pause in each mode with requests in flight and continue,
memory release and resume (a 503 while released), tokenize / detokenize, the profiler, slow-down, the
internal-state knobs, the GC freeze, and --admin-api-key guarding the control routes while generation
keeps --api-key. Greedy outputs equal HF; bad bodies are 400s; the engine ends idle with nothing leaked."""
from __future__ import annotations

import asyncio
import gzip
import json

import httpx
import pytest
from engine_server import running_engine, wait_idle_integrity
from transformers import AutoTokenizer

from baton.engine.entrypoints.auth import ADMIN_PATHS
from test_scheduler_fuzz import REF_LEN, reference

API_KEY, ADMIN_KEY = "user-key", "admin-key"
USER = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
PROMPTS = [[11, 12, 13, 14, 15], [21, 22, 23], [31, 32, 33, 34, 35, 36, 37], [41, 42, 43, 44]]


@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def engine(model_path):
    with running_engine(model_path, "--enable-memory-saver", "--max-total-tokens", "4096",
                        "--admin-api-key", ADMIN_KEY, api_key=API_KEY) as eng:
        yield eng


def _generate_body(prompt: list[int], rid: str) -> dict:
    return {"rid": rid, "input_ids": prompt,
            "sampling_params": {"max_new_tokens": REF_LEN, "temperature": 0, "ignore_eos": True}}


async def _running(c: httpx.AsyncClient, base: str, n: int) -> None:
    """Until n requests are running (polled, with a deadline)."""
    for _ in range(600):
        [state] = (await c.get(f"{base}/get_internal_state", headers=USER)).json()
        if state["num_running_reqs"] >= n:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{n} requests never ran: {state}")


async def _admin(c: httpx.AsyncClient, base: str, path: str, body=None, status: int = 200) -> httpx.Response:
    r = await c.post(f"{base}{path}", json=body, headers=ADMIN)
    assert r.status_code == status, (path, r.text)
    return r


def _check(model_path: str, prompt: list[int], r: httpx.Response, aborted_ok: bool = False) -> str:
    """A /generate answer: HF's tokens, or a prefix of them if it was aborted (and that is allowed)."""
    assert r.status_code == 200, r.text
    out, want = r.json(), reference(model_path, prompt)
    kind = out["meta_info"]["finish_reason"]["type"]
    if kind == "abort":
        assert aborted_ok and out["output_ids"] == want[:len(out["output_ids"])], out
    else:
        assert out["output_ids"] == want, out
    return kind


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_pause_with_requests_in_flight_then_continue(engine, model_path, mode):
    base = engine.base_url

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            await _admin(c, base, "/slow_down", {"forward_sleep_time": 0.05})  # keeps them in flight
            calls = [asyncio.create_task(c.post(f"{base}/generate", json=_generate_body(p, f"{mode}-{i}"), headers=USER))
                     for i, p in enumerate(PROMPTS[:3])]
            await _running(c, base, 3)
            r = await _admin(c, base, "/pause_generation", {"mode": mode})
            assert r.json() == {"message": "Generation paused successfully.", "status": "ok", "mode": mode}
            if mode == "abort":  # answered before any continue: 200, the output so far
                outs = await asyncio.wait_for(asyncio.gather(*calls), 10)
                assert all(_check(model_path, p, r, True) == "abort" for p, r in zip(PROMPTS, outs))
            late = asyncio.create_task(c.post(f"{base}/generate", json=_generate_body(PROMPTS[3], f"{mode}-late"),
                                              headers=USER))
            await asyncio.sleep(0.5)
            assert not late.done()  # it waits, it is not refused
            [state] = (await c.get(f"{base}/get_internal_state", headers=USER)).json()
            await asyncio.sleep(0.3)
            [later] = (await c.get(f"{base}/get_internal_state", headers=USER)).json()
            assert state["paused"] == mode and later["forward_ct"] == state["forward_ct"]  # nothing ran
            await _admin(c, base, "/continue_generation")
            await _admin(c, base, "/slow_down", {"forward_sleep_time": None})
            outs = await asyncio.gather(*calls, late)
            kinds = [_check(model_path, p, r, aborted_ok=mode == "abort") for p, r in zip(PROMPTS, outs)]
            assert kinds[-1] == "length" and (mode == "abort" or set(kinds) == {"length"})

    asyncio.run(run())
    assert wait_idle_integrity(engine.base_url, USER)["integrity_ok"] is True


def test_release_and_resume_memory(engine, model_path):
    base = engine.base_url

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            await _admin(c, base, "/slow_down", {"forward_sleep_time": 0.05})
            call = asyncio.create_task(c.post(f"{base}/generate", json=_generate_body(PROMPTS[0], "rel"), headers=USER))
            await _running(c, base, 1)
            r = await _admin(c, base, "/release_memory_occupation", {"tags": ["kv_cache"]}, status=400)
            assert "pause first" in r.json()["error"]["message"]
            await _admin(c, base, "/pause_generation", {"mode": "retract"})
            r = await _admin(c, base, "/release_memory_occupation")  # no body: every tag
            assert r.json()["released"] == ["kv_cache", "weights"]
            r = await c.post(f"{base}/generate", json=_generate_body(PROMPTS[1], "refused"), headers=USER)
            assert r.status_code == 503 and "resume_memory_occupation" in r.json()["error"]["message"]
            r = await c.post(f"{base}/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, headers=USER)
            assert r.status_code == 503
            assert (await c.get(f"{base}/get_server_info", headers=USER)).status_code == 200
            [state] = (await c.get(f"{base}/get_internal_state", headers=USER)).json()
            assert state["memory_released"] == ["kv_cache", "weights"]
            r = await _admin(c, base, "/resume_memory_occupation", {"tags": ["weights", "kv_cache"]})
            assert r.json()["released"] == []
            await _admin(c, base, "/slow_down", {"forward_sleep_time": None})
            await _admin(c, base, "/continue_generation")
            _check(model_path, PROMPTS[0], await call)  # retracted, then run again on the resumed memory
            after = await c.post(f"{base}/generate", json=_generate_body(PROMPTS[2], "after"), headers=USER)
            _check(model_path, PROMPTS[2], after)

    asyncio.run(run())
    assert wait_idle_integrity(engine.base_url, USER)["integrity_ok"] is True


def test_tokenize_and_detokenize(engine, model_path):
    tok = AutoTokenizer.from_pretrained(model_path)
    base, text = engine.base_url, "Hello world! How are you today?"
    r = httpx.post(f"{base}/tokenize", json={"prompt": text}, headers=USER)
    ids = tok.encode(text)
    assert r.json() == {"tokens": ids, "count": len(ids), "max_model_len": 512}
    r = httpx.post(f"{base}/v1/tokenize", json={"prompt": [text, "fox"], "add_special_tokens": False}, headers=USER)
    assert r.json()["tokens"] == [tok.encode(text, add_special_tokens=False), tok.encode("fox", add_special_tokens=False)]
    assert r.json()["count"] == [len(x) for x in r.json()["tokens"]]
    r = httpx.post(f"{base}/detokenize", json={"tokens": ids}, headers=USER)
    assert r.json() == {"text": tok.decode(ids, skip_special_tokens=True)}
    r = httpx.post(f"{base}/v1/detokenize", json={"tokens": [ids, [2, 5]], "skip_special_tokens": False}, headers=USER)
    assert r.json() == {"text": [tok.decode(ids), tok.decode([2, 5])]}
    assert httpx.post(f"{base}/detokenize", json={"tokens": []}, headers=USER).json() == {"text": ""}
    for path, body in (("/tokenize", {"prompt": 5}), ("/tokenize", {}), ("/detokenize", {"tokens": "abc"}),
                       ("/detokenize", {"tokens": [10 ** 6]})):
        r = httpx.post(f"{base}{path}", json=body, headers=USER)
        assert r.status_code == 400 and r.json()["error"]["message"], (path, body, r.text)


def test_profile(engine, tmp_path):
    base = engine.base_url

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            r = await _admin(c, base, "/stop_profile", status=400)
            assert "start_profile" in r.json()["error"]["message"]
            await _admin(c, base, "/start_profile", {"activities": ["RPD"]}, status=400)
            # num_steps: answered once those steps ran and the trace is written
            start = asyncio.create_task(c.post(f"{base}/start_profile", headers=ADMIN, json={
                "output_dir": str(tmp_path / "n"), "num_steps": 2, "activities": ["CPU"]}))
            await asyncio.sleep(0.3)
            gen = await c.post(f"{base}/generate", json=_generate_body(PROMPTS[0], "prof"), headers=USER)
            assert gen.status_code == 200 and (await start).status_code == 200
            # started and stopped by hand
            await _admin(c, base, "/start_profile", {"output_dir": str(tmp_path / "s"), "with_stack": True})
            await c.post(f"{base}/generate", json=_generate_body(PROMPTS[1], "prof2"), headers=USER)
            r = await _admin(c, base, "/stop_profile")
            assert r.text.startswith("Stop profiling.")

    asyncio.run(run())
    for sub in ("n", "s"):
        [trace] = (tmp_path / sub).glob("*-TP-0-DP-0.trace.json.gz")
        assert json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]


def test_internal_state_slow_down_and_gc_freeze(engine, model_path):
    base = engine.base_url
    [state] = httpx.get(f"{base}/get_internal_state", headers=USER).json()
    assert state["paused"] is None and state["memory_released"] == [] and "max_running_requests" in state["settable"]
    r = httpx.post(f"{base}/set_internal_state", json={"server_args": {"max_running_requests": 1}}, headers=ADMIN)
    assert r.status_code == 200 and r.json() == [{"updated": True, "server_args": {
        "max_running_requests": 1, "max_queued_requests": None, "forward_sleep_time": None}}]
    for bad in ({"max_micro_batch_size": 4}, {"max_running_requests": -1}, {"forward_sleep_time": "slow"}):
        r = httpx.post(f"{base}/set_internal_state", json={"server_args": bad}, headers=ADMIN)
        assert r.status_code == 400 and r.json()["error"]["message"], bad
    for bad in ({"forward_sleep_time": -1}, {"forward_sleep_time": "x"}):
        assert httpx.post(f"{base}/slow_down", json=bad, headers=ADMIN).status_code == 400
    for path, body in (("/pause_generation", {"mode": "sideways"}), ("/release_memory_occupation", {"tags": ["gpu"]}),
                       ("/resume_memory_occupation", {"tags": "kv_cache"})):
        assert httpx.post(f"{base}{path}", json=body, headers=ADMIN).status_code == 400, path
    outs = [httpx.post(f"{base}/generate", json=_generate_body(p, f"knob-{i}"), headers=USER) for i, p in
            enumerate(PROMPTS[:2])]
    for p, r in zip(PROMPTS, outs):
        _check(model_path, p, r)
    r = httpx.put(f"{base}/set_internal_state", json={"server_args": {"max_running_requests": state["max_running_requests"]}},
                  headers=ADMIN)
    assert r.status_code == 200
    r = httpx.post(f"{base}/freeze_gc", headers=ADMIN)
    assert r.status_code == 200 and r.text == "Garbage collection frozen.\n"
    assert wait_idle_integrity(base, USER)["integrity_ok"] is True


def test_admin_key_guards_the_control_routes(engine, model_path):
    base = engine.base_url
    for path in sorted(ADMIN_PATHS):  # weights and LoRA routes too, whoever registers them
        for headers in ({}, USER):
            r = httpx.post(f"{base}{path}", json={}, headers=headers)
            assert r.status_code == 401 and "admin" in r.json()["error"]["message"], (path, headers)
    assert httpx.post(f"{base}/flush_cache", headers=ADMIN).status_code == 200
    body = _generate_body(PROMPTS[0], "keys")
    assert httpx.post(f"{base}/generate", json=body, headers=ADMIN).status_code == 401  # generation takes --api-key
    _check(model_path, PROMPTS[0], httpx.post(f"{base}/generate", json=body, headers=USER))
    assert httpx.get(f"{base}/health").status_code == 200
    assert httpx.get(f"{base}/get_internal_state").status_code == 401
    info = httpx.get(f"{base}/get_server_info", headers={"x-api-key": API_KEY}).json()
    assert "api_key" not in info and "admin_api_key" not in info and info["enable_memory_saver"] is True
