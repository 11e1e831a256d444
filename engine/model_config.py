"""The model's configuration: the checkpoint's HF config read once, at load time, into frozen typed parts.

Everything the engine needs to know about a model (the model classes, the pools, the runner, PD's
handshake, the TP checks) reads a ModelConfig; this module is the only reader of the HF config. A
vision-language checkpoint (Qwen3.5, Qwen3-VL) wraps its text model's config in `text_config`: the
unwrap happens here (`_text_part`), and what HF reads from the outer config (tied embeddings, dtype,
the image token ids) is read from there.

    ModelConfig
      architecture      config.architectures[0]
      text              TextConfig: sizes, norm, RoPE, context length, tied embeddings, dtype, EOS ids
      heads             HeadGeometry: q / KV heads and head size; a hybrid's linear-attention heads
      layer_types       per layer: full_attention | linear_attention (| sliding_attention)
      moe               MoeGeometry of a sparse model, else None
      quantization      QuantizationConfig of a quantized checkpoint, else None
      vision            VisionConfig of a vision-language checkpoint, else None
      eagle             EagleDraftConfig of an EAGLE draft checkpoint, else None
      num_labels        a sequence classifier's labels, else 0
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Optional

import torch

FULL_ATTENTION, LINEAR_ATTENTION, SLIDING_ATTENTION = "full_attention", "linear_attention", "sliding_attention"
_LAYER_TYPES = {FULL_ATTENTION, LINEAR_ATTENTION, SLIDING_ATTENTION}
_CHECKPOINT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DEFAULT_CONTEXT_LENGTH = 4096  # a config without max_position_embeddings
_DEFAULT_ROPE_THETA = 10000.0
# the M-RoPE sections HF's text rotary embedding falls back to when the checkpoint names none, by the
# text config's model_type; these families always lay the sections out interleaved
_DEFAULT_MROPE_SECTIONS = {"qwen3_5_text": (11, 11, 10), "qwen3_5_moe_text": (11, 11, 10),
                           "qwen3_vl_text": (24, 20, 20), "qwen3_vl_moe_text": (24, 20, 20)}


@dataclass(frozen=True)
class RopeConfig:
    """RoPE's parameters as one read-only mapping (transformers 5.x's `rope_parameters`: rope_type,
    rope_theta and the scaling fields; a 4.x config's rope_theta and rope_scaling merged into it)."""

    params: Mapping[str, Any]
    # transformers' own yarn init reads an HF config (layers/rotary_embedding.py); nothing else may
    hf_config: Any = field(default=None, compare=False, repr=False)
    # M-RoPE (Qwen3.5, Qwen3-VL): how many of the rotary frequencies follow the temporal, height and
    # width positions; None: plain 1-D RoPE
    mrope_section: Optional[tuple[int, int, int]] = None
    mrope_interleaved: bool = False  # t, h, w columns interleaved (Qwen3-VL's layout), not in three runs

    def __post_init__(self) -> None:
        assert "rope_type" in self.params and "rope_theta" in self.params, dict(self.params)
        assert "full_attention" not in self.params, "per-layer-type RoPE parameters are not supported"
        assert self.mrope_section is None or len(self.mrope_section) == 3, self.mrope_section

    @property
    def rope_type(self) -> str:
        return self.params["rope_type"]

    @property
    def theta(self) -> float:
        return float(self.params["rope_theta"])

    @property
    def partial_rotary_factor(self) -> float:
        """The share of each head's dims that is rotated (Qwen3-Next, Qwen3.5: 0.25)."""
        return float(self.params.get("partial_rotary_factor", 1.0))


@dataclass(frozen=True)
class TextConfig:
    """The text model: what every decoder layer, the embedding and the LM head are built from."""

    hidden_size: int
    num_layers: int
    vocab_size: int
    intermediate_size: int  # the dense MLP's width; 0 where every MLP is sparse (Qwen3.5-MoE)
    hidden_act: str
    rms_norm_eps: float
    context_length: int  # max_position_embeddings
    rope: RopeConfig
    tie_word_embeddings: bool  # the LM head is the embedding
    attention_bias: bool  # on q/k/v and o
    mlp_bias: bool
    dtype: Optional[torch.dtype]  # the checkpoint's; None when its config names none
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class LinearAttentionHeads:
    """A hybrid's Gated DeltaNet layers (layers/gated_delta_net.py), all TP ranks together."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int  # the short causal conv1d's width

    def __post_init__(self) -> None:
        assert self.num_value_heads % self.num_key_heads == 0, (self.num_key_heads, self.num_value_heads)

    def as_tuple(self) -> tuple[int, int, int, int]:
        """(key heads, value heads, key head dim, value head dim): what PD's handshake compares."""
        return self.num_key_heads, self.num_value_heads, self.key_head_dim, self.value_head_dim


@dataclass(frozen=True)
class HeadGeometry:
    num_heads: int  # query heads, all TP ranks together
    num_kv_heads: int
    head_dim: int
    linear: Optional[LinearAttentionHeads] = None  # hybrids only

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, (self.num_heads, self.num_kv_heads)


@dataclass(frozen=True)
class MoeGeometry:
    """Sparse MLPs (Qwen3-MoE's rule, which Qwen3-Next and Qwen3.5-MoE follow with their defaults):
    layer i is sparse unless i is in mlp_only_layers or (i + 1) % decoder_sparse_step != 0."""

    num_experts: int
    top_k: int  # num_experts_per_tok
    intermediate_size: int  # each expert's
    shared_expert_intermediate_size: int  # 0: no shared expert
    norm_topk_prob: bool  # renormalise the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        assert 0 < self.top_k <= self.num_experts, (self.top_k, self.num_experts)

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_expert_intermediate_size > 0

    def is_sparse(self, layer_id: int) -> bool:
        """Whether layer `layer_id` (an MTP head's layer too: one past the last) has a sparse MLP."""
        return layer_id not in self.mlp_only_layers and (layer_id + 1) % self.decoder_sparse_step == 0


@dataclass(frozen=True)
class VisionConfig:
    """A vision-language checkpoint's vision tower (its `vision_config`) and the token ids that place
    images and videos in the text (from the outer config)."""

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int  # each block's MLP
    hidden_act: str  # each block's MLP (the mergers use exact GELU, as HF does)
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    num_position_embeddings: int  # the learned position grid, side * side, resampled to each image's grid
    rope_theta: float  # the blocks' 2-D (axial) rotary
    out_hidden_size: int  # the merged patch embeddings' width: the text model's hidden size
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    layer_norm_eps: float = 1e-6  # every LayerNorm of the tower (HF fixes it at 1e-6)
    # Qwen3-VL: blocks whose outputs, each through its own merger, are added to early text layers
    deepstack_visual_indexes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        assert self.hidden_size % self.num_heads == 0, (self.hidden_size, self.num_heads)
        assert self.head_dim % 4 == 0, f"2-D rotary splits each head in quarters: head_dim {self.head_dim}"
        side = int(self.num_position_embeddings ** 0.5)
        assert side * side == self.num_position_embeddings, f"{self.num_position_embeddings} is not a square grid"
        assert all(0 <= i < self.depth for i in self.deepstack_visual_indexes), self.deepstack_visual_indexes

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """One patch's pixel values as the image processor flattens them: channels * frames * rows * cols."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def tokens_merged(self) -> int:
        """Patches merged into one text token."""
        return self.spatial_merge_size ** 2

    def tokens_per_image(self, grid_thw: tuple[int, int, int]) -> int:
        """Text tokens an image (or video) of `grid_thw` patches becomes."""
        t, h, w = grid_thw
        assert h % self.spatial_merge_size == 0 and w % self.spatial_merge_size == 0, \
            f"grid {tuple(grid_thw)} is not a multiple of the merge size {self.spatial_merge_size}"
        return t * h * w // self.tokens_merged


@dataclass(frozen=True)
class QuantizationConfig:
    method: str  # quant_method: "fp8", ...
    params: Mapping[str, Any]  # the rest of the checkpoint's quantization_config, read-only


@dataclass(frozen=True)
class EagleDraftConfig:
    """The fields only an EAGLE draft checkpoint's config has (models/eagle.py)."""

    aux_layer_ids: tuple[int, ...]  # EAGLE-3: eagle_config.eagle_aux_hidden_state_layer_ids; (): the default
    draft_vocab_size: int  # EAGLE-3's reduced LM head
    fc_bias: bool  # EAGLE-3's fc (its config's `bias`)


@dataclass(frozen=True)
class ModelConfig:
    """One model's configuration (module docstring); build it with from_pretrained or from_hf."""

    architecture: str  # "" when the config names none (model_loader refuses it)
    text: TextConfig
    heads: HeadGeometry
    layer_types: tuple[str, ...]
    moe: Optional[MoeGeometry] = None
    num_mtp_layers: int = 0  # multi-token-prediction layers (`mtp.*`: Qwen3-Next, Qwen3.5)
    quantization: Optional[QuantizationConfig] = None
    vision: Optional[VisionConfig] = None
    eagle: Optional[EagleDraftConfig] = None
    num_labels: int = 0  # a sequence classifier's score-head rows (*ForSequenceClassification); 0 otherwise

    def __post_init__(self) -> None:
        assert len(self.layer_types) == self.text.num_layers, (len(self.layer_types), self.text.num_layers)
        assert set(self.layer_types) <= _LAYER_TYPES, set(self.layer_types)
        assert (self.heads.linear is not None) == (LINEAR_ATTENTION in self.layer_types), \
            "linear-attention layers and their heads go together"

    # ---- derived ----

    @property
    def is_hybrid(self) -> bool:
        """Linear-attention layers beside full-attention ones (Qwen3-Next, Qwen3.5)."""
        return self.heads.linear is not None

    @property
    def num_full_attention_layers(self) -> int:
        """Layers with a KV cache (a hybrid's full-attention ones; every layer otherwise)."""
        return self.text.num_layers - self.num_linear_attention_layers

    @property
    def num_linear_attention_layers(self) -> int:
        return self.layer_types.count(LINEAR_ATTENTION)

    @property
    def layer_layout(self) -> str:
        """One letter per layer: L linear attention, F full attention."""
        return "".join("L" if t == LINEAR_ATTENTION else "F" for t in self.layer_types)

    @property
    def kind_index(self) -> tuple[int, ...]:
        """Per layer, its index among the layers of its type (its KV-pool layer, or its state layer)."""
        return tuple(self.layer_types[:i].count(t) for i, t in enumerate(self.layer_types))

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """The layers whose MLP is a sparse MoE block (none in a dense model)."""
        return tuple(i for i in range(self.text.num_layers) if self.moe is not None and self.moe.is_sparse(i))

    # ---- building ----

    @classmethod
    def from_pretrained(cls, model_path: str) -> "ModelConfig":
        """The config.json of a local HF checkpoint directory."""
        from transformers import AutoConfig

        return cls.from_hf(AutoConfig.from_pretrained(model_path))

    @classmethod
    def from_hf(cls, hf: Any) -> "ModelConfig":
        """From an HF config (a `transformers.PretrainedConfig`, or any object with its attributes)."""
        text = _text_part(hf)
        # either model family's key: Qwen3-Next's num_nextn_predict_layers, Qwen3.5's mtp_num_hidden_layers
        mtp = _opt(text, "num_nextn_predict_layers") or _opt(text, "mtp_num_hidden_layers") or 0
        return cls(architecture=(_opt(hf, "architectures") or [""])[0], text=_text_config(hf, text),
                   heads=_head_geometry(text), layer_types=_layer_types(text), moe=_moe_geometry(text),
                   num_mtp_layers=int(mtp), quantization=_quantization(hf), vision=_vision_config(hf),
                   eagle=_eagle_config(hf), num_labels=_num_labels(hf))


# ---- the HF reads: this module's alone ----

def _opt(config: Any, name: str, default: Any = None) -> Any:
    """An attribute a config may lack (older versions, other families), else `default`."""
    return getattr(config, name, default)


def _text_part(hf: Any) -> Any:
    """The text model's config: a vision-language checkpoint's `text_config`, else the config itself."""
    return _opt(hf, "text_config") or hf


def _text_config(hf: Any, text: Any) -> TextConfig:
    eos = _opt(text, "eos_token_id")
    return TextConfig(
        hidden_size=text.hidden_size, num_layers=text.num_hidden_layers, vocab_size=text.vocab_size,
        intermediate_size=int(_opt(text, "intermediate_size") or 0), hidden_act=text.hidden_act,
        rms_norm_eps=float(text.rms_norm_eps),
        context_length=int(_opt(text, "max_position_embeddings") or _DEFAULT_CONTEXT_LENGTH),
        rope=_rope_config(text),
        # HF ties a wrapped text model's LM head by the outer config
        tie_word_embeddings=bool(_opt(hf, "tie_word_embeddings", False)),
        attention_bias=bool(_opt(text, "attention_bias", False)), mlp_bias=bool(_opt(text, "mlp_bias", False)),
        dtype=_checkpoint_dtype(hf) or (_checkpoint_dtype(text) if text is not hf else None),
        eos_token_ids=tuple(eos) if isinstance(eos, (list, tuple)) else (eos,) if eos is not None else ())


def _checkpoint_dtype(config: Any) -> Optional[torch.dtype]:
    # `torch_dtype` is the name older configs use (read from __dict__: the attribute warns as deprecated)
    value = _opt(config, "dtype") or vars(config).get("torch_dtype")
    if isinstance(value, str):
        return _CHECKPOINT_DTYPES.get(value)
    return value if isinstance(value, torch.dtype) else None


def _rope_config(text: Any) -> RopeConfig:
    params = _rope_parameters(text)
    default_section = _DEFAULT_MROPE_SECTIONS.get(_opt(text, "model_type"))
    section = params.get("mrope_section", default_section)
    interleaved = params.get("mrope_interleaved", default_section is not None)
    return RopeConfig(params, text, tuple(int(x) for x in section) if section is not None else None,
                      bool(interleaved))


def _rope_parameters(text: Any) -> Mapping[str, Any]:
    params = _opt(text, "rope_parameters")
    if params and "rope_theta" in params:
        params = dict(params)
    else:
        params = dict(_opt(text, "rope_scaling") or {})
        params.setdefault("rope_theta", _opt(text, "rope_theta", _DEFAULT_ROPE_THETA))
    params.setdefault("rope_type", params.pop("type", "default"))
    return MappingProxyType(params)


def _head_geometry(text: Any) -> HeadGeometry:
    heads = text.num_attention_heads
    linear = None
    if _opt(text, "linear_num_key_heads"):
        linear = LinearAttentionHeads(text.linear_num_key_heads, text.linear_num_value_heads,
                                      text.linear_key_head_dim, text.linear_value_head_dim,
                                      text.linear_conv_kernel_dim)
    return HeadGeometry(heads, _opt(text, "num_key_value_heads") or heads,
                        _opt(text, "head_dim") or text.hidden_size // heads, linear)


def _layer_types(text: Any) -> tuple[str, ...]:
    return tuple(_opt(text, "layer_types") or [FULL_ATTENTION] * text.num_hidden_layers)


def _moe_geometry(text: Any) -> Optional[MoeGeometry]:
    if not _opt(text, "num_experts"):
        return None
    return MoeGeometry(num_experts=text.num_experts, top_k=text.num_experts_per_tok,
                       intermediate_size=text.moe_intermediate_size,
                       shared_expert_intermediate_size=int(_opt(text, "shared_expert_intermediate_size") or 0),
                       norm_topk_prob=bool(_opt(text, "norm_topk_prob", True)),
                       decoder_sparse_step=int(_opt(text, "decoder_sparse_step") or 1),
                       mlp_only_layers=tuple(_opt(text, "mlp_only_layers") or ()))


def _quantization(hf: Any) -> Optional[QuantizationConfig]:
    config = _opt(hf, "quantization_config")
    if not config:
        return None
    config = dict(config if isinstance(config, Mapping) else config.to_dict())
    return QuantizationConfig(str(config.pop("quant_method", "")), MappingProxyType(config))


def _vision_config(hf: Any) -> Optional[VisionConfig]:
    vision = _opt(hf, "vision_config")
    if vision is None:
        return None
    # transformers 5.x: rope_parameters {"rope_type": "axial", "rope_theta": ...}; older configs: rope_theta
    rope = _opt(vision, "rope_parameters") or {}
    theta = rope.get("rope_theta", _opt(vision, "rope_theta", _DEFAULT_ROPE_THETA))
    return VisionConfig(depth=vision.depth, hidden_size=vision.hidden_size, num_heads=vision.num_heads,
                        intermediate_size=vision.intermediate_size, hidden_act=vision.hidden_act,
                        in_channels=int(_opt(vision, "in_channels", 3)), patch_size=vision.patch_size,
                        temporal_patch_size=vision.temporal_patch_size,
                        spatial_merge_size=vision.spatial_merge_size,
                        num_position_embeddings=vision.num_position_embeddings, rope_theta=float(theta),
                        out_hidden_size=vision.out_hidden_size,
                        image_token_id=hf.image_token_id, video_token_id=hf.video_token_id,
                        vision_start_token_id=hf.vision_start_token_id, vision_end_token_id=hf.vision_end_token_id,
                        layer_norm_eps=float(_opt(vision, "layer_norm_eps", 1e-6)),
                        deepstack_visual_indexes=tuple(_opt(vision, "deepstack_visual_indexes") or ()))


def _num_labels(hf: Any) -> int:
    """A sequence classifier's labels (every HF config has num_labels, 2 by default: read for classifiers only)."""
    if not ((_opt(hf, "architectures") or [""])[0]).endswith("ForSequenceClassification"):
        return 0
    return int(_opt(hf, "num_labels") or 0)


def _eagle_config(hf: Any) -> Optional[EagleDraftConfig]:
    if "Eagle" not in ((_opt(hf, "architectures") or [""])[0]):
        return None
    ids = (_opt(hf, "eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return EagleDraftConfig(aux_layer_ids=tuple(ids or ()),
                            draft_vocab_size=int(_opt(hf, "draft_vocab_size") or hf.vocab_size),
                            fc_bias=bool(_opt(hf, "bias", False)))
