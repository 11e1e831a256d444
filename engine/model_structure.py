"""A decoder model's structure as plain data: what a forward other than the model's own reads of it.

A model describes itself (`LlamaForCausalLM.decoder_structure()`); the native CPU forward
(model_executor/native_forward.py) checks the description and takes its weights' pointers from it. Neither
imports the other: this module sits below both. The description is a snapshot of the loaded (and
packed) model; its tensors are the model's own, not copies.

    embed -> per layer: input_norm, attn (qkv, q/k norms, rope, attention, o), residual add,
             post_norm, mlp, residual add -> final_norm -> lm_head
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch


@dataclass(frozen=True)
class Norm:
    kind: str  # "rms": RMSNorm as HF computes it (float32 statistics, weight in the input dtype); else the class name
    weight: torch.Tensor  # [dim]
    eps: float


@dataclass(frozen=True)
class Linear:
    """One projection as this rank holds it."""

    weight: torch.Tensor  # [out, in]
    packed: Optional[torch.Tensor]  # the CPU GEMM's packed copy (layers/linear.py pack_linear_weights); None: not packed
    bias: Optional[torch.Tensor]  # [out]


@dataclass(frozen=True, eq=False)  # layers that share their tables hold the same Rope
class Rope:
    kind: str  # "neox": HF Llama/Qwen's rotate-half; "mrope": it over M-RoPE's [3, n] positions; else the class name
    dim: int  # channels rotated in each head
    # device -> (cos, sin) [max_positions, dim // 2] float32, built there first if they are not
    tables: Callable[[str], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Attention:
    num_heads: int  # this rank's
    num_kv_heads: int
    head_dim: int
    scale: float  # of q.k
    qkv: Linear  # q | k | v, one projection
    o: Linear
    rope: Rope
    q_norm: Optional[Norm]  # per head, before RoPE (Qwen3)
    k_norm: Optional[Norm]


@dataclass(frozen=True)
class Mlp:
    kind: str  # "gated": down(act(gate) * up), gate | up one projection; "moe": sparse experts (nothing more here)
    act: str = ""  # gated: "silu", ...
    intermediate: int = 0  # gated: this rank's width
    gate_up: Optional[Linear] = None
    down: Optional[Linear] = None


@dataclass(frozen=True)
class DecoderLayer:
    input_norm: Norm  # before attention; the residual add fused into it from the second layer
    attn: Attention
    post_norm: Norm  # before the MLP, with the residual add
    mlp: Mlp


@dataclass(frozen=True)
class DecoderStructure:
    embed: torch.Tensor  # [vocab, hidden] this rank's rows
    layers: tuple[DecoderLayer, ...]
    final_norm: Norm  # with the last residual add
    lm_head: Linear  # the embedding's when tied
