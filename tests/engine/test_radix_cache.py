"""RadixCache and ChunkCache: matching, splits, locks, LRU eviction, request caching, and a
fixed-seed random mini-scheduler that checks the memory accounting after every step."""
import heapq
import random
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from baton.engine.mem_cache import create_prefix_cache
from baton.engine.mem_cache.allocator import TokenToKVPoolAllocator
from baton.engine.mem_cache.chunk_cache import ChunkCache
from baton.engine.mem_cache.radix_cache import RadixCache

try:
    from baton.engine.mem_cache.memory_pool import ReqToTokenPool
except ImportError:  # memory_pool.py is written in parallel; same attributes as the real one

    class ReqToTokenPool:
        def __init__(self, size: int, max_context_len: int, device: str) -> None:
            self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=device)
            self._free = list(range(size))

        def alloc(self, n: int):
            if n > len(self._free):
                return None
            rows, self._free = self._free[:n], self._free[n:]
            return rows

        def free(self, idx: int) -> None:
            assert idx not in self._free
            self._free.append(idx)

        def available_size(self) -> int:
            return len(self._free)


@dataclass(eq=False)
class FakeReq:
    req_pool_idx: int
    fill_ids: list[int]
    prefix_indices: torch.Tensor
    last_node: Any
    kv_committed_len: int = 0
    kv_allocated_len: int = 0
    extra: dict = field(default_factory=dict)
    lora_uid: int = 0


def make(page: int, pages: int = 64, rows: int = 16, max_len: int = 256):
    allocator = TokenToKVPoolAllocator(size=pages * page, page_size=page, device="cpu")
    pool = ReqToTokenPool(rows, max_len, "cpu")
    return RadixCache(pool, allocator, page), allocator, pool


def insert_fresh(tree: RadixCache, allocator: TokenToKVPoolAllocator, key: list[int]) -> torch.Tensor:
    value = allocator.alloc_extend([0], [len(key)], [-1])
    allocator.free(value[: tree.insert(key, value)])
    return value


def check_sizes(tree: RadixCache) -> None:
    nodes = [n for n in tree._iter_nodes() if n is not tree.root]
    assert tree.evictable_size() == sum(len(n.key) for n in nodes if n.lock_ref == 0)
    assert tree.protected_size() == sum(len(n.key) for n in nodes if n.lock_ref > 0)
    for n in nodes:
        assert len(n.key) % tree.page_size == 0 and len(n.key) == n.value.numel() > 0
        assert n.parent.children[tree._child_key(n.key)] is n
        assert n.lock_ref <= n.parent.lock_ref or n.parent is tree.root
        if not n.children and n.lock_ref == 0:  # evictable: the eviction heap must hold it
            assert n.in_heap
    queued = [entry[2] for entry in tree._evict_heap]
    assert len(queued) == len({id(n) for n in queued}), "a node has two heap entries"
    assert all(n.in_heap for n in queued)
    assert sum(n.in_heap for n in nodes) == len(queued)


def scan_eviction(tree: RadixCache, num_tokens: int) -> tuple[list[int], int]:
    """What a full scan would evict (node ids, tokens): the reference the heap must agree with.
    Collect every unlocked leaf, pop the least recently used (ties: the older node) until enough is
    freed; a parent left childless and unlocked joins the candidates. Reads the tree, changes nothing."""
    nodes = [n for n in tree._iter_nodes() if n is not tree.root]
    children = {n.id: len(n.children) for n in nodes}
    heap = [(n.last_access_time, n.id, n) for n in nodes if not n.children and n.lock_ref == 0]
    heapq.heapify(heap)
    evicted, freed = [], 0
    while freed < num_tokens and heap:
        _, node_id, leaf = heapq.heappop(heap)
        evicted.append(node_id)
        freed += len(leaf.key)
        parent = leaf.parent
        if parent is not tree.root:
            children[parent.id] -= 1
            if children[parent.id] == 0 and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
    return evicted, freed


def evict_checked(tree: RadixCache, num_tokens: int) -> int:
    """tree.evict, checked against `scan_eviction`: the same nodes go, and as many tokens."""
    expected, expected_freed = scan_eviction(tree, num_tokens)
    before = {n.id for n in tree._iter_nodes()}
    freed = tree.evict(num_tokens)
    gone = before - {n.id for n in tree._iter_nodes()}
    assert freed == expected_freed and gone == set(expected)
    return freed


def test_insert_and_match_page1():
    tree, alloc, _ = make(page=1)
    v = insert_fresh(tree, alloc, [1, 2, 3, 4])
    assert tree.insert([1, 2, 3, 4], v) == 4  # everything already cached
    m = tree.match_prefix([1, 2, 3, 5, 6])
    assert m.device_indices.tolist() == v[:3].tolist() and m.device_indices.dtype == torch.int64
    assert m.last_node.key == [1, 2, 3]  # split so last_node ends exactly at the match
    assert [len(c.key) for c in m.last_node.children.values()] == [1]
    empty = tree.match_prefix([9, 9])
    assert empty.device_indices.numel() == 0 and empty.last_node is tree.root
    assert tree.total_size() == 4 and alloc.available_size() == alloc.total_size - 4
    check_sizes(tree)


def test_partial_pages_never_match():
    tree, alloc, _ = make(page=4)
    v = insert_fresh(tree, alloc, list(range(8)))
    assert tree.match_prefix(list(range(7))).device_indices.tolist() == v[:4].tolist()
    assert tree.match_prefix([0, 1, 2, 3, 4, 5, 6, 99]).device_indices.tolist() == v[:4].tolist()
    assert tree.match_prefix([0, 1, 2, 99, 4, 5, 6, 7]).device_indices.numel() == 0
    assert tree.match_prefix(list(range(11))).device_indices.tolist() == v.tolist()
    with pytest.raises(AssertionError):
        tree.insert([1, 2, 3], torch.tensor([4, 5, 6]))
    check_sizes(tree)


def test_insert_splits_at_page_boundary():
    tree, alloc, _ = make(page=4)
    a = insert_fresh(tree, alloc, list(range(12)))
    b_key = list(range(4)) + [50, 51, 52, 53, 54, 55, 56, 57]
    b = alloc.alloc_extend([0], [12], [-1])
    assert tree.insert(b_key, b) == 4
    alloc.free(b[:4])
    (shared,) = tree.root.children.values()
    assert shared.key == [0, 1, 2, 3] and len(shared.children) == 2
    assert tree.match_prefix(b_key).device_indices.tolist() == a[:4].tolist() + b[4:].tolist()
    assert tree.total_size() == 20 and alloc.available_size() == alloc.total_size - 20
    assert torch.equal(tree.all_values_flat().sort().values, torch.cat([a, b[4:]]).sort().values)
    assert "[4] [0, 1, 2, 3]" in tree.pretty_print()
    check_sizes(tree)


def test_locks_protect_from_eviction():
    tree, alloc, _ = make(page=1)
    insert_fresh(tree, alloc, [1, 2, 3, 4])
    insert_fresh(tree, alloc, [1, 2, 7, 8])
    m = tree.match_prefix([1, 2, 3, 4])
    tree.inc_lock_ref(m.last_node)
    assert tree.protected_size() == 4 and tree.evictable_size() == 2
    assert tree.evict(100) == 2  # only the [7, 8] branch may go
    assert tree.match_prefix([1, 2, 7, 8]).device_indices.numel() == 2
    tree.dec_lock_ref(m.last_node)
    assert tree.protected_size() == 0 and tree.evictable_size() == 4
    assert tree.evict(100) == 4 and tree.total_size() == 0
    assert alloc.available_size() == alloc.total_size
    with pytest.raises(AssertionError):
        tree.dec_lock_ref(m.last_node)


def test_split_of_locked_node_keeps_locks_balanced():
    tree, alloc, _ = make(page=2)
    insert_fresh(tree, alloc, [1, 2, 3, 4, 5, 6])
    node = tree.match_prefix([1, 2, 3, 4, 5, 6]).last_node
    tree.inc_lock_ref(node)
    insert_fresh(tree, alloc, [1, 2, 9, 9])  # splits the locked node
    upper = tree.match_prefix([1, 2]).last_node
    assert upper is not node and upper.lock_ref == 1
    check_sizes(tree)
    assert tree.protected_size() == 6 and tree.evictable_size() == 2
    tree.dec_lock_ref(node)
    assert tree.protected_size() == 0 and upper.lock_ref == 0
    check_sizes(tree)


def test_eviction_is_least_recently_used_first():
    tree, alloc, _ = make(page=1)
    for key in ([1, 1], [2, 2], [3, 3]):
        insert_fresh(tree, alloc, key)
    tree.match_prefix([1, 1])  # refresh: order is now [2,2], [3,3], [1,1]
    assert tree.evict(1) == 2
    assert tree.match_prefix([2, 2]).device_indices.numel() == 0
    assert tree.evict(1) == 2
    assert tree.match_prefix([3, 3]).device_indices.numel() == 0
    assert tree.match_prefix([1, 1]).device_indices.numel() == 2


def test_eviction_heap_follows_locks_touches_and_children():
    """The heap's lazy entries: a leaf that was locked, touched, or given a child while queued must
    be evicted (or kept) as a fresh scan would decide, and lock cycles must not grow the heap."""
    tree, alloc, _ = make(page=1, pages=256)
    for key in ([1, 1], [2, 2], [3, 3], [4, 4]):
        insert_fresh(tree, alloc, key)
    locked = tree.match_prefix([1, 1]).last_node
    tree.inc_lock_ref(locked)  # [1,1] is queued but locked: skipped
    insert_fresh(tree, alloc, [2, 2, 5])  # [2,2] now has a child: only the child can go
    tree.match_prefix([3, 3])  # touched: now the most recent
    check_sizes(tree)
    assert evict_checked(tree, 1) == 2  # [4,4], the least recent evictable leaf
    assert evict_checked(tree, 1) == 1  # [5], put in by the walk through [2,2] before [3,3] was touched
    assert tree.match_prefix([3, 3]).device_indices.numel() == 2
    for _ in range(1000):  # each unlock of a queued leaf pushes nothing new
        tree.dec_lock_ref(locked)
        tree.inc_lock_ref(locked)
    assert len(tree._evict_heap) <= sum(1 for _ in tree._iter_nodes())
    tree.dec_lock_ref(locked)
    check_sizes(tree)
    while evict_checked(tree, 1):
        check_sizes(tree)
    assert tree.total_size() == 0 and not tree._evict_heap
    assert alloc.available_size() == alloc.total_size


def test_evicting_leaf_exposes_parent():
    tree, alloc, _ = make(page=1)
    insert_fresh(tree, alloc, [1, 2, 3])
    insert_fresh(tree, alloc, [1, 2, 4])
    assert tree.evict(6) == 4  # two leaves then their now-childless parent [1, 2]
    assert tree.total_size() == 0 and not tree.root.children
    assert alloc.available_size() == alloc.total_size


def test_reset_frees_everything():
    tree, alloc, _ = make(page=4)
    insert_fresh(tree, alloc, list(range(16)))
    insert_fresh(tree, alloc, list(range(8)) + [9] * 8)
    tree.reset()
    assert tree.total_size() == 0 and alloc.available_size() == alloc.total_size
    assert tree.all_values_flat().numel() == 0


def _start(tree, alloc, pool, tokens: list[int]) -> FakeReq:
    """Admit a request like the scheduler would: match, lock, take a row, allocate the rest."""
    prefix, node = tree.match_prefix(tokens)
    tree.inc_lock_ref(node)
    (row,) = pool.alloc(1)
    n = len(prefix)
    last_loc = int(prefix[-1]) if n else -1
    new = alloc.alloc_extend([n], [len(tokens)], [last_loc])
    pool.req_to_token[row, :n] = prefix
    pool.req_to_token[row, n : len(tokens)] = new
    return FakeReq(row, list(tokens), prefix, node, len(tokens), len(tokens))


@pytest.mark.parametrize("page", [1, 4])
def test_cache_finished_req_gives_aligned_kv_to_tree(page):
    tree, alloc, pool = make(page=page)
    tokens = list(range(10))
    req = _start(tree, alloc, pool, tokens)
    req.kv_committed_len = 9  # the last token's KV was never computed
    row_slots = pool.req_to_token[req.req_pool_idx, :10].clone()
    tree.cache_finished_req(req)
    aligned = 9 // page * page
    assert tree.total_size() == aligned and tree.protected_size() == 0
    assert alloc.available_size() == alloc.total_size - aligned
    assert tree.match_prefix(tokens).device_indices.tolist() == row_slots[:aligned].tolist()
    # a second identical request reuses the prefix; its duplicate pages come back to the allocator
    req2 = _start(tree, alloc, pool, tokens)
    assert req2.prefix_indices.tolist() == row_slots[:aligned].tolist()
    tree.cache_finished_req(req2)
    assert tree.total_size() == 10 // page * page
    assert alloc.available_size() + tree.total_size() == alloc.total_size
    check_sizes(tree)


@pytest.mark.parametrize("page", [1, 4])
def test_cache_finished_req_frees_duplicates(page):
    tree, alloc, pool = make(page=page)
    tokens = list(range(12))
    a, b = _start(tree, alloc, pool, tokens), _start(tree, alloc, pool, tokens)  # no sharing yet
    tree.cache_finished_req(a)
    tree.cache_finished_req(b)  # all 12 tokens of b are duplicates now
    assert tree.total_size() == 12 and alloc.available_size() == alloc.total_size - 12
    assert pool.available_size() == 16


@pytest.mark.parametrize("page", [1, 4])
def test_cache_unfinished_req_moves_prefix_into_tree(page):
    tree, alloc, pool = make(page=page)
    other = _start(tree, alloc, pool, list(range(6)))
    req = _start(tree, alloc, pool, list(range(10)))  # chunk 1 of a longer prompt
    tree.cache_finished_req(other)  # inserted meanwhile: req's first 6//page*page slots are duplicates
    tree.cache_unfinished_req(req)
    aligned = 10 // page * page
    cached = tree.match_prefix(list(range(10))).device_indices
    assert req.prefix_indices.tolist() == cached.tolist() and len(cached) == aligned
    row = pool.req_to_token[req.req_pool_idx]
    assert row[:aligned].tolist() == cached.tolist()
    assert tree.protected_size() == aligned
    owned_by_req = -(-(req.kv_allocated_len - aligned) // page) * page  # whole pages, the tail one partly used
    assert alloc.available_size() + tree.total_size() + owned_by_req == alloc.total_size
    # chunk 2: six more tokens, then finish; everything ends cached or free
    extra = alloc.alloc_extend([10], [16], [int(row[9])])
    row[10:16] = extra
    req.fill_ids = list(range(16))
    req.kv_committed_len = req.kv_allocated_len = 16
    tree.cache_unfinished_req(req)
    tree.cache_finished_req(req)
    assert tree.protected_size() == 0 and tree.total_size() == 16
    assert alloc.available_size() + tree.total_size() == alloc.total_size
    check_sizes(tree)


@pytest.mark.parametrize("page", [1, 4])
def test_random_operations_keep_memory_accounted(page):
    """A fixed-seed mini-scheduler. A fake KV pool remembers which (token, position) each slot holds,
    so a stale or reused slot returned by the tree shows up as wrong content."""
    rng = random.Random(7 * page)
    tree, alloc, pool = make(page=page, pages=192 // page, rows=12, max_len=128)
    kv_tok = torch.full((alloc.total_size + page,), -1, dtype=torch.int64)
    kv_pos = torch.full_like(kv_tok, -1)
    live: list[FakeReq] = []
    bases = [[rng.randrange(4) for _ in range(24)] for _ in range(3)]

    def compute(req: FakeReq) -> None:
        slots = pool.req_to_token[req.req_pool_idx, req.kv_committed_len : req.kv_allocated_len]
        kv_tok[slots] = torch.tensor(req.fill_ids[req.kv_committed_len : req.kv_allocated_len], dtype=torch.int64)
        kv_pos[slots] = torch.arange(req.kv_committed_len, req.kv_allocated_len)
        req.kv_committed_len = req.kv_allocated_len

    def alloc_or_evict(fn, need: int):
        out = fn()
        if out is None:
            evict_checked(tree, need)
            out = fn()
        return out

    def admit() -> None:
        tokens = rng.choice(bases)[: rng.randint(0, 24)] + [rng.randrange(4) for _ in range(rng.randint(1, 10))]
        prefix, node = tree.match_prefix(tokens)
        assert kv_tok[prefix].tolist() == tokens[: len(prefix)]
        assert kv_pos[prefix].tolist() == list(range(len(prefix)))
        tree.inc_lock_ref(node)
        rows = pool.alloc(1)
        n, last = len(prefix), int(prefix[-1]) if len(prefix) else -1
        new = None if rows is None else alloc_or_evict(
            lambda: alloc.alloc_extend([n], [len(tokens)], [last]), len(tokens)
        )
        if new is None:
            tree.dec_lock_ref(node)
            if rows is not None:
                pool.free(rows[0])
            return
        pool.req_to_token[rows[0], :n] = prefix
        pool.req_to_token[rows[0], n : len(tokens)] = new
        req = FakeReq(rows[0], tokens, prefix, node, n, len(tokens))
        compute(req)
        live.append(req)

    def decode(req: FakeReq) -> None:
        last = int(pool.req_to_token[req.req_pool_idx, req.kv_allocated_len - 1])
        out = alloc_or_evict(lambda: alloc.alloc_decode([req.kv_allocated_len + 1], [last]), page)
        if out is None or req.kv_allocated_len + 1 > 128:
            if out is not None:
                alloc.free(out)
            return
        pool.req_to_token[req.req_pool_idx, req.kv_allocated_len] = out[0]
        req.fill_ids.append(rng.randrange(4))
        req.kv_allocated_len += 1
        if rng.random() < 0.7:
            compute(req)

    def check() -> None:
        owned = sum(-(-(r.kv_allocated_len - len(r.prefix_indices)) // page) * page for r in live)  # whole pages
        assert alloc.available_size() + tree.total_size() + owned == alloc.total_size
        check_sizes(tree)
        for r in live:
            slots = pool.req_to_token[r.req_pool_idx, : r.kv_committed_len]
            assert kv_tok[slots].tolist() == r.fill_ids[: r.kv_committed_len]
            assert kv_pos[slots].tolist() == list(range(r.kv_committed_len))

    for _ in range(600):
        op = rng.random()
        if op < 0.25 or not live:
            admit()
        elif op < 0.6:
            decode(rng.choice(live))
        elif op < 0.7:
            tree.cache_unfinished_req(rng.choice(live))
        elif op < 0.85:
            req = live.pop(rng.randrange(len(live)))
            tree.cache_finished_req(req)
        elif op < 0.95:
            evict_checked(tree, rng.randint(1, 40))
        else:
            tokens = rng.choice(bases)[: rng.randint(0, 24)]
            prefix = tree.match_prefix(tokens).device_indices
            assert kv_tok[prefix].tolist() == tokens[: len(prefix)]
        check()
    while live:
        tree.cache_finished_req(live.pop())
    assert alloc.available_size() + tree.total_size() == alloc.total_size
    assert tree.protected_size() == 0
    tree.reset()
    assert alloc.available_size() == alloc.total_size


def test_chunk_cache_caches_nothing():
    allocator = TokenToKVPoolAllocator(size=64, page_size=4, device="cpu")
    pool = ReqToTokenPool(4, 64, "cpu")
    cache = create_prefix_cache(True, pool, allocator, 4)
    assert isinstance(cache, ChunkCache)
    assert isinstance(create_prefix_cache(False, pool, allocator, 4), RadixCache)
    prefix, node = cache.match_prefix(list(range(8)))
    assert prefix.numel() == 0
    cache.inc_lock_ref(node)
    (row,) = pool.alloc(1)
    pool.req_to_token[row, :10] = allocator.alloc_extend([0], [10], [-1])
    req = FakeReq(row, list(range(10)), prefix, node, 9, 10)
    cache.cache_unfinished_req(req)
    assert req.prefix_indices.numel() == 0 and allocator.available_size() == 64 - 12
    cache.cache_finished_req(req)
    assert allocator.available_size() == 64 and pool.available_size() == 4
    assert cache.total_size() == 0 and cache.evict(10) == 0
    assert cache.insert([1, 2, 3, 4], torch.tensor([4, 5, 6, 7])) == 4  # the caller keeps (and frees) them
    assert cache.match_prefix([1, 2, 3, 4]).device_indices.numel() == 0
