"""The vision tower's side of a batch with images: which images need encoding, the encoding (one tower
call for all of them, or with ViT DP each TP rank its share), the embeddings' cache, and the rows they
go to (ForwardBatch.mm_embeds, which the model splices over the token embeddings).

An image's embeddings are computed once per prefill: kept on its MmItem until the chunk that takes its
last rows (a prefill chunked across the image takes the rest at its next chunk), and in the cache by
the image's hash for later requests (and for a retracted request, which runs its prompt again; its
pixels stay with it for when the cache has let the image go).

ViT DP (--mm-enable-dp-encoder) with TP: the images to encode are dealt to the ranks (largest first,
each to the rank with the fewest patches so far), each rank encodes its share with the full vision
weights, and every rank gathers every embedding; a rank with no image takes part in the gather with
an empty share, so no rank waits for another that has nothing to send. Without it the driver encodes
them all. Either way the driver then sends the batch's spliced embeddings to the others, which keep
no image state of their own (their next step may need what only the driver's items hold).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

import torch

from baton.engine.distributed.parallel_state import all_gather_object, broadcast_object
from baton.engine.multimodal.embedding_cache import EmbeddingCache
from baton.engine.multimodal.inputs import MmBatch, MmItem

if TYPE_CHECKING:
    from baton.engine.distributed.parallel_state import TpGroup

logger = logging.getLogger(__name__)


def deal(items: list[MmItem], ranks: int) -> list[list[int]]:
    """Indices of `items` per rank: largest first, each to the rank with the fewest patches so far."""
    load, shares = [0] * ranks, [[] for _ in range(ranks)]
    for i in sorted(range(len(items)), key=lambda i: -items[i].pixel_values.shape[0]):
        r = min(range(ranks), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += items[i].pixel_values.shape[0]
    return shares


class MultimodalEmbedder:
    def __init__(self, tower: torch.nn.Module, cache_mb: int, device: str, dtype: torch.dtype,
                 tp: Optional["TpGroup"] = None, dp_encoder: bool = False) -> None:
        self.tower, self.device, self.dtype = tower, device, dtype
        self.cache = EmbeddingCache(cache_mb * 2 ** 20)
        self.tp, self.dp_encoder = tp, dp_encoder and tp is not None and tp.size > 1
        self.images_encoded = 0

    @property
    def _tp_size(self) -> int:
        return 1 if self.tp is None else self.tp.size

    def embeds(self, mm: MmBatch) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(rows [m], embeddings [m, hidden]) of the batch's image tokens, or None when it has none. With
        TP, the driver's side of the exchange follow() mirrors (the followers take the result)."""
        items = mm.items()
        missing = self._missing(items)
        if self.dp_encoder:  # every rank its share, also when there is nothing to encode
            broadcast_object(missing, self.tp)
            outs = self._encode_dp(missing)
        else:
            outs = self.encode(missing)
        for item, out in zip(missing, outs):
            item.embeds = out
            if self.cache.capacity:
                self.cache.put(item.hash, out)
        self.images_encoded += len(missing)
        out = None
        if mm.splices:
            rows = torch.cat([torch.arange(s.dst_start, s.dst_start + s.count) for s in mm.splices])
            embeds = torch.cat([s.item.embeds[s.src_start:s.src_start + s.count] for s in mm.splices])
            out = rows.to(self.device), embeds
            for s in mm.splices:  # the image's last rows: its request needs them no more (but after a
                if s.src_start + s.count == s.item.num_tokens:  # retraction: the cache, or its pixels)
                    s.item.embeds = None
        if self._tp_size > 1:
            broadcast_object(None if out is None else (out[0].cpu(), out[1].cpu()), self.tp)
        return out

    def follow(self) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """A TP follower's side of a step with images: its share of the encoding (ViT DP), then the
        driver's embeddings."""
        if self.dp_encoder:
            self._encode_dp(broadcast_object(None, self.tp))
        got = broadcast_object(None, self.tp)
        return None if got is None else (got[0].to(self.device), got[1].to(self.device, self.dtype))

    def _missing(self, items: list[MmItem]) -> list[MmItem]:
        """The items with no embeddings of their own or in the cache (which then fills them)."""
        missing = []
        for item in items:
            if item.embeds is None and self.cache.capacity:
                item.embeds = self.cache.get(item.hash)
            if item.embeds is None:
                if item.pixel_values is None:
                    raise RuntimeError(f"image {item.hash[:12]} has neither pixels nor embeddings")
                missing.append(item)
        return missing

    @torch.inference_mode()
    def encode(self, items: list[MmItem]) -> list[torch.Tensor]:
        """One tower call over the items' patches; each item's embeddings [num_tokens, hidden]."""
        if not items:
            return []
        pixels = torch.cat([it.pixel_values for it in items]).to(self.device, self.dtype)
        out = self.tower(pixels, [it.grid_thw for it in items])
        # Qwen3-VL's deepstack features ride along as further columns (models/llama.py splits them)
        embeds = torch.cat([out.embeds, *out.deepstack], dim=-1) if out.deepstack else out.embeds
        return list(embeds.split([it.num_tokens for it in items]))

    def _encode_dp(self, items: list[MmItem]) -> list[torch.Tensor]:
        """ViT DP (module docstring): this rank's share encoded, then all shares gathered."""
        shares = deal(items, self.tp.size)
        mine = self.encode([items[i] for i in shares[self.tp.rank]])
        gathered = all_gather_object([t.cpu() for t in mine], self.tp)
        out: list[Optional[torch.Tensor]] = [None] * len(items)
        for share, tensors in zip(shares, gathered):
            for i, t in zip(share, tensors):
                out[i] = t.to(self.device)
        return out

    def stats(self) -> dict[str, int]:
        return {**self.cache.stats(), "mm_images_encoded": self.images_encoded}
