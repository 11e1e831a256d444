"""Linear layers that hold one tensor-parallel shard and load it from the full checkpoint tensor.

    column-parallel (qkv, gate/up): out_features split; each rank computes its slice, no collective
    row-parallel (o_proj, down):    in_features split;  each rank's partial sums are all-reduced

A column-parallel layer may fuse several checkpoint projections (q|k|v, gate|up); each part says
which rows of its checkpoint tensor this rank holds (`OutputPart`). With one rank every part is the
whole tensor and the layers compute exactly what nn.Linear does.

With --enable-lora a layer may hold a `lora` (layers/lora.py): its adapters' delta, added to the output
(a row-parallel layer's before its all-reduce).

On a CPU with AVX512_BF16, `pack_linear_weights` gives each bfloat16 layer (and the LM head) a packed
copy of its weight (a buffer, `packed_weight`), and its calls go through the kernel of
engine/kernels/cpu_linear.py instead of torch's GEMM (layers/gemm.py).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, NamedTuple, Optional

import torch
from torch import nn

from baton.engine.distributed.parallel_state import TpGroup, all_reduce
from baton.engine.kernels import cpu_linear
from baton.engine.layers.gemm import GEMV_OFF, SmallBatchGemv, gemv_applies, linear_forward
from baton.engine.layers.vocab_parallel import VocabParallelEmbedding

if TYPE_CHECKING:
    from baton.engine.layers.activation import GatedAct
    from baton.engine.layers.lora import LoraLinear

logger = logging.getLogger(__name__)


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

    gemv: SmallBatchGemv = GEMV_OFF  # which calls take the Triton GEMV: set at load (layers/gemm.py bind_gemv)
    lora: Optional["LoraLinear"] = None  # the LoRA adapters' delta: set at load where LoRA serves the layer

    def __init__(self, in_features: int, parts: list[OutputPart], bias: bool) -> None:
        super().__init__(in_features, sum(p.size for p in parts), bias=bias)
        self.parts = parts
        self.output_sizes = [p.size for p in parts]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear_forward(self, x, self.bias)
        return out if self.lora is None else self.lora.add(x, out)

    def gated(self, x: torch.Tensor, act: "GatedAct") -> torch.Tensor:
        """act(gate) * up of this [gate | up] layer's output. A packed bfloat16 CPU layer, and a few
        CUDA rows where the layer's small-batch GEMV takes them (layers/gemm.py), give silu(gate) * up straight
        out of the matmul's tiles (no [rows, 2I] product)."""
        if self.lora is not None:  # the fused kernels below know no adapters
            return act(self(x))
        packed = getattr(self, "packed_weight", None)
        if act.is_silu and x.dtype == torch.bfloat16 and cpu_linear.silu_mul_fusable(self.weight, packed, self.bias):
            return cpu_linear.packed_linear_silu_mul(x, self.weight, packed)
        if act.is_silu and self.bias is None and gemv_applies(self, x, None):
            from baton.engine.triton_ops.gemv import gemv_silu_mul

            return gemv_silu_mul(x, self.weight)
        return act(self(x))

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

    gemv: SmallBatchGemv = GEMV_OFF  # which calls take the Triton GEMV: set at load (layers/gemm.py bind_gemv)
    lora: Optional["LoraLinear"] = None  # the LoRA adapters' delta: set at load where LoRA serves the layer

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
            out = linear_forward(self, x, self.bias)  # exactly nn.Linear
            return out if self.lora is None else self.lora.add(x, out)
        out = linear_forward(self, x, None)
        if self.lora is not None:  # a partial sum too (A holds this rank's columns)
            out = self.lora.add(x, out)
        out = all_reduce(out, self.tp)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (this rank: {self.in_local}), out_features={self.out_features}, "
                f"bias={self.bias is not None}")


def pack_linear_weights(model: nn.Module, device: str) -> int:
    """After loading: a packed weight copy for every bfloat16 linear layer and the LM head that the
    CPU kernel can serve (engine/kernels/cpu_linear.py), which then computes every call of theirs.
    Their original weights are released (a placeholder of the same shape, one element of storage),
    so the model takes no more memory than before; only a tied LM head keeps its table, which is
    also the embedding. Returns how many layers were packed; 0, with the reason logged, where the
    kernel cannot run."""
    head = getattr(model, "lm_head", None)
    tied = head is None
    if tied:  # the input embedding is the LM head
        head = getattr(getattr(model, "model", None), "embed_tokens", None)
    layers = [m for m in model.modules() if isinstance(m, (MergedColumnLinear, RowParallelLinear))]
    if isinstance(head, VocabParallelEmbedding):
        layers.append(head)
    layers = [m for m in layers if cpu_linear.packable(m.weight)]
    if not layers:
        return 0
    reason = cpu_linear.unavailable_reason(device)
    if reason is not None:
        logger.info("bfloat16 linears stay on torch's GEMM: %s", reason)
        return 0
    released = 0
    for m in layers:
        m.register_buffer("packed_weight", cpu_linear.pack_weight(m.weight), persistent=False)
        if not (tied and m is head):
            released += m.weight.numel() * 2
            loader = getattr(m.weight, "weight_loader", None)
            m.weight = nn.Parameter(cpu_linear.released_placeholder(m.weight), requires_grad=False)
            if loader is not None:  # a weight update still shards a checkpoint tensor through it
                m.weight.weight_loader = loader
    logger.info("the packed bfloat16 kernel serves %d linear layers (%.1f MB packed, %.1f MB of originals released)",
                len(layers), sum(m.packed_weight.numel() * 2 for m in layers) / 1e6, released / 1e6)
    return len(layers)


def load_param(param: nn.Parameter, tensor: torch.Tensor, name: str) -> None:
    """A checkpoint tensor into a parameter: through its shard loader when it has one."""
    loader = getattr(param, "weight_loader", None)
    if loader is not None:
        loader(param, tensor)
        return
    assert param.shape == tensor.shape, f"{name}: {tuple(tensor.shape)} in checkpoint, {tuple(param.shape)} in model"
    with torch.no_grad():
        param.copy_(tensor)
