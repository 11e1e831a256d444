"""RadixCache: a radix tree from token ids to KV slot indices, page-granular, LRU-evicted.

Every edge key is a token-id list whose length is a multiple of page_size, and a node's value holds
the slot of each key token (same length). Children are keyed by their first page (a tuple) or, when
page_size is 1, by their first token, so a lookup never compares a partial page: only whole pages
match and nodes split only at page boundaries.

Lock counts live on nodes. inc_lock_ref(node) bumps node and every ancestor (the root is always
locked), so a locked path can never lose a leaf; a split copies lock_ref and access time to the new
parent, which keeps the counts of requests holding the split node balanced.

Eviction does not scan the tree. Every evictable node (an unlocked leaf) has an entry in a heap
keyed by (access time, id), pushed when the node becomes evictable: inserted as a leaf, unlocked as
a leaf, or left childless by an eviction. Entries go stale when a node is touched, locked or given a
child; `evict` checks the top entry and drops it (no longer evictable) or re-pushes it with the
node's current time (touched since), so it frees exactly the least recently used leaves, as a full
scan would, in O(k log n) for k evictions. A node has at most one entry. (A server with a full pool
evicts on most decode steps; with a scan, the step's cost grew with every cached request.)
"""
from __future__ import annotations

import heapq
import itertools
from typing import Any, Iterator, Optional

import torch

from baton.engine.mem_cache.base import BasePrefixCache, CacheReq, MatchResult, cache_key


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access_time", "id", "in_heap")

    def __init__(self, node_id: int, key: list[int], value: torch.Tensor, parent: Optional["TreeNode"]) -> None:
        self.id = node_id
        self.children: dict[Any, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value  # [len(key)] int64 slot indices, owned by the tree
        self.lock_ref = 0
        self.last_access_time = 0
        self.in_heap = False  # has an entry in RadixCache._evict_heap

    def __lt__(self, other: "TreeNode") -> bool:
        return (self.last_access_time, self.id) < (other.last_access_time, other.id)

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock={self.lock_ref}, t={self.last_access_time})"


class RadixCache(BasePrefixCache):
    def __init__(self, req_to_token_pool: Any, token_to_kv_pool_allocator: Any, page_size: int) -> None:
        assert page_size >= 1
        assert token_to_kv_pool_allocator.page_size == page_size, "cache and allocator page sizes differ"
        self.req_to_token_pool = req_to_token_pool
        self.allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.device = req_to_token_pool.req_to_token.device
        self._ids = itertools.count()
        self._clock = itertools.count(1)
        self.reset_tree()

    # ---- tree bookkeeping ----

    def reset_tree(self) -> None:
        """Forget every node without freeing slots (the allocator is being cleared too)."""
        self.root = self._new_node([], self._empty(), None)
        self.root.lock_ref = 1
        self._evict_heap: list[tuple[int, int, TreeNode]] = []
        self.evictable_size_ = 0
        self.protected_size_ = 0

    def reset(self) -> None:
        self.allocator.free(self.all_values_flat())
        self.reset_tree()

    def _new_node(self, key: list[int], value: torch.Tensor, parent: Optional[TreeNode]) -> TreeNode:
        return TreeNode(next(self._ids), key, value, parent)

    def _on_evicted(self, node: TreeNode) -> None:
        """`node` just left the tree (eviction); subclasses free what else it held."""

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def _child_key(self, key: list[int]) -> Any:
        return key[0] if self.page_size == 1 else tuple(key[: self.page_size])

    def _match_len(self, node_key: list[int], key: list[int]) -> int:
        """Common prefix length of two keys, in whole pages."""
        n = min(len(node_key), len(key))
        if node_key[:n] == key[:n]:
            return n - n % self.page_size
        page = self.page_size
        i = 0
        while i + page <= n and node_key[i : i + page] == key[i : i + page]:
            i += page
        return i

    def _split(self, child: TreeNode, split_len: int) -> TreeNode:
        """Cut child's edge at split_len (page-aligned); returns the new upper node."""
        parent = child.parent
        upper = self._new_node(child.key[:split_len], child.value[:split_len], parent)
        upper.lock_ref = child.lock_ref
        upper.last_access_time = child.last_access_time
        child.key = child.key[split_len:]
        child.value = child.value[split_len:]
        child.parent = upper
        upper.children[self._child_key(child.key)] = child
        parent.children[self._child_key(upper.key)] = upper
        return upper

    def _mark_evictable(self, node: TreeNode) -> None:
        """`node` just became an unlocked leaf: make sure the eviction heap holds an entry for it."""
        if not node.in_heap:
            node.in_heap = True
            heapq.heappush(self._evict_heap, (node.last_access_time, node.id, node))

    def _iter_nodes(self) -> Iterator[TreeNode]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # ---- public API ----

    def _descend(self, key: list[int], now: int) -> tuple[TreeNode, list[TreeNode]]:
        """Walk down along `key` (page-aligned), refreshing access times and splitting the last edge
        so the walk ends exactly at the match. Returns the deepest node and the matched path."""
        node, path = self.root, []
        node.last_access_time = now
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            child.last_access_time = now
            n = self._match_len(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)
            path.append(child)
            node = child
            key = key[n:]
        return node, path

    def match_prefix(self, key: list[int]) -> MatchResult:
        return self._match_kv(key)

    def match_kv_prefix(self, key: list[int]) -> MatchResult:
        return self._match_kv(key)

    def _match_kv(self, key: list[int]) -> MatchResult:
        """The longest cached page-aligned prefix of `key`, by KV alone."""
        return self._result(self._matched_path(key))

    def _matched_path(self, key: list[int]) -> list[TreeNode]:
        """The nodes along the longest cached page-aligned prefix of `key` (access times refreshed)."""
        return self._descend(list(key[: len(key) - len(key) % self.page_size]), next(self._clock))[1]

    def _result(self, path: list[TreeNode]) -> MatchResult:
        indices = torch.cat([n.value for n in path]) if path else self._empty()
        return MatchResult(device_indices=indices, last_node=path[-1] if path else self.root)

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        assert len(key) % self.page_size == 0, f"key length {len(key)} is not page-aligned"
        assert len(key) == value.numel(), "key and value lengths differ"
        now = next(self._clock)
        node, path = self._descend(list(key), now)
        cached = sum(len(n.key) for n in path)
        rest = list(key[cached:])
        if rest:
            # clone: value is usually a view of a req_to_token row, which gets reused
            leaf = self._new_node(rest, value[cached:].clone(), node)
            leaf.last_access_time = now
            node.children[self._child_key(rest)] = leaf
            self.evictable_size_ += len(rest)
            self._mark_evictable(leaf)
        return cached

    def _insert_committed(self, req: CacheReq) -> tuple[torch.Tensor, int, int]:
        """Insert the request's computed, page-aligned KV and free the slots the tree already held
        (duplicates). Returns (the row's slots, len(prefix_indices), the aligned length)."""
        kv = self.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_allocated_len]
        num_prefix = len(req.prefix_indices)
        aligned = req.kv_committed_len // self.page_size * self.page_size
        assert num_prefix <= aligned, f"prefix {num_prefix} longer than committed page-aligned KV {aligned}"
        cached = self.insert(cache_key(req.fill_ids[:aligned], req.lora_uid), kv[:aligned])
        assert cached >= num_prefix, "the request's locked prefix is no longer in the tree"
        self.allocator.free(kv[num_prefix:cached])
        return kv, num_prefix, aligned

    def cache_finished_req(self, req: CacheReq) -> None:
        kv, _, aligned = self._insert_committed(req)
        self.allocator.free(kv[aligned:])
        self.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)

    def cache_unfinished_req(self, req: CacheReq) -> None:
        row = req.req_pool_idx
        _, num_prefix, aligned = self._insert_committed(req)
        new_indices, new_node = self._match_kv(cache_key(req.fill_ids[:aligned], req.lora_uid))
        assert len(new_indices) == aligned, f"re-match found {len(new_indices)} of {aligned} tokens"
        self.req_to_token_pool.req_to_token[row, num_prefix:aligned] = new_indices[num_prefix:]
        self.inc_lock_ref(new_node)
        self.dec_lock_ref(req.last_node)
        req.prefix_indices = new_indices
        req.last_node = new_node

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots (fewer if the unlocked leaves run out), least recently
        used leaves first; a parent left childless and unlocked becomes a candidate in turn."""
        heap = self._evict_heap
        freed: list[torch.Tensor] = []
        num_freed = 0
        while num_freed < num_tokens and heap:
            stamp, _, leaf = heap[0]
            if leaf.children or leaf.lock_ref:  # no longer evictable: becoming so again pushes it anew
                heapq.heappop(heap)
                leaf.in_heap = False
                continue
            if stamp != leaf.last_access_time:  # touched since it was pushed: back in at its place now
                heapq.heapreplace(heap, (leaf.last_access_time, leaf.id, leaf))
                continue
            heapq.heappop(heap)
            leaf.in_heap = False
            parent = leaf.parent
            del parent.children[self._child_key(leaf.key)]
            freed.append(leaf.value)
            self._on_evicted(leaf)
            num_freed += len(leaf.key)
            self.evictable_size_ -= len(leaf.key)
            if not parent.children and parent.lock_ref == 0:  # the root is always locked
                self._mark_evictable(parent)
        if freed:
            self.allocator.free(torch.cat(freed))
        return num_freed

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size_ -= len(node.key)
                self.protected_size_ += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, f"unbalanced dec_lock_ref on {node}"
            if node.lock_ref == 1:
                self.evictable_size_ += len(node.key)
                self.protected_size_ -= len(node.key)
                if not node.children:
                    self._mark_evictable(node)
            node.lock_ref -= 1
            node = node.parent

    def evictable_size(self) -> int:
        return self.evictable_size_

    def protected_size(self) -> int:
        return self.protected_size_

    # ---- debugging and integrity checks ----

    def all_values_flat(self) -> torch.Tensor:
        values = [n.value for n in self._iter_nodes() if n is not self.root]
        return torch.cat(values) if values else self._empty()

    def pretty_print(self) -> str:
        lines: list[str] = []
        stack = [(self.root, 0)]
        while stack:
            node, depth = stack.pop()
            head = node.key[:8]
            more = "..." if len(node.key) > 8 else ""
            lines.append(f"{'  ' * depth}[{len(node.key)}] {head}{more} lock={node.lock_ref} t={node.last_access_time}")
            stack.extend((c, depth + 1) for c in node.children.values())
        lines.append(f"evictable={self.evictable_size_} protected={self.protected_size_}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        sizes = f"evictable={self.evictable_size_}, protected={self.protected_size_}"
        return f"RadixCache(page_size={self.page_size}, {sizes})"
