"""Activations, including the fused gate/up product used by gated MLPs."""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}


def get_act_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {name!r}; supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class GatedAct(nn.Module):
    """act(gate) * up on a fused [..., 2 * d] input laid out as [gate | up]."""

    def __init__(self, act: str = "silu") -> None:
        super().__init__()
        self.act_fn = get_act_fn(act)
        self.is_silu = self.act_fn is F.silu  # what a packed gate|up GEMM can fuse (cpu_linear.py)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        d = gate_up.shape[-1] // 2
        return self.act_fn(gate_up[..., :d]) * gate_up[..., d:]
