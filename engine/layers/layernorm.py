"""RMSNorm, computed exactly as HF transformers does (float32 statistics, weight applied in the input dtype).

The reference path is torch's; on CUDA one Triton kernel does the norm, with the pre-norm residual
add fused in (triton_ops/norm.py), chosen at load time (layers/custom_op.py).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from baton.engine.layers.custom_op import CustomOp


class RMSNorm(CustomOp):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward_native(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
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

    def forward_cuda(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """The same on CUDA in one kernel; `residual` is updated in place (and returned)."""
        if x.dtype != self.weight.dtype or x.stride(-1) != 1:
            return self.forward_native(x, residual)
        from baton.engine.triton_ops.norm import fused_add_rmsnorm, rmsnorm

        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if residual is None:
            return rmsnorm(x2, self.weight, self.variance_epsilon).view(shape)
        if residual.dtype != x.dtype or not residual.is_contiguous():
            return self.forward_native(x, residual)
        out, residual = fused_add_rmsnorm(x2, residual.view(-1, shape[-1]), self.weight, self.variance_epsilon)
        return out.view(shape), residual.view(shape)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class ZeroCenteredRMSNorm(RMSNorm):
    """The (1 + w) RMSNorm of Qwen3-Next / Qwen3.5 (weights stored around zero), as HF computes it:
    normalise and scale in float32, then cast back to the input dtype ((x * w).to(dtype), not
    x.to(dtype) * w as RMSNorm). With `residual`, the pre-norm add first, as RMSNorm."""

    def forward_native(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is not None:
            x = x + residual
            residual = x
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        out = (h * (1.0 + self.weight.float())).type_as(x)
        return out if residual is None else (out, residual)

    def forward_cuda(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        return self.forward_native(x, residual)  # the Triton kernel scales by w, not 1 + w


class GatedRMSNorm(CustomOp):
    """RMSNorm of the Gated DeltaNet output, then times silu(gate) (HF's Qwen3NextRMSNormGated):
    x, gate [n, dim] -> [n, dim] in x's dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward_native(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        h = self.weight * h.to(input_dtype)
        return (h * torch.nn.functional.silu(gate.float())).to(input_dtype)
