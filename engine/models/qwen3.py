"""Qwen3: Llama with per-head RMSNorm on q and k before RoPE (bias from config.attention_bias)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from baton.engine.models.llama import LlamaAttention, LlamaForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Qwen3ForCausalLM(LlamaForCausalLM):
    def build_attention(self, config: "PretrainedConfig", layer_id: int) -> nn.Module:
        bias = bool(getattr(config, "attention_bias", False))
        return LlamaAttention(config, layer_id, qkv_bias=bias, o_bias=bias, qk_norm=True, tp=self.tp)
