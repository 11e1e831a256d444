"""Gated DeltaNet, the linear-attention layer of Qwen3-Next and Qwen3.5 (arXiv:2412.06464), HF's math.

    hidden -> projections -> mixed qkv [n, 2 * key_dim + value_dim], z [n, Hv, Dv], b, a [n, Hv]
           -> short causal conv1d over qkv (+ silu), carried across passes by its conv state
           -> q, k (l2-normed), v; beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)
           -> gated delta rule, carried across passes by its state S [Hv, Dk, Dv]:
                  S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T,  o_t = S_t^T q_t
           -> RMSNorm(o) * silu(z) -> out_proj

The conv and the rule are one layer op (`GatedDeltaCore`): its torch reference runs the chunked form
of the rule for a request's extend (transformers' torch_chunk_gated_delta_rule, from the request's
state) and the recurrent form for one token (decode; torch_recurrent_gated_delta_rule). Both read
and write the request's slot of the recurrent-state pool (mem_cache/state_pool.py), which the
forward batch carries. With the radix cache, an extend is cut at each tracked position and the
state there goes to a checkpoint slot as well (mem_cache/hybrid_radix_cache.py). A speculative verify
step runs its drafts' nodes (a chain's tokens, a tree's nodes) in waves by depth, each node from its
parent's state, every node's state kept in the scratch slot the scheduler names (`plan_tree_waves`,
planned once per pass for every layer). The CUDA path, bound at load where fla-core is installed
(the reference serves CUDA elsewhere: layers/custom_op.py), packs the batch (no per-request loop):
for an extend the conv as K gathers over one buffer of [state | tokens] per request
(`varlen_causal_conv1d`), tracked positions as waves of pieces, and the rule on fla-core's chunked
Triton kernel over the varlen batch (`fla_rule`); a decode step runs two Triton kernels in place on
the pool, the conv on the rows' conv states (triton_ops/causal_conv1d.py) and the rule on their
delta-rule states (triton_ops/gated_delta_decode.py): no gather or scatter of either.
The same packing runs on CPU with the reference rule (and the kernels' torch twins) in tests.

Checkpoint layouts: Qwen3-Next fuses the projections per key-head group (`in_proj_qkvz`,
`in_proj_ba`, interleaved); Qwen3.5 keeps them apart (`in_proj_qkv`, `in_proj_z`, `in_proj_b`,
`in_proj_a`).
"""
from __future__ import annotations

import functools
import itertools
import logging
from functools import partial
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from baton.engine.core.spec_info import node_depths
from baton.engine.distributed.parallel_state import TpGroup
from baton.engine.layers.attention.masks import node_parents
from baton.engine.layers.custom_op import CustomOp
from baton.engine.layers.layernorm import GatedRMSNorm
from baton.engine.layers.linear import MergedColumnLinear, OutputPart, RowParallelLinear
from baton.engine.triton_ops import causal_conv1d, gated_delta_decode

if TYPE_CHECKING:
    from baton.engine.core.forward_batch import ForwardBatch
    from baton.engine.model_config import LinearAttentionHeads

logger = logging.getLogger(__name__)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta):
    """[b, t, h, d] inputs -> float32 [b, h, t, d] with k heads repeated to v heads, q/k l2-normed, q scaled."""
    hk, hv = k.shape[2], v.shape[2]
    if hk != hv:
        q, k = q.repeat_interleave(hv // hk, dim=2), k.repeat_interleave(hv // hk, dim=2)
    q, k, v, beta, g = [x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                        for x in (q, k, v, beta, g)]
    q, k = _l2norm(q), _l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor, chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [b, t, Hk, Dk], v [b, t, Hv, Dv], g, beta [b, t, Hv], state [b, Hv, Dk, Dv] ->
    (out [b, t, Hv, Dv] in q's dtype, final state float32): transformers' chunked form."""
    dtype, t = q.dtype, q.shape[1]
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    pad = (chunk_size - t % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = [x.reshape(x.shape[0], x.shape[1], -1, chunk_size, x.shape[-1])
                            for x in (q, k, k_beta, v_beta)]
    g = g.reshape(g.shape[0], g.shape[1], -1, chunk_size)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=3)
    pairwise = (cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * pairwise
    intra = (q @ k.transpose(-1, -2)) * pairwise
    new_values = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
    s = state.to(new_values)
    out = torch.zeros_like(new_values)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    for i in range(q.shape[2]):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ s
        out[:, :, i] = q[:, :, i] @ s + intra[:, :, i] @ v_new
        s = s * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(out.shape[0], out.shape[1], -1, out.shape[-1])[:, :, :t]
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format), s


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same, token by token (transformers' recurrent form; what decode runs)."""
    dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    s = state.to(v)
    out = torch.zeros_like(v)
    for i in range(q.shape[2]):
        s = s * g[:, :, i].exp()[..., None, None]
        kv_mem = (s * k[:, :, i].unsqueeze(-1)).sum(dim=-2)
        delta = (v[:, :, i] - kv_mem) * beta[:, :, i].unsqueeze(-1)
        s = s + k[:, :, i].unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, :, i] = (s * q[:, :, i].unsqueeze(-1)).sum(dim=-2)
    return out.transpose(1, 2).contiguous().to(dtype), s


def delta_rule_decode_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """triton_ops/gated_delta_decode.py's contract in torch ops (the CPU path and the kernel's test
    oracle): the rows' delta-rule states gathered, recurrent_gated_delta_rule for one token, scattered back."""
    gated_delta_decode.check_args(q, k, v, g, beta, states, slots)
    out, s = recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], states[slots])
    states[slots] = s.to(states.dtype)
    return out[:, 0].to(v.dtype)


def delta_rule_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """A decode step's delta rule in place on the pool: the Triton kernel where it serves, else the twin."""
    if gated_delta_decode.takes(q, k, v, states):
        return gated_delta_decode.delta_rule_decode_triton(q, k, v, g, beta, states, slots)
    return delta_rule_decode_torch(q, k, v, g, beta, states, slots)


def _pick_rows(param: nn.Parameter, rows: list[tuple[int, int]]) -> None:
    """Load `param` from these (start, count) row ranges of its checkpoint tensor, concatenated:
    this rank's heads (every row with one rank)."""

    @torch.no_grad()
    def load(p: nn.Parameter, tensor: torch.Tensor) -> None:
        part = torch.cat([tensor[start:start + n] for start, n in rows])
        assert part.shape == p.shape, f"{tuple(tensor.shape)} in checkpoint, rows {rows} for {tuple(p.shape)}"
        p.copy_(part)

    param.weight_loader = load


def varlen_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, lens: list[int],
                         conv_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The short causal conv1d (+ silu) of packed requests, each continuing from its conv state:
    x [n, C], weight [C, K] (depthwise), conv_state [bs, C, K - 1] -> (y [n, C], new conv state).
    Each request's [state | tokens] sits in one buffer (request i's token l at its start + (i + 1)
    (K - 1) + l), and output token g sums the K rows from g + i (K - 1) on: K gathers, accumulated in
    float32 as a conv does, whatever the batch."""
    n, channels = x.shape
    bs, k1 = conv_state.shape[0], conv_state.shape[-1]
    dev = x.device
    lens_t = torch.tensor(lens, dtype=torch.int64, device=dev)
    req = torch.repeat_interleave(torch.arange(bs, device=dev), lens_t, output_size=n)
    tok = torch.arange(n, device=dev)
    starts = torch.cumsum(lens_t, 0) - lens_t
    ext = torch.empty(n + bs * k1, channels, dtype=x.dtype, device=dev)
    ext[tok + (req + 1) * k1] = x
    state_rows = (starts + torch.arange(bs, device=dev) * k1)[:, None] + torch.arange(k1, device=dev)
    ext[state_rows.reshape(-1)] = conv_state.transpose(1, 2).reshape(-1, channels).to(x.dtype)
    first = tok + req * k1
    w = weight.float()
    y = torch.zeros(n, channels, dtype=torch.float32, device=dev)
    for j in range(k1 + 1):
        y += ext[first + j].float() * w[:, j]
    last = (starts + lens_t + torch.arange(1, bs + 1, device=dev) * k1 - k1)[:, None] + torch.arange(k1, device=dev)
    new_state = ext[last.reshape(-1)].reshape(bs, k1, channels).transpose(1, 2)
    return F.silu(y).to(x.dtype), new_state


def decode_causal_conv1d(x: torch.Tensor, weight: torch.Tensor,
                         conv_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """varlen_causal_conv1d where every request has one token (x [bs, C]): the same sums in the same
    order, from device tensors alone (no lengths from the host), so a decode graph captures it."""
    seq = torch.cat([conv_state.to(x.dtype), x[:, :, None]], dim=-1)  # [bs, C, K]
    w = weight.float()
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for j in range(seq.shape[-1]):
        y += seq[:, :, j].float() * w[:, j]
    return F.silu(y).to(x.dtype), seq[:, :, 1:]


def conv1d_decode_torch(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor,
                        slots: torch.Tensor) -> torch.Tensor:
    """triton_ops/causal_conv1d.py's contract in torch ops (the CPU path and the kernel's test oracle):
    the rows' conv states gathered, decode_causal_conv1d, scattered back."""
    causal_conv1d.check_args(x, weight, states, slots)
    y, new_state = decode_causal_conv1d(x, weight, states[slots])
    states[slots] = new_state.to(states.dtype)
    return y


def conv1d_decode(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """A decode step's conv in place on the pool: the Triton kernel where it serves the call, else the twin."""
    if causal_conv1d.takes(x):
        return causal_conv1d.conv1d_decode_triton(x, weight, states, slots)
    return conv1d_decode_torch(x, weight, states, slots)


def torch_varlen_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      lens: list[int], state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule over packed requests with the reference functions, one request at a time:
    q, k [n, Hk, Dk], v [n, Hv, Dv], g, beta [n, Hv], state [bs, Hv, Dk, Dv] -> (out [n, Hv, Dv], state)."""
    outs, states, start = [], [], 0
    for i, n in enumerate(lens):
        sl = slice(start, start + n)
        fn = recurrent_gated_delta_rule if n == 1 else chunk_gated_delta_rule
        o, s = fn(q[None, sl], k[None, sl], v[None, sl], g[None, sl], beta[None, sl], state[i:i + 1])
        outs.append(o[0]), states.append(s)
        start += n
    return torch.cat(outs), torch.cat(states)


@functools.lru_cache(maxsize=None)
def fla_kernels() -> Optional[tuple[Callable, Callable]]:
    """fla-core's (chunk, fused recurrent) gated delta rule, or None where it is not installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as chunk
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as recurrent
    except Exception as exc:  # not installed, or no usable Triton backend
        logger.info("fla-core unavailable (%s): linear-attention layers run the torch reference on CUDA", exc)
        return None
    return chunk, recurrent


def fla_rule(chunk: Callable, recurrent: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor, lens: list[int], state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_varlen_rule's contract on fla's kernels: value heads grouped over key heads in the kernel
    (GVA), q/k l2-normed in it, scale 1/sqrt(Dk); the fused recurrent kernel when every request has
    one token (decode), else the chunked one over the varlen batch (cu_seqlens)."""
    beta = beta.to(q.dtype)
    h0 = state.float()
    if all(n == 1 for n in lens):
        o, s = recurrent(q[:, None].contiguous(), k[:, None].contiguous(), v[:, None].contiguous(), g[:, None],
                         beta=beta[:, None], initial_state=h0, output_final_state=True,
                         use_qk_l2norm_in_kernel=True)
        return o[:, 0], s
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int64, device=q.device)
    o, s = chunk(q[None].contiguous(), k[None].contiguous(), v[None].contiguous(), g[None], beta[None],
                 initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    return o[0], s


def tree_wave_plan(trees: Optional[list], lens: list[int], depths: Optional[list[int]]) -> list[list[list[int]]]:
    """The waves a verify step's nodes run in through a linear-attention layer (GatedDeltaCore._tree_waves):
    waves[d][i], the nodes of request i in wave d. A node needs its parent's state, so a tree on the host
    (its parents; a chain: node j's is j - 1) runs each node in the wave of its depth. A head's tree on
    the device (an ancestor matrix: its depths unknown here) runs nodes d .. n - 1 in wave d, up to the
    depth it may reach (`depths[i]`; n - 1 where not known): node j is right from the wave of its depth
    on (depth <= j), its parent being right by then, and a later wave computes it again from the same
    state; so the waves are as many as the deepest tree's levels, not its nodes.

        tree_wave_plan([[-1, 0, 0, 1], None], [4, 2], None) == [[[0], [0]], [[1, 2], [1]], [[3], []]]
    """
    plans = []
    for i, n in enumerate(lens):
        tree = None if trees is None else trees[i]
        if isinstance(tree, torch.Tensor):
            deepest = n - 1 if depths is None else min(depths[i], n - 1)
            plans.append([list(range(d, n)) for d in range(deepest + 1)])
            continue
        depth = list(range(n)) if tree is None else node_depths(tree)
        levels: list[list[int]] = [[] for _ in range(max(depth) + 1)]
        for j, d in enumerate(depth):
            levels[d].append(j)
        plans.append(levels)
    return [[plan[d] if d < len(plan) else [] for plan in plans] for d in range(max(map(len, plans)))]


class TreeWave(NamedTuple):
    """One wave of a tree verify step through the linear-attention layers (plan_tree_waves)."""

    at: torch.Tensor  # [m] the wave's nodes' token rows in the pass
    read: torch.Tensor  # [m] the state slot each node starts from: its parent's (node 0: its row)
    pick: torch.Tensor  # [w] the wave's rows (of m) whose states are kept ...
    slots: torch.Tensor  # [w] ... and the slots they go to (a row in several when it is tracked and last)


def plan_tree_waves(fb: "ForwardBatch") -> list[TreeWave]:
    """The waves of tree verify step `fb` (tree_wave_plan) as device indices, the same for every layer:
    built once per pass, from one host-to-device copy. A node reads the scratch slot that takes the
    state after its parent (the parent's track at offset p + 1; node 0 its row) and writes its own
    tracked slots, the last node its row too (GatedDeltaCore._tree_waves)."""
    rows, lens = fb.state_slots, list(fb.extend_seq_lens_cpu)
    bs, width, dev = len(lens), max(lens), rows.device
    tracks = fb.state_ops.tracks if fb.state_ops is not None else {}
    after = {(i, off - 1): slot for i, t in tracks.items() for off, slot in t}  # (request, node) -> slot
    assert all((i, p) in after for i, n in enumerate(lens) for p in range(n - 1)), "a node without its slot"
    pad = fb.state_pool.pad_slot
    host = [[0] + [after.get((i, p), pad) for p in range(width - 1)] for i in range(bs)]
    starts = list(itertools.accumulate([0] + lens[:-1]))
    plans, sizes = tree_wave_plan(fb.tree_parents, lens, fb.tree_depths), []
    for wave in plans:
        nodes = [(i, j) for i, js in enumerate(wave) for j in js]
        kept = [(n, after[node]) for n, node in enumerate(nodes) if node in after]
        last = [(n, i) for n, (i, j) in enumerate(nodes) if j == lens[i] - 1]
        parts = ([starts[i] + j for i, j in nodes], [i * width + j for i, j in nodes], [n for n, _ in kept + last],
                 [s for _, s in kept], [i for _, i in last])
        host.append([v for part in parts for v in part])
        sizes.append([len(part) for part in parts])
    flat = torch.tensor([v for part in host for v in part], dtype=torch.int64).to(dev, non_blocking=True)
    table = flat[:bs * width].view(bs, width).clone()  # column 1 + p: the slot after node p
    table[:, 0] = rows
    src = table.gather(1, node_parents(fb.tree_parents, lens, dev) + 1).view(-1)  # [bs x width]
    waves, at = [], bs * width
    for size in sizes:
        token_rows, flat_nodes, pick, kept_slots, last_rows = flat[at:at + sum(size)].split(size)
        waves.append(TreeWave(token_rows, src[flat_nodes], pick, torch.cat([kept_slots, rows[last_rows]])))
        at += sum(size)
    return waves


class GatedDeltaCore(CustomOp):
    """Conv1d + gated delta rule of one layer over a batch, through the request rows' state slots."""

    def __init__(self, conv: nn.Conv1d, key_dim: int, value_dim: int, head_k_dim: int, head_v_dim: int,
                 state_layer_id: int) -> None:
        super().__init__()
        self._conv = (conv,)  # held, not registered: the layer owns it (and its checkpoint name)
        self.key_dim, self.value_dim, self.head_k_dim, self.head_v_dim = key_dim, value_dim, head_k_dim, head_v_dim
        self.state_layer_id = state_layer_id

    def forward_native(self, mixed_qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       forward_batch: "ForwardBatch") -> torch.Tensor:
        """mixed_qkv [n, conv_dim], g, beta [n, Hv] -> core output [n, Hv, Dv]."""
        fb, pool = forward_batch, forward_batch.state_pool
        if fb.spec_verify:  # a verify step: its chains' or trees' nodes in waves
            return self._tree_waves(mixed_qkv, g, beta, fb, self._one_token)
        rows = fb.state_slots
        if fb.forward_mode.is_decode():
            lens, fresh = [1] * fb.batch_size, [False] * fb.batch_size
        else:
            lens, fresh = fb.extend_seq_lens_cpu, [p == 0 for p in fb.extend_prefix_lens_cpu]
        conv_state, ssm_state = pool.read(self.state_layer_id, rows, fresh)
        tracks = fb.state_ops.tracks if fb.state_ops is not None else {}
        ends: list[tuple[int, int]] = []  # (row, checkpoint slot) that take the row's final state
        if all(n == 1 for n in lens):  # one token per request (decode, or mixed-in decode steps): batched
            out, conv_state, ssm_state = self._run(mixed_qkv[:, None], g[:, None], beta[:, None], conv_state,
                                                   ssm_state)
            out = out[:, 0]
            ends = [(i, slot) for i, t in tracks.items() for _, slot in t]
        else:
            outs, convs, ssms, start = [], [], [], 0
            for i, n in enumerate(lens):
                # a tracked position inside the extend cuts it there: the state at the cut is a checkpoint
                cuts = [(off, slot) for off, slot in tracks.get(i, ()) if off < n]
                ends += [(i, slot) for off, slot in tracks.get(i, ()) if off == n]
                c, s, pieces, at = conv_state[i:i + 1], ssm_state[i:i + 1], [], 0
                for stop, slot in cuts + [(n, None)]:
                    o, c, s = self._run(mixed_qkv[None, start + at:start + stop], g[None, start + at:start + stop],
                                        beta[None, start + at:start + stop], c, s)
                    pieces.append(o[0])
                    if slot is not None:
                        pool.write(self.state_layer_id, torch.tensor([slot], device=rows.device), c, s)
                    at = stop
                outs.append(torch.cat(pieces) if len(pieces) > 1 else pieces[0]), convs.append(c), ssms.append(s)
                start += n
            out, conv_state, ssm_state = torch.cat(outs), torch.cat(convs), torch.cat(ssms)
        pool.write(self.state_layer_id, rows, conv_state, ssm_state)
        if ends:
            which = torch.tensor([i for i, _ in ends], device=rows.device)
            pool.write(self.state_layer_id, torch.tensor([slot for _, slot in ends], device=rows.device),
                       conv_state[which], ssm_state[which])
        return out

    def path_available(self, path: str) -> bool:
        return path != "cuda" or fla_kernels() is not None  # without fla-core the reference serves CUDA

    def forward_cuda(self, mixed_qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     forward_batch: "ForwardBatch") -> torch.Tensor:
        """Extends: fla-core's chunked kernel for the rule, the conv as one gather per tap over the
        packed batch. Decode: the in-place Triton kernels of the conv and the rule."""
        return self.forward_varlen(mixed_qkv, g, beta, forward_batch, partial(fla_rule, *fla_kernels()),
                                   conv1d_decode, delta_rule_decode)

    def forward_varlen(self, mixed_qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, fb: "ForwardBatch",
                       rule: Callable, conv_decode: Optional[Callable] = None,
                       state_decode: Optional[Callable] = None) -> torch.Tensor:
        """The batch packed, no per-request loop: what forward_native computes, with `rule` for the
        delta rule over a packed varlen batch (`fla_rule`, or `torch_varlen_rule` to test the rest on
        CPU). A tracked position inside an extend cuts it there: the batch runs in waves, wave w
        being every request's w-th piece, each starting from the state the last one left. A decode
        step with `conv_decode` (triton_ops/causal_conv1d.py's contract) updates the conv states in
        place on the pool instead, and with `state_decode` as well (triton_ops/gated_delta_decode.py's)
        the delta-rule states (`_decode_in_place`)."""
        if conv_decode is not None and fb.forward_mode.is_decode():
            return self._decode_in_place(mixed_qkv, g, beta, fb, rule, conv_decode, state_decode)
        if fb.spec_verify:  # a verify step: its chains' or trees' nodes in waves
            return self._tree_waves(mixed_qkv, g, beta, fb,
                                    lambda x, g1, b1, c, s: self._wave(x, g1, b1, [1] * x.shape[0], c, s, rule))
        pool, rows = fb.state_pool, fb.state_slots
        bs, dev = fb.batch_size, mixed_qkv.device
        if fb.forward_mode.is_decode():
            lens, fresh = [1] * bs, [False] * bs
        else:
            lens, fresh = list(fb.extend_seq_lens_cpu), [p == 0 for p in fb.extend_prefix_lens_cpu]
        conv_state, ssm_state = pool.read(self.state_layer_id, rows, fresh)
        tracks = fb.state_ops.tracks if fb.state_ops is not None else {}
        cuts = [sorted(off for off, _ in tracks.get(i, ()) if off < n) for i, n in enumerate(lens)]
        slot_at = {(i, off): slot for i, t in tracks.items() for off, slot in t}
        starts = [0]
        for n in lens[:-1]:
            starts.append(starts[-1] + n)
        if not any(cuts):
            out, conv_state, ssm_state = self._wave(mixed_qkv, g, beta, lens, conv_state, ssm_state, rule)
        else:
            out = torch.empty(mixed_qkv.shape[0], self.value_dim // self.head_v_dim, self.head_v_dim,
                              dtype=mixed_qkv.dtype, device=dev)
            for w in range(max(map(len, cuts)) + 1):
                active = [i for i in range(bs) if len(cuts[i]) >= w]
                bounds = [(0 if w == 0 else cuts[i][w - 1], cuts[i][w] if w < len(cuts[i]) else lens[i])
                          for i in active]
                idx = torch.tensor([starts[i] + t for i, (a, b) in zip(active, bounds) for t in range(a, b)],
                                   device=dev)
                which = torch.tensor(active, device=dev)
                o, c, s = self._wave(mixed_qkv[idx], g[idx], beta[idx], [b - a for a, b in bounds],
                                     conv_state[which], ssm_state[which], rule)
                out[idx] = o
                conv_state, ssm_state = conv_state.index_copy(0, which, c), ssm_state.index_copy(0, which, s)
                kept = [(j, slot_at[(i, b)]) for j, (i, (_, b)) in enumerate(zip(active, bounds)) if b < lens[i]]
                if kept:  # the state at a tracked cut: a checkpoint
                    pick = torch.tensor([j for j, _ in kept], device=dev)
                    pool.write(self.state_layer_id, torch.tensor([slot for _, slot in kept], device=dev),
                               c[pick], s[pick])
        pool.write(self.state_layer_id, rows, conv_state, ssm_state)
        ends = [(i, slot) for i, t in tracks.items() for off, slot in t if off == lens[i]]
        if ends:
            pick = torch.tensor([i for i, _ in ends], device=dev)
            pool.write(self.state_layer_id, torch.tensor([slot for _, slot in ends], device=dev),
                       conv_state[pick], ssm_state[pick])
        return out

    def _decode_in_place(self, x: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, fb: "ForwardBatch",
                         rule: Callable, conv_decode: Callable,
                         state_decode: Optional[Callable] = None) -> torch.Tensor:
        """One token per row: the conv reads and shifts the rows' conv states where they lie in the
        pool; `state_decode` runs the rule on the rows' delta-rule states there too, else `rule` on a
        gathered copy that is written back. A tracked end (every decode track) takes both states of
        its row: what the kernels left in the pool (or the rule's copy)."""
        pool, rows, layer = fb.state_pool, fb.state_slots, self.state_layer_id
        weight = self._conv[0].weight
        y = conv_decode(x, weight.view(weight.shape[0], -1), pool.conv[layer], rows)
        if state_decode is not None:
            out, ssm_state = state_decode(*self._heads(y), g, beta, pool.ssm[layer], rows), None
        else:
            out, ssm_state = self._rule(y, g, beta, [1] * fb.batch_size, pool.read_ssm(layer, rows), rule)
            pool.write_ssm(layer, rows, ssm_state)
        tracks = fb.state_ops.tracks if fb.state_ops is not None else {}
        ends = [(i, slot) for i, t in tracks.items() for _, slot in t]
        if ends:
            pick = torch.tensor([i for i, _ in ends], device=x.device)
            ssm_end = pool.ssm[layer][rows[pick]] if ssm_state is None else ssm_state[pick]
            pool.write(layer, torch.tensor([slot for _, slot in ends], device=x.device), pool.conv[layer][rows[pick]],
                       ssm_end)
        return out

    def _tree_waves(self, x: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, fb: "ForwardBatch",
                    step: Callable) -> torch.Tensor:
        """A verify step (speculative decoding), its requests' drafts as trees (fb.tree_parents; a request
        without one is a chain), in waves of nodes (`tree_wave_plan`: by depth), one token each (`step`: the one-token conv and rule of m
        rows from their states -> (out, conv, delta-rule state)). A node starts from its parent's state:
        node 0 from the row's, node p's child from the scratch slot that takes the state after node p
        (its track at offset p + 1). Each node's state goes to its tracked slots, the last node's into
        the row too, as a chain's final state does. A wave gathers every state it reads before it
        writes. Parents on the device (a draft head's ancestor matrices) stay there.

            node:            0     1     2     3          parents  -1   0   0   1
            reads from:     row   s1    s1    s2         (s_{p+1}: the slot after node p)
            writes to:      s1    s2    s3    s4, row    waves: {0}, {1, 2}, {3}
        """
        pool, layer = fb.state_pool, self.state_layer_id
        if fb.tree_waves is None:  # the first linear-attention layer of the pass plans for all of them
            fb.tree_waves = plan_tree_waves(fb)
        out = torch.empty(x.shape[0], self.value_dim // self.head_v_dim, self.head_v_dim, dtype=x.dtype,
                          device=x.device)
        for wave in fb.tree_waves:
            o, conv, ssm = step(x[wave.at], g[wave.at], beta[wave.at], pool.conv[layer][wave.read],
                                pool.ssm[layer][wave.read])
            out[wave.at] = o
            pool.write(layer, wave.slots, conv[wave.pick], ssm[wave.pick])
        return out

    def _one_token(self, x: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_state: torch.Tensor,
                   ssm_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """_run of one token per row: x [m, conv_dim], g, beta [m, Hv] -> (out [m, Hv, Dv], states)."""
        out, conv_state, ssm_state = self._run(x[:, None], g[:, None], beta[:, None], conv_state, ssm_state)
        return out[:, 0], conv_state, ssm_state

    def _wave(self, x: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, lens: list[int], conv_state: torch.Tensor,
              ssm_state: torch.Tensor, rule: Callable) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Packed requests of `lens` tokens from their states -> (out [n, Hv, Dv], conv, delta-rule state)."""
        weight = self._conv[0].weight
        conv = decode_causal_conv1d if all(n == 1 for n in lens) else partial(varlen_causal_conv1d, lens=lens)
        y, conv_state = conv(x, weight.view(weight.shape[0], -1), conv_state=conv_state)
        out, ssm_state = self._rule(y, g, beta, lens, ssm_state, rule)
        return out, conv_state, ssm_state

    def _rule(self, y: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, lens: list[int], ssm_state: torch.Tensor,
              rule: Callable) -> tuple[torch.Tensor, torch.Tensor]:
        """The conv's output y [n, conv_dim] split into q, k, v heads -> `rule`'s (out [n, Hv, Dv], state)."""
        return rule(*self._heads(y), g, beta, lens, ssm_state)

    def _heads(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """y [n, conv_dim] -> views q, k [n, Hk, Dk], v [n, Hv, Dv]."""
        n = y.shape[0]
        q, k, v = y.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.reshape(n, -1, self.head_k_dim), k.reshape(n, -1, self.head_k_dim),
                v.reshape(n, -1, self.head_v_dim))

    def _run(self, x: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_state: torch.Tensor,
             ssm_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """b requests of t tokens each: x [b, t, conv_dim], g, beta [b, t, Hv], states [b, ...] ->
        (out [b, t, Hv, Dv], conv state, delta-rule state)."""
        conv = self._conv[0]
        b, t, _ = x.shape
        # the conv over [state | new inputs], no padding: HF's causal_conv1d_fn / _update
        seq = torch.cat([conv_state.to(x.dtype), x.transpose(1, 2)], dim=-1).to(conv.weight.dtype)
        new_conv_state = seq[:, :, seq.shape[-1] - conv_state.shape[-1]:]
        y = F.silu(F.conv1d(seq, conv.weight, None, groups=conv.weight.shape[0])[:, :, -t:]).to(x.dtype)
        q, k, v = y.transpose(1, 2).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = q.reshape(b, t, -1, self.head_k_dim), k.reshape(b, t, -1, self.head_k_dim)
        v = v.reshape(b, t, -1, self.head_v_dim)
        rule = recurrent_gated_delta_rule if t == 1 else chunk_gated_delta_rule
        out, new_ssm_state = rule(q, k, v, g, beta, ssm_state)
        return out, new_conv_state, new_ssm_state


class GatedDeltaNet(nn.Module):
    """With tensor parallelism each rank holds whole heads: num_k_heads / tp key heads and the
    num_v_heads / tp value heads that read them (value head j reads key head j // (Hv / Hk)), so the
    conv channels, the rule and the state of a head never leave its rank; out_proj is row-parallel
    (one all-reduce). A checkpoint tensor's rows are picked per head range (`_pick_rows`)."""

    def __init__(self, hidden: int, heads: "LinearAttentionHeads", rms_norm_eps: float, state_layer_id: int,
                 split_projections: bool, tp: TpGroup = TpGroup()) -> None:
        """`heads`: the model's (model_config.HeadGeometry.linear); `state_layer_id`: this layer's index
        among the linear-attention layers (its state in the pool); `split_projections`: Qwen3.5's separate
        in_proj_qkv/z/b/a, else Qwen3-Next's fused in_proj_qkvz/ba."""
        super().__init__()
        full_k, full_v = heads.num_key_heads, heads.num_value_heads
        self.num_k_heads = tp.shard(full_k, "linear_num_key_heads")  # on this rank
        self.num_v_heads = tp.shard(full_v, "linear_num_value_heads")
        self.head_k_dim, self.head_v_dim = heads.key_head_dim, heads.value_head_dim
        self.key_dim, self.value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = heads.conv_kernel
        self.split_projections = split_projections
        r, dk, dv = full_v // full_k, self.head_k_dim, self.head_v_dim
        k0, v0 = tp.rank * self.num_k_heads, tp.rank * self.num_v_heads  # this rank's first heads
        full_key_dim = full_k * dk
        # checkpoint rows of [q | k | v] (in_proj_qkv, conv1d): this rank's heads of each
        qkv_rows = [(k0 * dk, self.key_dim), (full_key_dim + k0 * dk, self.key_dim),
                    (2 * full_key_dim + v0 * dv, self.value_dim)]

        def proj(n: int, rows: list[tuple[int, int]]) -> MergedColumnLinear:
            layer = MergedColumnLinear(hidden, [OutputPart(n, 0, n)], bias=False)
            _pick_rows(layer.weight, rows)
            return layer

        if split_projections:
            self.in_proj_qkv = proj(self.conv_dim, qkv_rows)
            self.in_proj_z = proj(self.value_dim, [(v0 * dv, self.value_dim)])
            self.in_proj_b = proj(self.num_v_heads, [(v0, self.num_v_heads)])
            self.in_proj_a = proj(self.num_v_heads, [(v0, self.num_v_heads)])
        else:  # fused per key-head group: whole groups per rank
            group = 2 * dk + 2 * r * dv
            self.in_proj_qkvz = proj(self.num_k_heads * group, [(k0 * group, self.num_k_heads * group)])
            self.in_proj_ba = proj(self.num_k_heads * 2 * r, [(k0 * 2 * r, self.num_k_heads * 2 * r)])
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_kernel, groups=self.conv_dim, bias=False,
                                padding=self.conv_kernel - 1)
        _pick_rows(self.conv1d.weight, qkv_rows)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        _pick_rows(self.dt_bias, [(v0, self.num_v_heads)])
        _pick_rows(self.A_log, [(v0, self.num_v_heads)])
        self.norm = GatedRMSNorm(self.head_v_dim, rms_norm_eps)
        self.out_proj = RowParallelLinear(full_v * dv, hidden, bias=False, tp=tp)
        self.core = GatedDeltaCore(self.conv1d, self.key_dim, self.value_dim, self.head_k_dim, self.head_v_dim,
                                   state_layer_id)

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """(conv state, delta-rule state) of one request row."""
        return (self.conv_dim, self.conv_kernel - 1), (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def forward(self, hidden: torch.Tensor, forward_batch: "ForwardBatch") -> torch.Tensor:
        """hidden [n, hidden] -> [n, hidden]."""
        n = hidden.shape[0]
        mixed_qkv, z, b, a = self._project(hidden)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        core = self.core(mixed_qkv, g, beta, forward_batch)  # [n, Hv, Dv]
        out = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(out.reshape(n, self.value_dim))

    def _project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> mixed qkv [n, conv_dim], z [n, Hv, Dv], b, a [n, Hv]."""
        n = hidden.shape[0]
        if self.split_projections:
            z = self.in_proj_z(hidden).reshape(n, self.num_v_heads, self.head_v_dim)
            return self.in_proj_qkv(hidden), z, self.in_proj_b(hidden), self.in_proj_a(hidden)
        # Qwen3-Next: per key head, [q | k | v of its value heads | z of its value heads], then [b | a]
        r, hk = self.num_v_heads // self.num_k_heads, self.num_k_heads
        qkvz = self.in_proj_qkvz(hidden).view(n, hk, 2 * self.head_k_dim + 2 * r * self.head_v_dim)
        q, k, v, z = qkvz.split([self.head_k_dim, self.head_k_dim, r * self.head_v_dim, r * self.head_v_dim], dim=2)
        b, a = self.in_proj_ba(hidden).view(n, hk, 2 * r).split([r, r], dim=2)
        mixed_qkv = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
        return (mixed_qkv, z.reshape(n, self.num_v_heads, self.head_v_dim), b.reshape(n, self.num_v_heads),
                a.reshape(n, self.num_v_heads))

