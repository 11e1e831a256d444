"""Segmented LoRA GEMMs: the rows of a batch in runs (segments), each run multiplied by its own adapter's
matrix from a stacked pool, in one launch (S-LoRA / Punica's SGMV; SGLang's LoRA backends).

    lora_shrink(x, a, segs)                    y[run] = x[run] @ a[slot].T          x [T, K], a [S, N, K]
    lora_expand_add(y, xa, b, scaling, segs)   y[run] += scaling[slot] * xa[run] @ b[slot].T
                                                                                    xa [T, R], b [S, N, R]

A run is (first row, rows, slot); rows outside every run (the base model's tokens) are left alone:
lora_shrink does not write them, lora_expand_add adds nothing there. `y`, `xa` and `b` may be column
slices of larger tensors (a fused projection's output part, its rank block): rows are strided, columns
contiguous.

The torch path loops over the runs (the CPU path and the reference); the Triton kernel runs one
program per (run, block of its rows, block of output columns), reading its slot's matrix from the pool.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs may lack triton; the torch path serves them
    triton = None


class Segments(NamedTuple):
    """The batch's adapter runs: host lists (the torch path) and, for the kernel, the same as int32
    device tensors. Only runs under an adapter are listed."""

    starts: list[int]
    lens: list[int]
    slots: list[int]
    device: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None  # (starts, lens, slots)

    @property
    def max_len(self) -> int:
        return max(self.lens, default=0)

    @staticmethod
    def from_rows(row_tokens: list[int], row_slots: list[int], device: str) -> "Segments":
        """Runs of consecutive rows (requests) under the same slot; rows of slot < 0 (no adapter) are
        in none. `row_tokens`: each row's tokens in the batch, back to back."""
        starts, lens, slots = [], [], []
        offset, prev = 0, -1
        for n, slot in zip(row_tokens, row_slots):
            if slot >= 0 and n:
                if slot == prev and starts[-1] + lens[-1] == offset:
                    lens[-1] += n
                else:
                    starts.append(offset)
                    lens.append(n)
                    slots.append(slot)
            prev = slot if n else prev
            offset += n
        on_device = None
        if device != "cpu" and starts:
            packed = torch.tensor([starts, lens, slots], dtype=torch.int32).to(device, non_blocking=True)
            on_device = (packed[0], packed[1], packed[2])
        return Segments(starts, lens, slots, on_device)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, segs: Segments) -> torch.Tensor:
    """[T, N] with x[run] @ a[slot].T in each run's rows (others unset)."""
    if triton is not None and x.is_cuda:
        return lora_shrink_triton(x, a, segs)
    return lora_shrink_torch(x, a, segs)


def lora_expand_add(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor,
                    segs: Segments) -> None:
    """y[run] += scaling[slot] * xa[run] @ b[slot].T, in place."""
    if triton is not None and y.is_cuda:
        lora_expand_add_triton(y, xa, b, scaling, segs)
    else:
        lora_expand_add_torch(y, xa, b, scaling, segs)


def lora_shrink_torch(x: torch.Tensor, a: torch.Tensor, segs: Segments) -> torch.Tensor:
    y = x.new_zeros(x.shape[0], a.shape[1])
    for start, n, slot in zip(segs.starts, segs.lens, segs.slots):
        y[start:start + n] = x[start:start + n] @ a[slot].T
    return y


def lora_expand_add_torch(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor,
                          segs: Segments) -> None:
    for start, n, slot in zip(segs.starts, segs.lens, segs.slots):
        y[start:start + n] += (xa[start:start + n] @ b[slot].T) * scaling[slot]


if triton is not None:

    @triton.jit
    def _sgemm_kernel(
        x, w, y, seg_starts, seg_lens, seg_slots, scaling,
        N, K,
        stride_xm, stride_ws, stride_wn, stride_wk, stride_ym,
        SCALE_ADD: tl.constexpr,  # y += scaling[slot] * product (expand), else y = product (shrink)
        IEEE: tl.constexpr,  # float32 inputs: no TF32
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        seg = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_n = tl.program_id(2)
        length = tl.load(seg_lens + seg)
        if pid_m * BLOCK_M >= length:
            return
        start = tl.load(seg_starts + seg).to(tl.int64)
        slot = tl.load(seg_slots + seg).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        rows = offs_m < length
        x_ptrs = x + (start + offs_m)[:, None] * stride_xm + offs_k[None, :]
        w_ptrs = w + slot * stride_ws + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_left = K - k0
            x_tile = tl.load(x_ptrs, mask=rows[:, None] & (offs_k[None, :] < k_left), other=0.0)
            w_tile = tl.load(w_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
            if IEEE:
                acc += tl.dot(x_tile, w_tile, input_precision="ieee")
            else:
                acc += tl.dot(x_tile, w_tile)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk
        y_ptrs = y + (start + offs_m)[:, None] * stride_ym + offs_n[None, :]
        mask = rows[:, None] & (offs_n[None, :] < N)
        if SCALE_ADD:
            acc = acc * tl.load(scaling + slot).to(tl.float32)
            acc += tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, acc.to(y.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, scaling: Optional[torch.Tensor],
            segs: Segments) -> None:
    n_cols, k_dim = w.shape[1], w.shape[2]
    assert x.stride(-1) == 1 and y.stride(-1) == 1 and w.stride(-1) == 1 and x.shape[1] == k_dim
    if not segs.starts:
        return
    starts, lens, slots = segs.device if segs.device is not None else (
        torch.tensor(t, dtype=torch.int32, device=x.device) for t in (segs.starts, segs.lens, segs.slots))
    block_m = 16 if segs.max_len <= 16 else 32 if segs.max_len <= 64 else 64
    block_n = 64 if n_cols >= 64 else max(16, triton.next_power_of_2(n_cols))
    block_k = 64 if k_dim >= 64 else max(16, triton.next_power_of_2(k_dim))
    grid = (len(segs.starts), triton.cdiv(segs.max_len, block_m), triton.cdiv(n_cols, block_n))
    _sgemm_kernel[grid](
        x, w, y, starts, lens, slots, scaling if scaling is not None else y,
        n_cols, k_dim, x.stride(0), w.stride(0), w.stride(1), w.stride(2), y.stride(0),
        SCALE_ADD=scaling is not None, IEEE=x.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )


def lora_shrink_triton(x: torch.Tensor, a: torch.Tensor, segs: Segments) -> torch.Tensor:
    y = torch.empty(x.shape[0], a.shape[1], dtype=x.dtype, device=x.device)
    _launch(x, a, y, None, segs)
    return y


def lora_expand_add_triton(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor,
                           segs: Segments) -> None:
    _launch(xa, b, y, scaling, segs)
