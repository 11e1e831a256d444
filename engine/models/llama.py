"""Llama, and the shared decoder skeleton the Qwen models subclass.

Subclasses change one piece each by overriding a builder on LlamaForCausalLM:
`build_attention` (bias, per-head q/k norm) and `build_mlp` (dense or sparse MoE), plus
`load_special_weight` for checkpoint names the generic loader does not know (MoE experts), and
`describe_mlp` for the MLPs they build in `decoder_structure()`, the model as plain data
(model_structure.py) for the native CPU forward.

q/k/v and gate/up are fused into one linear each; the loader copies every HF checkpoint shard
(`q_proj`, `k_proj`, `v_proj`, `gate_proj`, `up_proj`) into its slice of the fused weight.

Tensor parallelism (`tp`, a TpGroup; one rank by default) is Megatron's split: q/k/v and gate/up
are column-parallel (this rank's heads, its slice of the intermediate size), o_proj and down_proj
row-parallel (one all-reduce each per layer); the embedding and the LM head are split by vocabulary
rows (layers/vocab_parallel.py: an all-reduce after the lookup, an all-gather of the logits). Norms
are replicated. Each rank builds only its shard and the loader narrows the full checkpoint tensors
into it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Optional

import torch
from torch import nn

from baton.engine.distributed.parallel_state import TpGroup
from baton.engine.layers.layernorm import RMSNorm
from baton.engine.layers.linear import MergedColumnLinear, RowParallelLinear, load_param, qkv_parts
from baton.engine.layers.mlp import GatedMLP
from baton.engine.layers.norm_linear import norm_linear
from baton.engine.layers.qkv_rope import QKVRope
from baton.engine.layers.radix_attention import RadixAttention
from baton.engine.layers.rotary_embedding import RotaryEmbedding, get_rope
from baton.engine.layers.vocab_parallel import VocabParallelEmbedding
from baton.engine.model_config import SLIDING_ATTENTION, ModelConfig
from baton.engine.model_structure import Attention, DecoderLayer, DecoderStructure, Linear, Mlp, Norm, Rope

if TYPE_CHECKING:
    from baton.engine.core.forward_batch import ForwardBatch
    from baton.engine.mem_cache.state_pool import LinearStateShapes

# HF checkpoint module name -> (our fused module name, shard index)
STACKED_SHARDS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool = False, tp: TpGroup = TpGroup()) -> None:
        super().__init__()
        text, heads = config.text, config.heads
        self.head_dim = heads.head_dim
        if SLIDING_ATTENTION in config.layer_types:
            raise NotImplementedError("sliding-window attention layers are not supported")
        parts = qkv_parts(heads.num_heads, heads.num_kv_heads, self.head_dim, tp)
        # this rank's heads
        self.num_heads, self.num_kv_heads = parts[0].size // self.head_dim, parts[1].size // self.head_dim
        self.q_size, self.kv_size = parts[0].size, parts[1].size
        self.qkv_proj = MergedColumnLinear(text.hidden_size, parts, bias=qkv_bias)
        self.o_proj = RowParallelLinear(heads.num_heads * self.head_dim, text.hidden_size, bias=o_bias, tp=tp)
        # Qwen3: RMSNorm over each head's q and k, before RoPE
        self.q_norm = RMSNorm(self.head_dim, text.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, text.rms_norm_eps) if qk_norm else None
        self.rotary_emb = get_rope(text, self.head_dim)
        # split, q/k norms, RoPE (and on CUDA the KV store): one op
        self.qkv_rope = QKVRope(self.num_heads, self.num_kv_heads, self.head_dim, layer_id, self.rotary_emb,
                                self.q_norm, self.k_norm)
        self.attn = RadixAttention(self.num_heads, self.head_dim, self.head_dim ** -0.5, self.num_kv_heads, layer_id)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, forward_batch: "ForwardBatch") -> torch.Tensor:
        return self._attend(positions, self.qkv_proj(hidden), forward_batch)

    def forward_prenormed(self, positions: torch.Tensor, norm: nn.Module, hidden: torch.Tensor,
                          residual: Optional[torch.Tensor],
                          forward_batch: "ForwardBatch") -> tuple[torch.Tensor, torch.Tensor]:
        """forward(norm(hidden + residual)) and the new residual, the norm and qkv_proj as one op
        (layers/norm_linear.py)."""
        qkv, residual = norm_linear(norm, self.qkv_proj, hidden, residual)
        return self._attend(positions, qkv, forward_batch), residual

    def _attend(self, positions: torch.Tensor, qkv: torch.Tensor, forward_batch: "ForwardBatch") -> torch.Tensor:
        q, k, v = self.qkv_rope(positions, qkv, forward_batch)
        return self.o_proj(self.attn(q, k, v, forward_batch, save_kv_cache=k is not None))


LlamaMLP = GatedMLP  # the name the Llama-family models and their tests use


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        text = config.text
        self.input_layernorm = RMSNorm(text.hidden_size, text.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(text.hidden_size, text.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: Optional[torch.Tensor],
                forward_batch: "ForwardBatch") -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm with the residual add deferred into the next norm (HF's sums, in its order):
        the layer returns (its output, the residual stream before that output is added). Each norm
        runs with the linear that reads it (layers/norm_linear.py: one kernel for a few rows on CUDA);
        an MLP without forward_prenormed (MoE) takes the norm's output."""
        hidden, residual = self.self_attn.forward_prenormed(positions, self.input_layernorm, hidden, residual,
                                                            forward_batch)
        prenormed = getattr(self.mlp, "forward_prenormed", None)
        if prenormed is not None:
            return prenormed(self.post_attention_layernorm, hidden, residual)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, make_layer: Callable[[int], LlamaDecoderLayer],
                 tp: TpGroup = TpGroup()) -> None:
        super().__init__()
        text = config.text
        self.embed_tokens = VocabParallelEmbedding(text.vocab_size, text.hidden_size, tp)
        self.layers = nn.ModuleList(make_layer(i) for i in range(text.num_layers))
        self.norm = RMSNorm(text.hidden_size, text.rms_norm_eps)
        # EAGLE-3's draft reads the residual stream entering these layers (models/eagle.py): the forward
        # leaves them, concatenated, in forward_batch.aux_hidden
        self.aux_layers: tuple[int, ...] = ()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: "ForwardBatch") -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None  # [num_tokens, hidden]
        if forward_batch.mm_embeds is not None:  # images: the vision tower's rows over their tokens'
            hidden, deepstack = _splice_images(hidden, *forward_batch.mm_embeds)
            if deepstack:
                return self._forward_deepstack(hidden, positions, forward_batch, deepstack)
        if self.aux_layers:
            return self._forward_capturing(hidden, positions, forward_batch)
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, forward_batch)
        return self.norm(hidden, residual)[0]

    def _forward_deepstack(self, hidden: torch.Tensor, positions: torch.Tensor, forward_batch: "ForwardBatch",
                           deepstack: list[torch.Tensor]) -> torch.Tensor:
        """Qwen3-VL: the tower's deepstack features are added at the image tokens' rows to the output of
        the first len(deepstack) layers (HF adds them to the residual stream there: the same sum, as the
        layers defer the residual add)."""
        rows, residual = forward_batch.mm_embeds[0], None
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual, forward_batch)
            if i < len(deepstack):
                hidden = hidden.index_add(0, rows, deepstack[i])
        return self.norm(hidden, residual)[0]

    def _forward_capturing(self, hidden: torch.Tensor, positions: torch.Tensor,
                           forward_batch: "ForwardBatch") -> torch.Tensor:
        residual, aux = None, []
        for i, layer in enumerate(self.layers):
            if i in self.aux_layers:
                aux.append(hidden if residual is None else hidden + residual)
            hidden, residual = layer(positions, hidden, residual, forward_batch)
        forward_batch.aux_hidden = torch.cat(aux, dim=-1)
        return self.norm(hidden, residual)[0]


def _splice_images(hidden: torch.Tensor, rows: torch.Tensor, embeds: torch.Tensor
                   ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The token embeddings with the image tokens' rows replaced by the vision tower's, and the
    tower's deepstack features (Qwen3-VL), which come as further columns of `embeds`."""
    width = hidden.shape[-1]
    embeds = embeds.to(hidden.dtype)
    deepstack = list(embeds[:, width:].split(width, dim=-1)) if embeds.shape[-1] > width else []
    return hidden.index_copy(0, rows, embeds[:, :width]), deepstack


class LlamaForCausalLM(nn.Module):
    separately_loaded: tuple[str, ...] = ()  # parameter prefixes load_weights leaves to a subclass
    def __init__(self, config: ModelConfig, tp: TpGroup = TpGroup()) -> None:
        super().__init__()
        self.config, self.tp = config, tp
        self.model = LlamaModel(config, self._make_layer, tp)
        self.tie_word_embeddings = config.text.tie_word_embeddings
        self.lm_head = (None if self.tie_word_embeddings
                        else VocabParallelEmbedding(config.text.vocab_size, config.text.hidden_size, tp))

    # ---- what the model runner asks (hybrid models answer otherwise) ----

    @property
    def num_kv_layers(self) -> int:
        """Layers that keep a KV cache; their RadixAttention layer_ids are 0 .. num_kv_layers - 1."""
        return self.config.text.num_layers

    def linear_state_shapes(self) -> Optional["LinearStateShapes"]:
        """The recurrent state of linear-attention layers per request row; None: no such layers."""
        return None

    # ---- pieces subclasses override ----

    def build_attention(self, config: ModelConfig, layer_id: int) -> nn.Module:
        bias = config.text.attention_bias
        return LlamaAttention(config, layer_id, qkv_bias=bias, o_bias=bias, tp=self.tp)

    def build_mlp(self, config: ModelConfig, layer_id: int) -> nn.Module:
        text = config.text
        return LlamaMLP(text.hidden_size, text.intermediate_size, text.hidden_act, bias=text.mlp_bias, tp=self.tp)

    def load_special_weight(self, name: str, tensor: torch.Tensor) -> str | None:
        """Hook for checkpoint names the generic loader does not handle; returns the name of the
        parameter it filled, or None when the name is not special."""
        return None

    def describe_mlp(self, mlp: nn.Module) -> Mlp:
        """A layer's MLP in decoder_structure(); a subclass that builds other MLPs describes them."""
        return Mlp("gated", act="silu" if mlp.act.is_silu else mlp.hidden_act, intermediate=mlp.down_proj.in_local,
                   gate_up=_linear(mlp.gate_up_proj), down=_linear(mlp.down_proj))

    def _make_layer(self, layer_id: int) -> LlamaDecoderLayer:
        return LlamaDecoderLayer(self.config, self.build_attention(self.config, layer_id),
                                 self.build_mlp(self.config, layer_id))

    # ---- forward ----

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: "ForwardBatch") -> torch.Tensor:
        """input_ids, positions [num_tokens] -> final-normed hidden states [num_tokens, hidden]."""
        return self.model(input_ids, positions, forward_batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [m, hidden] -> logits [m, vocab] float32. With TP a collective: every rank calls
        it on the same rows."""
        return (self.model.embed_tokens if self.lm_head is None else self.lm_head).logits(hidden)

    # ---- structure ----

    def decoder_structure(self) -> DecoderStructure:
        """This model as plain data (model_structure.py), for a forward other than its own (the
        native CPU forward); taken once the weights are loaded (and packed)."""
        ropes: dict[int, Rope] = {}  # one per RoPE module, as the layers share them
        layers = tuple(DecoderLayer(_norm(layer.input_layernorm), _attention(layer.self_attn, ropes),
                                    _norm(layer.post_attention_layernorm), self.describe_mlp(layer.mlp))
                       for layer in self.model.layers)
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return DecoderStructure(embed=self.model.embed_tokens.weight, layers=layers, final_norm=_norm(self.model.norm),
                                lm_head=_linear(head))

    # ---- weights ----

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> None:
        """HF checkpoint (name, tensor) pairs; raises if any parameter of the model was not loaded
        (but those of the submodules a subclass loads itself: `separately_loaded`), unless not
        `strict` (a weight update of some parameters)."""
        params = {n: p for n, p in self.named_parameters() if not n.startswith(self.separately_loaded)}
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (self.lm_head is None and name.startswith("lm_head.")):
                continue
            if (target := self.load_special_weight(name, tensor)) is not None:
                loaded.add(target)
            elif (target := self._load_stacked(name, tensor)) is not None:
                loaded.add(target)
            elif name in params:
                load_param(params[name], tensor, name)
                loaded.add(name)
            else:
                raise KeyError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")
        if strict:
            self._check_all_loaded(params, loaded)

    def _load_stacked(self, name: str, tensor: torch.Tensor) -> str | None:
        parts = name.split(".")
        if len(parts) < 3 or parts[-2] not in STACKED_SHARDS:
            return None
        fused, shard = STACKED_SHARDS[parts[-2]]
        module_path = ".".join(parts[:-2] + [fused])
        try:
            module = self.get_submodule(module_path)
        except AttributeError:
            return None
        if not isinstance(module, MergedColumnLinear):
            return None
        module.load_shard(parts[-1], shard, tensor)
        return f"{module_path}.{parts[-1]}"

    @staticmethod
    def _check_all_loaded(params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        missing = [n for n in params if n not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} parameters, e.g. {missing[:5]}")


def _norm(norm: nn.Module) -> Norm:
    return Norm("rms" if type(norm) is RMSNorm else type(norm).__name__, norm.weight,
                getattr(norm, "variance_epsilon", 0.0))


def _linear(layer: nn.Module) -> Linear:
    return Linear(layer.weight, getattr(layer, "packed_weight", None), getattr(layer, "bias", None))


def _rope(rotary: nn.Module) -> Rope:
    def tables(device: str) -> tuple[torch.Tensor, torch.Tensor]:
        if rotary.cos_table is None or rotary.cos_table.device.type != torch.device(device).type:
            rotary.reserve(rotary.max_positions, device)
        return rotary.cos_table, rotary.sin_table

    if type(rotary) is not RotaryEmbedding:
        kind = type(rotary).__name__
    else:  # the native CPU forward reads the tables by 1-D positions: it declines M-RoPE
        kind = "neox" if rotary.mrope_rows is None else "mrope"
    return Rope(kind, rotary.rotary_dim, tables)


def _attention(attn: LlamaAttention, ropes: dict[int, Rope]) -> Attention:
    key = id(attn.rotary_emb)
    if key not in ropes:
        ropes[key] = _rope(attn.rotary_emb)
    return Attention(attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.attn.scaling, _linear(attn.qkv_proj),
                     _linear(attn.o_proj), ropes[key], None if attn.q_norm is None else _norm(attn.q_norm),
                     None if attn.k_norm is None else _norm(attn.k_norm))
