"""Greedy acceptance on the device, read by the host only with the verify step's result.

A verify step whose every request takes the argmax with nothing processed (no penalties, logit bias,
grammar or min_new_tokens) and asks no logprobs is checked without reading anything back, so on CUDA
its launch returns before its forward ends, and the overlap loop can build the next step meanwhile
(verifying.py, lagged verify steps).

The rule is verify.py's, on tensors: each request walks its draft from node 0 (its last token), at each
node to the first child (in node order) whose token is the target's argmax there, until none is; it
emits the tokens of the nodes it walked to and the argmax at the last one. A chain is the tree whose
node j's parent is j - 1. Per request the walk reads its nodes' tokens and argmaxes, each node's depth
and which nodes are its ancestors (the ancestor matrix of masks.ancestors: a head's tree has it on the
device already, a host tree or chain is built into one), for as many steps as its deepest draft.

Everything the worker does with the result before the next step (the head's pass over the accepted
path, the accepted nodes' KV moved next to the last token, the future map's last tokens and counts)
uses the walk's tensors (HeadDrafter.after_verify_on_device, move_accepted_kv_on_device). The host gets
counts, paths and tokens in one copy, queued behind the step (non-blocking on CUDA), and reads them
when the scheduler processes the result (PendingVerify.read).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from baton.engine.layers.attention.masks import ancestors
from baton.engine.speculative.head_drafter import _ints  # host lists to the device without waiting
from baton.engine.speculative.spec_info import VerifyInput, VerifyOutput

if TYPE_CHECKING:
    from baton.engine.sampling.sampling_batch_info import ReqSamplingState


def accepts_on_device(states: Sequence[Optional["ReqSamplingState"]], return_logprob: bool) -> bool:
    """Whether a verify step's acceptance can stay on the device: every request greedy with nothing
    processed, no logprobs."""
    return not return_logprob and all(s is not None and s.plain_greedy for s in states)


@dataclass
class DeviceAcceptance:
    """One verify step's greedy walk, per request b (on the logits' device):"""

    count: torch.Tensor  # [bs] accepted draft tokens (the request emits count + 1)
    path: torch.Tensor  # [bs, D + 1] the nodes walked from node 0; past count, the last node again
    tokens: torch.Tensor  # [bs, D + 1] the emitted tokens (count + 1 of them), then 0s
    last: torch.Tensor  # [bs] the last emitted token: the next step's input
    offsets: torch.Tensor  # [bs] each request's first token row in the pass


def greedy_accept_on_device(logits: torch.Tensor, input_ids: torch.Tensor, spec: VerifyInput,
                            tree_parents: Optional[list]) -> DeviceAcceptance:
    """`logits` [num_tokens, vocab] and `input_ids` [num_tokens] of the verify pass (the drafts in
    place, spec.drafts' lengths right, the trees' shapes in `tree_parents`: per request None (a chain),
    host parents, or a head tree's ancestor matrix on the device; ForwardBatch.tree_parents)."""
    dev = logits.device
    sizes = [1 + len(d) for d in spec.drafts]
    bs, n = len(sizes), max(sizes)
    offsets = _ints(spec.offsets, dev)
    local = torch.arange(n, device=dev)
    valid = local[None, :] < _ints(sizes, dev)[:, None]  # [bs, n] the request's nodes
    rows = offsets[:, None] + torch.where(valid, local[None, :], 0)
    tok = input_ids[rows]  # [bs, n] each node's token (node 0: the last token)
    target = torch.argmax(logits, dim=-1)[rows]  # [bs, n] the target's choice after each node
    # node j sees node c: c is j or an ancestor of j (a chain: c <= j)
    seen = torch.ones(n, n, dtype=torch.bool, device=dev).tril().expand(bs, n, n).clone()
    steps = max(sizes) - 1
    if tree_parents is not None:
        host = [(b, p) for b, p in enumerate(tree_parents) if p is not None and not isinstance(p, torch.Tensor)]
        if host:
            matrices = ancestors(_ints([p + [-1] * (n - len(p)) for _, p in host], dev), n)
            for k, (b, p) in enumerate(host):
                seen[b, :len(p), :len(p)] = matrices[k, :len(p), :len(p)]
        for b, p in enumerate(tree_parents):
            if isinstance(p, torch.Tensor):  # a head's tree: its ancestor matrix, on the device
                seen[b, :p.shape[0], :p.shape[1]] = p
        steps = max(spec.depth(b) for b in range(bs))
    depth = seen.sum(dim=2) - 1  # [bs, n]
    batch = torch.arange(bs, device=dev)
    cur = torch.zeros(bs, dtype=torch.int64, device=dev)
    count = torch.zeros(bs, dtype=torch.int64, device=dev)
    walking = torch.ones(bs, dtype=torch.bool, device=dev)
    path = [cur]
    for _ in range(steps):
        child = (seen[batch, :, cur] & (depth == (depth[batch, cur] + 1)[:, None]) & valid
                 & (tok == target[batch, cur][:, None]))  # [bs, n]
        walking = walking & child.any(dim=1)
        cur = torch.where(walking, torch.argmax(child.to(torch.uint8), dim=1), cur)  # the first such child
        count = count + walking.to(torch.int64)
        path.append(cur)
    path_t = torch.stack(path, dim=1)  # [bs, steps + 1]
    last = target[batch, cur]
    tokens = torch.cat([tok.gather(1, path_t[:, 1:]), torch.zeros(bs, 1, dtype=torch.int64, device=dev)], dim=1)
    tokens = torch.where(torch.arange(steps + 1, device=dev)[None, :] < count[:, None], tokens, 0)
    tokens.scatter_(1, count[:, None], last[:, None])
    return DeviceAcceptance(count, path_t, tokens, last, offsets)


def move_accepted_kv_on_device(runner: Any, out_cache_loc: torch.Tensor, acc: DeviceAcceptance) -> None:
    """verify.move_accepted_kv on the walk's tensors: each request's accepted node at depth j moves its
    KV (every pool layer) to the column of node j, right after the last token's. Rows past a request's
    count move the root's slot onto itself (never a destination), so no move depends on the host."""
    steps = acc.path.shape[1] - 1
    if steps == 0:
        return
    j = torch.arange(1, steps + 1, device=acc.path.device)[None, :]
    accepted = j <= acc.count[:, None]
    dst = acc.offsets[:, None] + torch.where(accepted, j, 0)
    src = acc.offsets[:, None] + torch.where(accepted, acc.path[:, 1:], 0)
    runner.token_to_kv_pool.move_kv_cache(out_cache_loc[dst.reshape(-1)], out_cache_loc[src.reshape(-1)])


class PendingVerify:
    """The walk's result on its way to the host: one copy of counts, paths and tokens queued behind the
    step (into pinned memory without waiting, on CUDA); read() waits for it and gives the VerifyOutput
    verify_drafts would have, once the scheduler processes the step."""

    def __init__(self, acc: DeviceAcceptance, spec: VerifyInput, async_copy: bool) -> None:
        self.spec = spec
        packed = torch.cat([acc.count[:, None], acc.path, acc.tokens], dim=1)
        self.done = None
        if async_copy and packed.is_cuda:
            self.host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self.host.copy_(packed, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()
        else:
            self.host = packed.to("cpu")

    def read(self) -> VerifyOutput:
        if self.done is not None:
            self.done.synchronize()
        self.spec.settle()  # the drafts (and a head's trees) the walk checked, on the host
        width = (self.host.shape[1] - 1) // 2
        tokens, nodes = [], []
        for row in self.host.tolist():
            count = row[0]
            tokens.append(row[1 + width:2 + width + count])
            nodes.append(row[2:2 + count])
        # (no num_sampled to count: it only times min_new_tokens, which a plain greedy request has none of,
        # and the sampling state is the worker's)
        return VerifyOutput(tokens, accepted_nodes=None if self.spec.parents is None else nodes)
