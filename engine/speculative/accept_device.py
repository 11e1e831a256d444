"""Acceptance on the device, read by the host only with the verify step's result.

A verify step whose every request is greedy or sampled (temperature, top-k, top-p, min-p and a seed),
with penalties, a logit bias or min_new_tokens at most (no grammar: its matcher is on the host), is
checked without reading anything back (logprobs too), so on CUDA its launch returns before its forward
ends, and the overlap loop can build the next step meanwhile (verify_strategy.py, lagged verify steps).
Penalised, biased and min_new_tokens requests' rows are processed on the device first, each node's row
as the sampler would after the drafts on its path (processed_logits); unlike the host rule, which
verifies only the first chain of such a request's tree, they walk the whole tree (each node's row is
exact for its own path; the host rule keeps one path for the grammar's matcher). min_new_tokens blocks
the stop ids at the nodes whose output position is below it, counted from the request's tokens so far
on the device (ReqSamplingState.sampled: a lagged step's count includes what the step before it
emitted, which the host has not read yet).

The rules are accept_host.py's, on tensors. Greedy: each request walks its draft from node 0 (its last
token), at each node to the first child (in node order) whose token is the target's argmax there, until
none is; it emits the tokens of the nodes it walked to and the argmax at the last one. Sampled: the
same walk with the rejection rule deciding at each node (_rejection_walk). A chain is the tree whose
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

from baton.engine.core.spec_info import VerifyInput, VerifyOutput
from baton.engine.layers.attention.masks import ancestors
from baton.engine.utils.device_lists import to_device  # host lists to the device without waiting

if TYPE_CHECKING:
    from baton.engine.sampling.sampling_batch_info import ReqSamplingState
    from baton.engine.sampling.sampling_params import SamplingParams


def accepts_on_device(states: Sequence[Optional["ReqSamplingState"]]) -> bool:
    """Whether a verify step's acceptance can stay on the device: every request greedy or sampled
    (temperature, top-k, top-p, min-p, a seed), with penalties, a logit bias or min_new_tokens at most
    (no grammar)."""
    return all(s is not None and s.grammar is None for s in states)


def _processed(state: "ReqSamplingState") -> bool:
    return state.has_penalties or bool(state.params.logit_bias) or state.min_tokens_active


@dataclass
class DeviceAcceptance:
    """One verify step's walk, per request b (on the logits' device):"""

    count: torch.Tensor  # [bs] accepted draft tokens (the request emits count + 1)
    path: torch.Tensor  # [bs, D + 1] the nodes walked from node 0; past count, the last node again
    tokens: torch.Tensor  # [bs, D + 1] the emitted tokens (count + 1 of them), then 0s
    last: torch.Tensor  # [bs] the last emitted token: the next step's input
    offsets: torch.Tensor  # [bs] each request's first token row in the pass
    states: Optional[Sequence["ReqSamplingState"]] = None  # their counts take the tokens once read
    counted: tuple = ()  # the requests whose sampled_on_device took this step's tokens (min_new_tokens)


class _Nodes:
    """The verify pass's requests as padded node tables [bs, n] (n: the most nodes of a request)."""

    def __init__(self, logits: torch.Tensor, input_ids: torch.Tensor, spec: VerifyInput,
                 tree_parents: Optional[list]) -> None:
        dev = self.device = logits.device
        sizes = [1 + len(d) for d in spec.drafts]
        self.bs, n = len(sizes), max(sizes)
        self.offsets = to_device(spec.offsets, dev)
        local = torch.arange(n, device=dev)
        self.valid = local[None, :] < to_device(sizes, dev)[:, None]  # [bs, n] the request's nodes
        self.rows = self.offsets[:, None] + torch.where(self.valid, local[None, :], 0)  # [bs, n] rows of the pass
        self.tok = input_ids[self.rows]  # [bs, n] each node's token (node 0: the last token)
        self.target = torch.argmax(logits, dim=-1)[self.rows]  # [bs, n] the target's choice after each node
        # node j sees node c: c is j or an ancestor of j (a chain: c <= j)
        seen = torch.ones(n, n, dtype=torch.bool, device=dev).tril().expand(self.bs, n, n).clone()
        self.steps = n - 1
        if tree_parents is not None:
            host = [(b, p) for b, p in enumerate(tree_parents) if p is not None and not isinstance(p, torch.Tensor)]
            if host:
                matrices = ancestors(to_device([p + [-1] * (n - len(p)) for _, p in host], dev), n)
                for k, (b, p) in enumerate(host):
                    seen[b, :len(p), :len(p)] = matrices[k, :len(p), :len(p)]
            for b, p in enumerate(tree_parents):
                if isinstance(p, torch.Tensor):  # a head's tree: its ancestor matrix, on the device
                    seen[b, :p.shape[0], :p.shape[1]] = p
            self.steps = max(spec.depth(b) for b in range(self.bs))
        self.seen = seen
        self.depth = seen.sum(dim=2) - 1  # [bs, n]
        self.batch = torch.arange(self.bs, device=dev)

    def children(self, cur: torch.Tensor) -> torch.Tensor:
        """[bs, n]: the nodes that are children of each request's node `cur` [bs]."""
        b = self.batch
        return self.seen[b, :, cur] & (self.depth == (self.depth[b, cur] + 1)[:, None]) & self.valid

    def accepted(self, count: torch.Tensor, path: list, last: torch.Tensor) -> DeviceAcceptance:
        bs, dev = self.bs, self.device
        path_t = torch.stack(path, dim=1)  # [bs, steps + 1]
        tokens = torch.cat([self.tok.gather(1, path_t[:, 1:]), torch.zeros(bs, 1, dtype=torch.int64, device=dev)], 1)
        tokens = torch.where(torch.arange(self.steps + 1, device=dev)[None, :] < count[:, None], tokens, 0)
        tokens.scatter_(1, count[:, None], last[:, None])
        return DeviceAcceptance(count, path_t, tokens, last, self.offsets)


def accept_on_device(logits: torch.Tensor, input_ids: torch.Tensor, spec: VerifyInput, tree_parents: Optional[list],
                     states: Optional[Sequence["ReqSamplingState"]] = None,
                     draws: Optional[list[int]] = None) -> DeviceAcceptance:
    """`logits` [num_tokens, vocab] and `input_ids` [num_tokens] of the verify pass (the drafts in
    place, spec.drafts' lengths right, the trees' shapes in `tree_parents`: per request None (a chain),
    host parents, or a head tree's ancestor matrix on the device; ForwardBatch.tree_parents).
    `states` (accepts_on_device's) with the step's draw numbers; None: every request greedy with nothing
    processed. Penalised requests' counts take the emitted tokens, and min_new_tokens requests' the
    number of them (on the device)."""
    nodes = _Nodes(logits, input_ids, spec, tree_parents)
    processed = [i for i, s in enumerate(states or ()) if _processed(s)]
    blocking = tuple(i for i in processed if states[i].min_tokens_active)
    if processed:
        logits = processed_logits(logits, nodes, spec, states, processed)
        nodes.target = torch.argmax(logits, dim=-1)[nodes.rows]
    acc = _walk(nodes, logits, states, draws)
    for i in processed:
        if states[i].has_penalties:
            _count_emitted(states[i], acc, i)
    for i in blocking:  # created by processed_logits (sampled())
        states[i].sampled_on_device += (acc.count[i] + 1).to(states[i].sampled_on_device.device)
    acc.states, acc.counted = states, blocking
    return acc


def _walk(nodes: "_Nodes", logits: torch.Tensor, states: Optional[Sequence["ReqSamplingState"]],
          draws: Optional[list[int]]) -> DeviceAcceptance:
    if states is not None and not all(s.params.is_greedy for s in states):
        return _rejection_walk(nodes, logits, states, draws)
    b = nodes.batch
    cur = torch.zeros(nodes.bs, dtype=torch.int64, device=nodes.device)
    count = torch.zeros_like(cur)
    walking = torch.ones(nodes.bs, dtype=torch.bool, device=nodes.device)
    path = [cur]
    for _ in range(nodes.steps):
        child = nodes.children(cur) & (nodes.tok == nodes.target[b, cur][:, None])  # [bs, n]
        walking = walking & child.any(dim=1)
        cur = torch.where(walking, torch.argmax(child.to(torch.uint8), dim=1), cur)  # the first such child
        count = count + walking.to(torch.int64)
        path.append(cur)
    return nodes.accepted(count, path, nodes.target[b, cur])


def _rejection_walk(nodes: _Nodes, logits: torch.Tensor, states: Sequence["ReqSamplingState"],
                    draws: Optional[list[int]]) -> DeviceAcceptance:
    """accept_host.py's rule for sampled requests (recursive rejection sampling: a chain is a tree of one
    child per node), every request at once; greedy requests of the batch walk by the argmax.

    At a node the children are tried in node order, child c with token d accepted when
    u_c x (1 - the mass of the siblings rejected before it) < p(d), the first such child wins (a token
    an earlier sibling had has no mass left: never accepted); the trials of all children of a node
    run at once, each with its own number (the outcome is the sequential rule's). Where no child is
    accepted (or there is none) the request draws its token from p at its node with its children's
    tokens removed, by the inverse of the cumulative sum, and stops.

    The random numbers are a hash of (the request's seed, the step's draw number, which trial): the
    CPU sampler's splitmix64 (kernels/cpu_sampling.c), so a request's draws do not depend on the rest
    of the batch, and nothing is generated per request."""
    dev, b, n = nodes.device, nodes.batch, nodes.tok.shape[1]
    greedy = to_device([int(s.params.is_greedy) for s in states], dev).bool()  # [bs]
    probs = target_probs_rows(logits, [s.params for s in states], nodes)  # [num_tokens, vocab]
    key = _hash(_hash(to_device([s.rng_seed for s in states], dev))
                ^ to_device(draws if draws is not None else [s.num_sampled for s in states], dev))  # [bs]
    earlier = torch.ones(n, n, dtype=torch.bool, device=dev).tril(-1)  # [c, c']: c' before c
    same = (nodes.tok[:, :, None] == nodes.tok[:, None, :]) & earlier  # [bs, c, c']
    cur = torch.zeros(nodes.bs, dtype=torch.int64, device=dev)
    count = torch.zeros_like(cur)
    walking = torch.ones(nodes.bs, dtype=torch.bool, device=dev)
    path = [cur]
    trial = torch.arange(n, device=dev)
    for step in range(nodes.steps):
        child = nodes.children(cur)  # [bs, n]
        row = nodes.rows[b, cur]  # [bs]
        repeated = (same & child[:, None, :]).any(dim=2)  # a sibling before it had its token
        p = torch.where(child & ~repeated, probs[row[:, None], nodes.tok], 0.0)  # [bs, n]
        p = torch.where(greedy[:, None], (child & ~repeated & (nodes.tok == nodes.target[b, cur][:, None])).float(), p)
        left = 1.0 - (p.cumsum(dim=1) - p)  # the mass the siblings before c left
        u = _uniform(key[:, None] ^ (step * _TRIALS + trial)[None, :])  # [bs, n]
        hit = child & ((u * left < p) | (left - p <= 0))  # the host rule's "all mass gone": accept
        walking = walking & hit.any(dim=1)
        cur = torch.where(walking, torch.argmax(hit.to(torch.uint8), dim=1), cur)  # the first accepted child
        count = count + walking.to(torch.int64)
        path.append(cur)
    # the last node: its children (all rejected, or none) leave the mass the token is drawn from
    child = nodes.children(cur)
    vocab = probs.shape[1]
    residual = torch.cat([probs[nodes.rows[b, cur]], torch.zeros(nodes.bs, 1, device=dev)], dim=1)
    residual.scatter_(1, torch.where(child, nodes.tok, vocab), 0.0)
    cdf = residual[:, :vocab].cumsum(dim=1)  # [bs, vocab]
    x = _uniform(key ^ _LAST_DRAW) * cdf[:, -1]
    drawn = torch.searchsorted(cdf, x[:, None], right=True)[:, 0].clamp_(max=vocab - 1)
    return nodes.accepted(count, path, torch.where(greedy, nodes.target[b, cur], drawn))


def processed_logits(logits: torch.Tensor, nodes: "_Nodes", spec: VerifyInput,
                     states: Sequence["ReqSamplingState"], which: list[int]) -> torch.Tensor:
    """A copy of the pass's logits whose rows of the requests `which` are processed as
    verify.processed_rows processes a chain's, on the device: a node's row with the penalties counting
    the drafts on its path (itself and its ancestors but the root: a chain's row j, drafts[:j];
    repetition, frequency, presence), then the logit bias, then min_new_tokens: the stop ids at -inf
    in the rows whose output position (the tokens sampled before the step, on the device, and the
    node's depth) is below it."""
    out = logits.clone()
    for i in which:
        state, off, n = states[i], spec.offsets[i], 1 + len(spec.drafts[i])
        rows = out[off:off + n]
        if state.has_penalties:
            params = state.params
            state.ensure_penalty_tensors()
            drafted = torch.zeros(n, rows.shape[1], dtype=torch.float32, device=rows.device)
            drafted[1:].scatter_(1, nodes.tok[i, 1:n, None].to(rows.device), 1.0)  # node c's token, c > 0
            path = nodes.seen[i, :n, :n].to(rows.device, torch.float32)  # [c, a]: a is c or an ancestor of c
            before = path @ drafted  # node c's row: how often each token is among the drafts on its path
            counts = state.output_counts.to(rows.device, torch.float32)[None, :] + before
            seen = state.seen_mask.to(rows.device)[None, :] | (before > 0)
            rows = torch.where(seen, torch.where(rows > 0, rows / params.repetition_penalty,
                                                 rows * params.repetition_penalty), rows)
            rows = rows - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
        if state.params.logit_bias:
            ids, values = state.logit_bias()
            rows = rows.index_add(1, ids.to(rows.device), values.to(rows.device).expand(n, -1))
        if state.min_tokens_active:  # no grammar here (accepts_on_device)
            stop = state.min_tokens_stop_ids.to(rows.device)
            blocked = state.sampled(rows.device) + nodes.depth[i, :n].to(rows.device) < state.params.min_new_tokens
            rows[:, stop] = torch.where(blocked[:, None], float("-inf"), rows[:, stop])
        out[off:off + n] = rows
    return out


def _count_emitted(state: "ReqSamplingState", acc: DeviceAcceptance, i: int) -> None:
    """The tokens request i emitted into its penalty counts (what state.on_sampled does per token),
    without reading the count."""
    tokens = acc.tokens[i].to(state.device)
    emitted = (torch.arange(tokens.shape[0], device=state.device) <= acc.count[i].to(state.device)).to(torch.int32)
    state.output_counts.index_add_(0, tokens, emitted)
    state.seen_mask |= state.output_counts > 0  # the prompt's stay; an output token is seen once counted


def target_probs_rows(logits: torch.Tensor, params: Sequence["SamplingParams"], nodes: _Nodes) -> torch.Tensor:
    """verify.target_probs for every row of the pass [num_tokens, vocab], each with its request's
    parameters (a greedy request's rows: temperature 1, unused)."""
    dev, vocab = logits.device, logits.shape[1]
    sizes = (nodes.valid.sum(dim=1)).to(dev)
    owner = torch.repeat_interleave(nodes.batch, sizes, output_size=logits.shape[0])  # [num_tokens]

    def per_row(values: list, dtype=torch.float32) -> torch.Tensor:
        return to_device(values, dev, dtype)[owner][:, None]

    temps = per_row([1.0 if p.is_greedy else p.temperature for p in params])
    probs = torch.softmax(logits / temps, dim=-1)
    top_k = [vocab if p.is_greedy or p.top_k == -1 else min(p.top_k, vocab) for p in params]
    top_p = [1.0 if p.is_greedy else p.top_p for p in params]
    min_p = [0.0 if p.is_greedy else p.min_p for p in params]
    if any(k < vocab for k in top_k) or any(x < 1.0 for x in top_p) or any(x > 0.0 for x in min_p):
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        sorted_p.masked_fill_(torch.arange(vocab, device=dev)[None, :] >= per_row(top_k, torch.int64), 0.0)
        if any(x < 1.0 for x in top_p):
            cumsum = sorted_p.cumsum(dim=-1)
            p = per_row(top_p)
            sorted_p.masked_fill_((cumsum - sorted_p > p * cumsum[:, -1:]) & (p < 1.0), 0.0)
        if any(x > 0.0 for x in min_p):
            sorted_p.masked_fill_(sorted_p < sorted_p[:, :1] * per_row(min_p), 0.0)
        probs = torch.zeros_like(probs).scatter_(1, idx, sorted_p)
    return probs / probs.sum(dim=-1, keepdim=True)


# ---------------------------------------------------------------------------- counter-based random numbers
_TRIALS = 1 << 20  # trial numbers: step x _TRIALS + node; the last draw's is past them all
_LAST_DRAW = 1 << 40


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _MUL1, _MUL2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _hash(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function on int64 tensors (multiplication wraps, as uint64's)."""
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _MUL1
    x = (x ^ _shr(x, 27)) * _MUL2
    return x ^ _shr(x, 31)


def _uniform(x: torch.Tensor) -> torch.Tensor:
    """A float32 in [0, 1) from each int64: the top 24 bits of its hash (exact in float32, below 1)."""
    return _shr(_hash(x), 40).to(torch.float32) * (1.0 / (1 << 24))


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
    step (into pinned memory without waiting, on CUDA), and with `top_logprobs_nums` (return_logprob)
    the emitted tokens' logprobs and each one's best `max(nums)` (accept_host.py's: log_softmax of the raw
    logits at the node the token was predicted at); read() waits for them and gives the VerifyOutput
    verify_drafts would have, once the scheduler processes the step."""

    def __init__(self, acc: DeviceAcceptance, spec: VerifyInput, async_copy: bool,
                 logits: Optional[torch.Tensor] = None, top_logprobs_nums: Optional[list[int]] = None) -> None:
        self.spec, self.nums = spec, top_logprobs_nums
        self.states, self.counted = acc.states, acc.counted
        parts = [torch.cat([acc.count[:, None], acc.path, acc.tokens], dim=1)]
        if top_logprobs_nums is not None:
            assert logits is not None, "logprobs are read from the pass's logits"
            bs, width = acc.path.shape
            lps = torch.log_softmax(logits[(acc.offsets[:, None] + acc.path).reshape(-1)], dim=-1)  # [bs x width, V]
            parts.append(lps.gather(1, acc.tokens.reshape(-1, 1)).view(bs, width))
            k = min(max(top_logprobs_nums, default=0), lps.shape[1])
            if k > 0:
                values, ids = lps.topk(k, dim=-1)  # [bs x width, k]
                parts += [values.view(bs, width * k), ids.view(bs, width * k)]
        self.done = None
        if async_copy and parts[0].is_cuda:
            self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in parts]
            for h, t in zip(self.host, parts):
                h.copy_(t, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()
        else:
            self.host = [t.to("cpu") for t in parts]

    def read(self) -> VerifyOutput:
        if self.done is not None:
            self.done.synchronize()
        self.spec.settle()  # the drafts (and a head's trees) the walk checked, on the host
        packed = self.host[0]
        width = (packed.shape[1] - 1) // 2
        tokens, nodes = [], []
        for row in packed.tolist():
            count = row[0]
            tokens.append(row[1 + width:2 + width + count])
            nodes.append(row[2:2 + count])
        # the counts min_new_tokens reads: from the device's into num_sampled (the draws are numbered at
        # launch; penalty counts were kept on the device)
        for i, state in enumerate(self.states or ()):
            state.on_read(len(tokens[i]), i in self.counted)
        out = VerifyOutput(tokens, accepted_nodes=None if self.spec.parents is None else nodes)
        if self.nums is not None:
            values = self.host[1].tolist()
            out.logprobs = [v[:len(t)] for v, t in zip(values, tokens)]
            if len(self.host) > 2:
                k = self.host[2].shape[1] // width
                tops = zip(self.host[2].tolist(), self.host[3].tolist())
                out.top_logprobs = [[list(zip(v[j * k:j * k + n], i[j * k:j * k + n])) for j in range(len(t))]
                                    for (v, i), t, n in zip(tops, tokens, self.nums)]
            else:
                out.top_logprobs = [[[] for _ in t] for t in tokens]
        return out
