"""RMSNorm, computed exactly as HF transformers does (float32 statistics, weight applied in the input dtype)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """x: [..., hidden]. With `residual`, first computes x + residual and returns (normed, new_residual),
        the pre-norm decoder pattern; the add happens in the input dtype, as in HF."""
        if residual is not None:
            x = x + residual
            residual = x
        input_dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.variance_epsilon)
        out = self.weight * h.to(input_dtype)
        return out if residual is None else (out, residual)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"
