"""What one forward pass needs, as device tensors.

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

from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any, Optional, Union

import torch

if TYPE_CHECKING:
    from baton.engine.layers.attention.base import AttentionBackend
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
    # tree, else None (speculative/spec_info.py VerifyInput.parents), or a draft head's tree as its
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

    @property
    def state_slots(self) -> torch.Tensor:
        """[bs] each request's recurrent-state slot (a hybrid model's linear-attention layers)."""
        return self.req_pool_indices if self.state_rows is None else self.state_rows

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def __post_init__(self) -> None:
        assert self.req_pool_indices.shape[0] == self.batch_size == len(self.seq_lens_cpu)
        assert self.out_cache_loc.shape[0] == self.input_ids.shape[0] == self.positions.shape[0]
        if self.forward_mode.is_extend():
            assert self.extend_seq_lens_cpu is not None and self.extend_prefix_lens_cpu is not None
            assert sum(self.extend_seq_lens_cpu) == self.input_ids.shape[0]
        elif self.forward_mode.is_decode():
            assert self.input_ids.shape[0] == self.batch_size
