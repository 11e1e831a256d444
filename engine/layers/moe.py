"""Sparse mixture-of-experts blocks: Qwen3-MoE's, and Qwen3-Next's / Qwen3.5's with a shared expert.

Router: softmax over all experts in float32, top-k, optionally renormalised (`norm_topk_prob`).
Experts are stacked weights, `w13` [E, 2 * I, H] laid out [gate | up] (HF's fused `gate_up_proj`)
and `w2` [E, H, I]. The experts run in `triton_ops.fused_moe.fused_experts`: on CPU a loop over the
experts that were hit (transformers' order of ops); on CUDA two grouped-GEMM Triton kernels with no
host sync, so decode captures into a CUDA graph.

Tensor parallelism splits every expert's intermediate size over the ranks (w13 holds this rank's
gate rows and up rows, w2 its columns); the router is replicated, and the block's output is the
all-reduce of the ranks' partial sums.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from baton.engine.distributed.parallel_state import TpGroup, all_reduce
from baton.engine.layers.activation import get_act_fn
from baton.engine.layers.mlp import GatedMLP
from baton.engine.triton_ops.fused_moe import fused_experts

_PER_EXPERT = re.compile(r"^experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool, hidden_act: str = "silu", tp: TpGroup = TpGroup()) -> None:
        super().__init__()
        assert 0 < top_k <= num_experts
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.tp = tp
        self.intermediate_size = intermediate_size  # in the checkpoint
        inter = self.inter_local = tp.shard(intermediate_size, "moe_intermediate_size")  # on this rank
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, inter))
        self.act_fn = get_act_fn(hidden_act)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, H] -> (weights [n, top_k] in x's dtype, expert ids [n, top_k])."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [n, E]
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, H] -> [n, H]."""
        weights, ids = self.route(x)
        return all_reduce(self._experts(x, weights, ids), self.tp)

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return fused_experts(x, self.w13, self.w2, weights, ids, self.act_fn)

    @torch.no_grad()
    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        """name relative to this block (`gate.weight`, `experts.3.up_proj.weight`, or the fused
        `experts.gate_up_proj` / `experts.down_proj`). Returns False for names it does not own."""
        full, inter = self.intermediate_size, self.inter_local
        mine = slice(self.tp.rank * inter, (self.tp.rank + 1) * inter)  # this rank's intermediate rows
        if name == "gate.weight":
            self.gate.weight.copy_(tensor)
        elif name == "experts.gate_up_proj":  # [E, 2 * full, H]: gate rows, then up rows
            self.w13.copy_(torch.cat([tensor[:, :full][:, mine], tensor[:, full:][:, mine]], dim=1))
        elif name == "experts.down_proj":  # [E, H, full]
            self.w2.copy_(tensor[:, :, mine])
        elif (m := _PER_EXPERT.match(name)) is not None:
            e, proj = int(m.group(1)), m.group(2)
            if proj == "down_proj":
                self.w2[e].copy_(tensor[:, mine])
            else:
                start = 0 if proj == "gate_proj" else inter
                self.w13[e, start:start + inter].copy_(tensor[mine])
        else:
            return False
        return True


class SharedExpertMoeBlock(SparseMoeBlock):
    """The sparse block plus a dense shared expert whose output is scaled by a sigmoid gate
    (Qwen3-Next, Qwen3.5-MoE): experts(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x).
    Checkpoint names: `shared_expert.{gate,up,down}_proj.weight`, `shared_expert_gate.weight`."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool, shared_intermediate_size: int, hidden_act: str = "silu",
                 tp: TpGroup = TpGroup()) -> None:
        super().__init__(hidden_size, intermediate_size, num_experts, top_k, norm_topk_prob, hidden_act, tp)
        self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size, hidden_act, tp=tp)
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, H] -> [n, H]."""
        weights, ids = self.route(x)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)  # reduced in its down_proj
        return all_reduce(self._experts(x, weights, ids), self.tp) + shared

