"""RMSNorm and the pre-norm residual add in one Triton kernel (the CUDA path of layers/layernorm.py).

    rmsnorm(x, w, eps)                   y = w * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)
    fused_add_rmsnorm(x, residual, w)    residual <- x + residual (in place, x's dtype); y = rmsnorm(residual)

Rounded where HF rounds: the add in the input dtype, the statistics in float32, the normed value
back to the input dtype before the weight multiplies it (a product of two values of that dtype,
rounded once). Only the order of the squares' sum differs from torch's, so results agree to an
ulp or so. One program per row; a row of up to 64k elements is held in registers.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs may lack triton; the layer's torch path serves them
    triton = None


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"rmsnorm: x must be 2-D with contiguous rows, got shape {tuple(x.shape)} strides {x.stride()}")
    if weight.shape != (x.shape[1],) or not weight.is_contiguous():
        raise ValueError(f"rmsnorm: weight {tuple(weight.shape)} does not match rows of {x.shape[1]}")


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check(x, weight)
    n, cols = x.shape
    out = torch.empty((n, cols), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    block = triton.next_power_of_2(cols)
    if block > 65536:
        raise ValueError(f"rmsnorm: rows of {cols} elements are longer than the kernel takes (65536)")
    res = residual if residual is not None else x
    _rmsnorm_kernel[(n,)](
        x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), cols, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(max(block // 512, 1), 16))
    return out


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [n, d] (rows contiguous) -> [n, d] in x's dtype."""
    return _launch(x, None, weight, eps)


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rmsnorm(x + residual), residual) with residual updated in place to x + residual."""
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1:
        raise ValueError(f"fused_add_rmsnorm: residual {tuple(residual.shape)} {residual.dtype} does not match x "
                         f"{tuple(x.shape)} {x.dtype}")
    return _launch(x, residual, weight, eps), residual


if triton is not None:

    @triton.jit
    def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, x_stride, res_stride, out_stride, cols, eps,
                        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < cols
        x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * res_stride + offs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(res_ptr + row * res_stride + offs, x, mask=mask)
        xf = x.to(tl.float32)
        variance = tl.sum(xf * xf, axis=0) / cols
        normed = (xf * tl.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        y = w.to(tl.float32) * normed.to(tl.float32)
        tl.store(out_ptr + row * out_stride + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
