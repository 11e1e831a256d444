"""LoRA on a linear layer: y = base(x) + scaling * (x A^T) B^T, each token under its own request's adapter.

The adapters' matrices live in a pool of slots (model_executor/lora_manager.py); a layer served with LoRA
holds a `LoraLinear` (`layer.lora`) with its views of the pool, and the pass's `LoraBatchInfo`, shared by
every layer of the model, says which rows run under which slot (set before each forward pass).

A layer fuses several checkpoint projections (q|k|v, gate|up: layers/linear.py OutputPart); each has
its own A and B. Per layer and slot the pool holds

    A  [parts * R, in]     the parts' A matrices stacked, each padded with zero rows to the pool's rank R
    B  [out, R]            the parts' B matrices stacked the way the layer's outputs are (this rank's rows),
                           each padded with zero columns to R

so one shrink gives every part's x A^T ([tokens, parts * R]) and each part expands its own rank block
into its own output columns. Zero padding adds exact zeros: an adapter of rank r < R computes what it
would at rank r.

Tensor parallelism: column-parallel layers (qkv, gate|up) take x whole, so A is whole and B is this
rank's rows of each part; a row-parallel layer (o_proj, down_proj) takes its slice of x, so A is this
rank's columns and B whole: x A^T is then a partial sum, and so is the delta, which the layer adds to
its partial output before the one all-reduce (S-LoRA's split).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from baton.engine.triton_ops.lora_sgemm import Segments, lora_expand_add, lora_expand_add_torch, lora_shrink, \
    lora_shrink_torch


@dataclass
class LoraBatchInfo:
    """The current pass's runs of rows under an adapter; None: no row of the pass has one."""

    segments: Optional[Segments] = None
    reference: bool = False  # the torch path on every device (--disable-fused-ops)


class LoraLinear:
    """The LoRA delta of one linear layer. `parts`: (first output column, columns) of each fused part."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor, parts: list[tuple[int, int]],
                 rank: int, batch: LoraBatchInfo) -> None:
        assert a.shape[1] == len(parts) * rank and b.shape[2] == rank, (tuple(a.shape), tuple(b.shape), rank)
        assert sum(n for _, n in parts) == b.shape[1]
        self.a, self.b, self.scaling = a, b, scaling  # [slots, parts * R, in], [slots, out, R], [slots]
        self.parts, self.rank, self.batch = parts, rank, batch

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (the base layer's output for x, [tokens, out]) plus each adapter's delta on its rows."""
        segs = self.batch.segments
        if segs is None or not segs.starts:
            return out
        shape = out.shape
        x2, out2 = x.reshape(-1, x.shape[-1]), out.reshape(-1, shape[-1])
        shrink, expand = ((lora_shrink_torch, lora_expand_add_torch) if self.batch.reference
                          else (lora_shrink, lora_expand_add))
        xa = shrink(x2, self.a, segs)  # [tokens, parts * R]
        r = self.rank
        for i, (first, n) in enumerate(self.parts):
            expand(out2[:, first:first + n], xa[:, i * r:(i + 1) * r], self.b[:, first:first + n], self.scaling, segs)
        return out2.view(shape)
