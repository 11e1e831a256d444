"""TokenToKVPoolAllocator: hands out KV slots of the token pool a whole page at a time.

Slot s lives in page s // page_size. Page 0 is the dummy page (padded tokens write there), so the
usable slots are [page_size, size + page_size). Paging keeps one invariant the kernels rely on:
a token at position p of a request sits in a slot with slot % page_size == p % page_size, so a
request's KV is a run of whole pages plus one partly filled last page.

    positions:  prefix_len-1 | prefix_len ...  (page boundary) ...                seq_len-1
    slots:      last_loc     | last_loc+1 ... rest of last page | fresh page | fresh page ...

Free pages live on the CPU in a stack (a preallocated tensor plus a top pointer), so alloc and free
cost O(pages moved), never O(pool). Pages are pushed in descending order so that a pop returns them
ascending, which keeps freshly freed runs contiguous for page-run KV transfers.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

IntList = Union[Sequence[int], torch.Tensor]


def _as_long(values: IntList) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.to(device="cpu", dtype=torch.int64)
    return torch.tensor(values, dtype=torch.int64)


class TokenToKVPoolAllocator:
    """Results are int64 CPU tensors of slot indices; the caller moves them to `device`."""

    def __init__(self, size: int, page_size: int, device: str) -> None:
        assert page_size >= 1, "page_size must be >= 1"
        assert size > 0 and size % page_size == 0, f"size {size} must be a positive multiple of {page_size}"
        self.size = size
        self.page_size = page_size
        self.device = device
        self.num_pages = size // page_size
        self._free_stack = torch.empty(self.num_pages, dtype=torch.int64)  # [num_pages] page ids
        self._is_free = torch.zeros(self.num_pages + 1, dtype=torch.bool)  # [num_pages + 1], page 0 never free
        self.clear()

    @property
    def total_size(self) -> int:
        return self.size

    def available_size(self) -> int:
        return self._num_free * self.page_size

    def clear(self) -> None:
        self._free_stack.copy_(torch.arange(self.num_pages, 0, -1, dtype=torch.int64))
        self._num_free = self.num_pages
        self._is_free.fill_(True)
        self._is_free[0] = False

    # ---- page stack ----

    def _pop_pages(self, n: int) -> torch.Tensor:
        """Caller checked n <= self._num_free. Returns [n] page ids, ascending for a fresh stack."""
        top = self._num_free
        pages = self._free_stack[top - n : top].flip(0)  # flip() copies, so the stack may be reused
        self._num_free = top - n
        self._is_free[pages] = False
        return pages

    def _push_pages(self, pages: torch.Tensor) -> None:
        """pages: sorted unique page ids, all currently allocated."""
        n = pages.numel()
        self._free_stack[self._num_free : self._num_free + n] = pages.flip(0)
        self._num_free += n
        self._is_free[pages] = True

    # ---- allocation ----

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """page_size == 1 only: `need_size` arbitrary slots, or None."""
        assert self.page_size == 1, "alloc() is for page_size 1; use alloc_extend/alloc_decode"
        if need_size > self._num_free:
            return None
        return self._pop_pages(need_size)

    def alloc_extend(self, prefix_lens: IntList, seq_lens: IntList, last_locs: IntList) -> Optional[torch.Tensor]:
        """Slots for positions [prefix_lens[i], seq_lens[i]) of every request, concatenated in order."""
        prefix = _as_long(prefix_lens)  # [bs]
        seq = _as_long(seq_lens)
        last = _as_long(last_locs)
        extend = seq - prefix
        assert bool((extend >= 0).all()), "seq_lens must be >= prefix_lens"
        if self.page_size == 1:
            return self.alloc(int(extend.sum()))
        page = self.page_size
        room = (page - (last + 1) % page) % page  # free slots left in each request's last page
        fill = torch.minimum(room, extend)  # tokens that continue the partial page
        rest = extend - fill  # tokens that need fresh pages
        num_new_pages = (rest + page - 1) // page
        total_pages = int(num_new_pages.sum())
        if total_pages > self._num_free:
            return None
        pages = self._pop_pages(total_pages)
        return self._extend_slots(extend, last, fill, num_new_pages, pages)

    def _extend_slots(
        self,
        extend: torch.Tensor,  # [bs] new tokens per request
        last: torch.Tensor,  # [bs] last_locs
        fill: torch.Tensor,  # [bs] new tokens that continue the partial page
        num_new_pages: torch.Tensor,  # [bs]
        pages: torch.Tensor,  # [sum(num_new_pages)] fresh page ids, in request order
    ) -> torch.Tensor:
        page = self.page_size
        num_tokens = int(extend.sum())
        bs = extend.numel()
        req = torch.repeat_interleave(torch.arange(bs), extend, output_size=num_tokens)  # [num_tokens]
        starts = torch.cumsum(extend, 0) - extend  # [bs] first output index of each request
        offset = torch.arange(num_tokens) - starts[req]  # [num_tokens] offset inside the request
        in_partial = offset < fill[req]
        page_starts = torch.cumsum(num_new_pages, 0) - num_new_pages  # [bs] first page of each request
        fresh = (offset - fill[req]).clamp(min=0)
        # partial-page tokens compute a page index too (discarded by the where below); keep it in range
        page_idx = (page_starts[req] + fresh // page).clamp(max=max(pages.numel() - 1, 0))
        fresh_slot = pages[page_idx] * page + fresh % page if pages.numel() else fresh
        return torch.where(in_partial, last[req] + 1 + offset, fresh_slot)

    def alloc_decode(self, seq_lens: IntList, last_locs: IntList) -> Optional[torch.Tensor]:
        """One slot per request, for position seq_lens[i] - 1."""
        last = last_locs.tolist() if isinstance(last_locs, torch.Tensor) else last_locs
        if self.page_size == 1:
            return self.alloc(len(last))
        # A plain loop beats torch ops here up to ~256 requests (measured: 83 vs 99 us at 256, 23 vs 58 at 8).
        page = self.page_size
        out = [loc + 1 for loc in last]
        needs_page = [i for i, slot in enumerate(out) if slot % page == 0]  # the previous token closed its page
        if len(needs_page) > self._num_free:
            return None
        if needs_page:
            for i, p in zip(needs_page, self._pop_pages(len(needs_page)).tolist()):
                out[i] = p * page
        return torch.tensor(out, dtype=torch.int64)

    # ---- release ----

    def free(self, indices: torch.Tensor) -> None:
        """Free the pages holding `indices`; the caller owns those pages wholly."""
        if indices.numel() == 0:
            return
        pages = torch.unique(indices.to(device="cpu", dtype=torch.int64) // self.page_size)
        if int(pages[0]) < 1 or int(pages[-1]) > self.num_pages:
            raise ValueError(f"free of slots outside the pool: pages {pages.tolist()}")
        if bool(self._is_free[pages].any()):
            raise RuntimeError(f"double free of KV pages {pages[self._is_free[pages]].tolist()}")
        self._push_pages(pages)

    def __repr__(self) -> str:
        return (
            f"TokenToKVPoolAllocator(size={self.size}, page_size={self.page_size}, "
            f"free_pages={self._num_free}/{self.num_pages})"
        )
