"""A decode step of the Gated DeltaNet short causal conv1d in place on the state pool, one Triton kernel.

    conv1d_decode_triton(x [bs, C], weight [C, K], states [S, C, K - 1], slots [bs]) -> y [bs, C] in x's dtype

(layers/gated_delta_net.py conv1d_decode calls it where `takes` says, else its torch twin.)

Row i continues from its conv state states[slots[i]]: seq = [state (as x's dtype) | x[i]], K taps
oldest first; y[i] = silu(sum_j seq[:, j] * weight[:, j]), fp32 products summed in tap order (no
fused multiply-add) then rounded once, the sums layers/gated_delta_net.py's decode_causal_conv1d
does; the state becomes seq[:, 1:] in the states' dtype. One kernel replaces the torch path's gather
of the states, cat, K multiply-adds, silu and scatter back (~15 launches per layer per decode step):
grid (bs, cdiv(C, BLOCK_C)), each program reads its block of the K - 1 state columns, shifts them
left in place and writes x as the newest. No host sync, so a decode CUDA graph captures it.

Rows may share a slot (a graph's padded rows all point at the padding slot): what lands there is
garbage that nothing reads, and every other slot is still only written by its own row.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs may lack triton; the torch path serves them
    triton = None


def check_args(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, slots: torch.Tensor) -> None:
    bs, c = x.shape
    if weight.shape[0] != c or states.shape[1:] != (c, weight.shape[1] - 1) or slots.shape != (bs,):
        raise ValueError(f"conv1d_decode: x {tuple(x.shape)}, weight {tuple(weight.shape)}, states "
                         f"{tuple(states.shape)} and slots {tuple(slots.shape)} do not match")


def takes(x: torch.Tensor) -> bool:
    """Whether the kernel serves this call: CUDA, triton importable, x's rows contiguous. The torch twin
    (layers/gated_delta_net.py conv1d_decode_torch) serves the rest."""
    return triton is not None and x.is_cuda and x.stride(1) == 1


def conv1d_decode_triton(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor,
                         slots: torch.Tensor) -> torch.Tensor:
    check_args(x, weight, states, slots)
    assert x.stride(1) == 1, "x's rows must be contiguous (its row stride may be anything)"
    (bs, c), k = x.shape, weight.shape[1]
    y = torch.empty((bs, c), dtype=x.dtype, device=x.device)
    if bs == 0 or c == 0:
        return y
    block = min(1024, triton.next_power_of_2(c))
    # no FMA contraction: each product rounded to fp32, then added, as the torch ops do
    _conv1d_decode_kernel[(bs, triton.cdiv(c, block))](
        x, weight, states, slots, y, c, x.stride(0), weight.stride(0), weight.stride(1), states.stride(0),
        states.stride(1), states.stride(2), y.stride(0), K=k, BLOCK_C=block, enable_fp_fusion=False)
    return y


if triton is not None:

    @triton.jit
    def _conv1d_decode_kernel(x_ptr, w_ptr, s_ptr, slot_ptr, y_ptr, C, x_stride, w_stride_c, w_stride_k,
                              s_stride, s_stride_c, s_stride_k, y_stride, K: tl.constexpr, BLOCK_C: tl.constexpr):
        row = tl.program_id(0)
        cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = cs < C
        slot = tl.load(slot_ptr + row).to(tl.int64)
        state = s_ptr + slot * s_stride + cs * s_stride_c
        x = tl.load(x_ptr + row.to(tl.int64) * x_stride + cs, mask=mask)
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(K - 1):  # column j is read before anything overwrites it (j - 1 is)
            tap = tl.load(state + j * s_stride_k, mask=mask).to(x.dtype)
            acc += tap.to(tl.float32) * tl.load(w_ptr + cs * w_stride_c + j * w_stride_k, mask=mask).to(tl.float32)
            if j > 0:
                tl.store(state + (j - 1) * s_stride_k, tap.to(s_ptr.dtype.element_ty), mask=mask)
        acc += x.to(tl.float32) * tl.load(w_ptr + cs * w_stride_c + (K - 1) * w_stride_k, mask=mask).to(tl.float32)
        tl.store(state + (K - 2) * s_stride_k, x.to(s_ptr.dtype.element_ty), mask=mask)
        y = acc / (1.0 + tl.exp(-acc))
        tl.store(y_ptr + row.to(tl.int64) * y_stride + cs, y.to(y_ptr.dtype.element_ty), mask=mask)
