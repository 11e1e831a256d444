"""Attention in plain torch over the paged KV pool: the slow, obvious path beside FlashInfer.

Works on slot indices (req_to_token), so it is correct for any page_size. Every pass first writes
the new K/V into the pool, then reads each request's whole KV back through its row:

    kv slots of request i = req_to_token[req_pool_indices[i], :seq_lens[i]]
    query j of request i sits at position prefix_len_i + j and sees keys 0 .. prefix_len_i + j

DECODE on CPU runs the native kernel (kernels/paged_decode_attention.c) when it builds: it reads
each request's K/V rows in place through req_to_token (~2.5x faster per layer than the gather
below at batch 32). Otherwise it gathers all requests at once into [bs, max_len] padded with an
additive key mask and runs one scaled_dot_product_attention per layer. Under GQA the G query heads
that share a KV head are passed as G query rows of that KV head ([bs, kv_heads, G, head_dim]), so
SDPA never expands K/V to all query heads (its `enable_gqa` path does, measured ~1.3x slower per
layer). EXTEND on CPU also runs a native kernel when it builds (paged_extend_attention): one call
for the whole batch, each request's cached prefix read in place through req_to_token and its new
tokens from the pass's own K/V (as the SDPA path), no gather and no mask; requests of more than
NATIVE_EXTEND_MAX_TOKENS new tokens stay on SDPA, whose flash kernel is as fast there. Otherwise EXTEND loops over requests with one SDPA each (no padding
waste when prompt lengths differ a lot); the index tensors and masks of those requests are built
once per pass in init_forward_metadata and reused by every layer. The one-token rows at the end of
a mixed batch (--enable-mixed-chunk: the running requests' decode step) go to the native decode
kernel in one call, as a decode batch would.

A speculative verify step with tree drafts (fb.tree_parents, core/spec_info.py) runs each tree
request on SDPA with a mask of its own: its new tokens are tree nodes, node j at position prefix + its
depth, and sees the cached prefix, itself and its ancestors only:

    parents [-1, 0, 0, 1]     keys:  prefix | n0 n1 n2 n3
                              n0      1..1  |  1  .  .  .
                              n1      1..1  |  1  1  .  .
                              n2      1..1  |  1  .  1  .
                              n3      1..1  |  1  1  .  1

so its output is the one the chain root -> node alone would give. Chain requests of the same pass take
their usual path. (The native extend kernel and the compiled extend op know only causal masks: the
model runner runs a tree step through the model's own forward.)
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F

from baton.engine.core.forward_batch import AttentionBackend
from baton.engine.kernels import cpu_attention
from baton.engine.kernels.torch_ops import define_op
from baton.engine.layers.attention.masks import prefix_causal_mask, tree_mask

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from baton.engine.core.forward_batch import ForwardBatch
    from baton.engine.layers.radix_attention import RadixAttention


@dataclass
class DecodeMetadata:
    kv_indices: torch.Tensor  # [bs, max_len] slots, padding points at slot 0 (dummy page)
    key_mask: torch.Tensor  # [bs, 1, 1, max_len] bool, True = a key of the request, False = padding


# Longer extends go to SDPA: measured per layer on a 2-core AVX-512 VM, the native kernel took
# 0.3-0.45x SDPA's time for 32 x 128 new tokens, 32 x 32 over 1,024 cached and 4 x 512, but
# 0.9-1.15x for one prompt of 2,048-4,096 new tokens, where SDPA's per-call cost is nothing and its
# key tiling keeps the working set in cache.
NATIVE_EXTEND_MAX_TOKENS = 1024


@dataclass
class NativeExtend:
    """The requests of a pass that the native extend kernel takes in one call, as its arguments
    (built once per pass, used by every layer)."""
    rows: torch.Tensor  # [m] int64 req_to_token rows
    prefix_lens: torch.Tensor  # [m] int64
    extend_lens: torch.Tensor  # [m] int64
    q_starts: torch.Tensor  # [m] int64 where each one's tokens start in the pass


@dataclass
class ExtendMetadata:
    token_starts: list[int]  # request i owns new tokens [token_starts[i], token_starts[i] + extend_len_i)
    # for the requests SDPA serves (None for those the native kernels take):
    kv_indices: list[Optional[torch.Tensor]]  # [seq_len_i] slots of request i
    masks: list[Optional[torch.Tensor]]  # [extend_len_i, seq_len_i] bool, None = plain causal (no prefix)
    prefix_lens: torch.Tensor  # [bs] int64 on the CPU (what the compiled graph passes to its op)
    extend_lens: torch.Tensor  # [bs] int64 on the CPU
    # the batch's last rows that are one new token over a cached prefix (a mixed batch's decode
    # steps, --enable-mixed-chunk): the native decode kernel can take them in one call
    decode_tail: int = 0
    native: list[int] = field(default_factory=list)  # the requests the native extend kernel takes, in one call
    native_args: Optional[NativeExtend] = None  # their arguments to it (None when there are none)


def _build_extend_metadata(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: list[int],
                           extend_lens: list[int], native: bool = False,
                           trees: Optional[list[Optional[list[int]]]] = None) -> ExtendMetadata:
    """`native`: the native kernels are available (the decode tail and every request of at most
    NATIVE_EXTEND_MAX_TOKENS new tokens go to them; no index tensors or masks are built for those).
    `trees`: per request, its tree nodes' parents (None: causal), for SDPA with the tree mask."""
    bs = len(extend_lens)
    tail = 0
    while native and tail < bs and extend_lens[-1 - tail] == 1 and prefix_lens[-1 - tail] > 0:
        tail += 1
    rows = req_pool_indices.tolist()
    starts, kv_indices, masks, native_reqs = [], [], [], []
    start = 0
    for i, (row, prefix, extend) in enumerate(zip(rows, prefix_lens, extend_lens)):
        starts.append(start)
        start += extend
        tree = None if trees is None else trees[i]
        on_sdpa = i < bs - tail and (tree is not None or not (native and 0 < extend <= NATIVE_EXTEND_MAX_TOKENS))
        if on_sdpa:
            kv_indices.append(req_to_token[row, :prefix + extend])
            if tree is not None:
                masks.append(tree_mask(prefix, tree, req_to_token.device))
            else:
                masks.append(None if prefix == 0 else prefix_causal_mask(prefix, extend, req_to_token.device))
        else:
            kv_indices.append(None)
            masks.append(None)
            if i < bs - tail:
                native_reqs.append(i)
    picked = None
    if native_reqs:
        def pick(values: list[int]) -> torch.Tensor:
            return torch.tensor([values[i] for i in native_reqs], dtype=torch.int64)
        picked = NativeExtend(pick(rows), pick(prefix_lens), pick(extend_lens), pick(starts))
    return ExtendMetadata(starts, kv_indices, masks, torch.tensor(prefix_lens, dtype=torch.int64),
                          torch.tensor(extend_lens, dtype=torch.int64), tail, native_reqs, picked)


class TorchAttnBackend(AttentionBackend):
    def __init__(self, model_runner=None, native_decode: Optional[bool] = None, **_unused) -> None:
        """native_decode: read the pool in place with the native CPU kernels, at decode (same result as
        the gather + SDPA below, without the per-step copy of every request's KV) and at extend (when
        head_dim <= 128). None = when the model runner's device and dtype allow it and the kernels
        build; no model runner = off."""
        if native_decode is None and model_runner is not None:
            reason = cpu_attention.unavailable_reason(model_runner.dtype, model_runner.device,
                                                      model_runner.token_to_kv_pool.dtype)
            native_decode = reason is None
            if reason and str(model_runner.device).startswith("cpu"):
                logger.warning("native CPU decode attention off (%s); using gather + SDPA", reason)
        self.native_decode = bool(native_decode)
        head_dim = getattr(model_runner, "head_dim", None)
        self.native_extend = self.native_decode and (head_dim is None or head_dim <= cpu_attention.EXTEND_MAX_HEAD_DIM)

    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        if forward_batch.forward_mode.is_decode():
            # The native kernel reads req_to_token itself: no per-pass metadata to build.
            forward_batch.attn_metadata = None if self.native_decode else self._decode_metadata(forward_batch)
        elif forward_batch.forward_mode.is_extend():
            forward_batch.attn_metadata = self._extend_metadata(forward_batch)

    @staticmethod
    def _decode_metadata(fb: "ForwardBatch") -> DecodeMetadata:
        max_len = max(fb.seq_lens_cpu)
        rows = fb.req_to_token_pool.req_to_token[fb.req_pool_indices, :max_len]  # [bs, max_len]
        valid = torch.arange(max_len, device=rows.device)[None, :] < fb.seq_lens[:, None]  # [bs, max_len]
        kv_indices = torch.where(valid, rows, torch.zeros_like(rows))
        # a bool mask: SDPA applies it in the query's dtype, whatever the pool's (--kv-cache-dtype)
        return DecodeMetadata(kv_indices, valid[:, None, None, :])

    def _extend_metadata(self, fb: "ForwardBatch") -> ExtendMetadata:
        for i, (prefix, extend) in enumerate(zip(fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu)):
            assert prefix + extend == fb.seq_lens_cpu[i], "seq_len must equal prefix_len + extend_len"
        return _build_extend_metadata(fb.req_to_token_pool.req_to_token, fb.req_pool_indices,
                                      fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu, self.native_extend,
                                      fb.tree_parents)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "RadixAttention",
                       forward_batch: "ForwardBatch", save_kv_cache: bool = True) -> torch.Tensor:
        if save_kv_cache:
            self._save_kv(k, v, layer, forward_batch)
        k_buf, v_buf = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        bs, group = q.shape[0], layer.num_heads // layer.num_kv_heads
        qg = q.view(bs, layer.num_kv_heads, group, layer.head_dim)  # query heads grouped by their KV head
        if self.native_decode:
            out = cpu_attention.paged_decode_attention(
                qg, k_buf, v_buf, forward_batch.req_to_token_pool.req_to_token, forward_batch.req_pool_indices,
                forward_batch.seq_lens, layer.scaling)
            return out.reshape(bs, layer.num_heads * layer.head_dim)
        meta: DecodeMetadata = forward_batch.attn_metadata
        keys = _gather(k_buf, meta.kv_indices).to(q.dtype).transpose(1, 2)  # [bs, kv_heads, max_len, head_dim]
        values = _gather(v_buf, meta.kv_indices).to(q.dtype).transpose(1, 2)
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=meta.key_mask,
                                             scale=layer.scaling)
        return out.reshape(bs, layer.num_heads * layer.head_dim)  # [bs, num_heads * head_dim]

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "RadixAttention",
                       forward_batch: "ForwardBatch", save_kv_cache: bool = True) -> torch.Tensor:
        if save_kv_cache:
            self._save_kv(k, v, layer, forward_batch)
        meta: ExtendMetadata = forward_batch.attn_metadata
        k_buf, v_buf = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        n = q.shape[0]
        q3 = q.view(n, layer.num_heads, layer.head_dim)
        k3, v3 = k.view(n, layer.num_kv_heads, layer.head_dim), v.view(n, layer.num_kv_heads, layer.head_dim)
        if torch.compiler.is_compiling():
            assert forward_batch.tree_parents is None, "a tree verify step runs the model's own forward"
            # Under torch.compile the per-request loop is one opaque op fed with tensors only, so
            # the model compiles into one graph whatever the batch's lengths (no graph break, no
            # guard on Python lists of lengths).
            out = torch.ops.baton.extend_attention(q3, k3, v3, k_buf, v_buf, forward_batch.req_to_token_pool.req_to_token,
                                                   forward_batch.req_pool_indices, meta.prefix_lens, meta.extend_lens,
                                                   layer.scaling, self.native_extend)
        else:
            out = _extend_attention(q3, k3, v3, k_buf, v_buf, meta, layer.scaling,
                                    forward_batch.req_to_token_pool.req_to_token, forward_batch.req_pool_indices)
        return out.view(n, layer.num_heads * layer.head_dim)


def _extend_attention(q3: torch.Tensor, k3: torch.Tensor, v3: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                      meta: ExtendMetadata, scale: float, req_to_token: Optional[torch.Tensor] = None,
                      req_pool_indices: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of each request's new tokens over its prefix (from the pool) and themselves.
    q3 [n, num_heads, head_dim], k3/v3 [n, kv_heads, head_dim] -> [n, num_heads, head_dim].
    The requests in meta.native go to the native extend kernel in one call, the trailing one-token
    rows (meta.decode_tail) to the native decode kernel in one call (their K/V are in the pool
    already); every other request gets one SDPA."""
    n, heads, head_dim = q3.shape
    bs, tail = len(meta.token_starts), meta.decode_tail
    if meta.native_args is not None:
        nat = meta.native_args
        out = cpu_attention.paged_extend_attention(q3, k3, v3, k_buf, v_buf, req_to_token, nat.rows, nat.prefix_lens,
                                                   nat.extend_lens, scale, q_starts=nat.q_starts)
    else:
        out = torch.empty_like(q3)
    gqa = heads != k3.shape[1]
    if tail:
        kv_heads = k_buf.shape[1]
        qg = q3[n - tail:].reshape(tail, kv_heads, heads // kv_heads, head_dim)
        dec = cpu_attention.paged_decode_attention(qg, k_buf, v_buf, req_to_token, req_pool_indices[bs - tail:],
                                                   meta.prefix_lens[bs - tail:] + 1, scale)
        out[n - tail:] = dec.reshape(tail, heads, head_dim).to(out.dtype)
    for i, extend in enumerate(meta.extend_lens[:bs - tail].tolist()):
        if extend == 0 or meta.kv_indices[i] is None:  # nothing to attend, or a native request
            continue
        s = meta.token_starts[i]
        qi = q3[s:s + extend].transpose(0, 1)[None]  # [1, num_heads, extend, head_dim]
        mask = meta.masks[i]
        if mask is None:  # no cached prefix: the keys are exactly this pass's k/v, no pool gather
            ki, vi = k3[s:s + extend], v3[s:s + extend]
        else:
            ki, vi = _gather(k_buf, meta.kv_indices[i]), _gather(v_buf, meta.kv_indices[i])
        ki = ki.to(q3.dtype).transpose(0, 1)[None]  # [1, kv_heads, seq_len, head_dim]
        vi = vi.to(q3.dtype).transpose(0, 1)[None]
        oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, is_causal=mask is None, scale=scale,
                                            enable_gqa=gqa)
        out[s:s + extend] = oi[0].transpose(0, 1)
    return out


def _extend_attention_impl(q3: torch.Tensor, k3: torch.Tensor, v3: torch.Tensor, k_buf: torch.Tensor,
                           v_buf: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                           prefix_lens: torch.Tensor, extend_lens: torch.Tensor, scale: float,
                           native: bool) -> torch.Tensor:
    meta = _build_extend_metadata(req_to_token, req_pool_indices, prefix_lens.tolist(), extend_lens.tolist(), native)
    return _extend_attention(q3, k3, v3, k_buf, v_buf, meta, scale, req_to_token, req_pool_indices)


define_op("extend_attention", "(Tensor q3, Tensor k3, Tensor v3, Tensor k_buf, Tensor v_buf, Tensor req_to_token, "
          "Tensor req_pool_indices, Tensor prefix_lens, Tensor extend_lens, float scale, bool native) -> Tensor",
          _extend_attention_impl,
          lambda q3, k3, v3, k_buf, v_buf, req_to_token, req_pool_indices, prefix_lens, extend_lens, scale, native:
          torch.empty_like(q3), dispatch_key="CompositeExplicitAutograd")


def _gather(buf: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """buf[idx] for a [slots, heads, head_dim] pool: index_select on a 2-D view is ~2.5x faster than
    advanced indexing on CPU. Returns [*idx.shape, heads, head_dim]."""
    flat = buf.view(buf.shape[0], -1)
    return torch.index_select(flat, 0, idx.reshape(-1)).view(*idx.shape, *buf.shape[1:])
