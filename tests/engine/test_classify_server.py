"""/classify on a real engine serving a sequence classifier (Qwen3ForSequenceClassification) with
--is-embedding: each input's vector is the score head's logits at its last token, equal to HF's within
1e-5; `dimensions`, which would cut logits, is a 400."""
from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from engine_server import running_engine, wait_idle_integrity
from tiny_models import make_tiny_encoder

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello world!"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return make_tiny_encoder("qwen3", tmp_path_factory.mktemp("qwen3-classifier"), "classifier", num_labels=3)


@pytest.fixture(scope="module")
def engine(model_path):
    with running_engine(model_path, "--is-embedding") as eng:
        yield eng


def hf_logits(model_path: str, texts: list[str]) -> list[torch.Tensor]:
    model = AutoModelForSequenceClassification.from_pretrained(model_path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    with torch.no_grad():
        return [model(torch.tensor([tokenizer.encode(t)])).logits[0] for t in texts]


def test_classify_returns_the_score_heads_logits(engine, model_path):
    r = httpx.post(f"{engine.base_url}/classify", json={"text": TEXTS}, timeout=60)
    assert r.status_code == 200, r.text
    for out, ref in zip(r.json(), hf_logits(model_path, TEXTS)):
        assert len(out["embedding"]) == 3
        torch.testing.assert_close(torch.tensor(out["embedding"]), ref, atol=1e-5, rtol=0)
    r = httpx.post(f"{engine.base_url}/v1/embeddings", json={"input": TEXTS[0], "dimensions": 2}, timeout=60)
    assert r.status_code == 400 and "classifier" in r.json()["error"]["message"], r.text
    assert wait_idle_integrity(engine.base_url)["integrity_ok"] is True
