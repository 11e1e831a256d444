"""The vision embeddings' cache: the tower's output per image, kept by the image's content hash in
least-recently-used order within a byte budget (--mm-embedding-cache-mb; SGLang sizes its
equivalent with SGLANG_VLM_CACHE_SIZE_MB). A repeated image (the same screenshot asked about again,
a multi-turn conversation that resends its images) skips the encoder. Lives in the worker that runs
the tower, on the tower's device."""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import torch


class EmbeddingCache:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self._entries: "OrderedDict[str, torch.Tensor]" = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = self.evictions = 0

    @staticmethod
    def _size(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def get(self, key: str) -> Optional[torch.Tensor]:
        t = self._entries.get(key)
        if t is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return t

    def put(self, key: str, embeds: torch.Tensor) -> None:
        """Keeps `embeds` unless it alone exceeds the budget; evicts the least recently used first."""
        size = self._size(embeds)
        if size > self.capacity or key in self._entries:
            return
        while self.bytes + size > self.capacity:
            _, old = self._entries.popitem(last=False)
            self.bytes -= self._size(old)
            self.evictions += 1
        self._entries[key] = embeds
        self.bytes += size

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict[str, int]:
        return {"mm_cache_hits": self.hits, "mm_cache_misses": self.misses, "mm_cache_bytes": self.bytes,
                "mm_cache_entries": len(self._entries), "mm_cache_evictions": self.evictions,
                "mm_cache_capacity_bytes": self.capacity}
