"""Accepting draft tokens against the target model's logits (the worker's half of a verify step).

Greedy requests accept the longest prefix of the draft that equals the target's argmax at each
position, then take the argmax after it: the tokens are exactly what step-by-step greedy decoding would
give. Sampled requests use the rejection rule for a deterministic draft (a draft token has proposal
probability 1): accept d with probability p(d), where p is the target's distribution after temperature,
top-k, top-p and min-p as the sampler applies them; on a rejection, draw from p with d's mass removed
(renormalised) and stop; after a fully accepted draft, draw the bonus token from p. Each emitted token
is then distributed as the target's (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding", the special case q = one-hot).

Requests whose sampler processes the logits first (penalties, logit_bias, a grammar, min_new_tokens;
sampling/penalties.py, in its order) get each position's row processed as the sampler would process it
after the drafts before it were sampled (processed_rows): penalty counts include those drafts, the
grammar's mask is its matcher's after accepting them (then rolled back: the scheduler feeds it the
emitted tokens), stop ids stay blocked while the position is below min_new_tokens. A draft the
processing rules out has no mass there, so it is rejected.

Tree drafts (spec_info.py): a greedy request follows the tree from its root, at each node taking the
child whose token is the target's argmax there, until no child is; it emits that path and the target's
token after it, which is again exactly what step-by-step greedy decoding gives (each node's logits are
its root -> node chain's). A sampled request walks the tree with the rejection rule for several
deterministic proposals (recursive rejection sampling, as SpecInfer's and SGLang's tree sampling for
drafts without draft probabilities): at a node, its children in order, each accepted with its share
of the mass its earlier siblings left (the target's distribution with the rejected siblings' tokens
removed, renormalised); when one is accepted the walk goes on from it, when all are rejected the
request draws its token from what is left. The token emitted at a node is then distributed as the
target's there: the first child d1 comes out with probability p(d1), the second with
(1 - p(d1)) x p(d2) / (1 - p(d1)) = p(d2), and so on, and anything else with its own p. A request
whose logits are processed (needs_processing) verifies only the tree's first chain (the path of first
children, spec_info.first_chain) with the chain rules: processed_rows follows one draft.

Logprobs are those the sampler reports: log_softmax of the raw logits at the token's position (the node
it was predicted at).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from baton.engine.core.spec_info import VerifyInput, VerifyOutput, first_chain

if TYPE_CHECKING:
    from baton.engine.sampling.sampling_batch_info import ReqSamplingState
    from baton.engine.sampling.sampling_params import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15  # a step's draws: (request seed, draw number) mixed into one seed


def verify_drafts(logits: torch.Tensor, spec: VerifyInput, states: list["ReqSamplingState"],
                  draws: Optional[list[int]], return_logprob: bool, top_logprobs_nums: list[int]) -> VerifyOutput:
    """`logits`: [num_tokens, vocab] float32, one row per token of the verify batch (spec_info.py)."""
    from baton.engine.layers.sampler import top_logprobs

    spec.settle()

    greedy_ids = None
    if any(s.params.is_greedy and not needs_processing(s) for s in states):
        greedy_ids = torch.argmax(logits, dim=-1).tolist()  # [num_tokens]
    tokens = []
    # tree steps: per request, the nodes its emitted tokens were predicted at (the root, then the accepted
    # draft nodes); a chain's are 0, 1, ..
    nodes: Optional[list[list[int]]] = None if spec.parents is None else []
    for i, (draft, off, state) in enumerate(zip(spec.drafts, spec.offsets, states)):
        tree, processed = spec.tree(i), needs_processing(state)
        path = None  # the nodes verified as a chain, where they are not 0, 1, .. (a tree's)
        if tree is not None and state.params.is_greedy and not processed:
            path = accept_greedy_tree(tree, draft, greedy_ids[off:off + len(draft) + 1])
            tokens.append([draft[n - 1] for n in path[1:]] + [greedy_ids[off + path[-1]]])
        elif tree is not None and not processed:
            probs = target_probs(logits[off:off + len(draft) + 1], state.params)
            path, emitted = accept_rejection_tree(tree, draft, probs, _generator(state, draws, i))
            tokens.append(emitted)
        else:
            if tree is None:
                rows = logits[off:off + len(draft) + 1]
            else:  # the first chain only (module docstring)
                path = first_chain(tree)
                draft = [draft[n - 1] for n in path[1:]]
                rows = logits[torch.tensor(path, device=logits.device) + off]
            if processed:
                rows = processed_rows(rows, draft, state)
            if state.params.is_greedy:
                target = torch.argmax(rows, dim=-1).tolist() if processed else greedy_ids[off:off + len(draft) + 1]
                tokens.append(accept_greedy(draft, target))
            else:
                probs = target_probs(rows, state.params)
                tokens.append(accept_rejection(probs, draft, _generator(state, draws, i)))
        if nodes is not None:
            nodes.append(list(range(len(tokens[-1]))) if path is None else path[:len(tokens[-1])])
        if state.has_penalties:
            for t in tokens[-1]:
                state.on_sampled(t)  # the counts the next step's penalties read
        else:
            state.num_sampled += len(tokens[-1])
    out = VerifyOutput(tokens, accepted_nodes=None if nodes is None else [n[1:] for n in nodes])
    if return_logprob:
        at = (nodes if nodes is not None else [range(len(t)) for t in tokens])
        rows = torch.tensor([off + j for off, n in zip(spec.offsets, at) for j in n], device=logits.device)
        flat = torch.tensor([x for t in tokens for x in t], device=logits.device)
        lps = torch.log_softmax(logits[rows], dim=-1)  # [emitted, vocab]
        values = lps.gather(1, flat.view(-1, 1)).view(-1).tolist()
        nums = [n for n, t in zip(top_logprobs_nums, tokens) for _ in t]
        tops = top_logprobs(lps, nums)
        out.logprobs, out.top_logprobs, start = [], [], 0
        for t in tokens:
            out.logprobs.append(values[start:start + len(t)])
            out.top_logprobs.append(tops[start:start + len(t)])
            start += len(t)
    return out


def _generator(state: "ReqSamplingState", draws: Optional[list[int]], i: int) -> torch.Generator:
    """The request's random numbers for this step: from (its seed, the step's draw number)."""
    draw = draws[i] if draws is not None else state.num_sampled
    return torch.Generator().manual_seed((state.rng_seed * _SEED_MIX + draw) % (1 << 63))


def needs_processing(state: "ReqSamplingState") -> bool:
    """Whether the sampler changes this request's logits before choosing (sampling/penalties.py)."""
    return (state.has_penalties or bool(state.params.logit_bias) or state.grammar is not None
            or state.min_tokens_active)


def processed_rows(rows: torch.Tensor, draft: list[int], state: "ReqSamplingState") -> torch.Tensor:
    """`rows`: [len(draft) + 1, vocab] raw logits of one request -> a processed copy, row j as the
    sampler would process it after sampling draft[:j] (module docstring)."""
    rows = rows.clone()
    n, params = rows.shape[0], state.params
    if state.has_penalties:
        state.ensure_penalty_tensors()
        counts = state.output_counts.to(rows.device, torch.float32)
        seen = state.seen_mask.to(rows.device).clone()
        for j in range(n):
            if j:
                counts = counts.clone()
                counts[draft[j - 1]] += 1
                seen[draft[j - 1]] = True
            r = rows[j]
            r = torch.where(seen, torch.where(r > 0, r / params.repetition_penalty, r * params.repetition_penalty), r)
            rows[j] = r - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
    if params.logit_bias:
        ids, values = state.logit_bias()
        rows.index_add_(1, ids.to(rows.device), values.to(rows.device).expand(n, -1))
    if state.grammar is not None:
        _mask_by_grammar(rows, draft, state.grammar)
    if state.min_tokens_stop_ids is not None and state.grammar is None:  # as the sampler: a grammar ends itself
        stop = state.min_tokens_stop_ids.to(rows.device)
        for j in range(n):
            if state.num_sampled + j < params.min_new_tokens:
                rows[j].index_fill_(0, stop, float("-inf"))
    return rows


def _mask_by_grammar(rows: torch.Tensor, draft: list[int], grammar) -> None:
    """Row j: the grammar's mask after draft[:j]. Its matcher walks the draft and is rolled back; a
    grammar still waiting for the end of the reasoning starts after that token, if the draft has it.
    Rows after a draft token the grammar refuses (or after it terminated) are never used: that token
    is rejected at its own row."""
    import xgrammar as xgr

    active, walked = grammar.active, 0
    try:
        for j in range(rows.shape[0]):
            if active:
                if grammar.matcher.is_terminated():
                    break
                grammar.fill()
                xgr.apply_token_bitmask_inplace(rows[j:j + 1], grammar.bitmask.to(rows.device))
            if j == len(draft):
                break
            if not active:
                active = draft[j] == grammar.reasoning_end
            elif grammar.matcher.accept_token(draft[j]):
                walked += 1
            else:
                break
    finally:
        if walked:
            grammar.matcher.rollback(walked)


def accept_greedy(draft: list[int], target: list[int]) -> list[int]:
    """`target`: the argmax at each of the len(draft) + 1 positions."""
    n = 0
    while n < len(draft) and draft[n] == target[n]:
        n += 1
    return draft[:n] + [target[n]]


def _children(parents: list[int]) -> list[list[int]]:
    """Each node's children, in node order."""
    children: list[list[int]] = [[] for _ in parents]
    for j in range(1, len(parents)):
        children[parents[j]].append(j)
    return children


def accept_greedy_tree(parents: list[int], draft: list[int], target: list[int]) -> list[int]:
    """`target`: the argmax at each node of the tree (`parents`, `draft`: spec_info.py). The accepted
    path's nodes from the root (node 0): at each node, the first child whose token is the target's."""
    children = _children(parents)
    path = [0]
    while True:
        want = target[path[-1]]
        child = next((c for c in children[path[-1]] if draft[c - 1] == want), None)
        if child is None:
            return path
        path.append(child)


def accept_rejection(probs: torch.Tensor, draft: list[int], gen: torch.Generator) -> list[int]:
    """`probs`: [len(draft) + 1, vocab] the target's distribution at each position (any device: only the
    drafts' probabilities and the row a token is drawn from come to the host)."""
    u = torch.rand(len(draft), generator=gen).tolist()
    at = torch.arange(len(draft), device=probs.device)
    p_draft = probs[at, torch.tensor(draft, dtype=torch.int64, device=probs.device)].tolist()
    out = []
    for j, d in enumerate(draft):
        if u[j] < p_draft[j]:
            out.append(d)
            continue
        residual = probs[j].cpu().clone()
        residual[d] = 0.0
        if float(residual.sum()) <= 0.0:  # p(d) is 1 up to rounding: u fell on the rounding
            out.append(d)
            continue
        out.append(int(torch.multinomial(residual, 1, generator=gen)))
        return out
    out.append(int(torch.multinomial(probs[len(draft)].cpu(), 1, generator=gen)))
    return out


def accept_rejection_tree(parents: list[int], draft: list[int], probs: torch.Tensor,
                          gen: torch.Generator) -> tuple[list[int], list[int]]:
    """`probs`: [nodes, vocab] the target's distribution at each node of the tree (`parents`, `draft`:
    spec_info.py; any device: the rows of the nodes the walk visits come to the host). Recursive
    rejection sampling (module docstring): (the accepted path's nodes from the root, the tokens emitted:
    the accepted drafts, then one drawn at the path's last node)."""
    children = _children(parents)
    path, out = [0], []
    while True:
        residual = probs[path[-1]].cpu().clone()
        accepted = None
        for child in children[path[-1]]:
            d = draft[child - 1]
            if float(torch.rand(1, generator=gen)) * float(residual.sum()) < float(residual[d]):
                accepted = child
                break
            residual[d] = 0.0
            if float(residual.sum()) <= 0.0:  # d held all the mass left up to rounding: u fell on the rounding
                accepted = child
                break
        if accepted is None:
            out.append(int(torch.multinomial(residual, 1, generator=gen)))
            return path, out
        path.append(accepted)
        out.append(draft[accepted - 1])


def target_probs(logits: torch.Tensor, params: "SamplingParams") -> torch.Tensor:
    """[rows, vocab] logits -> the distribution the sampler draws from (layers/sampler.py): softmax at
    the temperature, then top-k, top-p over the top-k-renormalised mass, min-p; renormalised."""
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    vocab = probs.shape[-1]
    top_k = vocab if params.top_k == -1 else min(params.top_k, vocab)
    if top_k < vocab or params.top_p < 1.0 or params.min_p > 0.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        sorted_p[:, top_k:] = 0.0
        if params.top_p < 1.0:
            cumsum = sorted_p.cumsum(dim=-1)
            sorted_p.masked_fill_(cumsum - sorted_p > params.top_p * cumsum[:, -1:], 0.0)
        if params.min_p > 0.0:
            sorted_p.masked_fill_(sorted_p < sorted_p[:, :1] * params.min_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, idx, sorted_p)
    return probs / probs.sum(dim=-1, keepdim=True)


def move_accepted_kv(runner: Any, fb: Any, spec: VerifyInput, out: VerifyOutput) -> None:
    """Tree drafts, after acceptance: each request's accepted nodes' KV (every pool layer: a draft head's
    too) into its columns L + 1, L + 2, .. (right after its last token's), where the scheduler keeps a
    request's accepted KV as it keeps a chain's (speculative/verify_strategy.py keep_kv). A node at depth j
    sits in column L + its index >= L + j. Every TP rank moves its own shard (worker/tp_step.py)."""
    src, dst = [], []
    for off, nodes in zip(spec.offsets, out.accepted_nodes):
        for j, node in enumerate(nodes, start=1):
            if node != j:
                src.append(off + node)
                dst.append(off + j)
    if src:
        loc = fb.out_cache_loc
        index = torch.tensor(dst + src, dtype=torch.int64, device=loc.device)
        slots = loc[index]
        runner.token_to_kv_pool.move_kv_cache(slots[:len(dst)], slots[len(dst):])
