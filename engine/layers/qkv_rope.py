"""The attention input: the fused qkv projection's output split into q, k, v, the optional per-head
q/k RMSNorm (Qwen3), and the rotary embedding; on CUDA also the KV-cache store, all in one kernel.

    reference (torch)   split -> q_norm/k_norm -> RoPE -> (q, k, v); the attention backend stores k, v
    CUDA (Triton)       one kernel: q out, rotated k and v written into the layer's KV slots
                        (triton_ops/qkv_rope.py); the backend is told the KV is stored already

The fused path runs where the attention backend reads a pass's new K/V back from the pool
(FlashInfer), the cache has the model's dtype, the RoPE covers the whole head and the positions are
1-D (not M-RoPE's [3, n]); otherwise the reference runs.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Optional

import torch

from baton.engine.layers.custom_op import CustomOp

if TYPE_CHECKING:
    from baton.engine.core.forward_batch import ForwardBatch
    from baton.engine.layers.layernorm import RMSNorm
    from baton.engine.layers.rotary_embedding import RotaryEmbedding


class AttentionInput(NamedTuple):
    q: torch.Tensor  # [n, num_heads * head_dim]
    k: Optional[torch.Tensor]  # [n, num_kv_heads * head_dim]; None once stored in the KV cache
    v: Optional[torch.Tensor]

    @property
    def kv_stored(self) -> bool:
        return self.k is None


class QKVRope(CustomOp):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_id: int, rotary_emb: "RotaryEmbedding",
                 q_norm: Optional["RMSNorm"] = None, k_norm: Optional["RMSNorm"] = None) -> None:
        super().__init__()
        assert (q_norm is None) == (k_norm is None), "q and k norms come together"
        self.num_heads, self.num_kv_heads, self.head_dim, self.layer_id = num_heads, num_kv_heads, head_dim, layer_id
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        # Held, not registered: the attention layer owns these modules (and their checkpoint names).
        self._parts = (rotary_emb, q_norm, k_norm)

    def forward_native(self, positions: torch.Tensor, qkv: torch.Tensor, forward_batch: "ForwardBatch") -> AttentionInput:
        rotary_emb, q_norm, k_norm = self._parts
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if q_norm is not None:
            n = qkv.shape[0]
            q = q_norm(q.reshape(n, self.num_heads, self.head_dim)).view(n, self.q_size)
            k = k_norm(k.reshape(n, self.num_kv_heads, self.head_dim)).view(n, self.kv_size)
        q, k = rotary_emb(positions, q, k)
        return AttentionInput(q, k, v.contiguous())

    def forward_cuda(self, positions: torch.Tensor, qkv: torch.Tensor, forward_batch: "ForwardBatch") -> AttentionInput:
        rotary_emb, q_norm, k_norm = self._parts
        pool = forward_batch.token_to_kv_pool
        k_buffer, v_buffer = pool.k_buffer[self.layer_id], pool.v_buffer[self.layer_id]
        # the kernel reads the tables by 1-D positions: M-RoPE's [3, n] take the reference
        if (not getattr(forward_batch.attn_backend, "reads_new_kv_from_pool", False) or k_buffer.dtype != qkv.dtype
                or positions.dim() != 1
                or qkv.stride(-1) != 1 or rotary_emb.cos_table is None or rotary_emb.rotary_dim != self.head_dim
                or rotary_emb.cos_table.device != qkv.device
                or (q_norm is not None and q_norm.weight.dtype != qkv.dtype)):
            return self.forward_native(positions, qkv, forward_batch)
        from baton.engine.triton_ops.qkv_rope import qkv_rope_store

        q = qkv_rope_store(qkv, positions, rotary_emb.cos_table, rotary_emb.sin_table, self.num_heads,
                           self.num_kv_heads, self.head_dim, k_buffer, v_buffer, forward_batch.out_cache_loc,
                           q_norm.weight if q_norm is not None else None, k_norm.weight if k_norm is not None else None,
                           q_norm.variance_epsilon if q_norm is not None else 1e-6)
        return AttentionInput(q, None, None)
