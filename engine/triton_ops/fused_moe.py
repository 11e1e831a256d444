"""fused_experts: a sparse MoE block's expert MLPs as two grouped GEMMs, with no host sync.

The obvious forward (`fused_experts_torch`, the CPU path) loops over the experts a batch hit. That
needs the hit list on the host: one device->host sync per MoE layer on a GPU, and a CUDA graph cannot
be captured around it at all. The Triton path keeps everything on the device, in fixed shapes:

1. `moe_align` sorts the (token, k) slots by expert and pads each expert's run to a multiple of
   BLOCK_M, in torch ops whose sizes depend only on the token count (an upper bound on the padded
   length, not the actual one). Every BLOCK_M block of the sorted order then belongs to one expert.
2. `_grouped_gemm_kernel` runs one program per (block, BLOCK_N columns): it gathers the block's
   input rows, multiplies them by its expert's weight, and writes each row to its slot. Blocks past
   the actual padded length (read from device memory) return at once.

First GEMM: x @ w13[e].T -> [slots, 2I]; then act(gate) * up in torch; second GEMM: @ w2[e].T, each
row scaled by its routing weight; finally the top_k rows of a token are summed. The scheme is the
one SGLang's and vLLM's `fused_moe` use; the code is ours.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs may lack triton; the torch path serves them
    triton = None


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, act_fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """x [n, H]; w13 [E, 2I, H] ([gate | up]); w2 [E, H, I]; weights [n, k] (x's dtype); ids [n, k]
    expert ids. Returns sum_k weights[:, k] * w2[e](act(gate) * up) -> [n, H]."""
    if triton is not None and x.is_cuda:
        return fused_experts_triton(x, w13, w2, weights, ids, act_fn)
    return fused_experts_torch(x, w13, w2, weights, ids, act_fn)


def fused_experts_torch(x, w13, w2, weights, ids, act_fn) -> torch.Tensor:
    """One pass per expert hit (the same ops, in the same order, as transformers' MoE blocks)."""
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        token_idx, k_pos = torch.where(ids == e)
        gate, up = F.linear(x[token_idx], w13[e]).chunk(2, dim=-1)  # [m, I] each
        y = F.linear(act_fn(gate) * up, w2[e])  # [m, H]
        out.index_add_(0, token_idx, y * weights[token_idx, k_pos, None])
    return out


def padded_slots(num_slots: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the padded sorted length: each expert that was hit (at most
    min(E, slots) of them) pads its run by fewer than block_m; rounded up to whole blocks."""
    bound = num_slots + min(num_experts, num_slots) * (block_m - 1)
    return -(-bound // block_m) * block_m


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [n, k] -> (sorted_slots [P], block_expert [P / block_m], num_padded [1]).

    sorted_slots lists the flat slot indices (token * k + j) grouped by expert, each expert's run
    padded to a multiple of block_m with the sentinel n * k; block_expert[b] is the expert of block
    b; num_padded is the padded length actually used. P = `padded_slots(...)`: a function of the
    shapes only, so the ops capture into a CUDA graph. Nothing here reads a value on the host."""
    flat = ids.reshape(-1)
    t = flat.numel()
    dev = flat.device
    p = padded_slots(t, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(
        0, flat.long(), torch.ones(t, dtype=torch.int64, device=dev))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)  # slots in expert order
    expert_of = flat[order].long()
    rank = torch.arange(t, device=dev) - (counts.cumsum(0) - counts)[expert_of]  # place within its expert
    sorted_slots = torch.full((p,), t, dtype=torch.int64, device=dev)
    sorted_slots[(ends - padded)[expert_of] + rank] = order
    block_starts = torch.arange(0, p, block_m, device=dev)
    # blocks past the used length get expert E-1 (any valid id); the kernel skips them
    block_expert = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_slots, block_expert, ends[-1:]


def _block_m(num_slots: int, num_experts: int) -> int:
    """Small blocks when experts get few rows each (decode), larger for prefill."""
    per_expert = num_slots / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


if triton is not None:

    @triton.jit
    def _grouped_gemm_kernel(
        a, w, c, row_weights, sorted_slots, block_expert, num_padded,
        N, K, num_slots,
        stride_am, stride_we, stride_wn, stride_wk, stride_cm,
        A_ROWS_PER_SLOT: tl.constexpr,  # top_k for the first GEMM (slot s reads x[s // k]), 1 after
        SCALE_ROWS: tl.constexpr,
        IEEE: tl.constexpr,  # float32 inputs: no TF32
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if pid_m * BLOCK_M >= tl.load(num_padded):
            return
        slots = tl.load(sorted_slots + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = slots < num_slots
        expert = tl.load(block_expert + pid_m).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        a_rows = tl.where(valid, slots // A_ROWS_PER_SLOT, 0)
        a_ptrs = a + a_rows[:, None] * stride_am + offs_k[None, :]
        w_ptrs = w + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_left = K - k0
            a_tile = tl.load(a_ptrs, mask=valid[:, None] & (offs_k[None, :] < k_left), other=0.0)
            w_tile = tl.load(w_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
            if IEEE:
                acc += tl.dot(a_tile, w_tile, input_precision="ieee")
            else:
                acc += tl.dot(a_tile, w_tile)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk
        if SCALE_ROWS:
            scale = tl.load(row_weights + slots, mask=valid, other=0.0).to(tl.float32)
            acc = acc * scale[:, None]
        c_ptrs = c + slots[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, row_weights: torch.Tensor,
                  align: tuple[torch.Tensor, torch.Tensor, torch.Tensor], block_m: int,
                  a_rows_per_slot: int, scale_rows: bool) -> None:
    """out[s] = a[s // a_rows_per_slot] @ w[expert(s)].T (* row_weights[s]) for every slot s."""
    sorted_slots, block_expert, num_padded = align
    n_cols, k_dim = w.shape[1], w.shape[2]
    assert a.stride(1) == 1 and out.stride(1) == 1 and a.shape[1] == k_dim
    block_n = 64 if n_cols >= 64 else max(16, triton.next_power_of_2(n_cols))
    block_k = 64 if k_dim >= 64 else max(16, triton.next_power_of_2(k_dim))
    grid = (block_expert.numel(), triton.cdiv(n_cols, block_n))
    _grouped_gemm_kernel[grid](
        a, w, out, row_weights, sorted_slots, block_expert, num_padded,
        n_cols, k_dim, out.shape[0],
        a.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
        A_ROWS_PER_SLOT=a_rows_per_slot, SCALE_ROWS=scale_rows, IEEE=a.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )


def fused_experts_triton(x, w13, w2, weights, ids, act_fn) -> torch.Tensor:
    n, top_k = ids.shape
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    slots = n * top_k
    out = torch.empty(n, top_k, hidden, dtype=x.dtype, device=x.device)
    if n == 0:
        return out.sum(1)
    block_m = _block_m(slots, num_experts)
    align = moe_align(ids, num_experts, block_m)
    x = x if x.stride(1) == 1 else x.contiguous()
    flat_weights = weights.reshape(-1)
    gate_up = torch.empty(slots, two_inter, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, flat_weights, align, block_m, a_rows_per_slot=top_k, scale_rows=False)
    hidden_in = act_fn(gate_up[:, :inter]) * gate_up[:, inter:]
    _grouped_gemm(hidden_in, w2, out.view(slots, hidden), flat_weights, align, block_m,
                  a_rows_per_slot=1, scale_rows=True)
    return out.sum(1)
