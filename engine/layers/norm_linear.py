"""A pre-norm and the linear that reads it, as one op (the decoder layer's norm -> qkv_proj and
norm -> gate_up_proj):

    norm_linear(norm, linear, x, residual, act=None) -> (linear(norm(x + residual)), x + residual)

Without a residual (the first layer) the norm reads x and x is the residual returned. With `act`
(a GatedAct) the linear is [gate | up] and the result act(gate) * up (MergedColumnLinear.gated).

Where the linear's small-batch GEMV takes its call (layers/gemm.py: bound on CUDA, 1..N rows, bf16/fp16,
norms folded in) and the norm is a plain RMSNorm bound to its fused path, one Triton kernel does it all
(triton_ops/gemv.py gemv_rmsnorm): the norm's statistic is summed from the tiles the GEMV loads
anyway, so a decode step spends no kernel and no pass over the activations on its two norms per
layer. Elsewhere (CPU, the reference ops, prefill, a bias with silu, the zero-centred norm) it is the
norm's op, then the linear's: exactly what the layer computed before.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from baton.engine.layers import gemm
from baton.engine.layers.layernorm import RMSNorm

if TYPE_CHECKING:
    from baton.engine.layers.activation import GatedAct


def fusable(norm: nn.Module, linear: nn.Module, x: torch.Tensor, residual: Optional[torch.Tensor],
            act: Optional["GatedAct"] = None) -> bool:
    """Whether norm_linear takes the one-kernel path for this call."""
    bias = getattr(linear, "bias", None)
    return (gemm.gemv_of(linear).fuse_norms and type(norm) is RMSNorm and norm.path != "native"
            and gemm.gemv_applies(linear, x, bias) and norm.weight.dtype == x.dtype
            and norm.weight.shape == (x.shape[1],)
            and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype
                                      and residual.is_contiguous()))
            and (act is None or (act.is_silu and bias is None)))


def norm_linear(norm: nn.Module, linear: nn.Module, x: torch.Tensor, residual: Optional[torch.Tensor],
                act: Optional["GatedAct"] = None) -> tuple[torch.Tensor, torch.Tensor]:
    if fusable(norm, linear, x, residual, act):
        from baton.engine.triton_ops.gemv import gemv_rmsnorm

        return gemv_rmsnorm(x, residual, norm.weight, norm.variance_epsilon, linear.weight, linear.bias,
                            silu_mul=act is not None)
    if residual is None:
        residual, h = x, norm(x)
    else:
        h, residual = norm(x, residual)
    return (linear(h) if act is None else linear.gated(h, act)), residual
