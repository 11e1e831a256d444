"""Linear layers that hold one tensor-parallel shard and load it from the full checkpoint tensor.

    column-parallel (qkv, gate/up): out_features split; each rank computes its slice, no collective
    row-parallel (o_proj, down):    in_features split;  each rank's partial sums are all-reduced

A column-parallel layer may fuse several checkpoint projections (q|k|v, gate|up); each part says
which rows of its checkpoint tensor this rank holds (`OutputPart`). With one rank every part is the
whole tensor and the layers compute exactly what nn.Linear does.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from baton.engine.distributed.parallel_state import TpGroup, all_reduce


class OutputPart(NamedTuple):
    full: int  # rows of the checkpoint tensor
    start: int  # its first row this rank holds
    size: int  # rows this rank holds


def even_parts(sizes: list[int], tp: TpGroup) -> list[OutputPart]:
    """Each projection split evenly over the ranks (gate|up of an MLP)."""
    return [OutputPart(n, tp.rank * tp.shard(n), tp.shard(n)) for n in sizes]


def qkv_parts(num_heads: int, num_kv_heads: int, head_dim: int, tp: TpGroup) -> list[OutputPart]:
    """q split by heads; k and v by KV heads, replicated when there are fewer KV heads than ranks."""
    q_heads = tp.shard(num_heads, "num_attention_heads")
    kv_start, kv_heads = tp.kv_head_range(num_kv_heads)
    q = OutputPart(num_heads * head_dim, tp.rank * q_heads * head_dim, q_heads * head_dim)
    kv = OutputPart(num_kv_heads * head_dim, kv_start * head_dim, kv_heads * head_dim)
    return [q, kv, kv]


class MergedColumnLinear(nn.Linear):
    """One linear whose output is this rank's rows of several checkpoint projections, concatenated."""

    def __init__(self, in_features: int, parts: list[OutputPart], bias: bool) -> None:
        super().__init__(in_features, sum(p.size for p in parts), bias=bias)
        self.parts = parts
        self.output_sizes = [p.size for p in parts]

    @torch.no_grad()
    def load_shard(self, param_name: str, shard: int, tensor: torch.Tensor) -> None:
        """Copy this rank's rows of checkpoint projection `shard` (e.g. k_proj's weight) into place."""
        part = self.parts[shard]
        assert tensor.shape[0] == part.full, f"shard {shard} of {param_name}: {tuple(tensor.shape)} in checkpoint"
        offset = sum(self.output_sizes[:shard])
        target = getattr(self, param_name)[offset:offset + part.size]
        source = tensor[part.start:part.start + part.size]
        assert target.shape == source.shape, f"shard {shard} of {param_name}: {tuple(tensor.shape)} in checkpoint"
        target.copy_(source)


class RowParallelLinear(nn.Module):
    """y = x @ W.T + b where x holds this rank's slice of in_features: the partial products are
    summed over the ranks, then the (replicated) bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TpGroup) -> None:
        super().__init__()
        self.tp = tp
        self.in_features, self.out_features = in_features, out_features
        self.in_local = tp.shard(in_features, "in_features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_local))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.weight.weight_loader = self._load_weight

    @torch.no_grad()
    def _load_weight(self, param: nn.Parameter, tensor: torch.Tensor) -> None:
        assert tensor.shape == (self.out_features, self.in_features), f"{tuple(tensor.shape)} in checkpoint"
        start = self.tp.rank * self.in_local
        param.copy_(tensor[:, start:start + self.in_local])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.linear(x, self.weight, self.bias)  # exactly nn.Linear
        out = all_reduce(F.linear(x, self.weight), self.tp)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (this rank: {self.in_local}), out_features={self.out_features}, "
                f"bias={self.bias is not None}")


def load_param(param: nn.Parameter, tensor: torch.Tensor, name: str) -> None:
    """A checkpoint tensor into a parameter: through its shard loader when it has one."""
    loader = getattr(param, "weight_loader", None)
    if loader is not None:
        loader(param, tensor)
        return
    assert param.shape == tensor.shape, f"{name}: {tuple(tensor.shape)} in checkpoint, {tuple(param.shape)} in model"
    with torch.no_grad():
        param.copy_(tensor)
