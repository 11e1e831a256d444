"""Qwen2: Llama with a bias on q/k/v (none on o_proj)."""
from __future__ import annotations

from torch import nn

from baton.engine.model_config import ModelConfig
from baton.engine.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    def build_attention(self, config: ModelConfig, layer_id: int) -> nn.Module:
        return LlamaAttention(config, layer_id, qkv_bias=True, o_bias=False, tp=self.tp)
