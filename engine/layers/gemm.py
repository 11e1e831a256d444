"""A layer's matmul: torch's GEMM, a packed bfloat16 CPU kernel, or a Triton GEMV for a few rows.

The packed CPU kernel serves a layer with a packed copy; the GEMV, where the layer's choice has it, a
CUDA call of a few rows.

The copy is the buffer `packed_weight`, made by layers/linear.py's pack_linear_weights after loading.
The linear layers and the LM head (layers/vocab_parallel.py) both multiply through here.

A layer's GEMV choice is a `SmallBatchGemv`, made once at load (layers/custom_op.py bind_layer_ops,
which gives it only to a model on CUDA with the fused ops) and held by every linear layer (`gemv`;
GEMV_OFF until bound). With `max_rows` r, its calls of 1..r rows go to triton_ops/gemv.py, which reads
each weight once in one kernel where cuBLAS may split K and add a reduce kernel (a decode step is
memory bound). Off by default (--small-batch-gemv-rows 0): on an H200 it was 3-4% faster at batch 1
and 16 and 5% slower at 64 (`baton bench step --variants fused,triton-gemv`), and no served run has
used it yet. MergedColumnLinear.gated takes gemv_silu_mul under the same rule (`gemv_applies`), and a
pre-norm followed by its linear (layers/norm_linear.py) the GEMV with the norm folded in, unless the
choice says `fuse_norms=False` (the norm keeps its own kernel: a benchmark variant).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from baton.engine.kernels import cpu_linear


@dataclass(frozen=True)
class SmallBatchGemv:
    """Which calls of a linear layer take the Triton GEMV."""

    max_rows: int = 0  # calls of 1..max_rows rows (bf16/fp16); 0: none
    fuse_norms: bool = True  # a pre-norm and the linear that reads it run as one kernel

    def __post_init__(self) -> None:
        if self.max_rows:  # (the kernel's module imports triton: not for the choice that is off)
            from baton.engine.triton_ops.gemv import MAX_ROWS

            if not 0 < self.max_rows <= MAX_ROWS:
                raise ValueError(f"small-batch GEMV: max_rows must be 0..{MAX_ROWS}, got {self.max_rows}")


GEMV_OFF = SmallBatchGemv()


def gemv_of(layer: nn.Module) -> SmallBatchGemv:
    """The layer's GEMV choice (any module with a weight; one never bound: off)."""
    return getattr(layer, "gemv", GEMV_OFF)


def bind_gemv(model: nn.Module, gemv: SmallBatchGemv) -> int:
    """Give `gemv` to every layer of `model` that multiplies through here (those that declare a `gemv`:
    layers/linear.py's, the LM head); returns how many. No device check: bind_layer_ops makes that."""
    if gemv.max_rows:
        from baton.engine.triton_ops import gemv as gemv_kernels

        if gemv_kernels.triton is None:
            raise RuntimeError("the small-batch GEMV needs triton, which is not installed")
    layers = [m for m in model.modules() if isinstance(getattr(m, "gemv", None), SmallBatchGemv)]
    for m in layers:
        m.gemv = gemv
    return len(layers)


def gemv_applies(layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    """Whether a call of `layer` on x takes the Triton GEMV: the layer's choice has it for x's rows
    (1..max_rows), x 2-D and contiguous, bf16/fp16 like the weight (and bias), no packed CPU copy."""
    rows = gemv_of(layer).max_rows
    return (rows > 0 and x.dim() == 2 and 1 <= x.shape[0] <= rows and x.is_contiguous()
            and x.dtype in (torch.bfloat16, torch.float16) and layer.weight.dtype == x.dtype
            and (bias is None or bias.dtype == x.dtype) and getattr(layer, "packed_weight", None) is None)


def linear_forward(layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """F.linear(x, layer.weight, bias), through the packed copy when the layer has one, or the Triton GEMV
    for a few rows where the layer's choice has it."""
    packed = getattr(layer, "packed_weight", None)
    if packed is not None:
        return cpu_linear.packed_linear(x, layer.weight, packed, bias)
    if gemv_applies(layer, x, bias):
        from baton.engine.triton_ops.gemv import gemv

        return gemv(x, layer.weight, bias)
    return F.linear(x, layer.weight, bias)
