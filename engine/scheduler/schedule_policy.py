"""Waiting-queue ordering (fcfs, lpm, dfs-weight, lof, random, priority) and PrefillAdder, which
admits waiting requests into the next prefill batch under three budgets:

    rem_total_tokens  free + evictable KV slots, minus what running requests will still decode
                      (their remaining max_new_tokens, clipped, times new_token_ratio)
    rem_input_tokens  --max-prefill-tokens: new (non-cached) prompt tokens in one batch
    rem_chunk_tokens  --chunked-prefill-size: a longer prompt is cut into chunks of this size
"""
from __future__ import annotations

import random
from collections import defaultdict
from enum import Enum, auto
from typing import TYPE_CHECKING, Optional

from baton.engine.core.req import Req

if TYPE_CHECKING:
    from baton.engine.mem_cache.allocator import TokenToKVPoolAllocator
    from baton.engine.mem_cache.base import BasePrefixCache

# Prefix matching the whole queue every step is O(queue); beyond this size lpm/dfs-weight fall back
# to fcfs, as SGLang does.
PREFIX_POLICY_MAX_QUEUE = 128


class SchedulePolicy:
    def __init__(self, policy: str, tree_cache: "BasePrefixCache", enable_priority: bool, seed: int = 0) -> None:
        self.policy, self.tree_cache, self.enable_priority = policy, tree_cache, enable_priority
        self._rng = random.Random(seed)
        self._prefix_aware = policy in ("lpm", "dfs-weight") and tree_cache.total_size() >= 0 \
            and type(tree_cache).__name__ != "ChunkCache"

    def calc_priority(self, queue: list[Req]) -> None:
        """Sort `queue` in place, most urgent first."""
        policy = self.policy
        if policy in ("lpm", "dfs-weight") and (not self._prefix_aware or len(queue) > PREFIX_POLICY_MAX_QUEUE):
            policy = "fcfs"
        if policy in ("lpm", "dfs-weight"):
            for req in queue:  # prefix lengths for ordering only; admission matches again
                req.init_next_round_input(self.tree_cache if req.req_pool_idx is None else None)
        if policy == "fcfs":
            queue.sort(key=lambda r: r.arrival_time)
        elif policy == "lof":
            queue.sort(key=lambda r: -r.sampling_params.max_new_tokens)
        elif policy == "random":
            self._rng.shuffle(queue)
        elif policy == "lpm":
            queue.sort(key=lambda r: -len(r.prefix_indices))
        elif policy == "dfs-weight":
            queue[:] = _dfs_weight_order(queue, self.tree_cache)
        if self.enable_priority:  # stable: the policy orders within one priority level
            queue.sort(key=lambda r: -r.priority)


def _dfs_weight_order(queue: list[Req], tree_cache: "BasePrefixCache") -> list[Req]:
    """Visit the radix tree depth first, heavier subtrees (more waiting requests) first, so that
    requests sharing a prefix run together while it is cached."""
    by_node: dict[int, list[Req]] = defaultdict(list)
    nodes: dict[int, object] = {}
    weight: dict[int, int] = defaultdict(int)
    for req in queue:
        node = req.last_node
        by_node[id(node)].append(req)
        while node is not None:
            nodes[id(node)] = node
            weight[id(node)] += 1
            node = getattr(node, "parent", None)
    children: dict[int, list] = defaultdict(list)
    roots = []
    for nid, node in nodes.items():
        parent = getattr(node, "parent", None)
        (children[id(parent)] if parent is not None else roots).append(node)
    out: list[Req] = []

    def visit(node) -> None:
        out.extend(by_node.get(id(node), []))
        for child in sorted(children[id(node)], key=lambda c: -weight[id(c)]):
            visit(child)

    for root in sorted(roots, key=lambda c: -weight[id(c)]):
        visit(root)
    return out


# In-batch prefix caching (as SGLang's): a waiting request that shares at least this many tokens
# with a request already chosen for this prefill batch, beyond what the cache already holds, waits
# one round, so it hits the cache the chosen one fills instead of computing the same prefix again.
IN_BATCH_PREFIX_BLOCK = 32


class InBatchPrefixIndex:
    """Prefixes of the requests chosen for the current batch, as chained hashes of 32-token blocks."""

    def __init__(self) -> None:
        self._hashes: set[int] = set()

    @staticmethod
    def _chain(ids: list[int]):
        h = 0
        for start in range(0, len(ids) - IN_BATCH_PREFIX_BLOCK + 1, IN_BATCH_PREFIX_BLOCK):
            h = hash((h, tuple(ids[start:start + IN_BATCH_PREFIX_BLOCK])))
            yield start + IN_BATCH_PREFIX_BLOCK, h

    def add(self, ids: list[int]) -> None:
        self._hashes.update(h for _, h in self._chain(ids))

    def shared_len(self, ids: list[int]) -> int:
        shared = 0
        for end, h in self._chain(ids):
            if h not in self._hashes:
                break
            shared = end
        return shared


class AddReqResult(Enum):
    CONTINUE = auto()  # keep adding
    NO_TOKEN = auto()  # KV pool budget exhausted: the batch is full
    OTHER = auto()  # prefill/chunk budget exhausted


class PrefillAdder:
    def __init__(self, page_size: int, tree_cache: "BasePrefixCache", allocator: "TokenToKVPoolAllocator",
                 running_reqs: list[Req], new_token_ratio: float, max_prefill_tokens: int,
                 chunked_prefill_size: Optional[int], mixed_with_decode_tokens: int = 0) -> None:
        """`mixed_with_decode_tokens`: decode tokens the batch will also carry (--enable-mixed-chunk);
        they count against the input and chunk budgets, as SGLang's adder counts them, but leave at
        least a page of each, so that a prompt makes progress however many requests decode."""
        self.page_size, self.tree_cache, self.allocator = page_size, tree_cache, allocator

        def less_mixed(budget: int) -> int:
            return budget if not mixed_with_decode_tokens else max(budget - mixed_with_decode_tokens, page_size)

        self.rem_input_tokens = less_mixed(max_prefill_tokens)
        # None: chunking disabled
        self.rem_chunk_tokens = None if chunked_prefill_size is None else less_mixed(chunked_prefill_size)
        self.rem_total_token_offset = sum(r.remaining_token_budget() * new_token_ratio for r in running_reqs)
        self.can_run_list: list[Req] = []
        self.new_chunked_req: Optional[Req] = None
        self.log_hit_tokens = self.log_input_tokens = 0

    @property
    def rem_total_tokens(self) -> float:
        return self.allocator.available_size() + self.tree_cache.evictable_size() - self.rem_total_token_offset

    def _ceil_paged(self, n: int) -> int:
        return -(-n // self.page_size) * self.page_size

    def _budget_state(self) -> AddReqResult:
        if self.rem_total_tokens <= 0:
            return AddReqResult.NO_TOKEN
        if self.rem_input_tokens <= 0 or (self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0):
            return AddReqResult.OTHER
        return AddReqResult.CONTINUE

    def _take(self, req: Req, extend_len: int, reserve_decode: int) -> None:
        self.can_run_list.append(req)
        self.rem_total_token_offset += self._ceil_paged(extend_len) + reserve_decode
        self.rem_input_tokens -= extend_len
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= extend_len
        self.log_input_tokens += extend_len

    def _truncate(self, req: Req, room: int) -> int:
        """Cut req's extend to `room` tokens (page aligned); returns the new extend length."""
        trunc = room // self.page_size * self.page_size
        if trunc <= 0:
            return 0
        req.extend_input_len = trunc
        req.fill_ids = req.fill_ids[:req.kv_start_len + trunc]
        return trunc

    def add_chunked_req(self, req: Req) -> Optional[Req]:
        """The next chunk of the request being chunk-prefilled. Returns it if more chunks follow."""
        room = min(req.extend_input_len, self.rem_chunk_tokens if self.rem_chunk_tokens is not None
                   else req.extend_input_len, max(self.rem_input_tokens, 0), max(int(self.rem_total_tokens), 0))
        truncated = room < req.extend_input_len
        if truncated and self._truncate(req, room) == 0:
            return req  # no room for even one page this round; try next round
        self._take(req, req.extend_input_len, 0 if truncated else req.remaining_token_budget())
        return req if truncated else None

    def add_one_req(self, req: Req, has_chunked_req: bool) -> AddReqResult:
        extend = req.extend_input_len
        reserve = req.remaining_token_budget()
        if extend > self.rem_input_tokens and self.can_run_list:
            return AddReqResult.OTHER
        # Lock first: the request's own cached prefix must not count as space it can evict.
        self.tree_cache.inc_lock_ref(req.last_node)
        if self._ceil_paged(extend + reserve) > self.rem_total_tokens:
            self.tree_cache.dec_lock_ref(req.last_node)
            return AddReqResult.NO_TOKEN
        self.log_hit_tokens += len(req.prefix_indices)
        if self.rem_chunk_tokens is None or extend <= self.rem_chunk_tokens:
            self._take(req, extend, reserve)
            return self._budget_state()
        # Too long for one chunk: only one chunked request at a time.
        if has_chunked_req or self._truncate(req, self.rem_chunk_tokens) == 0:
            self.tree_cache.dec_lock_ref(req.last_node)
            return AddReqResult.OTHER
        self._take(req, req.extend_input_len, 0)
        self.new_chunked_req = req
        return self._budget_state()
