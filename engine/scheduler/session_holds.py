"""How a session keeps a finished request's KV until a request that continues it runs (sessions.py).

One strategy per engine, by --disable-radix-cache:

RadixPins (the radix cache on): the finished request's KV goes to the tree as any finished request's
does, and the session locks the node where it ends, so nothing evicts it. The next turn finds it as a
cached prefix through the ordinary match (no code path of its own); a branch (`offset`, `replace`)
matches the part it shares; pins on one path cost its slots once. A hybrid model's tree also hangs
the state at the request's end on that node (with page size 1 always, else when the end is
page-aligned); checkpoints keep their own LRU, so under checkpoint pressure a later turn restarts from
the deepest checkpoint left on the path.

RowHolds (the radix cache off): nothing is shared, so the session keeps the request's row: its KV
slots and, for a hybrid model, its recurrent state (the state slot is the row). A request that
continues it takes the row over, as a chunked request keeps its row between chunks, which ends the
hold; a branch that cuts the history keeps the row's first tokens and frees the pages past them. A
recurrent state cannot go back, so for a hybrid model only a request that continues at the very end
takes the row; any other starts afresh.

Ownership of a held row (RowHolds), page-granular as everywhere:

    | 0 .. length                    | .. slots = length rounded up to a page |
    | KV computed, held              | the last page's rest: owned, not computed |
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Optional

if TYPE_CHECKING:
    from baton.engine.core.req import Req
    from baton.engine.mem_cache.allocator import TokenToKVPoolAllocator
    from baton.engine.mem_cache.base import BasePrefixCache
    from baton.engine.mem_cache.memory_pool import ReqToTokenPool


@dataclass(eq=False)
class Hold:
    """The KV of a finished request's first `length` tokens (`ids`), kept for the requests that continue it."""

    length: int
    ids: list[int] = field(repr=False)
    node: Any = None  # RadixPins: the locked tree node where the held prefix ends
    row: Optional[int] = None  # RowHolds: the held request row
    slots: int = 0  # RowHolds: KV slots the row keeps from the pool (whole pages)


def _max_prefix(req: "Req") -> int:
    """The most of a request's prompt that may come from held KV: at least one token is computed (the
    pass must yield logits), and not the positions whose input logprobs were asked for (as
    Req.init_next_round_input limits a cache match)."""
    limit = len(req.origin_input_ids) - 1
    if req.return_logprob and req.logprob_start_len >= 0:
        limit = min(limit, max(req.logprob_start_len - 1, 0))
    return limit


def _common_len(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    if a[:n] == b[:n]:
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class RadixPins:
    holds_rows = False

    def __init__(self, tree_cache: "BasePrefixCache", page_size: int) -> None:
        self.tree_cache, self.page_size = tree_cache, page_size

    def hold(self, req: "Req") -> Optional[Hold]:
        """Release the finished request as the releaser would (its KV into the tree), then lock the
        node its cached KV ends at."""
        self.tree_cache.cache_finished_req(req)
        ids = req.fill_ids  # the tokens whose KV was computed (ReqReleaser synced them)
        aligned = len(ids) // self.page_size * self.page_size
        match = self.tree_cache.match_kv_prefix(ids[:aligned])
        self.tree_cache.inc_lock_ref(match.last_node)
        return Hold(length=len(match.device_indices), ids=ids, node=match.last_node)

    def release(self, hold: Hold) -> None:
        """The pinned KV becomes evictable (it stays cached until the LRU takes it)."""
        self.tree_cache.dec_lock_ref(hold.node)

    def take_over(self, hold: Hold, req: "Req") -> bool:
        return False  # a continuing request matches the pinned prefix as any cached one

    @staticmethod
    def pinned_size(holds: Iterable[Hold]) -> int:
        """Slots of the tree nodes the pins keep (each node once: paths share their prefixes)."""
        seen: set[int] = set()
        total = 0
        for hold in holds:
            node = hold.node
            while node.parent is not None and id(node) not in seen:  # the root has no parent
                seen.add(id(node))
                total += len(node.key)
                node = node.parent
        return total


class RowHolds:
    holds_rows = True

    def __init__(self, tree_cache: "BasePrefixCache", req_to_token_pool: "ReqToTokenPool",
                 allocator: "TokenToKVPoolAllocator", page_size: int, keeps_state: bool) -> None:
        """`keeps_state`: a hybrid model, whose row also holds the recurrent state at the end."""
        self.tree_cache, self.req_to_token_pool, self.allocator = tree_cache, req_to_token_pool, allocator
        self.page_size, self.keeps_state = page_size, keeps_state

    def _pages(self, n: int) -> int:
        return -(-n // self.page_size) * self.page_size

    def _free_past(self, row: int, start: int, end: int) -> None:
        """Free the pages of the row's positions [start, end) (start page-aligned; the table has
        entries only up to what was allocated)."""
        if end > start:
            self.allocator.free(self.req_to_token_pool.req_to_token[row, start:end])

    def hold(self, req: "Req") -> Optional[Hold]:
        """Keep the finished request's row and its computed KV; pages past it go back to the pool."""
        n, row = req.kv_committed_len, req.req_pool_idx
        if n == 0:
            self.tree_cache.cache_finished_req(req)
            return None
        slots = self._pages(n)
        self._free_past(row, slots, req.kv_allocated_len)
        return Hold(length=n, ids=req.fill_ids, row=row, slots=slots)

    def release(self, hold: Hold) -> None:
        self._free_past(hold.row, 0, hold.length)
        self.req_to_token_pool.free(hold.row)

    def take_over(self, hold: Hold, req: "Req") -> bool:
        """A queued request whose prompt starts with the held tokens takes the row (as an earlier chunk
        of its own): its prefill starts after them. False when too little of it is usable."""
        n = _common_len(hold.ids, req.origin_input_ids, min(hold.length, _max_prefix(req)))
        if n == 0 or (self.keeps_state and n != hold.length):
            return False
        self._free_past(hold.row, self._pages(n), hold.length)
        req.req_pool_idx = hold.row
        req.kv_committed_len = req.kv_allocated_len = n
        req.cached_tokens = n
        return True

    @staticmethod
    def pinned_size(holds: Iterable[Hold]) -> int:
        return 0
