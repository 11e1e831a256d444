"""A layer's matmul: torch's GEMM, a packed bfloat16 CPU kernel, or a Triton GEMV for a few rows.

The packed CPU kernel serves a layer with a packed copy; the GEMV, when switched on, a CUDA call of a
few rows.

The copy is the buffer `packed_weight`, made by layers/linear.py's pack_linear_weights after loading.
The linear layers and the LM head (layers/vocab_parallel.py) both multiply through here.

`set_small_batch_gemv(r)` sends calls of 1..r rows on CUDA to triton_ops/gemv.py, which reads each
weight once in one kernel where cuBLAS may split K and add a reduce kernel (a decode step is memory
bound). Off (0) by default (--small-batch-gemv-rows): on an H200 it was 3-4% faster at batch 1 and 16
and 5% slower at 64 (`baton bench step --variants fused,triton-gemv`), and no served run has used it yet.
MergedColumnLinear.gated takes gemv_silu_mul under the same rule (`gemv_applies`), and a pre-norm
followed by its linear (layers/norm_linear.py) the GEMV with the norm folded in, unless
`set_small_batch_gemv(r, fuse_norms=False)` keeps the norm's own kernel (a benchmark variant).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from baton.engine.kernels import cpu_linear

_gemv_rows = 0  # calls of 1.._gemv_rows rows take the Triton GEMV; 0: off
_fuse_norms = True  # with the GEMV on: a pre-norm and the linear that reads it run as one kernel
_GEMV_DEVICE = "cuda"  # the device type it serves (tests point it at cpu, with a stand-in kernel, to check the rule)


def set_small_batch_gemv(max_rows: int, fuse_norms: bool = True) -> None:
    """Route CUDA calls of 1..max_rows rows (bf16/fp16) through the Triton GEMV; 0 switches it off.
    fuse_norms: a pre-norm followed by its linear takes the GEMV with the norm folded in."""
    global _gemv_rows, _fuse_norms
    if max_rows:
        from baton.engine.triton_ops import gemv

        if gemv.triton is None:
            raise RuntimeError("set_small_batch_gemv: triton is not installed")
        if not 0 < max_rows <= gemv.MAX_ROWS:
            raise ValueError(f"set_small_batch_gemv: max_rows must be 0..{gemv.MAX_ROWS}, got {max_rows}")
    _gemv_rows, _fuse_norms = max_rows, fuse_norms


def small_batch_gemv_rows() -> int:
    return _gemv_rows


def norms_fused() -> bool:
    """Whether a pre-norm folds into the GEMV that follows it (when that GEMV applies)."""
    return _fuse_norms


def gemv_applies(layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    """Whether a call of `layer` on x takes the Triton GEMV: switched on, x on CUDA, 2-D and contiguous,
    1..max_rows rows, bf16/fp16 like the weight (and bias), no packed CPU copy."""
    return (_gemv_rows > 0 and x.device.type == _GEMV_DEVICE and x.dim() == 2 and 1 <= x.shape[0] <= _gemv_rows
            and x.is_contiguous() and x.dtype in (torch.bfloat16, torch.float16) and layer.weight.dtype == x.dtype
            and (bias is None or bias.dtype == x.dtype) and getattr(layer, "packed_weight", None) is None)


def linear_forward(layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """F.linear(x, layer.weight, bias), through the packed copy when the layer has one, or the Triton GEMV
    for a few rows when that is switched on."""
    packed = getattr(layer, "packed_weight", None)
    if packed is not None:
        return cpu_linear.packed_linear(x, layer.weight, packed, bias)
    if _gemv_rows and gemv_applies(layer, x, bias):
        from baton.engine.triton_ops.gemv import gemv

        return gemv(x, layer.weight, bias)
    return F.linear(x, layer.weight, bias)
