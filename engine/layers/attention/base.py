"""Attention backend contract.

A backend reads and writes the paged KV pool through `forward_batch.req_to_token_pool` and
`forward_batch.token_to_kv_pool`. Contract:
- `init_forward_metadata(fb)` runs once per forward pass, before any layer; it may store index
  tensors in `fb.attn_metadata` (the layers then reuse them).
- `forward(q, k, v, layer, fb)` first writes this pass's K/V into the pool at `fb.out_cache_loc`
  (when `save_kv_cache`), then attends each new token to all of its request's KV
  `req_to_token[req_pool_indices[i], :seq_lens[i]]` with causal masking inside the new tokens.
- Shapes: q [num_tokens, num_heads * head_dim], k/v [num_tokens, num_kv_heads * head_dim];
  returns [num_tokens, num_heads * head_dim] in q's dtype. GQA: num_heads % num_kv_heads == 0.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from baton.engine.layers.radix_attention import RadixAttention
    from baton.engine.model_executor.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    @abstractmethod
    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        """Precompute per-pass index data (called once per forward, before the first layer)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "RadixAttention",
                forward_batch: "ForwardBatch", save_kv_cache: bool = True) -> torch.Tensor:
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)

    @staticmethod
    def _save_kv(k: torch.Tensor, v: torch.Tensor, layer: "RadixAttention", fb: "ForwardBatch") -> None:
        """Write this pass's K/V ([num_tokens, num_kv_heads * head_dim]) into the pool at fb.out_cache_loc."""
        n = k.shape[0]
        fb.token_to_kv_pool.set_kv_buffer(
            layer.layer_id, fb.out_cache_loc,
            k.view(n, layer.num_kv_heads, layer.head_dim), v.view(n, layer.num_kv_heads, layer.head_dim))

    @abstractmethod
    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "RadixAttention",
                       forward_batch: "ForwardBatch", save_kv_cache: bool = True) -> torch.Tensor:
        """Several new tokens per request, after an optional cached prefix."""

    @abstractmethod
    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "RadixAttention",
                       forward_batch: "ForwardBatch", save_kv_cache: bool = True) -> torch.Tensor:
        """Exactly one new token per request."""
