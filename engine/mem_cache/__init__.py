"""Memory: the prefix cache (radix or naive), the request-to-token pool and the KV pool allocator.

`create_prefix_cache` picks the prefix cache; implementations are imported lazily.
"""
from __future__ import annotations

from typing import Any

from baton.engine.mem_cache.base import BasePrefixCache


def create_prefix_cache(
    disable_radix_cache: bool, req_to_token_pool: Any, allocator: Any, page_size: int, state_pool: Any = None,
    track_interval: int = 0,
) -> BasePrefixCache:
    """`state_pool`: a hybrid model's recurrent-state pool; its checkpoint slots go to the radix
    cache, which keeps a state every `track_interval` tokens (hybrid_radix_cache.py)."""
    if disable_radix_cache:
        from baton.engine.mem_cache.chunk_cache import ChunkCache

        return ChunkCache(req_to_token_pool, allocator, page_size)
    if state_pool is not None:
        from baton.engine.mem_cache.hybrid_radix_cache import HybridRadixCache

        return HybridRadixCache(req_to_token_pool, allocator, page_size, state_pool.checkpoint_slots(), track_interval)
    from baton.engine.mem_cache.radix_cache import RadixCache

    return RadixCache(req_to_token_pool, allocator, page_size)
