"""Prefix cache contract (the radix cache and the naive cache behind --disable-radix-cache).

Memory has three levels:

    prefix cache (token ids -> KV slot indices, shared, LRU-evictable)
      -> ReqToTokenPool   (request row -> KV slot indices of that request, in token order)
        -> TokenToKVPoolAllocator + KV pool tensors (the physical pages)

Ownership of the slots in one request's row `req_to_token[req.req_pool_idx, :req.kv_allocated_len]`:

    | 0 .. len(req.prefix_indices)  | .. req.kv_committed_len | .. req.kv_allocated_len |
    | owned by the cache, locked    | owned by the request,   | owned by the request,   |
    | via req.last_node             | KV computed             | allocated, not computed |

The cache only ever holds page-aligned keys: every node's key length is a multiple of page_size, so
whole pages move between owners. Indices returned by match_prefix stay valid only while the node
(or a descendant) is locked with inc_lock_ref; unlocked nodes may be evicted at any time.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, NamedTuple, Optional, Protocol

import torch

if TYPE_CHECKING:
    from baton.engine.mem_cache.state_pool import StateOps


# Keys of a LoRA adapter's requests live in a namespace of their own: the same tokens under another adapter
# (or none) have other KV. Token ids are below 2**31; namespace n moves every id of a key by n << 32, so keys
# of two namespaces never share a page, and namespace 0 (the base model) is the ids themselves.
NAMESPACE_SHIFT = 32


def cache_key(ids: list[int], namespace: int) -> list[int]:
    """The prefix cache's key of token ids in `namespace` (a request's lora_uid)."""
    if not namespace:
        return ids
    offset = namespace << NAMESPACE_SHIFT
    return [t + offset for t in ids]


class MatchResult(NamedTuple):
    device_indices: torch.Tensor  # [matched_len] int64 KV slot indices, matched_len % page_size == 0
    last_node: Any  # the deepest matched node; lock it to keep the indices valid


class CacheReq(Protocol):
    """The request attributes a prefix cache reads and updates."""

    req_pool_idx: int
    fill_ids: list[int]  # token ids whose KV the request has or will have
    prefix_indices: torch.Tensor  # cache-owned prefix slots (int64)
    last_node: Any
    kv_committed_len: int
    kv_allocated_len: int
    origin_input_ids: list[int]
    output_ids: list[int]
    # hybrid models: (position, checkpoint slot) of states tracked for this request, not yet on a node
    state_checkpoints: list[tuple[int, int]]
    lora_uid: int  # the key namespace of the request's tokens (cache_key); 0: the base model's


class BasePrefixCache(ABC):
    page_size: int
    # hybrid models' cache (hybrid_radix_cache.py) keeps recurrent-state checkpoints and plans the
    # state work of each pass; every other cache has none, and these hooks do nothing
    tracks_state = False

    def restore_state(self, req: CacheReq) -> None:
        """`req` matched a prefix and just got its row: start it from the prefix's state."""

    def plan_extend_tracks(self, req: CacheReq, start: int, end: int, more_chunks: bool) -> list[tuple[int, int]]:
        """State checkpoints an extend of tokens [start, end) takes: (offset into it, slot)."""
        return []

    def plan_decode_track(self, req: CacheReq, new_len: int) -> list[tuple[int, int]]:
        return []

    # recurrent-state copies queued for the next pass (hybrid models: a hit's checkpoint into its row, a
    # request's end state into a checkpoint, a speculative step's rollback); None while there are none
    _state_copies: Optional[list[tuple[int, int]]] = None

    def queue_state_copy(self, src: int, dst: int) -> None:
        """Copy state slot `src` into `dst` at the start of the next pass (before its layers)."""
        if self._state_copies is None:
            self._state_copies = []
        self._state_copies.append((src, dst))

    def take_state_ops(self, tracks: Optional[dict[int, list[tuple[int, int]]]] = None) -> Optional["StateOps"]:
        """The state work the next pass does: the copies queued since the last pass, and `tracks`."""
        if not self._state_copies and not tracks:  # every step of a model without recurrent state
            return None
        from baton.engine.mem_cache.state_pool import StateOps

        copies, self._state_copies = self._state_copies or [], None
        return StateOps(copies, tracks or {})

    def check_state_slots(self) -> bool:
        return True

    def pending_state_sources(self) -> set[int]:
        """State slots that a copy queued for the next pass still reads (take_state_ops has not
        taken it): nothing may write them from outside a pass (a PD decode's incoming state)."""
        return {src for src, _ in self._state_copies or ()}

    @abstractmethod
    def reset(self) -> None:
        """Drop every node and free its slots (used by /flush_cache when nothing is running)."""

    @abstractmethod
    def match_prefix(self, key: list[int]) -> MatchResult:
        """Longest cached page-aligned prefix of `key`; refreshes LRU time along the path."""

    def match_kv_prefix(self, key: list[int]) -> MatchResult:
        """match_prefix by KV alone: a hybrid model's cache would back off to the deepest node with a
        state checkpoint, which a PD decode does not need (its state always comes from the prefill)."""
        return self.match_prefix(key)

    @abstractmethod
    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Insert key -> slot indices (len(key) % page_size == 0). Returns how many leading tokens
        were already cached: the caller still owns value[:that] and must free it (duplicates)."""

    @abstractmethod
    def cache_finished_req(self, req: CacheReq) -> None:
        """The request is done: give its computed page-aligned KV to the cache, free duplicate and
        tail slots, unlock req.last_node, free the request row. Every slot in the row ends up either
        cached or free."""

    @abstractmethod
    def cache_unfinished_req(self, req: CacheReq) -> None:
        """Mid-request (chunked prefill): insert the computed page-aligned KV, then point
        req.prefix_indices / req.last_node at the (locked) cached copy. The request keeps its row."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Evict unlocked leaves, least recently used first, until num_tokens slots are freed or
        nothing is evictable. Returns the number of slots freed."""

    @abstractmethod
    def inc_lock_ref(self, node: Any) -> None:
        """Protect node and its ancestors from eviction (moves their size evictable -> protected)."""

    @abstractmethod
    def dec_lock_ref(self, node: Any) -> None:
        """Undo one inc_lock_ref."""

    @abstractmethod
    def evictable_size(self) -> int:
        """Slots held by unlocked nodes."""

    @abstractmethod
    def protected_size(self) -> int:
        """Slots held by locked nodes."""

    def total_size(self) -> int:
        return self.evictable_size() + self.protected_size()
