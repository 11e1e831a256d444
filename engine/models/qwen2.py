"""Qwen2: Llama with a bias on q/k/v (none on o_proj)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from baton.engine.models.llama import LlamaAttention, LlamaForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Qwen2ForCausalLM(LlamaForCausalLM):
    def build_attention(self, config: "PretrainedConfig", layer_id: int) -> nn.Module:
        return LlamaAttention(config, layer_id, qkv_bias=True, o_bias=False, tp=self.tp)
