"""An embedding engine (--is-embedding) through the real scheduler: each request's vector equals HF's
(the base model's last hidden state at the prompt's last token, after the final norm, L2-normalised;
a classifier's score-head logits there) within 1e-5, for single and batched requests, chunked prefills,
prompts whose prefix the radix cache serves, in the plain and the overlap loop; every checkpoint layout
embedding models ship in loads; nothing is left held."""
from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModel, AutoModelForSequenceClassification

from baton.engine.model_executor.model_loader import load_model
from scheduler_harness import SchedulerHarness
from tiny_models import make_tiny_encoder

ATOL = 1e-5
_REFERENCES: dict[str, torch.nn.Module] = {}


@pytest.fixture(scope="module")
def encoders(tmp_path_factory) -> dict[str, str]:
    """(arch, layout) -> a tiny checkpoint, built once for the module."""
    built = {}
    for arch, layout in (("qwen3", "bare_causal"), ("qwen3", "causal"), ("qwen3", "bare"), ("llama", "bare"),
                         ("qwen3", "classifier")):
        built[f"{arch}-{layout}"] = make_tiny_encoder(arch, tmp_path_factory.mktemp(f"{arch}-{layout}"), layout)
    return built


def hf_vector(path: str, prompt: list[int]) -> torch.Tensor:
    """HF's vector for one prompt: a classifier's logits, else the normalised last hidden state."""
    if path not in _REFERENCES:
        cls = AutoModelForSequenceClassification if "classifier" in path else AutoModel
        _REFERENCES[path] = cls.from_pretrained(path, dtype=torch.float32).eval()
    model = _REFERENCES[path]
    with torch.no_grad():
        out = model(torch.tensor([prompt]))
    if "classifier" in path:
        return out.logits[0]
    return torch.nn.functional.normalize(out.last_hidden_state[0, -1], dim=-1)


def prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6, 500) for _ in range(n)] for n in lengths]


def embed_all(h: SchedulerHarness, batch: list[list[int]], prefix: str = "r") -> list[list[float]]:
    """Every prompt submitted before the first step (one prefill batch where the budgets allow)."""
    for i, p in enumerate(batch):
        h.submit(f"{prefix}{i}", p)
    results = h.run_until_idle()
    outs = [results[f"{prefix}{i}"] for i in range(len(batch))]
    assert all(o.ids == [] and o.finish is not None and o.finish.kind == "length" for o in outs)
    assert all(o.after_finish == 0 for o in outs)
    return [o.embedding for o in outs]


def assert_matches_hf(path: str, batch: list[list[int]], vectors: list[list[float]]) -> None:
    for p, v in zip(batch, vectors):
        assert v is not None
        ref = hf_vector(path, p)
        assert len(v) == ref.numel()
        torch.testing.assert_close(torch.tensor(v), ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_single_and_batched_prompts_equal_hf(encoders, overlap):
    path = encoders["qwen3-bare_causal"]
    h = SchedulerHarness(path, is_embedding=True, enable_overlap_schedule=overlap)
    single = prompts(1, (9,))
    assert_matches_hf(path, single, embed_all(h, single, "s"))
    batch = prompts(2, (3, 17, 40, 1, 64))
    assert_matches_hf(path, batch, embed_all(h, batch, "b"))
    assert h.scheduler.check_memory_integrity()


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_chunked_prefill_pools_the_last_chunk(encoders, overlap):
    """Prompts several chunks long, beside short ones: the vector comes from the last chunk's last token."""
    path = encoders["qwen3-bare_causal"]
    h = SchedulerHarness(path, is_embedding=True, chunked_prefill_size=16, enable_overlap_schedule=overlap)
    batch = prompts(3, (100, 5, 47, 33))
    assert_matches_hf(path, batch, embed_all(h, batch))
    assert h.scheduler.check_memory_integrity()


def test_repeated_prefix_is_served_from_the_radix_cache(encoders):
    path = encoders["qwen3-bare_causal"]
    h = SchedulerHarness(path, is_embedding=True, chunked_prefill_size=16)
    base = prompts(4, (60,))[0]
    first = embed_all(h, [base], "a")
    again = [base, base[:30] + [7, 8, 9], base + [11]]
    vectors = embed_all(h, again, "b")
    assert_matches_hf(path, [base] + again, first + vectors)
    cached = [h.results[f"b{i}"].cached_tokens for i in range(3)]
    assert cached[0] == 59 and cached[1] >= 30 and cached[2] == 60, cached  # the last token is always computed
    assert h.scheduler.check_memory_integrity()


@pytest.mark.parametrize("key", ["qwen3-causal", "qwen3-bare", "llama-bare", "qwen3-classifier"])
def test_every_layout_equals_hf(encoders, key):
    """A generation checkpoint, a bare decoder (Qwen3Model, LlamaModel) and a classifier's logits."""
    path = encoders[key]
    h = SchedulerHarness(path, is_embedding=True)
    batch = prompts(5, (1, 12, 30))
    assert_matches_hf(path, batch, embed_all(h, batch))
    assert h.scheduler.check_memory_integrity()


def test_a_request_that_asks_for_tokens_still_ends_after_its_prefill(encoders):
    """/health_generate's probe (max_new_tokens 1) on an embedding engine: a vector, no token."""
    path = encoders["qwen3-bare_causal"]
    h = SchedulerHarness(path, is_embedding=True)
    h.submit("probe", [5, 6, 7], max_new_tokens=4)
    out = h.run_until_idle()["probe"]
    assert out.ids == [] and out.embedding is not None and h.scheduler.check_memory_integrity()


def test_the_lm_head_is_neither_loaded_nor_required(encoders):
    model, _, _ = load_model(encoders["qwen3-causal"], embedding=True)
    assert model.lm_head is None
    model, _, _ = load_model(encoders["qwen3-bare_causal"], embedding=True)
    assert model.lm_head is None and model.model.norm.weight.abs().sum() > 0


@pytest.mark.parametrize("key, message", [("qwen3-bare", "decoder without an LM head"),
                                          ("qwen3-bare_causal", "missing"),
                                          ("qwen3-classifier", "sequence classifier")])
def test_checkpoints_that_cannot_generate_need_is_embedding(encoders, key, message):
    with pytest.raises(ValueError, match=message):
        load_model(encoders[key])


def test_is_embedding_refuses_what_it_cannot_serve(encoders):
    from baton.engine.server_args import ServerArgs

    with pytest.raises(ValueError, match="prefills only"):
        ServerArgs(model_path=encoders["qwen3-causal"], is_embedding=True, disaggregation_mode="prefill")
    with pytest.raises(ValueError, match="speculative"):
        ServerArgs(model_path=encoders["qwen3-causal"], is_embedding=True, speculative_algorithm="NGRAM")


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_tp2_equals_hf(encoders, overlap):
    """TP 2: the follower runs the forward (its share of every all-reduce) and no LM head; in the overlap
    loop it takes the driver's placeholder tokens for its future map."""
    from baton.engine.server_args import ServerArgs
    from tp_group import tp_followers

    path = encoders["qwen3-bare_causal"]
    args = dict(tp_size=2, is_embedding=True, chunked_prefill_size=16, enable_overlap_schedule=overlap,
                disable_overlap_schedule=not overlap)
    with tp_followers(ServerArgs(model_path=path, **args)) as tp:
        h = SchedulerHarness(path, tp=tp, **args)
        try:
            batch = prompts(6, (40, 7, 23))
            assert_matches_hf(path, batch, embed_all(h, batch))
            assert h.scheduler.check_memory_integrity()
        finally:
            h.scheduler.close()


def test_bfloat16_is_close_to_hf(encoders):
    """bfloat16 on CPU (the native forward's extends where the CPU has them): within bfloat16's rounding
    of HF's float32 vector."""
    path = encoders["qwen3-bare_causal"]
    h = SchedulerHarness(path, is_embedding=True, dtype="bfloat16")
    batch = prompts(7, (5, 30))
    for p, v in zip(batch, embed_all(h, batch)):
        torch.testing.assert_close(torch.tensor(v), hf_vector(path, p), atol=3e-2, rtol=0)
    assert h.scheduler.check_memory_integrity()
