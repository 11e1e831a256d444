"""Qwen3-Next and Qwen3.5 (dense and MoE): hybrids of Gated DeltaNet and gated full attention.

`config.layer_types` says which layer is which (three linear, then one full, in the published models):

    linear_attention  layers/gated_delta_net.py; no KV, a recurrent state per request row
                      (mem_cache/state_pool.py): its index among the linear layers is its state slot
    full_attention    q_proj gives [q | gate] per head; (1 + w) RMSNorm on q and k; RoPE over the
                      first partial_rotary_factor of each head; attention; times sigmoid(gate);
                      o_proj. Its index among the full layers is its KV-pool layer.
    MLP               Qwen3-Next: Qwen3-MoE's sparse/dense rule, sparse blocks with a shared expert;
                      Qwen3.5: dense; Qwen3.5-MoE: every layer sparse with a shared expert
    norms             the zero-centred (1 + w) RMSNorm, decoder and final

Qwen3-Next fuses the linear layers' input projections per key-head group, Qwen3.5 keeps them apart;
otherwise the architectures are one.

Multi-token prediction (`mtp.*`, one layer in the published checkpoints: `num_nextn_predict_layers` in
Qwen3-Next's config, `mtp_num_hidden_layers` in Qwen3.5's): loaded only for --speculative-algorithm
NEXTN (add_mtp_head), as the draft of speculative decoding (speculative/head_worker.py); skipped
otherwise. MtpHead predicts the token after next from the target's final hidden state at a position
and the embedding of the token that follows it:

    x = fc([pre_fc_norm_embedding(embed(t[p+1])) ; pre_fc_norm_hidden(h[p])])
    g = norm(full-attention decoder layer(x))        its attention: a KV-pool layer of its own
    logits = the target's LM head (g)                the embedding and LM head are the target's

The published Qwen3.5 checkpoints are vision-language models (`Qwen3_5ForConditionalGeneration`,
`Qwen3_5MoeForConditionalGeneration`): a `text_config` and a `vision_config`, the text model's weights
under `model.language_model.*` beside `lm_head.*`, the vision tower's under `model.visual.*`. The text
model is this file's; the tower is models/qwen_vision.py, its embeddings spliced over the image tokens
(ForwardBatch.mm_embeds), and the full-attention layers' RoPE takes the M-RoPE positions of a batch with
images (multimodal/mrope.py; the linear-attention layers read no positions).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Iterable, Optional

import torch
from torch import nn

from baton.engine.distributed.parallel_state import TpGroup
from baton.engine.layers.gated_delta_net import GatedDeltaNet
from baton.engine.layers.layernorm import ZeroCenteredRMSNorm
from baton.engine.layers.linear import MergedColumnLinear, OutputPart, RowParallelLinear
from baton.engine.layers.moe import SharedExpertMoeBlock
from baton.engine.layers.radix_attention import RadixAttention
from baton.engine.layers.rotary_embedding import get_rope
from baton.engine.mem_cache.state_pool import LinearStateShapes
from baton.engine.model_config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig
from baton.engine.model_structure import DecoderStructure
from baton.engine.models.llama import LlamaMLP
from baton.engine.models.qwen3_moe import Qwen3MoeForCausalLM, is_sparse_layer
from baton.engine.models.vision_language import VisionLanguageMixin

if TYPE_CHECKING:
    from baton.engine.core.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)


class GatedAttention(nn.Module):
    """With tensor parallelism: whole heads per rank (q_proj's rows are [q | gate] per head, so a
    head's pair moves together), KV heads as Llama's (replicated when fewer than ranks)."""

    def __init__(self, config: ModelConfig, kv_layer_id: int, tp: TpGroup = TpGroup()) -> None:
        super().__init__()
        text, heads = config.text, config.heads
        self.head_dim = hd = heads.head_dim
        self.num_heads = tp.shard(heads.num_heads, "num_attention_heads")  # on this rank
        kv_start, self.num_kv_heads = tp.kv_head_range(heads.num_kv_heads)
        self.q_size, self.kv_size = self.num_heads * hd, self.num_kv_heads * hd
        bias = text.attention_bias
        q = OutputPart(2 * heads.num_heads * hd, tp.rank * 2 * self.q_size, 2 * self.q_size)
        kv = OutputPart(heads.num_kv_heads * hd, kv_start * hd, self.kv_size)
        self.qkv_proj = MergedColumnLinear(text.hidden_size, [q, kv, kv], bias=bias)  # q_proj is [q | gate]
        self.o_proj = RowParallelLinear(heads.num_heads * hd, text.hidden_size, bias=bias, tp=tp)
        self.q_norm = ZeroCenteredRMSNorm(hd, text.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(hd, text.rms_norm_eps)
        self.rotary_emb = get_rope(text, hd)
        self.attn = RadixAttention(self.num_heads, hd, hd ** -0.5, self.num_kv_heads, kv_layer_id)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, forward_batch: "ForwardBatch") -> torch.Tensor:
        n, hd = hidden.shape[0], self.head_dim
        q_gate, k, v = self.qkv_proj(hidden).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = q_gate.view(n, self.num_heads, 2 * hd).chunk(2, dim=-1)  # per head: [q | gate]
        q = self.q_norm(q).reshape(n, self.q_size)
        k = self.k_norm(k.reshape(n, self.num_kv_heads, hd)).reshape(n, self.kv_size)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v.contiguous(), forward_batch)
        return self.o_proj(out * torch.sigmoid(gate.reshape(n, self.q_size)))


class HybridDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, mixer: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.is_linear = isinstance(mixer, GatedDeltaNet)
        if self.is_linear:  # the checkpoint's names
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.mlp = mlp
        text = config.text
        self.input_layernorm = ZeroCenteredRMSNorm(text.hidden_size, text.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(text.hidden_size, text.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: Optional[torch.Tensor],
                forward_batch: "ForwardBatch") -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer: returns (output, residual stream before it)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if self.is_linear:
            hidden = self.linear_attn(hidden, forward_batch)
        else:
            hidden = self.self_attn(positions, hidden, forward_batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class MtpHead(nn.Module):
    """The checkpoint's `mtp.*` (module docstring): fc, its two pre-norms, one gated-attention decoder
    layer over KV-pool layer `kv_layer_id`, the final norm. Its MLP is the model's kind for a layer
    after the last one (sparse in the MoE models)."""

    algorithm = "NEXTN"
    own_lm_head = False  # the model's LM head reads its outputs
    aux_layers: tuple[int, ...] = ()  # it reads the model's final hidden states

    def __init__(self, config: ModelConfig, layer: HybridDecoderLayer) -> None:
        super().__init__()
        hidden, eps = config.text.hidden_size, config.text.rms_norm_eps
        self.fc = MergedColumnLinear(2 * hidden, [OutputPart(hidden, 0, hidden)], bias=False)
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(hidden, eps)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(hidden, eps)
        self.layers = nn.ModuleList([layer])
        self.norm = ZeroCenteredRMSNorm(hidden, eps)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                forward_batch: "ForwardBatch") -> torch.Tensor:
        """embeds: the next tokens' embeddings, hidden: the target's final hidden states, both
        [num_tokens, hidden] -> the head's own final hidden states (the next draft step's `hidden`)."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        x, residual = self.layers[0](positions, x, None, forward_batch)
        return self.norm(x, residual)[0]


class Qwen3NextForCausalLM(Qwen3MoeForCausalLM):
    split_linear_projections = False  # Qwen3.5: True
    all_layers_sparse = False  # Qwen3.5-MoE: True

    def __init__(self, config: ModelConfig, tp: TpGroup = TpGroup()) -> None:
        assert set(config.layer_types) <= {LINEAR_ATTENTION, FULL_ATTENTION}, set(config.layer_types)
        # layer index -> its index among the layers of its kind (KV-pool layer, or state slot layer)
        self.kind_index = config.kind_index
        super().__init__(config, tp)
        self.model.norm = ZeroCenteredRMSNorm(config.text.hidden_size, config.text.rms_norm_eps)
        self.mtp: Optional[MtpHead] = None

    def add_mtp_head(self) -> MtpHead:
        """Build the `mtp.*` head (before load_weights, which then fills it instead of skipping it).
        Its attention takes the KV-pool layer after the model's own."""
        n = self.config.num_mtp_layers
        if n != 1:
            raise ValueError(f"NEXTN needs a checkpoint with one multi-token-prediction layer; this config has {n} "
                             "(num_nextn_predict_layers / mtp_num_hidden_layers)")
        config = self.config
        layer = HybridDecoderLayer(config, GatedAttention(config, self.num_kv_layers, self.tp),
                                   self.build_mlp(config, config.text.num_layers))
        self.mtp = MtpHead(config, layer)
        return self.mtp

    # ---- what the model runner asks ----

    @property
    def num_kv_layers(self) -> int:
        """Layers with a KV cache: the full-attention ones, and the MTP head's when it is loaded."""
        return self.config.num_full_attention_layers + (self.mtp is not None)

    def linear_state_shapes(self) -> Optional[LinearStateShapes]:
        """The recurrent state per request row (None for a model without linear attention)."""
        linear = [layer.linear_attn for layer in self.model.layers if layer.is_linear]
        if not linear:
            return None
        conv, ssm = linear[0].state_shapes()
        return LinearStateShapes(len(linear), conv, ssm)

    # ---- builders ----

    def _make_layer(self, layer_id: int) -> HybridDecoderLayer:
        config, index = self.config, self.kind_index[layer_id]
        if config.layer_types[layer_id] == LINEAR_ATTENTION:
            mixer: nn.Module = GatedDeltaNet(config.text.hidden_size, config.heads.linear, config.text.rms_norm_eps,
                                             index, self.split_linear_projections, self.tp)
        else:
            mixer = GatedAttention(config, index, self.tp)
        return HybridDecoderLayer(config, mixer, self.build_mlp(config, layer_id))

    def build_mlp(self, config: ModelConfig, layer_id: int) -> nn.Module:
        text, moe = config.text, config.moe
        if not (self.all_layers_sparse or is_sparse_layer(config, layer_id)):
            return LlamaMLP(text.hidden_size, text.intermediate_size, text.hidden_act, tp=self.tp)
        return SharedExpertMoeBlock(text.hidden_size, moe.intermediate_size, moe.num_experts, moe.top_k,
                                    moe.norm_topk_prob, moe.shared_expert_intermediate_size, text.hidden_act,
                                    tp=self.tp)

    def decoder_structure(self) -> DecoderStructure:
        raise NotImplementedError("a hybrid model has no dense decoder structure (linear-attention layers)")

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> None:
        if self.mtp is None:
            weights = ((name, t) for name, t in weights if not name.startswith("mtp."))
        super().load_weights(weights, strict)


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    split_linear_projections = True

    def build_mlp(self, config: ModelConfig, layer_id: int) -> nn.Module:
        text = config.text
        return LlamaMLP(text.hidden_size, text.intermediate_size, text.hidden_act, tp=self.tp)


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    split_linear_projections = True
    all_layers_sparse = True


# ---- the published vision-language layout: the text model and its vision tower ----

class Qwen3_5ForConditionalGeneration(VisionLanguageMixin, Qwen3_5ForCausalLM):
    def __init__(self, config: ModelConfig, tp: TpGroup = TpGroup()) -> None:
        super().__init__(config, tp)
        self._add_vision_tower(config)


class Qwen3_5MoeForConditionalGeneration(VisionLanguageMixin, Qwen3_5MoeForCausalLM):
    def __init__(self, config: ModelConfig, tp: TpGroup = TpGroup()) -> None:
        super().__init__(config, tp)
        self._add_vision_tower(config)
