"""The weight endpoints of a real engine process, driven as RL frameworks drive them: an update from
disk, from tensors (shared memory) and over a gloo weight-update group with this test process as the
trainer's rank 0; after each, greedy outputs equal HF on the new weights and every response reports
the version (meta_info, OpenAI metadata, /get_weight_version, /get_model_info); a refused update
answers 400 and the old weights serve on; requests in flight finish under the new weights, or end
with 503 under abort_all_requests; nothing leaks."""
from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from safetensors.torch import load_file

from baton.engine.distributed.weight_group import destroy_process_group, init_custom_process_group
from baton.engine.utils.named_tensors import serialize_named_tensors
from baton.engine.utils.process import free_port
from engine_server import running_engine, wait_idle_integrity
from test_scheduler_vs_hf import hf_greedy

PROMPTS = [[5, 17, 33, 99, 100, 7, 8], [300, 301, 302, 9, 9, 41], [12, 13]]
MAX_NEW = 8
LONG = 1500  # tokens of a request in flight at an update
TIMEOUT = 300


@pytest.fixture(scope="module")
def models(tiny_model_factory) -> tuple[str, str]:
    # a 2k context: requests in flight at an update run long enough to be there when it comes
    return (tiny_model_factory("qwen3", max_position_embeddings=2048),
            tiny_model_factory("qwen3", seed=1, max_position_embeddings=2048))


@pytest.fixture(scope="module")
def engine(models):
    with running_engine(models[0], "--enable-overlap-schedule", "--max-total-tokens", "8192",
                        "--weight-version", "base") as eng:
        yield eng


def checkpoint(path: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(path, "model.safetensors"))


def generate(base: str, prompt: list[int], n: int = MAX_NEW) -> dict:
    r = httpx.post(f"{base}/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": n,
                                                                                      "temperature": 0}},
                   timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def assert_serves(base: str, path: str, version: str) -> None:
    for p in PROMPTS:
        out = generate(base, p)
        assert out["output_ids"] == hf_greedy(path, p, MAX_NEW)
        assert out["meta_info"]["weight_version"] == version
    assert httpx.get(f"{base}/get_weight_version").json() == {"weight_version": version}
    assert httpx.get(f"{base}/get_model_info").json()["weight_version"] == version


def update_from_disk(base: str, **body) -> httpx.Response:
    return httpx.post(f"{base}/update_weights_from_disk", json=body, timeout=TIMEOUT)


def test_update_from_disk_and_the_version_everywhere(engine, models):
    old, new = models
    base = engine.base_url
    assert_serves(base, old, "base")
    r = update_from_disk(base, model_path=new, weight_version="step-1")
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert set(r.json()) == {"success", "message", "num_paused_requests"} and "step-1" in r.json()["message"]
    assert_serves(base, new, "step-1")
    completion = httpx.post(f"{base}/v1/completions", json={"model": "m", "prompt": PROMPTS[0], "max_tokens": 4,
                                                            "temperature": 0}, timeout=TIMEOUT).json()
    assert completion["metadata"] == {"weight_version": "step-1"}
    assert update_from_disk(base, model_path=old).json()["success"]  # no version given: the count of updates
    assert_serves(base, old, "2")


def test_a_refused_update_answers_400_and_the_old_weights_serve_on(engine, models, tmp_path):
    old, _ = models
    base = engine.base_url
    assert update_from_disk(base, model_path=old, weight_version="kept").status_code == 200
    for body, why in [({"model_path": str(tmp_path)}, "not a checkpoint directory"),
                      ({"model_path": old, "load_format": "gguf"}, "load_format"),
                      ({}, "model_path")]:
        r = update_from_disk(base, **body)
        assert r.status_code == 400, r.text
        text = r.json().get("message") or r.json()["error"]["message"]
        assert why in text and r.json().get("success", False) is False
    assert_serves(base, old, "kept")


def test_get_weights_by_name(engine, models):
    old, _ = models
    base = engine.base_url
    assert update_from_disk(base, model_path=old).status_code == 200
    tensors = checkpoint(old)
    name = "model.layers.0.self_attn.k_proj.weight"
    got = httpx.post(f"{base}/get_weights_by_name", json={"name": name, "truncate_size": 3}).json()
    assert torch.equal(torch.tensor(got), tensors[name][:3])
    got = httpx.get(f"{base}/get_weights_by_name", params={"name": "model.norm.weight"}).json()
    assert torch.equal(torch.tensor(got), tensors["model.norm.weight"])
    r = httpx.post(f"{base}/get_weights_by_name", json={"name": "nope"})
    assert r.status_code == 400 and "no tensor 'nope'" in r.json()["error"]["message"]


def test_update_from_tensors_by_shared_memory(engine, models):
    old, new = models
    base = engine.base_url
    import torch.multiprocessing as tmp

    saved = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        tensors = list(checkpoint(new).items())  # alive until the engine has answered
        body = {"serialized_named_tensors": [serialize_named_tensors(tensors)], "weight_version": "from-tensors"}
        r = httpx.post(f"{base}/update_weights_from_tensor", json=body, timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["success"], r.text
    finally:
        tmp.set_sharing_strategy(saved)
    assert_serves(base, new, "from-tensors")
    r = httpx.post(f"{base}/update_weights_from_tensor", json={"serialized_named_tensors": ["not base64!"]})
    assert r.status_code == 400 and "base64" in r.json()["error"]["message"]


def test_update_over_a_gloo_group_with_this_process_as_the_trainer(engine, models):
    """rank 0: this process; rank 1: the engine's only TP rank (rank_offset 1)."""
    old, new = models
    base = engine.base_url
    assert update_from_disk(base, model_path=old).status_code == 200
    port, group = free_port(), "test_group"
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(httpx.post, f"{base}/init_weights_update_group", timeout=TIMEOUT, json={
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": group, "backend": "gloo"})
        pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, group)
        r = joined.result()
        assert r.status_code == 200 and r.json()["success"], r.text
        try:
            tensors = checkpoint(new)
            assert broadcast(pool, base, pg, group, tensors, "dist-1").json()["success"]
            assert_serves(base, new, "dist-1")
            # a shape the model cannot take: the engine still receives every broadcast, then refuses
            wrong = dict(tensors, **{"model.norm.weight": torch.ones(3)})
            r = broadcast(pool, base, pg, group, wrong, "dist-2")
            assert r.status_code == 400 and "model.norm.weight" in r.json()["message"], r.text
            assert_serves(base, new, "dist-1")
            r = pool.submit(httpx.post, f"{base}/destroy_weights_update_group", json={"group_name": group},
                            timeout=TIMEOUT).result()
            assert r.status_code == 200 and r.json()["success"], r.text
        finally:
            destroy_process_group(pg)
    r = httpx.post(f"{base}/destroy_weights_update_group", json={"group_name": group})
    assert r.status_code == 400 and "no weight-update group" in r.json()["message"]


def broadcast(pool: ThreadPoolExecutor, base: str, pg, group: str, tensors: dict[str, torch.Tensor],
              version: str) -> httpx.Response:
    """The trainer's side of /update_weights_from_distributed: the call, then each tensor's broadcast."""
    import torch.distributed as dist

    names = list(tensors)
    answer = pool.submit(httpx.post, f"{base}/update_weights_from_distributed", timeout=TIMEOUT, json={
        "names": names, "dtypes": [str(tensors[n].dtype) for n in names],
        "shapes": [list(tensors[n].shape) for n in names], "group_name": group, "weight_version": version})
    for n in names:
        dist.broadcast(tensors[n], group=pg, group_src=0)
    return answer.result()


def _running(base: str, n: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{base}/get_server_info").json()["num_running_reqs"] < n:
        assert time.monotonic() < deadline, f"never {n} requests running"
        time.sleep(0.02)


@pytest.mark.parametrize("abort", [False, True], ids=["go-on", "abort"])
def test_requests_in_flight_at_an_update(engine, models, abort):
    """Without abort_all_requests they finish (retracted, then on under the new weights) and report the
    new version; with it they end with 503. The engine is whole after either."""
    old, new = models
    base = engine.base_url
    assert update_from_disk(base, model_path=old).status_code == 200

    async def run() -> tuple[list[httpx.Response], httpx.Response]:
        async with httpx.AsyncClient(timeout=TIMEOUT) as c:
            calls = [asyncio.ensure_future(c.post(f"{base}/generate", json={
                "input_ids": p, "sampling_params": {"max_new_tokens": LONG, "temperature": 0, "ignore_eos": True}}))
                for p in PROMPTS]
            await asyncio.to_thread(_running, base, len(PROMPTS))
            update = await c.post(f"{base}/update_weights_from_disk", json={
                "model_path": new, "abort_all_requests": abort, "weight_version": f"inflight-{abort}"})
            return list(await asyncio.gather(*calls)), update

    outs, update = asyncio.run(run())
    assert update.status_code == 200, update.text
    if abort:
        assert all(r.status_code == 503 and "weights are being updated" in r.text for r in outs)
    else:
        assert update.json()["num_paused_requests"] == len(PROMPTS)
        assert all(r.status_code == 200 and len(r.json()["output_ids"]) == LONG for r in outs)
        assert all(r.json()["meta_info"]["weight_version"] == "inflight-False" for r in outs)
    assert wait_idle_integrity(base)["integrity_ok"] is True
    assert_serves(base, new, f"inflight-{abort}")
