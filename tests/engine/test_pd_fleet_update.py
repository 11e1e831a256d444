"""A fleet weight update through `baton router` in front of a real PD pair (Mooncake over TCP), with
requests in flight: every response's tokens equal HF's greedy tokens on the checkpoint of the weight
version its meta_info reports (a request aborted by the update's pause: a prefix of them), so none mixes
two versions; the pools are whole afterwards."""
from __future__ import annotations

import asyncio
import sys
import time

import httpx
import pytest

from test_pd_server import _assert_idle_and_whole, _pair, pd_router
from test_scheduler_vs_hf import hf_greedy

MAX_NEW = 12
PROMPTS = [[(11 * i + 5 * j) % 400 + 7 for j in range(6 + 3 * i)] for i in range(12)]


@pytest.fixture(scope="module")
def checkpoints(tiny_model_factory) -> dict[str, str]:
    """The version each checkpoint is served under: two seeds of one architecture."""
    old, new = tiny_model_factory("llama"), tiny_model_factory("llama", seed=1)
    return {"v0": old, "v1": new, "v2": old}


async def _generate(client: httpx.AsyncClient, base: str, prompt: list[int]) -> tuple[list[int], dict]:
    r = await client.post(f"{base}/generate", json={
        "input_ids": prompt, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}})
    assert r.status_code == 200, r.text  # never the decode's 409: no pair ever ran two versions
    return prompt, r.json()


async def _decoding(client: httpx.AsyncClient, decode: str) -> None:
    """Until the decode engine runs requests (their KV arrived; deadline 60 s)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if (await client.get(f"{decode}/get_server_info")).json().get("num_running_reqs"):
            return
        await asyncio.sleep(0.02)
    raise AssertionError("no request decoding")


async def _update_under_load(base: str, decode: str, prompts: list[list[int]], body: dict) -> tuple[dict, list]:
    """Requests sent, the update posted while they decode, more requests sent meanwhile and after."""
    async with httpx.AsyncClient(timeout=120) as c:
        first = [asyncio.ensure_future(_generate(c, base, p)) for p in prompts[:4]]
        await _decoding(c, decode)
        update = asyncio.ensure_future(c.post(f"{base}/update_weights_from_disk", json=body))
        during = [asyncio.ensure_future(_generate(c, base, p)) for p in prompts[4:6]]
        answer = await update
        assert answer.status_code == 200, answer.text
        after = [await _generate(c, base, p) for p in prompts[6:8]]
        return answer.json(), [*await asyncio.gather(*first, *during), *after]


def _check_versions(results: list, checkpoints: dict[str, str], versions: set[str]) -> int:
    """Each response equals HF on the checkpoint of the version it reports; returns how many the pause
    aborted (their tokens so far: a prefix of HF's)."""
    aborted = 0
    for prompt, out in results:
        meta = out["meta_info"]
        assert meta["weight_version"] in versions, meta
        want = hf_greedy(checkpoints[meta["weight_version"]], prompt, MAX_NEW)
        if meta["finish_reason"]["type"] == "abort":
            aborted += 1
            assert out["output_ids"] == want[:len(out["output_ids"])], (meta, out["output_ids"], want)
        else:
            assert out["output_ids"] == want, (meta, out["output_ids"], want)
    return aborted


def test_a_fleet_update_with_requests_in_flight_never_mixes_versions(checkpoints):
    assert hf_greedy(checkpoints["v0"], PROMPTS[0], MAX_NEW) != hf_greedy(checkpoints["v1"], PROMPTS[0], MAX_NEW)
    with _pair(checkpoints["v0"], ["--weight-version", "v0"]) as (prefill, bootstrap_port, decode):
        for engine in (prefill, decode):  # each step a little slower: the requests are still running at the update
            httpx.post(f"{engine.base_url}/slow_down", json={"forward_sleep_time": 0.05}, timeout=30)
        with pd_router(sys.executable, "-m", "baton", "router", prefill=prefill.base_url,
                       bootstrap_port=bootstrap_port, decode=decode.base_url) as router:
            # the default: the requests in flight finish on v0, the ones that arrive wait and run on v1
            answer, results = asyncio.run(_update_under_load(router.base_url, decode.base_url, PROMPTS, {
                "model_path": checkpoints["v1"], "weight_version": "v1"}))
            assert answer["success"] and answer["weight_version"] == "v1", answer
            assert answer["requests_in_flight_at_pause"] == 0
            assert [w["role"] for w in answer["workers"]] == ["prefill", "decode"]
            assert _check_versions(results, checkpoints, {"v0", "v1"}) == 0
            assert {out["meta_info"]["weight_version"] for _, out in results} == {"v0", "v1"}
            # abort_all_requests: the requests in flight end now with their tokens so far, all from v1
            answer, results = asyncio.run(_update_under_load(router.base_url, decode.base_url, PROMPTS[4:], {
                "model_path": checkpoints["v2"], "weight_version": "v2", "abort_all_requests": True}))
            assert answer["success"] and answer["requests_in_flight_at_pause"] >= 1, answer
            assert _check_versions(results, checkpoints, {"v1", "v2"}) >= 1
            assert httpx.get(f"{router.base_url}/get_weight_version").json()["weight_version"] == "v2"
        for engine in (prefill, decode):
            httpx.post(f"{engine.base_url}/slow_down", json={"forward_sleep_time": None}, timeout=30)
        _assert_idle_and_whole(prefill, decode)
