"""A layer's matmul: torch's GEMM, or the packed bfloat16 CPU kernel where the layer has a packed copy.

The copy is the buffer `packed_weight`, made by layers/linear.py's pack_linear_weights after loading.
The linear layers and the LM head (layers/vocab_parallel.py) both multiply through here.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from baton.engine.kernels import cpu_linear


def linear_forward(layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """F.linear(x, layer.weight, bias), through the packed copy when the layer has one."""
    packed = getattr(layer, "packed_weight", None)
    if packed is None:
        return F.linear(x, layer.weight, bias)
    return cpu_linear.packed_linear(x, layer.weight, packed, bias)
