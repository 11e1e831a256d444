"""Qwen3: Llama with per-head RMSNorm on q and k before RoPE (bias from config.attention_bias)."""
from __future__ import annotations

from torch import nn

from baton.engine.model_config import ModelConfig
from baton.engine.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    def build_attention(self, config: ModelConfig, layer_id: int) -> nn.Module:
        bias = config.text.attention_bias
        return LlamaAttention(config, layer_id, qkv_bias=bias, o_bias=bias, qk_norm=True, tp=self.tp)
