"""What a request's images become on their way to the scheduler, and the plan that places their
embeddings in a batch.

The tokenizer process (processor.py) expands each image's one placeholder token into as many tokens
as the vision tower gives the image (its merged patches), and writes there not the placeholder id
but pad values drawn from the image's content hash. The prompt's token ids thus name the image:
the radix cache shares KV (and a hybrid model's state checkpoints) between two requests exactly as
far as their text and images agree, and no further. The model never embeds those ids: the vision
tower's output is spliced over their rows (MmSplice).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass(eq=False)
class MmItem:
    """One image of a request."""

    hash: str  # hex digest of the decoded picture (media.py): the embedding cache's key
    offset: int  # the prompt position of its first token
    num_tokens: int  # its tokens in the prompt: t * h * w / merge^2 of its patch grid
    grid_thw: tuple[int, int, int]  # its patch grid (temporal, height, width), before merging
    # [patches, channels * temporal_patch * patch^2] as the image processor emits them
    pixel_values: Optional[torch.Tensor] = None
    # the vision tower's output [num_tokens, hidden (x (1 + deepstack layers))] from the chunk that
    # encodes the image to the chunk that takes its last rows (model_executor/mm_embedder.py)
    embeds: Optional[torch.Tensor] = None

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens

    @property
    def pixel_bytes(self) -> int:
        p = self.pixel_values
        return 0 if p is None else p.numel() * p.element_size()


@dataclass(eq=False)
class MultimodalInputs:
    """A request's images and its M-RoPE positions (mrope.py)."""

    items: list[MmItem]
    mrope_positions: torch.Tensor  # [3, prompt length] int64
    mrope_delta: int  # a position past the prompt is its index plus this (decode steps)
    vision_start_token_id: int = -1


@dataclass
class MmSplice:
    """Rows src_start .. src_start + count of `item`'s embeddings go to the batch's token rows
    dst_start .. dst_start + count."""

    item: MmItem
    dst_start: int
    src_start: int
    count: int


def plan_splices(items: list[MmItem], prefix_len: int, seq_len: int, batch_offset: int) -> list[MmSplice]:
    """The splices of one request's extend over prompt positions prefix_len .. seq_len - 1, whose
    first token is the batch's row `batch_offset`."""
    out = []
    for item in items:
        lo, hi = max(prefix_len, item.offset), min(seq_len, item.end)
        if lo < hi:
            out.append(MmSplice(item, batch_offset + lo - prefix_len, lo - item.offset, hi - lo))
    return out


@dataclass
class MmBatch:
    """A batch's image work, as the worker takes it: the splices, and the [3, num_tokens] M-RoPE
    positions of its tokens (rows of requests without images: their positions on all three)."""

    splices: list[MmSplice] = field(default_factory=list)
    mrope_positions: Optional[torch.Tensor] = None

    def items(self) -> list[MmItem]:
        """The distinct images the splices read, in order."""
        seen: dict[int, MmItem] = {}
        for s in self.splices:
            seen.setdefault(id(s.item), s.item)
        return list(seen.values())
