"""The attention layer a model holds: its head geometry plus a call into the pass's backend."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

if TYPE_CHECKING:
    from baton.engine.core.forward_batch import ForwardBatch


class RadixAttention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scaling: float, num_kv_heads: int, layer_id: int) -> None:
        super().__init__()
        assert num_heads % num_kv_heads == 0, f"GQA needs num_heads ({num_heads}) % num_kv_heads ({num_kv_heads}) == 0"
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.num_kv_heads = num_kv_heads
        self.layer_id = layer_id

    def forward(self, q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                forward_batch: "ForwardBatch", save_kv_cache: bool = True) -> torch.Tensor:
        """q [n, num_heads * head_dim], k/v [n, num_kv_heads * head_dim] -> [n, num_heads * head_dim].
        save_kv_cache=False: k and v are in the KV cache already (then they may be None)."""
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch, save_kv_cache)

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, layer={self.layer_id}"
