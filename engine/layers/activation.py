"""Activations, including the fused gate/up product used by gated MLPs (on CUDA, silu's in one
Triton kernel: triton_ops/activation.py)."""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F

from baton.engine.layers.custom_op import CustomOp

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


class GatedAct(CustomOp):
    """act(gate) * up on a fused [..., 2 * d] input laid out as [gate | up]."""

    def __init__(self, act: str = "silu") -> None:
        super().__init__()
        self.act_fn = get_act_fn(act)
        self.is_silu = self.act_fn is F.silu  # what a packed gate|up GEMM can fuse (cpu_linear.py)

    def forward_native(self, gate_up: torch.Tensor) -> torch.Tensor:
        d = gate_up.shape[-1] // 2
        return self.act_fn(gate_up[..., :d]) * gate_up[..., d:]

    def forward_cuda(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not self.is_silu or gate_up.stride(-1) != 1:
            return self.forward_native(gate_up)
        from baton.engine.triton_ops.activation import silu_and_mul

        shape = gate_up.shape
        return silu_and_mul(gate_up.reshape(-1, shape[-1])).view(*shape[:-1], shape[-1] // 2)
