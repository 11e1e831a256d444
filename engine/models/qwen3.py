"""Qwen3: Llama with per-head RMSNorm on q and k before RoPE (bias from config.attention_bias).

Qwen3-VL (`Qwen3VLForConditionalGeneration`) is this text model with interleaved M-RoPE and the vision
tower (models/qwen_vision.py), whose deepstack features are added to the first layers' outputs at the
image tokens (models/llama.py _forward_deepstack)."""
from __future__ import annotations

from torch import nn

from baton.engine.distributed.parallel_state import TpGroup

from baton.engine.model_config import ModelConfig
from baton.engine.models.llama import LlamaAttention, LlamaForCausalLM
from baton.engine.models.vision_language import VisionLanguageMixin


class Qwen3ForCausalLM(LlamaForCausalLM):
    def build_attention(self, config: ModelConfig, layer_id: int) -> nn.Module:
        bias = config.text.attention_bias
        return LlamaAttention(config, layer_id, qkv_bias=bias, o_bias=bias, qk_norm=True, tp=self.tp)


class Qwen3VLForConditionalGeneration(VisionLanguageMixin, Qwen3ForCausalLM):
    def __init__(self, config: ModelConfig, tp: TpGroup = TpGroup()) -> None:
        super().__init__(config, tp)
        self._add_vision_tower(config)
