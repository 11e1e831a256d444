"""ChunkCache: the naive prefix cache behind --disable-radix-cache. It caches nothing.

Every request owns its whole row (`prefix_indices` stays empty, `last_node` stays None), so a
finished request frees all its slots and the row; nothing is ever shared or evictable. Kept as the
slow, obvious path beside RadixCache: both must produce the same tokens.
"""
from __future__ import annotations

from typing import Any

import torch

from baton.engine.mem_cache.base import BasePrefixCache, CacheReq, MatchResult


class ChunkCache(BasePrefixCache):
    def __init__(self, req_to_token_pool: Any, token_to_kv_pool_allocator: Any, page_size: int) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.device = req_to_token_pool.req_to_token.device

    def reset(self) -> None:
        pass

    def match_prefix(self, key: list[int]) -> MatchResult:
        return MatchResult(device_indices=torch.empty(0, dtype=torch.int64, device=self.device), last_node=None)

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        # Nothing is stored, so by the contract every slot stays with the caller, who must free it.
        return len(key)

    def cache_finished_req(self, req: CacheReq) -> None:
        row = req.req_pool_idx
        self.allocator.free(self.req_to_token_pool.req_to_token[row, : req.kv_allocated_len])
        self.req_to_token_pool.free(row)

    def cache_unfinished_req(self, req: CacheReq) -> None:
        pass  # the request keeps owning its whole row

    def evict(self, num_tokens: int) -> int:
        return 0

    def inc_lock_ref(self, node: Any) -> None:
        pass

    def dec_lock_ref(self, node: Any) -> None:
        pass

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def all_values_flat(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def pretty_print(self) -> str:
        return "ChunkCache(empty)"

    def __repr__(self) -> str:
        return f"ChunkCache(page_size={self.page_size})"
