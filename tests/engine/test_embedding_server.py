"""The embedding routes of a real engine started with --is-embedding (a Qwen3-Embedding-layout checkpoint:
bare weights under Qwen3ForCausalLM, no LM head): /v1/embeddings (the OpenAI client too) and /encode
equal HF's normalised last hidden state within 1e-5 for text, batches, token ids, long prompts in
chunks and repeated prefixes; base64 and dimensions; every bad input and every generation route a clear
400; nothing left held."""
from __future__ import annotations

import base64
import struct

import httpx
import openai
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from engine_server import running_engine, wait_idle_integrity
from tiny_models import make_tiny_encoder

ATOL = 1e-5
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello world!", "Prefill first, then decode."]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return make_tiny_encoder("qwen3", tmp_path_factory.mktemp("qwen3-embedding"), "bare_causal")


@pytest.fixture(scope="module")
def engine(model_path):
    with running_engine(model_path, "--is-embedding", "--chunked-prefill-size", "16",
                        "--served-model-name", "tiny-embedding") as eng:
        yield eng


@pytest.fixture(scope="module")
def hf(model_path):
    return AutoModel.from_pretrained(model_path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(model_path)


def reference(hf, prompt) -> torch.Tensor:
    model, tokenizer = hf
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(hidden, dim=-1)


def close(vector, ref: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(vector, dtype=torch.float32), ref, atol=ATOL, rtol=0)


def post(engine, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{engine.base_url}{path}", json=body, timeout=60)


def test_openai_embeddings_of_text_batches_and_token_ids(engine, hf):
    ids = [[5, 9, 200, 31], [7] * 3]
    for inp, prompts in (("Hello world!", ["Hello world!"]), (TEXTS, TEXTS), (ids[0], [ids[0]]), (ids, ids)):
        r = post(engine, "/v1/embeddings", {"input": inp, "model": "tiny-embedding"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and body["model"] == "tiny-embedding"
        assert [d["index"] for d in body["data"]] == list(range(len(prompts)))
        assert all(d["object"] == "embedding" for d in body["data"])
        for d, p in zip(body["data"], prompts):
            close(d["embedding"], reference(hf, p))
        tokens = sum(len(hf[1].encode(p)) if isinstance(p, str) else len(p) for p in prompts)
        assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_the_openai_client(engine, hf):
    """The SDK asks for base64 and decodes it itself."""
    client = openai.OpenAI(base_url=f"{engine.base_url}/v1", api_key="unused")
    out = client.embeddings.create(model="tiny-embedding", input=TEXTS[:2])
    for d, text in zip(out.data, TEXTS):
        close(d.embedding, reference(hf, text))
    assert out.usage.prompt_tokens == sum(len(hf[1].encode(t)) for t in TEXTS[:2])


def test_base64_and_dimensions(engine, hf):
    r = post(engine, "/v1/embeddings", {"input": TEXTS[0], "encoding_format": "base64"})
    raw = base64.b64decode(r.json()["data"][0]["embedding"])
    close(list(struct.unpack(f"<{len(raw) // 4}f", raw)), reference(hf, TEXTS[0]))
    r = post(engine, "/v1/embeddings", {"input": TEXTS[0], "dimensions": 16})
    vector = r.json()["data"][0]["embedding"]
    assert len(vector) == 16
    close(vector, torch.nn.functional.normalize(reference(hf, TEXTS[0])[:16], dim=-1))
    r = post(engine, "/encode", {"text": TEXTS[0], "dimensions": 8})
    close(r.json()["embedding"], torch.nn.functional.normalize(reference(hf, TEXTS[0])[:8], dim=-1))


def test_encode_and_classify_single_and_batched(engine, hf):
    ids = [11, 12, 13, 14, 15]
    for path in ("/encode", "/classify"):
        one = post(engine, path, {"text": TEXTS[1]}).json()
        close(one["embedding"], reference(hf, TEXTS[1]))
        meta = one["meta_info"]
        assert meta["prompt_tokens"] == len(hf[1].encode(TEXTS[1])) and meta["finish_reason"]["type"] == "length"
        many = post(engine, path, {"text": TEXTS, "rid": ["a", "b", "c"]}).json()
        assert [m["meta_info"]["id"] for m in many] == ["a", "b", "c"]
        for m, text in zip(many, TEXTS):
            close(m["embedding"], reference(hf, text))
        close(post(engine, path, {"input_ids": ids}).json()["embedding"], reference(hf, ids))
        batch = post(engine, path, {"input_ids": [ids, ids[:2]]}).json()
        close(batch[1]["embedding"], reference(hf, ids[:2]))


def test_long_prompts_in_chunks_and_a_repeated_prefix(engine, hf):
    """100 tokens in chunks of 16; then the same prompt again and one sharing 60 tokens: served from the
    radix cache (cached_tokens), the same vectors."""
    long = [(13 * i) % 490 + 6 for i in range(100)]
    first = post(engine, "/encode", {"input_ids": long}).json()
    close(first["embedding"], reference(hf, long))
    again = post(engine, "/encode", {"input_ids": [long, long[:60] + [7, 8]]}).json()
    assert again[0]["meta_info"]["cached_tokens"] == 99 and again[1]["meta_info"]["cached_tokens"] == 60
    close(again[0]["embedding"], reference(hf, long))
    close(again[1]["embedding"], reference(hf, long[:60] + [7, 8]))


@pytest.mark.parametrize("path, body", [
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
def test_generation_routes_are_refused(engine, path, body):
    r = post(engine, path, body)
    assert r.status_code == 400 and "--is-embedding" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("path, body, words", [
    ("/v1/embeddings", {"input": ""}, "empty"),
    ("/v1/embeddings", {"input": []}, "non-empty list"),
    ("/v1/embeddings", {"input": ["a", 3]}, "non-empty list"),
    ("/v1/embeddings", {"input": [[1, 2], []]}, "non-empty list"),
    ("/v1/embeddings", {"input": [{"text": "a", "image": "x.png"}]}, "multimodal"),
    ("/v1/embeddings", {"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": "a", "dimensions": 0}, "dimensions"),
    ("/v1/embeddings", {"input": "a", "dimensions": 65}, "between 1 and 64"),
    ("/v1/embeddings", {"input": ["a", "b"], "rid": ["x"]}, "one per input"),
    ("/v1/embeddings", {"input": [1, 99999]}, "vocabulary"),
    ("/v1/embeddings", {"input": list(range(6, 506)) * 2}, "context length"),
    ("/encode", {}, "exactly one of text or input_ids"),
    ("/encode", {"text": "a", "input_ids": [1]}, "exactly one of text or input_ids"),
    ("/encode", {"text": [1, 2]}, "text takes strings"),
    ("/encode", {"input_ids": "abc"}, "text takes strings"),
    ("/encode", {"text": "a", "image_data": "x.png"}, "image_data"),
])
def test_bad_inputs_are_a_clear_400(engine, path, body, words):
    r = post(engine, path, body)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_model_info_health_and_memory_after(engine):
    assert httpx.get(f"{engine.base_url}/get_model_info").json()["is_generation"] is False
    assert httpx.get(f"{engine.base_url}/health_generate", timeout=30).status_code == 200
    info = wait_idle_integrity(engine.base_url)
    assert info["integrity_ok"] is True and info["is_embedding"] is True
