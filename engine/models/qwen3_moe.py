"""Qwen3-MoE: Qwen3 attention; the MLP of layer i is a sparse MoE block unless i is in
`mlp_only_layers` or (i + 1) % decoder_sparse_step != 0, in which case it is a dense MLP of
`intermediate_size` (same rule as transformers' Qwen3MoeDecoderLayer)."""
from __future__ import annotations

import re

import torch
from torch import nn

from baton.engine.layers.moe import SparseMoeBlock
from baton.engine.model_config import ModelConfig
from baton.engine.model_structure import Mlp
from baton.engine.models.qwen3 import Qwen3ForCausalLM

# a sparse layer's router and experts; `mtp.layers.N`: a Qwen3-Next / Qwen3.5-MoE MTP head's layer
_MOE_NAME = re.compile(r"^((?:model|mtp)\.layers\.\d+)\.mlp\.((?:experts|gate)\..+)$")


def is_sparse_layer(config: ModelConfig, layer_id: int) -> bool:
    return config.moe is not None and config.moe.is_sparse(layer_id)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def build_mlp(self, config: ModelConfig, layer_id: int) -> nn.Module:
        if not is_sparse_layer(config, layer_id):
            return super().build_mlp(config, layer_id)
        moe, text = config.moe, config.text
        return SparseMoeBlock(text.hidden_size, moe.intermediate_size, moe.num_experts, moe.top_k, moe.norm_topk_prob,
                              text.hidden_act, tp=self.tp)

    def describe_mlp(self, mlp: nn.Module) -> Mlp:
        return Mlp("moe") if isinstance(mlp, SparseMoeBlock) else super().describe_mlp(mlp)

    def load_special_weight(self, name: str, tensor: torch.Tensor) -> str | None:
        m = _MOE_NAME.match(name)
        if m is None:
            return None
        block = self.get_submodule(m.group(1)).mlp
        if not isinstance(block, SparseMoeBlock) or not block.load_weight(m.group(2), tensor):
            return None
        param = "gate.weight" if m.group(2) == "gate.weight" else ("w2" if "down_proj" in m.group(2) else "w13")
        return f"{m.group(1)}.mlp.{param}"
