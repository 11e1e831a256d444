"""The two lower memory levels: request rows (ReqToTokenPool) and the physical KV tensors (MHATokenToKVPool).

KV pool layout, per layer and separately for K and V (one contiguous tensor each, because PD
transfer registers every layer buffer with the transfer engine):

    slot:   0 .. page_size-1 | page_size .. size+page_size-1
            dummy page 0     | usable slots, handed out by TokenToKVPoolAllocator
            (padded / garbage writes land here; never allocated)
"""
from __future__ import annotations

from typing import Union

import torch

from baton.engine.triton_ops.kv_store import store_kv


class ReqToTokenPool:
    """Row r maps request-local token positions to KV slot indices: req_to_token[r, pos] = slot."""

    def __init__(self, size: int, max_context_len: int, device: str) -> None:
        assert size > 0 and max_context_len > 0
        self.size = size
        self.max_context_len = max_context_len
        self.device = device
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=device)
        self.clear()

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """n free rows, or None (and nothing taken) when fewer than n are free."""
        if n > len(self._free):
            return None
        rows, self._free = self._free[:n], self._free[n:]
        self._is_free_set.difference_update(rows)
        return rows

    def free(self, idx: Union[int, list[int]]) -> None:
        rows = [idx] if isinstance(idx, int) else list(idx)
        for r in rows:
            assert 0 <= r < self.size, f"request row {r} out of range"
            assert r not in self._is_free_set, f"double free of request row {r}"
            self._is_free_set.add(r)
        self._free.extend(rows)

    def clear(self) -> None:
        self._free: list[int] = list(range(self.size))
        self._is_free_set: set[int] = set(self._free)


class MHATokenToKVPool:
    """Per-layer K and V tensors of shape [size + page_size, head_num, head_dim] (see module docstring)."""

    layout = "mha"  # what kernels that read the tensors directly check (model_executor/native_forward.py)

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, head_num: int, head_dim: int,
                 layer_num: int, device: str) -> None:
        assert size > 0 and page_size >= 1 and layer_num > 0
        self.size, self.page_size, self.dtype = size, page_size, dtype
        self.head_num, self.head_dim, self.layer_num = head_num, head_dim, layer_num
        self.device = device
        shape = (size + page_size, head_num, head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layer_num)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layer_num)]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        """loc [n] slots; cache_k / cache_v [n, head_num, head_dim], cast to the pool dtype."""
        store_kv(self.k_buffer[layer_id], self.v_buffer[layer_id], loc, cache_k, cache_v)  # Triton on CUDA

    def move_kv_cache(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Every layer's K and V of slots `src` into slots `dst` (speculative tree drafts: the accepted
        path's KV into the columns a request keeps). Each source is read before any slot is written,
        so the two may overlap."""
        for k, v in zip(self.k_buffer, self.v_buffer):
            k[dst] = k[src]
            v[dst] = v[src]

    @property
    def bytes_per_token(self) -> int:
        """K and V of one slot in one layer (each)."""
        return self.head_num * self.head_dim * self.k_buffer[0].element_size()

    def get_kv_size_bytes(self) -> int:
        return sum(t.nbytes for t in self.k_buffer) + sum(t.nbytes for t in self.v_buffer)

    def get_contiguous_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """(data_ptrs, byte lengths, bytes per token slot), all K layers then all V layers."""
        bufs = self.k_buffer + self.v_buffer
        return [t.data_ptr() for t in bufs], [t.nbytes for t in bufs], [self.bytes_per_token] * len(bufs)
