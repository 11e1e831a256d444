"""ModelConfig (engine/model_config.py) against the HF configs it is read from, for every tiny model the
engine tests build and for the vision-language layouts; and the rule that nothing else in the engine
reads an HF config: no getattr on a config, no `text_config` unwrap, outside model_config.py."""
from __future__ import annotations

import ast
import dataclasses
import importlib
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from baton.engine.model_config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig
from test_models import LLAMA3_ROPE
from tiny_models import _BASE, ARCH_DEFAULTS, _config_and_model_classes

ENGINE = Path(__file__).resolve().parents[2] / "engine"
CASES = {
    "llama": ("llama", {}),
    "llama-tied-llama3rope": ("llama", {"tie_word_embeddings": True, "rope_parameters": LLAMA3_ROPE}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe-dense0-step2": ("qwen3_moe", {"mlp_only_layers": [0], "decoder_sparse_step": 2,
                                             "norm_topk_prob": False}),
    "qwen3_next": ("qwen3_next", {"num_nextn_predict_layers": 1}),
    "qwen3_5": ("qwen3_5", {"mtp_num_hidden_layers": 1}),
    "qwen3_5_moe": ("qwen3_5_moe", {}),
}
# text config model_type -> (transformers module, its text rotary embedding: the M-RoPE ones)
_HF_MROPE_ROTARY = {"qwen3_5_text": ("qwen3_5", "Qwen3_5TextRotaryEmbedding"),
                    "qwen3_5_moe_text": ("qwen3_5_moe", "Qwen3_5MoeTextRotaryEmbedding"),
                    "qwen3_vl_text": ("qwen3_vl", "Qwen3VLTextRotaryEmbedding"),
                    "qwen3_vl_moe_text": ("qwen3_vl_moe", "Qwen3VLMoeTextRotaryEmbedding")}
_TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                    num_position_embeddings=16)


def tiny_hf_config(arch: str, **overrides: Any):
    config_cls, model_cls = _config_and_model_classes(arch)
    return config_cls(**{**_BASE, **ARCH_DEFAULTS[arch], **overrides}, architectures=[model_cls.__name__])


def hf_sparse_layers(arch: str, config) -> tuple[int, ...]:
    """The layers whose MLP transformers' own decoder layers build as sparse blocks (they hold experts)."""
    _, model_cls = _config_and_model_classes(arch)
    model = model_cls(config)
    return tuple(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts"))


def check_text_against_hf(mc: ModelConfig, text, outer) -> None:
    """Every field read from the text model's config `text` (`outer`: the config it came in)."""
    assert mc.architecture == outer.architectures[0]
    t = mc.text
    assert (t.hidden_size, t.num_layers, t.vocab_size) == (text.hidden_size, text.num_hidden_layers, text.vocab_size)
    assert (t.hidden_act, t.rms_norm_eps, t.context_length) == (text.hidden_act, text.rms_norm_eps,
                                                               text.max_position_embeddings)
    assert t.intermediate_size == (getattr(text, "intermediate_size", None) or 0)
    assert t.tie_word_embeddings == outer.tie_word_embeddings
    assert t.attention_bias == bool(getattr(text, "attention_bias", False))
    assert t.mlp_bias == bool(getattr(text, "mlp_bias", False))
    assert dict(t.rope.params) == dict(text.rope_parameters)
    assert (t.rope.rope_type, t.rope.theta) == (text.rope_parameters["rope_type"], text.rope_parameters["rope_theta"])
    assert t.rope.partial_rotary_factor == text.rope_parameters.get("partial_rotary_factor", 1.0)
    check_mrope_against_hf(mc, text)
    eos = text.eos_token_id
    assert t.eos_token_ids == (() if eos is None else tuple(eos) if isinstance(eos, list) else (eos,))
    h = mc.heads
    assert (h.num_heads, h.num_kv_heads) == (text.num_attention_heads, text.num_key_value_heads)
    assert h.head_dim == (getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    layer_types = getattr(text, "layer_types", None) or [FULL_ATTENTION] * text.num_hidden_layers
    assert mc.layer_types == tuple(layer_types)
    assert mc.num_linear_attention_layers == layer_types.count(LINEAR_ATTENTION)
    assert mc.num_full_attention_layers == layer_types.count(FULL_ATTENTION)
    assert mc.layer_layout == "".join("L" if t == LINEAR_ATTENTION else "F" for t in layer_types)
    assert mc.is_hybrid == (LINEAR_ATTENTION in layer_types)
    if mc.is_hybrid:
        lin = h.linear
        assert lin.as_tuple() == (text.linear_num_key_heads, text.linear_num_value_heads, text.linear_key_head_dim,
                                  text.linear_value_head_dim)
        assert lin.conv_kernel == text.linear_conv_kernel_dim
    assert mc.num_mtp_layers == (getattr(text, "num_nextn_predict_layers", None)
                                 or getattr(text, "mtp_num_hidden_layers", None) or 0)
    assert mc.quantization is None and mc.eagle is None


def check_mrope_against_hf(mc: ModelConfig, text) -> None:
    """M-RoPE's sections as HF's text rotary embedding takes them (its own fallback where the checkpoint
    names none), and the layout flag as the checkpoint gives it (these families interleave by default)."""
    rope = mc.text.rope
    if text.model_type not in _HF_MROPE_ROTARY:
        assert rope.mrope_section is None and rope.mrope_interleaved is False
        return
    module, name = _HF_MROPE_ROTARY[text.model_type]
    rotary = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)(text)
    assert rope.mrope_section == tuple(rotary.mrope_section)
    assert rope.mrope_interleaved == text.rope_parameters.get("mrope_interleaved", True)


def check_moe_against_hf(mc: ModelConfig, text) -> None:
    if not getattr(text, "num_experts", 0):
        assert mc.moe is None and mc.sparse_layers == ()
        return
    moe = mc.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (text.num_experts, text.num_experts_per_tok,
                                                                   text.moe_intermediate_size)
    assert moe.shared_expert_intermediate_size == (getattr(text, "shared_expert_intermediate_size", None) or 0)
    assert moe.has_shared_expert == bool(getattr(text, "shared_expert_intermediate_size", 0))
    assert moe.norm_topk_prob == getattr(text, "norm_topk_prob", True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_text_models_read_as_hf_configures_them(case):
    arch, overrides = CASES[case]
    hf = tiny_hf_config(arch, **overrides)
    mc = ModelConfig.from_hf(hf)
    check_text_against_hf(mc, hf, hf)
    check_moe_against_hf(mc, hf)
    assert mc.vision is None
    assert mc.text.dtype is None  # the config names none
    assert mc.sparse_layers == hf_sparse_layers(arch, hf)  # transformers' own rule for which layers are MoE


def test_sparse_layers_follow_mlp_only_layers_and_the_step():
    mc = ModelConfig.from_hf(tiny_hf_config("qwen3_moe", num_hidden_layers=6, mlp_only_layers=[1],
                                            decoder_sparse_step=2))
    assert mc.sparse_layers == (3, 5)
    assert mc.moe.is_sparse(7) and not mc.moe.is_sparse(6)  # an MTP head's layer, one past the last


def test_hybrid_kind_index():
    mc = ModelConfig.from_hf(tiny_hf_config("qwen3_next"))
    assert mc.layer_layout == "LFLF"
    assert mc.kind_index == (0, 0, 1, 1)  # linear layers' state layers, full layers' KV layers


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("tie", [False, True])
def test_qwen3_5_vision_language_config(arch, tie):
    """The published Qwen3.5 layout: the text part from text_config, tied embeddings, dtype and the
    image token ids from the outer config, the vision tower's geometry from vision_config."""
    import transformers as tf

    config_cls, name = {"qwen3_5": (tf.Qwen3_5Config, "Qwen3_5ForConditionalGeneration"),
                        "qwen3_5_moe": (tf.Qwen3_5MoeConfig, "Qwen3_5MoeForConditionalGeneration")}[arch]
    hf = config_cls(text_config={**_BASE, **ARCH_DEFAULTS[arch]}, vision_config=_TINY_VISION,
                    tie_word_embeddings=tie, architectures=[name], dtype="bfloat16")
    mc = ModelConfig.from_hf(hf)
    check_text_against_hf(mc, hf.text_config, hf)
    check_moe_against_hf(mc, hf.text_config)
    assert mc.text.dtype == torch.bfloat16
    v, hv = mc.vision, hf.vision_config
    assert (v.depth, v.hidden_size, v.num_heads, v.out_hidden_size) == (hv.depth, hv.hidden_size, hv.num_heads,
                                                                        hv.out_hidden_size)
    assert (v.patch_size, v.temporal_patch_size, v.spatial_merge_size) == (hv.patch_size, hv.temporal_patch_size,
                                                                           hv.spatial_merge_size)
    assert v.tokens_merged == hv.spatial_merge_size ** 2
    check_vision_tower_fields(v, hv)
    assert v.deepstack_visual_indexes == ()
    assert (v.image_token_id, v.video_token_id) == (hf.image_token_id, hf.video_token_id)
    assert (v.vision_start_token_id, v.vision_end_token_id) == (hf.vision_start_token_id, hf.vision_end_token_id)


def check_vision_tower_fields(v, hv) -> None:
    """What the vision tower (models/qwen_vision.py) is built from, as HF's vision model reads it."""
    assert (v.intermediate_size, v.hidden_act, v.in_channels) == (hv.intermediate_size, hv.hidden_act, hv.in_channels)
    assert v.num_position_embeddings == hv.num_position_embeddings
    assert v.rope_theta == hv.rope_parameters["rope_theta"] and hv.rope_parameters["rope_type"] == "axial"
    assert v.layer_norm_eps == 1e-6  # HF's vision LayerNorms fix it
    assert v.head_dim == hv.hidden_size // hv.num_heads
    assert v.patch_dim == hv.in_channels * hv.temporal_patch_size * hv.patch_size ** 2
    assert v.tokens_per_image((1, 4, 6)) == 4 * 6 // hv.spatial_merge_size ** 2


def test_qwen3_vl_vision_config():
    from transformers import Qwen3VLConfig

    vision = {**_TINY_VISION, "depth": 3, "deepstack_visual_indexes": [0, 2],
              "rope_parameters": {"rope_type": "axial", "rope_theta": 500.0}}
    hf = Qwen3VLConfig(text_config={**_BASE, "head_dim": 16}, vision_config=vision,
                       architectures=["Qwen3VLForConditionalGeneration"])
    mc = ModelConfig.from_hf(hf)
    check_text_against_hf(mc, hf.text_config, hf)
    assert (mc.vision.depth, mc.vision.image_token_id) == (3, hf.image_token_id)
    check_vision_tower_fields(mc.vision, hf.vision_config)
    assert mc.vision.rope_theta == 500.0
    assert mc.vision.deepstack_visual_indexes == (0, 2)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_vl"])
def test_mrope_parameters_from_the_checkpoint(arch):
    """A checkpoint's own mrope_section and mrope_interleaved (the published configs name both) win
    over the family's defaults."""
    import transformers as tf

    rope = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [3, 3, 2], "mrope_interleaved": True}
    if arch == "qwen3_5":
        hf = tf.Qwen3_5Config(text_config={**_BASE, **ARCH_DEFAULTS[arch],
                                           "rope_parameters": {**rope, "partial_rotary_factor": 0.25}},
                              vision_config=_TINY_VISION, architectures=["Qwen3_5ForConditionalGeneration"])
    else:
        hf = tf.Qwen3VLConfig(text_config={**_BASE, "head_dim": 16, "rope_parameters": rope},
                              vision_config={**_TINY_VISION, "deepstack_visual_indexes": [0]},
                              architectures=["Qwen3VLForConditionalGeneration"])
    mc = ModelConfig.from_hf(hf)
    check_text_against_hf(mc, hf.text_config, hf)
    assert (mc.text.rope.mrope_section, mc.text.rope.mrope_interleaved) == ((3, 3, 2), True)


def test_checkpoint_dtype_eagle_and_quantization_fields():
    from transformers import LlamaConfig

    llama = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, intermediate_size=96)
    assert ModelConfig.from_hf(LlamaConfig(**llama, dtype="float16")).text.dtype == torch.float16
    old = LlamaConfig(**llama)
    old.__dict__["torch_dtype"] = "bfloat16"  # older configs name it so
    assert ModelConfig.from_hf(old).text.dtype == torch.bfloat16
    eagle3 = ModelConfig.from_hf(LlamaConfig(**llama, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=32,
                                             eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 4, 7]}))
    assert (eagle3.eagle.aux_layer_ids, eagle3.eagle.draft_vocab_size, eagle3.eagle.fc_bias) == ((1, 4, 7), 32, False)
    fp8 = LlamaConfig(**llama, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    q = ModelConfig.from_hf(fp8).quantization
    assert q.method == "fp8" and dict(q.params) == {"weight_block_size": [128, 128]}


def test_model_config_is_frozen():
    mc = ModelConfig.from_hf(tiny_hf_config("qwen3_moe"))
    for obj, name in ((mc, "architecture"), (mc.text, "hidden_size"), (mc.heads, "head_dim"), (mc.moe, "top_k")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, 1)
    with pytest.raises(TypeError):
        mc.text.rope.params["rope_theta"] = 1.0  # a read-only mapping


# ---- nothing else reads the HF config ----

_CONFIG_NAME = re.compile(r"(^|_)(config|cfg)$|^text$")


def _named(node: ast.AST) -> str:
    """The name a getattr's object goes by (through nested getattrs): `config`, `self.hf_config` -> hf_config."""
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" and node.args:
        node = node.args[0]
    if isinstance(node, ast.BoolOp):  # getattr(config, "text_config", None) or config
        return next((n for n in map(_named, node.values) if _CONFIG_NAME.search(n)), "")
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def hf_config_reads(source: str) -> list[tuple[int, str]]:
    """(line, what) for each read of an HF config the typed ModelConfig replaces: getattr / hasattr / vars
    on an object named like a config, its __dict__, and any `text_config` unwrap."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args \
                and node.func.id in ("getattr", "hasattr", "vars") and _CONFIG_NAME.search(_named(node.args[0])):
            found.append((node.lineno, f"{node.func.id}({_named(node.args[0])}, ...)"))
        elif isinstance(node, ast.Attribute) and node.attr == "__dict__" and _CONFIG_NAME.search(_named(node.value)):
            found.append((node.lineno, f"{_named(node.value)}.__dict__"))
        elif (isinstance(node, ast.Attribute) and node.attr == "text_config") or \
                (isinstance(node, ast.Constant) and node.value == "text_config"):
            found.append((node.lineno, "text_config"))
    return found


@pytest.mark.parametrize("line", [
    'cfg = getattr(hf_config, "text_config", None) or hf_config',
    'ids = getattr(getattr(hf_config, "text_config", None) or hf_config, "eos_token_id", None)',
    'text_cfg = getattr(self.hf_config, "text_config", None) or self.hf_config',
    'bias = bool(getattr(config, "attention_bias", False))',
    'self.head_dim = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // text_cfg.num_attention_heads',
    'kv = getattr(text, "num_key_value_heads", None) or heads',
    'arch = (getattr(draft_config, "architectures", None) or ["?"])[0]',
    'value = config.__dict__.get("torch_dtype")',
    'text = copy.copy(config.text_config)',
])
def test_the_hf_read_check_catches_the_old_reads(line):
    assert hf_config_reads(line), line


def test_only_model_config_reads_the_hf_config():
    own = ENGINE / "model_config.py"
    found = [f"{path.relative_to(ENGINE.parent)}:{line}: {what}"
             for path in sorted(ENGINE.rglob("*.py")) if path != own
             for line, what in hf_config_reads(path.read_text())]
    assert not found, "read the HF config in engine/model_config.py (ModelConfig), not here:\n" + "\n".join(found)
    assert hf_config_reads(own.read_text())  # the check sees the reads where they belong
