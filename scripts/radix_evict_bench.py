"""RadixCache.evict against a full scan of the tree (the old way, kept here as the reference), on
the same trees in one run: a cache holding N finished requests, each evict asking for one decode
step's worth of slots (as a server with a full pool does on most decode steps), then a new request
inserted so the tree keeps its size. Prints us per evict for both and their ratio.

    .venv/bin/python scripts/radix_evict_bench.py 1000,10000
"""
import heapq
import random
import statistics
import sys
import time

import torch

from baton.engine.mem_cache.allocator import TokenToKVPoolAllocator
from baton.engine.mem_cache.memory_pool import ReqToTokenPool
from baton.engine.mem_cache.radix_cache import RadixCache


class ScanRadixCache(RadixCache):
    """Evicts by collecting every unlocked leaf into a fresh heap on each call."""

    def evict(self, num_tokens: int) -> int:
        heap = [n for n in self._iter_nodes() if not n.children and n.lock_ref == 0 and n is not self.root]
        heapq.heapify(heap)
        freed, num_freed = [], 0
        while num_freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[self._child_key(leaf.key)]
            freed.append(leaf.value)
            num_freed += len(leaf.key)
            self.evictable_size_ -= len(leaf.key)
            if not parent.children and parent.lock_ref == 0 and parent is not self.root:
                heapq.heappush(heap, parent)
        if freed:
            self.allocator.free(torch.cat(freed))
        return num_freed


def run(cls, num_reqs: int, page: int, steps: int, seed: int) -> float:
    rng = random.Random(seed)
    req_len, system = 192, [rng.randrange(50_000) for _ in range(32)]
    allocator = TokenToKVPoolAllocator(size=(num_reqs + 4) * req_len, page_size=page, device="cpu")
    tree = cls(ReqToTokenPool(4, 256, "cpu"), allocator, page)

    def add() -> None:
        key = system + [rng.randrange(50_000) for _ in range(req_len - len(system))]
        value = allocator.alloc_extend([0], [len(key)], [-1])
        if value is None:
            tree.evict(len(key))
            value = allocator.alloc_extend([0], [len(key)], [-1])
        allocator.free(value[: tree.insert(key, value)])

    for _ in range(num_reqs):
        add()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        tree.evict(32)
        times.append(time.perf_counter() - start)
        add()
    return statistics.median(times) * 1e6


def main() -> None:
    sizes = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "1000,10000").split(",")]
    for n in sizes:
        for page in (1, 16):
            scan = run(ScanRadixCache, n, page, 200, seed=n)
            heap = run(RadixCache, n, page, 200, seed=n)
            print(f"{n:>6} cached requests, page {page:>2}: scan {scan:8.1f} us, heap {heap:6.1f} us per evict "
                  f"(scan / heap {scan / heap:6.1f}x)")


if __name__ == "__main__":
    main()
