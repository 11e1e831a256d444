"""M-RoPE against transformers: the prompt's [3, L] positions and delta (multimodal/mrope.py) against HF's
get_rope_index, the rotary embedding over [3, n] positions (layers/rotary_embedding.py) against HF's
text rotary embedding and apply_rotary_pos_emb, and the positions of a request's later tokens."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from baton.engine.layers.rotary_embedding import get_rope
from baton.engine.model_config import ModelConfig
from baton.engine.multimodal.mrope import mrope_positions, rope_positions_for

# (prompt length, [(first placeholder, grid_thw in patches)], spatial merge size)
PROMPTS = {
    "text-only": (7, [], 2),
    "one-image": (14, [(3, (1, 4, 6))], 2),  # 6 tokens, advances 3
    "three-images": (47, [(2, (1, 4, 4)), (9, (1, 6, 2)), (20, (2, 4, 8))], 2),  # 4, 3 and 16 tokens
    "image-first": (10, [(0, (1, 8, 4))], 2),
    "image-last": (12, [(4, (1, 4, 8))], 2),  # ends the prompt
    "one-row-image": (9, [(2, (1, 2, 8))], 2),  # advances as many positions as it has tokens
    "images-at-both-ends-merge-1": (22, [(0, (1, 2, 3)), (16, (1, 3, 2))], 1),
}


def _hf_model_classes() -> dict:
    import transformers as tf

    return {"qwen3_5": tf.Qwen3_5Model, "qwen3_5_moe": tf.Qwen3_5MoeModel, "qwen3_vl": tf.Qwen3VLModel,
            "qwen3_vl_moe": tf.Qwen3VLMoeModel}


def hf_rope_index(model_cls, num_tokens: int, images, merge: int) -> tuple[torch.Tensor, int]:
    """HF's get_rope_index on one prompt, called on a stand-in holding only the config it reads."""
    stub_cls = type("Stub", (), {"get_rope_index": model_cls.get_rope_index,
                                 "get_vision_position_ids": model_cls.get_vision_position_ids})
    stub = stub_cls()
    stub.config = SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=merge))
    types = torch.zeros(1, num_tokens, dtype=torch.int32)
    for offset, (t, h, w) in images:
        types[0, offset:offset + t * (h // merge) * (w // merge)] = 1
    input_ids = torch.where(types.bool(), 99, 5).long()
    grids = torch.tensor([grid for _, grid in images]) if images else None
    positions, deltas = stub.get_rope_index(input_ids, types, image_grid_thw=grids)
    return positions[:, 0], int(deltas[0, 0])


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_vl", "qwen3_vl_moe"])
@pytest.mark.parametrize("prompt", sorted(PROMPTS))
def test_mrope_positions_equal_hf_get_rope_index(family, prompt):
    num_tokens, images, merge = PROMPTS[prompt]
    want, want_delta = hf_rope_index(_hf_model_classes()[family], num_tokens, images, merge)
    got, delta = mrope_positions(num_tokens, images, merge)
    assert got.dtype == torch.int64 and got.shape == (3, num_tokens)
    assert torch.equal(got, want) and delta == want_delta
    assert delta <= 0  # an image advances the position by at most its token count


def test_mrope_positions_refuse_overlapping_images():
    with pytest.raises(AssertionError, match="overlaps"):
        mrope_positions(20, [(0, (1, 4, 4)), (3, (1, 2, 2))], 2)
    with pytest.raises(AssertionError, match="past the prompt"):
        mrope_positions(10, [(8, (1, 4, 4))], 2)


# ---- the rotary embedding over [3, n] positions ----

def _text_config(family: str, head_dim: int, section):
    import transformers as tf

    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if section is not None:
        rope.update(mrope_section=list(section), mrope_interleaved=True)
    if family == "qwen3_5":
        config = tf.Qwen3_5TextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                                      num_hidden_layers=4, rope_parameters={**rope, "partial_rotary_factor": 0.25},
                                      architectures=["Qwen3_5ForCausalLM"])
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding as hf_rotary
        from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb
    else:
        config = tf.Qwen3VLTextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                                      num_hidden_layers=1, rope_parameters=rope, architectures=["Qwen3VLTextModel"])
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding as hf_rotary
        from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb
    return config, hf_rotary(config), apply_rotary_pos_emb


def _image_prompt_positions() -> torch.Tensor:
    """[3, n]: text, two images, text, and generated tokens, shifted past 1,000 so that every column
    of a row differs from the others'."""
    positions, delta = mrope_positions(47, PROMPTS["three-images"][1], 2)
    later = torch.arange(47, 60) + delta
    return torch.cat((positions, later.expand(3, -1)), dim=1) + 1000


# (family, head_dim, mrope_section: None is the family's default)
ROTARY_CASES = [("qwen3_5", 16, None), ("qwen3_5", 32, None), ("qwen3_5", 32, (1, 1, 1)),
                ("qwen3_vl", 16, None), ("qwen3_vl", 32, None), ("qwen3_vl", 32, (4, 2, 2))]


@pytest.mark.parametrize("family,head_dim,section", ROTARY_CASES)
def test_rotary_over_3d_positions_equals_hf(family, head_dim, section):
    config, hf_rotary, apply_rotary_pos_emb = _text_config(family, head_dim, section)
    rope = get_rope(ModelConfig.from_hf(config).text, head_dim)
    assert rope.rotary_dim == (head_dim // 4 if family == "qwen3_5" else head_dim)
    positions = _image_prompt_positions()
    n = positions.shape[1]
    torch.manual_seed(0)
    q, k = torch.randn(n, 4 * head_dim), torch.randn(n, 2 * head_dim)
    cos, sin = hf_rotary(q, positions[:, None, :])
    want_q, want_k = apply_rotary_pos_emb(q.view(1, n, 4, head_dim), k.view(1, n, 2, head_dim), cos, sin,
                                          unsqueeze_dim=2)
    got_q, got_k = rope(positions, q, k)
    torch.testing.assert_close(got_q, want_q.reshape(n, -1), rtol=0, atol=1e-6)
    torch.testing.assert_close(got_k, want_k.reshape(n, -1), rtol=0, atol=1e-6)
    # the 1-D result differs: the height and width rows are read
    assert not torch.allclose(rope(positions[0], q, k)[0], got_q)


@pytest.mark.parametrize("family,head_dim,section", ROTARY_CASES)
def test_three_equal_rows_give_the_1d_result(family, head_dim, section):
    config, _, _ = _text_config(family, head_dim, section)
    rope = get_rope(ModelConfig.from_hf(config).text, head_dim)
    positions = torch.arange(3, 40)
    q, k = torch.randn(37, 4 * head_dim), torch.randn(37, 2 * head_dim)
    want_q, want_k = rope(positions, q, k)
    got_q, got_k = rope(positions.expand(3, -1).clone(), q, k)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_fused_qkv_rope_takes_the_reference_for_3d_positions():
    """The CUDA path's Triton kernel reads the tables by 1-D positions: [3, n] positions go to the
    reference (called here on CPU, where the kernel would fail)."""
    from baton.engine.layers.qkv_rope import QKVRope

    config, _, _ = _text_config("qwen3_vl", 16, None)
    rope = get_rope(ModelConfig.from_hf(config).text, 16)
    rope.reserve(rope.max_positions, "cpu")
    op = QKVRope(4, 2, 16, 0, rope)
    kv = torch.zeros(8, 2, 16)
    batch = SimpleNamespace(token_to_kv_pool=SimpleNamespace(k_buffer=[kv], v_buffer=[kv]),
                            attn_backend=SimpleNamespace(reads_new_kv_from_pool=True), out_cache_loc=torch.arange(5))
    positions, qkv = _image_prompt_positions()[:, :5], torch.randn(5, (4 + 2 + 2) * 16)
    got, want = op.forward_cuda(positions, qkv, batch), op.forward_native(positions, qkv, batch)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


# ---- positions of a request's later tokens ----

@pytest.mark.parametrize("prompt", ["text-only", "one-image", "three-images", "image-last"])
def test_rope_positions_for_across_the_prompt_end(prompt):
    """Every window of a request's sequence (chunks of the prompt, a chunk across its end, decode steps,
    a retracted request prefilled again with its output) is the slice of HF's positions: the prompt's
    table, then the sequence position plus the delta on all three rows."""
    num_tokens, images, merge = PROMPTS[prompt]
    table, delta = mrope_positions(num_tokens, images, merge)
    generated = 6
    later = torch.arange(num_tokens, num_tokens + generated) + delta
    whole = torch.cat((table, later.expand(3, -1)), dim=1)
    total = num_tokens + generated
    for start in range(total):
        for end in range(start + 1, total + 1):
            got = rope_positions_for(start, end, table, delta)
            assert got.dtype == torch.int64 and torch.equal(got, whole[:, start:end]), (start, end)


def test_native_cpu_forward_is_told_the_rope_is_mrope():
    """The native CPU forward reads the tables by 1-D positions: an M-RoPE model describes its RoPE as
    "mrope", which it declines (model_executor/native_forward.py takes "neox" only)."""
    from baton.engine.models.llama import _rope

    config, _, _ = _text_config("qwen3_vl", 16, None)
    text = ModelConfig.from_hf(config).text
    plain = dataclasses.replace(text, rope=dataclasses.replace(text.rope, mrope_section=None))
    assert _rope(get_rope(text, 16)).kind == "mrope" and _rope(get_rope(plain, 16)).kind == "neox"
