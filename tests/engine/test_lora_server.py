"""LoRA through a real engine (`baton serve --lora-paths ...`): SGLang's endpoints and request fields, outputs
equal to HF on each adapter's merged checkpoint, /v1/models listing the adapters, an unknown adapter a 400
that names it, loading and unloading while serving (an unload waits for the requests under it), and the
radix cache kept apart per adapter."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from engine_server import running_engine, wait_idle_integrity
from lora_adapters import make_adapter
from test_scheduler_vs_hf import hf_greedy

PROMPT = [11, 42, 7, 99, 5, 17, 300, 23, 61]


@pytest.fixture(scope="module")
def setup(tiny_model_factory, tmp_path_factory):
    base = tiny_model_factory("qwen3")
    root = tmp_path_factory.mktemp("lora-server")
    paths = {"a": make_adapter(base, root / "a", rank=8, seed=11),
             "b": make_adapter(base, root / "b", targets=("q_proj", "v_proj", "down_proj"), rank=4, seed=12),
             "c": make_adapter(base, root / "c", targets=("k_proj", "gate_proj"), rank=8, seed=13)}
    flags = ["--lora-paths", f"a={paths['a'][0]}", json.dumps({"lora_name": "b", "lora_path": paths["b"][0]}),
             "--max-lora-rank", "8", "--lora-target-modules", "all", "--max-loras-per-batch", "2",
             "--max-total-tokens", "4096"]
    with running_engine(base, *flags) as eng:
        yield eng.base_url, base, paths


def _want(setup, lora, prompt=PROMPT, n=6):
    _, base, paths = setup
    return hf_greedy(base if lora is None else paths[lora][1], prompt, n)


def _generate(url: str, lora, prompt=PROMPT, n=6) -> httpx.Response:
    return httpx.post(f"{url}/generate", timeout=120, json={
        "input_ids": prompt, "lora_path": lora, "sampling_params": {"max_new_tokens": n, "temperature": 0}})


def test_models_list_the_adapters_with_the_base_as_parent(setup):
    url, base, paths = setup
    cards = {c["id"]: c for c in httpx.get(f"{url}/v1/models").json()["data"]}
    name = base.rstrip("/").rsplit("/", 1)[-1]
    assert set(cards) == {name, "a", "b"}
    assert cards["a"]["parent"] == name and cards["a"]["root"] == paths["a"][0] and "parent" not in cards[name]


def test_generate_batch_under_adapters_and_base_equals_hf(setup):
    url = setup[0]
    r = httpx.post(f"{url}/generate", timeout=120, json={
        "input_ids": [PROMPT, PROMPT, PROMPT[:5]], "lora_path": ["a", None, "b"],
        "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
    assert r.status_code == 200, r.text
    got = [o["output_ids"] for o in r.json()]
    assert got == [_want(setup, "a"), _want(setup, None), _want(setup, "b", PROMPT[:5])]
    assert got[0] != got[1]  # the adapter changes the output


def test_openai_model_names_the_adapter(setup):
    """SGLang's model "base:adapter", an adapter's name as /v1/models lists it, and lora_path in the body."""
    import openai
    from transformers import AutoTokenizer

    url, base, _ = setup
    name = base.rstrip("/").rsplit("/", 1)[-1]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    tok = AutoTokenizer.from_pretrained(base)

    def text(lora):
        return tok.decode(_want(setup, lora), skip_special_tokens=True)

    for model, extra, lora in ((f"{name}:a", None, "a"), ("a", None, "a"), (name, {"lora_path": "b"}, "b"),
                               (f"{name}:a", {"lora_path": "b"}, "a"),  # the model's adapter wins (SGLang)
                               (f"{name}:", None, None)):
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, extra_body=extra)
        assert out.choices[0].text == text(lora), (model, extra)
    chat = client.chat.completions.create(model=f"{name}:b", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=6, temperature=0)
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                  tokenize=True)["input_ids"]
    assert chat.choices[0].message.content == tok.decode(_want(setup, "b", list(ids)), skip_special_tokens=True)


def test_an_unknown_adapter_is_a_400_that_names_it(setup):
    url, base, _ = setup
    r = _generate(url, "zzz")
    assert r.status_code == 400 and "'zzz' is not loaded" in r.text
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "m:zzz", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 400 and "zzz" in r.json()["error"]["message"]


def test_load_serve_unload(setup):
    url, _, paths = setup
    bad = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nonexistent"})
    assert bad.status_code == 400 and not bad.json()["success"] and "adapter_config.json" in bad.json()["error_message"]
    r = httpx.post(f"{url}/load_lora_adapter", timeout=60, json={"lora_name": "c", "lora_path": paths["c"][0]})
    assert r.status_code == 200 and r.json()["loaded_adapters"] == {n: paths[n][0] for n in "abc"}, r.text
    got = _generate(url, "c")
    assert got.status_code == 200 and got.json()["output_ids"] == _want(setup, "c")
    r = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "c"})
    assert r.status_code == 200 and "c" not in r.json()["loaded_adapters"]
    assert _generate(url, "c").status_code == 400
    assert httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "c"}).status_code == 400
    assert "c" not in {m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]}
    assert wait_idle_integrity(url)["integrity_ok"]


def test_an_unload_waits_for_the_requests_under_the_adapter(setup):
    url, _, paths = setup
    assert httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "d", "lora_path": paths["a"][0]}).status_code == 200
    max_new = 300

    async def run():
        received, first = [], asyncio.Event()
        async with httpx.AsyncClient(timeout=120) as c:
            async def stream():
                body = {"input_ids": PROMPT, "lora_path": "d", "stream": True,
                        "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
                async with c.stream("POST", f"{url}/generate", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            received.append(json.loads(line[6:])["output_ids"])
                            first.set()

            task = asyncio.create_task(stream())
            await first.wait()
            unload = asyncio.create_task(c.post(f"{url}/unload_lora_adapter", json={"lora_name": "d"}))
            await asyncio.sleep(0.2)
            refused = await c.post(f"{url}/generate", json={"input_ids": PROMPT, "lora_path": "d"})
            done = await unload
            at_unload = len(received[-1])
            await task
            return refused, done, at_unload, received[-1]

    refused, done, at_unload, output = asyncio.run(run())
    assert refused.status_code == 400  # the name is gone for new requests at once
    assert done.status_code == 200 and "d" not in done.json()["loaded_adapters"]
    assert at_unload >= max_new // 2, f"the unload returned after {at_unload} of {max_new} tokens"
    assert output == hf_greedy(paths["a"][1], PROMPT, max_new, ignore_eos=True)
    assert wait_idle_integrity(url)["integrity_ok"]


def test_the_radix_cache_keeps_adapters_apart(setup):
    url = setup[0]
    prompt = list(range(200, 240))
    cached = []
    for lora in (None, "a", "b", "a"):
        r = _generate(url, lora, prompt, 2)
        assert r.status_code == 200, r.text
        cached.append(r.json()["meta_info"]["cached_tokens"])
    assert cached[1:3] == [0, 0] and cached[3] >= len(prompt) - 1, cached
