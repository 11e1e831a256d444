"""What a verify step carries between the scheduler and the worker (SGLang: spec_info).

A verify step runs each request of the decode batch as a small extend over its last token and its
draft, on top of the KV it holds:

    row i's tokens   [ last | d1 .. dk ]             k = len(drafts[i]) (0: a plain decode step)
    positions        L_i .. L_i + k                  L_i = the request's computed KV length
    logits row L_i+j predicts the token after position L_i + j: the target's own choice where the draft
    had d_{j+1}

The worker compares them (accept_host.py) and returns, per request, the accepted draft tokens followed by the
target's token at the first position it disagreed (or after the last draft token): 1 to k + 1 tokens.

A draft may be a tree (several candidate continuations, NGRAM's --speculative-ngram-max-bfs-breadth):
its nodes are packed in the same row, node 0 the last token and node j the draft token d_j, each with
a parent among the nodes before it. A node sits at position L_i + its depth and attends to the prefix
and to its ancestors only (the torch attention backend's tree mask), so its logits are those the
chain root -> node would give. Its KV goes to the row's column L_i + j as any draft's; after the
acceptance the worker copies the accepted path's KV to columns L_i + 1 .. (the scheduler then keeps
them as it keeps a chain's):

    parents   [-1, 0, 0, 1, 2]      node:   0      the last token, position L
    tokens    [last, a, b, c, d]            1 a  2 b       position L + 1
                                            3 c  4 d       position L + 2 (c after a, d after b)

A chain is parents [-1, 0, 1, .., k - 1]; VerifyInput keeps None for it, so a batch of chains takes
exactly the chain path (no mask, no copy).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional


def node_depths(parents: list[int]) -> list[int]:
    """Each node's depth (node 0: 0): its position is the request's L + this."""
    depths = [0] * len(parents)
    for j in range(1, len(parents)):
        depths[j] = depths[parents[j]] + 1
    return depths


def is_chain(parents: list[int]) -> bool:
    return all(p == j - 1 for j, p in enumerate(parents))


def first_chain(parents: list[int]) -> list[int]:
    """The nodes from the root along first children (the tree's first chain: node 0, its first child,
    that one's first child ...)."""
    chain, last = [0], 0
    for j in range(1, len(parents)):
        if parents[j] == last:
            chain.append(j)
            last = j
    return chain


def tree_size(depth: int, topk: int, max_nodes: int) -> tuple[int, int]:
    """(nodes, depth) of a draft head's best-first tree (head_worker.py) `depth` deep with `topk`
    branches per step, within `max_nodes`: every candidate it can draft (topk at depth 1, topk x topk
    at each depth after) or max_nodes. Its head's steps write their KV to the verify step's slots, topk
    of them per step past the first, so it reaches at most 1 + (max_nodes + 1) // topk deep; and a tree
    of n >= 2 nodes at most n - 1 deep (n deep it would be a chain).

        tree_size(3, 2, 6) == (6, 3)    tree_size(3, 4, 4) == (4, 2)
    """
    depth = max(1, min(depth, 1 + (max_nodes + 1) // topk))
    nodes = min(max_nodes, topk + (depth - 1) * topk * topk)
    return nodes, max(1, min(depth, nodes - 1))  # one node: a chain (the caller drafts one)


def placeholder_tree(depth: int, nodes: int) -> list[int]:
    """The shape a tree's slots are reserved with before its head drafts it (nodes >= 2, depth < nodes):
    a chain `depth` deep, the other nodes under the root. The drafter puts the real parents in its place;
    what the scheduler reads of it (the node count, that it is a tree) stays true.

        placeholder_tree(2, 4) == [-1, 0, 1, 0, 0]
    """
    assert 1 <= depth < nodes, (depth, nodes)
    return [-1] + list(range(depth)) + [0] * (nodes - depth)


def state_node(accepted_nodes: Optional[list[list[int]]], i: int, kept: int) -> int:
    """The node of request i's verify step whose recurrent state follows the first `kept` tokens it
    emitted (a hybrid model's rollback): node 0, its last token, then its accepted nodes (a chain's
    1, 2, ..; accepted_nodes None: a step of chains)."""
    if kept <= 1:
        return 0
    return kept - 1 if accepted_nodes is None else accepted_nodes[i][kept - 2]


@dataclass
class VerifyInput:
    drafts: list[list[int]]  # per request, its draft tokens (may be empty); a tree's in its packed order
    # hybrid models: per request, the scratch slots that take its recurrent state after each of its
    # first len(draft) tokens (offsets 1 .. k; a tree: after nodes 0 .. k - 1), to roll back to where the
    # drafts stop being accepted; where verify steps may lag, after all 1 + k too (the state a step built
    # behind this one starts from; a tree: after its last node)
    state_slots: Optional[list[list[int]]] = None
    # tree drafts: per request, each node's parent (node 0 = its last token: -1; node j = drafts[i][j - 1]:
    # a node before j), None for a chain; the whole list None when no request has a real tree
    # (__post_init__ turns chains given here into None)
    parents: Optional[list[Optional[list[int]]]] = None
    # a draft head (head_worker.py): batch index -> (first-draft candidates, the head's output, the
    # candidates' log-probabilities) a PD prefill sent for a transferred request, put in its row before
    # the chain or tree is drafted
    primes: Optional[dict[int, tuple[tuple[int, ...], Any, tuple[float, ...]]]] = None
    # a verify step launched while the one before it still runs (the overlap loop; verify_strategy.py): per
    # request, the future-map slot of that step whose emitted-token count the worker adds to the row's
    # positions, lengths and KV columns before the pass (0: the row's start is known); None: no such row
    lagged: Optional[list[int]] = None
    # a lagged step of a hybrid model: per request, the state slots of the step before (its state_slots[i]):
    # the worker copies the one after that step's emitted tokens into the request's row before the pass
    lagged_states: Optional[list[list[int]]] = None
    # the first token row of each request in the batch's packed tokens (filled in __post_init__)
    offsets: list[int] = field(init=False)
    # a draft head's drafts still on the device: what reads them into `drafts` (whose lengths are right
    # already) and a tree's into `parents` (placeholders till then), run by settle() once the verify
    # pass is queued
    pending: Optional[Callable[[], Any]] = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.offsets, start = [], 0
        for d in self.drafts:
            self.offsets.append(start)
            start += 1 + len(d)
        if self.parents is not None:
            for d, p in zip(self.drafts, self.parents):
                assert p is None or (len(p) == 1 + len(d) and p[0] == -1
                                     and all(0 <= q < j for j, q in enumerate(p) if j)), "a tree's parents: -1, then < j"
            parents = [None if p is None or is_chain(p) else p for p in self.parents]
            self.parents = parents if any(p is not None for p in parents) else None

    def settle(self) -> None:
        """The drafts (and a draft head's trees) on the host: one read, once."""
        if self.pending is not None:
            fill, self.pending = self.pending, None
            fill()

    @property
    def num_draft_tokens(self) -> int:
        return sum(map(len, self.drafts))

    def tree(self, i: int) -> Optional[list[int]]:
        """Request i's parents where its draft is a real tree, else None."""
        return None if self.parents is None else self.parents[i]

    def depth(self, i: int) -> int:
        """How far request i's draft reaches: its longest branch (a chain: its length)."""
        tree = self.tree(i)
        return len(self.drafts[i]) if tree is None else max(node_depths(tree))

    def positions(self, i: int, start: int) -> list[int]:
        """Request i's nodes' positions, its last token at `start`."""
        tree = self.tree(i)
        if tree is None:
            return list(range(start, start + 1 + len(self.drafts[i])))
        return [start + d for d in node_depths(tree)]


@dataclass
class VerifyOutput:
    # per request: accepted draft tokens, then the target's token (1 .. k + 1 tokens)
    tokens: list[list[int]]
    # per request and token (with return_logprob): the target's logprob of it, its top logprobs
    logprobs: Optional[list[list[float]]] = None
    top_logprobs: Optional[list[list[list[tuple[float, int]]]]] = None
    # a step with tree drafts: per request, the nodes of its accepted draft tokens, in order (a chain
    # request's 1, 2, ..); their KV moves to the columns after the last token's (TpModelWorker._verify)
    accepted_nodes: Optional[list[list[int]]] = None

    @property
    def last_tokens(self) -> list[int]:
        """Each request's next decode input: the last token it emitted."""
        return [t[-1] for t in self.tokens]
