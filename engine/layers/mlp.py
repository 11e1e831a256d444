"""The gated MLP of Llama-family models (and the shared expert of Qwen3-Next's MoE):
down(act(gate(x)) * up(x)), gate|up fused into one column-parallel linear, down row-parallel."""
from __future__ import annotations

import torch
from torch import nn

from baton.engine.distributed.parallel_state import TpGroup
from baton.engine.layers.activation import GatedAct
from baton.engine.layers.linear import MergedColumnLinear, RowParallelLinear, even_parts
from baton.engine.layers.norm_linear import norm_linear


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = False,
                 tp: TpGroup = TpGroup()) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnLinear(hidden_size, even_parts([intermediate_size] * 2, tp), bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, tp=tp)
        self.act = GatedAct(hidden_act)
        self.hidden_act = hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.gated(x, self.act))

    def forward_prenormed(self, norm: nn.Module, x: torch.Tensor,
                          residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """forward(norm(x + residual)) and the new residual, the norm and gate_up as one op
        (layers/norm_linear.py)."""
        act, residual = norm_linear(norm, self.gate_up_proj, x, residual, self.act)
        return self.down_proj(act), residual
