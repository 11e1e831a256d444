"""Attention masks of an extend pass whose queries are not all plain causal: a speculative verify
step with tree drafts (core/spec_info.py VerifyInput.parents).

A request's n new tokens follow its prefix of p cached tokens. Causal: new token j (position p + j)
sees keys 0 .. p + j. A tree: node j sees the prefix, itself and its ancestors (parents[j] < j, the
root's parent -1), so each node attends exactly as the chain root -> node would on its own.

The torch backend takes each request's mask as a matrix; FlashInfer takes the batch's masks
flattened, request after request, row-major ([n, p + n] each: `flat_extend_mask`).

A tree comes as its parents (a host list: NGRAM's trees) or, from a draft head whose tree was chosen
on the device, as its ancestor matrix there ([n, n] bool, `ancestors`): its mask is then built on the
device, without the host reading the tree.
"""
from __future__ import annotations

from typing import Optional, Union

import torch


Tree = Union[list[int], torch.Tensor]  # parents, or the ancestor matrix [n, n] bool (node j sees node c)


def ancestors(parents: torch.Tensor, depth: int) -> torch.Tensor:
    """Trees' parents [t, n] (node 0 the root: -1; a parent before its child) -> [t, n, n] bool: node
    j sees node c (c is j or an ancestor of j), for trees at most `depth` deep. On the parents'
    device, `depth` row gathers."""
    t, n = parents.shape
    eye = torch.eye(n, dtype=torch.bool, device=parents.device).expand(t, n, n)
    up = parents.clamp(min=0)[:, :, None].expand(t, n, n)
    has_parent = (parents >= 0)[:, :, None]
    seen = eye
    for _ in range(depth):
        seen = eye | (seen.gather(1, up) & has_parent)
    return seen


def node_parents(trees: Optional[list[Optional[Tree]]], lens: list[int], device: torch.device) -> torch.Tensor:
    """[bs, max(lens)] int64: each request's nodes' parents (-1: node 0, and past its `lens[i]` nodes).
    A request without a tree is a chain (node j's parent j - 1); an ancestor matrix gives each node its
    deepest ancestor, the last one before it, computed where the matrix is (nothing read back)."""
    width = max(lens)
    host = [(list(range(-1, n - 1)) if t is None or isinstance(t, torch.Tensor) else list(t)) + [-1] * (width - n)
            for n, t in zip(lens, trees or [None] * len(lens))]
    out = torch.tensor(host, dtype=torch.int64, device=device)
    for i, t in enumerate(trees or ()):
        if isinstance(t, torch.Tensor):
            n = t.shape[0]
            idx = torch.arange(n, device=t.device)
            before = t & (idx[None, :] < idx[:, None])  # [n, n]: c an ancestor of j
            out[i, :n] = torch.where(before, idx[None, :], -1).amax(dim=1).to(device)
    return out


def prefix_causal_mask(prefix_len: int, extend_len: int, device: torch.device) -> torch.Tensor:
    """[extend_len, prefix_len + extend_len] bool: query j (position prefix_len + j) sees keys <= its position."""
    q_pos = torch.arange(prefix_len, prefix_len + extend_len, device=device)[:, None]
    k_pos = torch.arange(prefix_len + extend_len, device=device)[None, :]
    return k_pos <= q_pos


def tree_mask(prefix_len: int, parents: Tree, device: torch.device) -> torch.Tensor:
    """[n, prefix_len + n] bool for n tree nodes: node j sees the prefix, itself and its ancestors."""
    if isinstance(parents, torch.Tensor):  # the ancestor matrix, where it is
        n = parents.shape[0]
        return torch.cat([torch.ones(n, prefix_len, dtype=torch.bool, device=parents.device), parents], dim=1)
    n = len(parents)
    rows = [[False] * n for _ in range(n)]
    for j, p in enumerate(parents):
        if p >= 0:
            rows[j][:j] = rows[p][:j]
        rows[j][j] = True
    tree = torch.tensor(rows, dtype=torch.bool)
    return torch.cat([torch.ones(n, prefix_len, dtype=torch.bool), tree], dim=1).to(device)


def flat_extend_mask(prefix_lens: list[int], extend_lens: list[int], trees: list[Optional[Tree]],
                     device: torch.device) -> torch.Tensor:
    """Every request's mask (its tree's, or causal where it has none), flattened and concatenated:
    [sum(n_i * (p_i + n_i))] bool, FlashInfer's custom_mask layout. Built on the device where a tree
    is an ancestor matrix there (nothing read back), else on the host and copied."""
    where = device if any(isinstance(t, torch.Tensor) for t in trees) else torch.device("cpu")
    parts = []
    for prefix, extend, tree in zip(prefix_lens, extend_lens, trees):
        assert tree is None or len(tree) == extend, (len(tree), extend)
        mask = prefix_causal_mask(prefix, extend, where) if tree is None else tree_mask(prefix, tree, where)
        parts.append(mask.reshape(-1))
    return torch.cat(parts).to(device)
