"""The attention input in one Triton kernel: split the fused qkv projection, RMSNorm each q/k head
(Qwen3), rotate q and k (NeoX "rotate half" RoPE from the cos/sin tables), write q out and k, v
straight into this layer's KV-cache slots. The CUDA path of layers/qkv_rope.py; it replaces a
split, two norms, ~12 rotary ops, two contiguous copies and the KV store.

    qkv row of token t:  [ q head 0 | ... | q head H-1 | k head 0 | ... | k head K-1 | v head 0 | ... ]
    program (t, h):      h < H: q head h -> q_out[t, h]
                         h >= H: k head h-H -> k_buffer[loc[t], h-H] (rotated), v head h-H -> v_buffer[loc[t], h-H]

The rotation is computed in float32 from the float32 tables and rounded once (torch's path rounds
after each product), so q and k agree with the reference within the dtype's rounding.
"""
from __future__ import annotations

from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs may lack triton; the layer's torch path serves them
    triton = None


def qkv_rope_store(qkv: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                   num_heads: int, num_kv_heads: int, head_dim: int, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                   loc: torch.Tensor, q_norm_weight: Optional[torch.Tensor] = None,
                   k_norm_weight: Optional[torch.Tensor] = None, eps: float = 1e-6) -> torch.Tensor:
    """qkv [n, (H + 2K) * D] (rows contiguous); positions, loc [n]; cos/sin tables [P, D // 2] float32;
    k/v buffers [slots, K, D]. Writes k, v at loc; returns q [n, H * D] (contiguous)."""
    n = qkv.shape[0]
    if qkv.dim() != 2 or qkv.stride(1) != 1 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv_rope_store: qkv {tuple(qkv.shape)} is not [n, (H + 2K) * D] with contiguous rows")
    if cos_table.shape[1] * 2 != head_dim or cos_table.stride() != sin_table.stride() or cos_table.stride(1) != 1:
        raise ValueError(f"qkv_rope_store: cos/sin tables {tuple(cos_table.shape)} do not fit head_dim {head_dim}")
    if not (k_buffer.is_contiguous() and v_buffer.is_contiguous() and k_buffer.shape[1:] == (num_kv_heads, head_dim)
            and k_buffer.stride() == v_buffer.stride()):
        raise ValueError(f"qkv_rope_store: KV buffers {tuple(k_buffer.shape)} do not hold {num_kv_heads} x {head_dim}")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("qkv_rope_store: q and k norms come together")
    q = torch.empty((n, num_heads * head_dim), dtype=qkv.dtype, device=qkv.device)
    if n == 0:
        return q
    has_norm = q_norm_weight is not None
    half_block = triton.next_power_of_2(head_dim // 2)
    _qkv_rope_store_kernel[(n, num_heads + num_kv_heads)](
        qkv, positions, cos_table, sin_table, q, k_buffer, v_buffer, loc,
        q_norm_weight if has_norm else qkv, k_norm_weight if has_norm else qkv,
        qkv.stride(0), cos_table.stride(0), q.stride(0), k_buffer.stride(0), eps,
        NUM_Q=num_heads, NUM_KV=num_kv_heads, HEAD_DIM=head_dim, HALF_BLOCK=half_block, HAS_NORM=has_norm,
        num_warps=1 if head_dim <= 128 else 2)
    return q


if triton is not None:

    @triton.jit
    def _qkv_rope_store_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, q_ptr, k_buf, v_buf, loc_ptr, qw_ptr, kw_ptr,
                               qkv_stride, table_stride, q_stride, buf_stride, eps,
                               NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
                               HALF_BLOCK: tl.constexpr, HAS_NORM: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        half: tl.constexpr = HEAD_DIM // 2
        offs = tl.arange(0, HALF_BLOCK)
        mask = offs < half
        src = qkv_ptr + token * qkv_stride + head * HEAD_DIM  # q heads then k heads: one offset for both
        x1 = tl.load(src + offs, mask=mask, other=0.0)
        x2 = tl.load(src + half + offs, mask=mask, other=0.0)
        is_q = head < NUM_Q
        if HAS_NORM:
            f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
            rstd = tl.rsqrt((tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)) / HEAD_DIM + eps)
            w_ptr = tl.where(is_q, qw_ptr, kw_ptr)
            w1 = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            w2 = tl.load(w_ptr + half + offs, mask=mask, other=0.0).to(tl.float32)
            x1 = (w1 * (f1 * rstd).to(qkv_ptr.dtype.element_ty).to(tl.float32)).to(qkv_ptr.dtype.element_ty)
            x2 = (w2 * (f2 * rstd).to(qkv_ptr.dtype.element_ty).to(tl.float32)).to(qkv_ptr.dtype.element_ty)
        pos = tl.load(pos_ptr + token).to(tl.int64)
        cos = tl.load(cos_ptr + pos * table_stride + offs, mask=mask, other=0.0)
        sin = tl.load(sin_ptr + pos * table_stride + offs, mask=mask, other=0.0)
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        o1 = a * cos - b * sin
        o2 = b * cos + a * sin
        if is_q:
            q_dst = q_ptr + token * q_stride + head * HEAD_DIM
            tl.store(q_dst + offs, o1.to(q_ptr.dtype.element_ty), mask=mask)
            tl.store(q_dst + half + offs, o2.to(q_ptr.dtype.element_ty), mask=mask)
        else:
            kv_head = head - NUM_Q
            slot = tl.load(loc_ptr + token).to(tl.int64)
            kv_off = slot * buf_stride + kv_head * HEAD_DIM
            tl.store(k_buf + kv_off + offs, o1.to(k_buf.dtype.element_ty), mask=mask)
            tl.store(k_buf + kv_off + half + offs, o2.to(k_buf.dtype.element_ty), mask=mask)
            v_src = qkv_ptr + token * qkv_stride + (NUM_Q + NUM_KV + kv_head) * HEAD_DIM
            v1 = tl.load(v_src + offs, mask=mask, other=0.0)
            v2 = tl.load(v_src + half + offs, mask=mask, other=0.0)
            tl.store(v_buf + kv_off + offs, v1.to(v_buf.dtype.element_ty), mask=mask)
            tl.store(v_buf + kv_off + half + offs, v2.to(v_buf.dtype.element_ty), mask=mask)
