"""What one forward pass needs, as device tensors, and the attention backend contract that reads it.

    ScheduleBatch (scheduler, CPU) -> ModelWorkerBatch (what the forward needs) -> ForwardBatch (device)

Token layout of an EXTEND batch (requests packed back to back, no padding):

    req:            |  r0 new tokens  |  r1 new tokens  | ...
    input_ids       [ e0 tokens        ][ e1 tokens       ]      e_i = extend_seq_lens_cpu[i]
    positions       [ p0 .. p0+e0-1    ][ p1 .. p1+e1-1   ]      p_i = extend_prefix_lens_cpu[i]
    out_cache_loc   [ slots for r0 new ][ slots for r1 new ]     (KV of new tokens is written here)

A DECODE batch has exactly one new token per request (e_i = 1, p_i = seq_len_i - 1).
The KV of request i lives at req_to_token[req_pool_indices[i], :seq_lens[i]] once this pass wrote it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any, Optional, Protocol, Union

import torch

if TYPE_CHECKING:
    from baton.engine.core.lora import LoraStep
    from baton.engine.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from baton.engine.mem_cache.state_pool import RecurrentStatePool, StateOps


class ForwardMode(IntEnum):
    EXTEND = 1  # prefill, or the next chunk of a chunked prefill (may have a cached prefix)
    DECODE = 2  # one token per request
    IDLE = 3  # nothing to run (kept for data-parallel lockstep)

    def is_extend(self) -> bool:
        return self == ForwardMode.EXTEND

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    req_pool_indices: torch.Tensor  # [bs] int64
    seq_lens: torch.Tensor  # [bs] int64, total KV length of each request after this pass
    out_cache_loc: torch.Tensor  # [num_tokens] int64, KV slots written by this pass
    seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: Optional[list[int]]  # EXTEND only
    extend_seq_lens_cpu: Optional[list[int]]  # EXTEND only
    req_to_token_pool: "ReqToTokenPool"
    token_to_kv_pool: "MHATokenToKVPool"
    attn_backend: "AttentionBackend"
    # per-pass data an attention backend precomputes once in init_forward_metadata()
    attn_metadata: Any = None
    # hybrid models: the linear-attention layers' states, one slot per request row (req_pool_indices)
    state_pool: Optional["RecurrentStatePool"] = None
    # and, with the radix cache, the checkpoint copies (run before the layers) and tracked positions
    state_ops: Optional["StateOps"] = None
    # the state slot of each request where it is not its row: a decode graph's padded rows
    # (state_pool.pad_slot); None: slot = req_pool_indices
    state_rows: Optional[torch.Tensor] = None
    # EAGLE-3: the residual streams entering the layers its draft reads, concatenated (models/eagle.py)
    aux_hidden: Optional[torch.Tensor] = None
    # a speculative verify step with tree drafts: per request, its nodes' parents where its draft is a
    # tree, else None (core/spec_info.py VerifyInput.parents), or a draft head's tree as its
    # ancestor matrix on the device (attention/masks.py); the attention masks each node to the prefix
    # and its ancestors
    tree_parents: Optional[list[Optional[Union[list[int], torch.Tensor]]]] = None
    # with tree_parents: per request, the deepest its tree may reach (VerifyInput.depth; a head's tree,
    # whose shape the host does not know, is chosen within it); None: not known
    tree_depths: Optional[list[int]] = None
    # a hybrid model's tree verify step: its waves through the linear-attention layers, planned by the
    # first of them for all (layers/gated_delta_net.py plan_tree_waves)
    tree_waves: Optional[list] = None
    # a speculative verify step: each request an extend of its last token and its drafts (verify graphs)
    spec_verify: bool = False
    # images (an EXTEND): the batch's [3, num_tokens] M-RoPE positions, which the rotary layers take in
    # place of `positions`, and the vision embeddings spliced over the image tokens' rows after the
    # token embedding: (rows [m], embeddings [m, hidden]) (multimodal/inputs.py)
    mrope_positions: Optional[torch.Tensor] = None
    mm_embeds: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    # multi-LoRA serving: each row's adapter slot and the pool's loads (core/lora.py), which the model
    # runner's LoRA manager applies before the layers; None: every row runs the base model
    lora: Optional["LoraStep"] = None

    @property
    def rope_positions(self) -> torch.Tensor:
        """What the model's rotary layers take: the M-RoPE positions where the batch has images."""
        return self.positions if self.mrope_positions is None else self.mrope_positions

    @property
    def state_slots(self) -> torch.Tensor:
        """[bs] each request's recurrent-state slot (a hybrid model's linear-attention layers)."""
        return self.req_pool_indices if self.state_rows is None else self.state_rows

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def __post_init__(self) -> None:
        assert self.req_pool_indices.shape[0] == self.batch_size == len(self.seq_lens_cpu)
        assert self.out_cache_loc.shape[0] == self.input_ids.shape[0] == self.positions.shape[-1]
        if self.forward_mode.is_extend():
            assert self.extend_seq_lens_cpu is not None and self.extend_prefix_lens_cpu is not None
            assert sum(self.extend_seq_lens_cpu) == self.input_ids.shape[0]
        elif self.forward_mode.is_decode():
            assert self.input_ids.shape[0] == self.batch_size


class AttentionLayer(Protocol):
    """What a backend reads of the attention layer it serves (layers/radix_attention.py RadixAttention)."""

    layer_id: int  # the layer's index into the KV pool
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank
    head_dim: int
    scaling: float  # softmax scale


class AttentionBackend(ABC):
    """How the layers attend over the paged KV pool; implementations in layers/attention/.

    A backend reads and writes the paged KV pool through `forward_batch.req_to_token_pool` and
    `forward_batch.token_to_kv_pool`. Contract:
    - `init_forward_metadata(fb)` runs once per forward pass, before any layer; it may store index
      tensors in `fb.attn_metadata` (the layers then reuse them).
    - `forward(q, k, v, layer, fb)` first writes this pass's K/V into the pool at `fb.out_cache_loc`
      (when `save_kv_cache`), then attends each new token to all of its request's KV
      `req_to_token[req_pool_indices[i], :seq_lens[i]]` with causal masking inside the new tokens.
    - Shapes: q [num_tokens, num_heads * head_dim], k/v [num_tokens, num_kv_heads * head_dim];
      returns [num_tokens, num_heads * head_dim] in q's dtype. GQA: num_heads % num_kv_heads == 0.
    """

    @abstractmethod
    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        """Precompute per-pass index data (called once per forward, before the first layer)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "AttentionLayer",
                forward_batch: "ForwardBatch", save_kv_cache: bool = True) -> torch.Tensor:
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)

    @staticmethod
    def _save_kv(k: torch.Tensor, v: torch.Tensor, layer: "AttentionLayer", fb: "ForwardBatch") -> None:
        """Write this pass's K/V ([num_tokens, num_kv_heads * head_dim]) into the pool at fb.out_cache_loc."""
        n = k.shape[0]
        fb.token_to_kv_pool.set_kv_buffer(
            layer.layer_id, fb.out_cache_loc,
            k.view(n, layer.num_kv_heads, layer.head_dim), v.view(n, layer.num_kv_heads, layer.head_dim))

    @abstractmethod
    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "AttentionLayer",
                       forward_batch: "ForwardBatch", save_kv_cache: bool = True) -> torch.Tensor:
        """Several new tokens per request, after an optional cached prefix."""

    @abstractmethod
    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "AttentionLayer",
                       forward_batch: "ForwardBatch", save_kv_cache: bool = True) -> torch.Tensor:
        """Exactly one new token per request."""
