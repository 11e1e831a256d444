"""silu(gate) * up over a fused [n, 2d] gate|up product, one Triton kernel (the CUDA path of
layers/activation.py's GatedAct). Rounded as torch rounds: silu in float32, its result to the input
dtype, then the product of two values of that dtype rounded once."""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs may lack triton; the layer's torch path serves them
    triton = None

_BLOCK = 1024


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [n, 2d] laid out [gate | up] (rows contiguous) -> [n, d]."""
    if gate_up.dim() != 2 or gate_up.stride(1) != 1 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_and_mul: need [n, 2d] with contiguous rows, got {tuple(gate_up.shape)}")
    n, d = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((n, d), dtype=gate_up.dtype, device=gate_up.device)
    if n == 0 or d == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(n, triton.cdiv(d, block))](gate_up, out, gate_up.stride(0), out.stride(0), d,
                                                     BLOCK=block, num_warps=4)
    return out


if triton is not None:

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, d, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < d
        gate = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * x_stride + d + offs, mask=mask, other=0.0)
        act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty)
        y = act.to(tl.float32) * up.to(tl.float32)
        tl.store(out_ptr + row * out_stride + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
