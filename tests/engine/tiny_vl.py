"""Tiny random vision-language checkpoints (Qwen3.5 dense and MoE, Qwen3-VL) with what a served one
has: a tokenizer with the vision special tokens, a chat template that renders image parts, and a
preprocessor_config.json, plus HF's greedy reference on the same images.

    path = make_tiny_vl_model("qwen3_5", tmp_path / "vl")
    ids, mm = processor.expand(...)            # the engine's prompt (multimodal/processor.py)
    hf_vl_greedy(path, ids, mm, max_new)       # HF generate on the same pixels
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional, Union

import numpy as np
import torch

from tiny_models import _BASE, _HYBRID, _HYBRID_MOE, _randomize_zero_params, save_tiny_tokenizer

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'text' %}{{ p['text'] }}"
    "{% elif p['type'] in ('image', 'image_url', 'input_image') %}" + IMAGE_PLACEHOLDER + "{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# patch 4, merge 2: an image is cut into 4x4 patches, 2x2 patches make one token; pixels bounded so
# test images stay a few dozen tokens
TINY_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                   temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 4, "temporal_patch_size": 2,
                "merge_size": 2, "size": {"shortest_edge": 8 * 8, "longest_edge": 48 * 48},
                "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
VL_ARCHS = ["qwen3_5", "qwen3_5_moe", "qwen3_vl"]


def _classes(arch: str):
    import transformers as tf

    return {"qwen3_5": (tf.Qwen3_5Config, tf.Qwen3_5ForConditionalGeneration, dict(_HYBRID)),
            "qwen3_5_moe": (tf.Qwen3_5MoeConfig, tf.Qwen3_5MoeForConditionalGeneration, {**_HYBRID, **_HYBRID_MOE}),
            "qwen3_vl": (tf.Qwen3VLConfig, tf.Qwen3VLForConditionalGeneration, {"head_dim": 16})}[arch]


def make_tiny_vl_model(arch: str, path: Union[str, os.PathLike], seed: int = 0,
                       vision_overrides: Optional[dict[str, Any]] = None,
                       preprocessor_overrides: Optional[dict[str, Any]] = None, **text_overrides: Any) -> str:
    """Build, save (safetensors, float32) and return the directory of a tiny random `arch` VL model.
    `vision_overrides` change the tower (TINY_VISION's keys); the preprocessor takes its patch, temporal
    patch and merge sizes from the tower, and `preprocessor_overrides` on top (e.g. its pixel bounds)."""
    from tokenizers import Tokenizer

    config_cls, model_cls, text = _classes(arch)
    path = os.fspath(path)
    save_tiny_tokenizer(path, _BASE["vocab_size"], VISION_TOKENS)
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in VISION_TOKENS}
    text_config = {**_BASE, **text, **text_overrides}
    if arch == "qwen3_vl":  # interleaved M-RoPE over a 16-wide head: sections of 8 rotary pairs
        text_config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                                          "mrope_interleaved": True}
    vision = dict(TINY_VISION, **({"deepstack_visual_indexes": [0]} if arch == "qwen3_vl" else {}),
                  **(vision_overrides or {}))
    config = config_cls(text_config=text_config, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False,
                        architectures=[model_cls.__name__])
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    _randomize_zero_params(model, 0.15)
    with torch.no_grad():  # the tower's weights too (its init is small): every block matters; its
        for name, p in model.model.visual.named_parameters():  # output scaled near the token embeddings'
            if p.ndim >= 2:
                p.normal_(0.0, 0.02 if "linear_fc2" in name and "merger" in name else 0.15)
    model.save_pretrained(path)
    with open(os.path.join(path, "tokenizer_config.json")) as f:
        tc = json.load(f)
    tc["chat_template"] = VL_CHAT_TEMPLATE
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(tc, f)
    for stale in ("chat_template.jinja",):
        if os.path.exists(os.path.join(path, stale)):
            os.remove(os.path.join(path, stale))
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump({**PREPROCESSOR, "patch_size": vision["patch_size"], "merge_size": vision["spatial_merge_size"],
                   "temporal_patch_size": vision["temporal_patch_size"], **(preprocessor_overrides or {})}, f)
    return path


def random_image(width: int, height: int, seed: int = 0):
    """A random RGB PIL image."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


_HF: dict[str, torch.nn.Module] = {}


def hf_vl_model(path: str) -> torch.nn.Module:
    if path not in _HF:
        from transformers import AutoConfig
        import transformers as tf

        arch = AutoConfig.from_pretrained(path).architectures[0]
        _HF[path] = getattr(tf, arch).from_pretrained(path, dtype=torch.float32).eval()
    return _HF[path]


_GREEDY: dict[tuple, list[int]] = {}


def hf_vl_greedy(path: str, ids: list[int], mm: Any, max_new: int, ignore_eos: bool = False) -> list[int]:
    """HF generate on the engine's expanded prompt: the image tokens back to the placeholder id, the
    same pixel_values and grids."""
    key = (path, tuple(ids), max_new, ignore_eos)
    if key not in _GREEDY:
        _GREEDY[key] = _hf_vl_greedy(path, ids, mm, max_new, ignore_eos)
    return _GREEDY[key]


def _hf_vl_greedy(path: str, ids: list[int], mm: Any, max_new: int, ignore_eos: bool) -> list[int]:
    model = hf_vl_model(path)
    image_token = model.config.image_token_id
    hf_ids = list(ids)
    types = [0] * len(ids)
    for item in (mm.items if mm is not None else []):
        for p in range(item.offset, item.end):
            hf_ids[p], types[p] = image_token, 1
    kwargs: dict[str, Any] = {}
    if mm is not None and mm.items:
        kwargs = dict(pixel_values=torch.cat([it.pixel_values for it in mm.items]),
                      image_grid_thw=torch.tensor([it.grid_thw for it in mm.items]),
                      mm_token_type_ids=torch.tensor([types]))
    saved = model.generation_config.eos_token_id
    if ignore_eos:
        model.generation_config.eos_token_id = None
    try:
        out = model.generate(torch.tensor([hf_ids]), max_new_tokens=max_new, do_sample=False, pad_token_id=0,
                             **kwargs)
    finally:
        model.generation_config.eos_token_id = saved
    return out[0, len(ids):].tolist()
