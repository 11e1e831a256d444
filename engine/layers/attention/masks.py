"""Attention masks of an extend pass whose queries are not all plain causal: a speculative verify
step with tree drafts (speculative/spec_info.py VerifyInput.parents).

A request's n new tokens follow its prefix of p cached tokens. Causal: new token j (position p + j)
sees keys 0 .. p + j. A tree: node j sees the prefix, itself and its ancestors (parents[j] < j, the
root's parent -1), so each node attends exactly as the chain root -> node would on its own.

The torch backend takes each request's mask as a matrix; FlashInfer takes the batch's masks
flattened, request after request, row-major ([n, p + n] each: `flat_extend_mask`).
"""
from __future__ import annotations

from typing import Optional

import torch


def prefix_causal_mask(prefix_len: int, extend_len: int, device: torch.device) -> torch.Tensor:
    """[extend_len, prefix_len + extend_len] bool: query j (position prefix_len + j) sees keys <= its position."""
    q_pos = torch.arange(prefix_len, prefix_len + extend_len, device=device)[:, None]
    k_pos = torch.arange(prefix_len + extend_len, device=device)[None, :]
    return k_pos <= q_pos


def tree_mask(prefix_len: int, parents: list[int], device: torch.device) -> torch.Tensor:
    """[n, prefix_len + n] bool for n tree nodes: node j sees the prefix, itself and its ancestors."""
    n = len(parents)
    rows = [[False] * n for _ in range(n)]
    for j, p in enumerate(parents):
        if p >= 0:
            rows[j][:j] = rows[p][:j]
        rows[j][j] = True
    tree = torch.tensor(rows, dtype=torch.bool)
    return torch.cat([torch.ones(n, prefix_len, dtype=torch.bool), tree], dim=1).to(device)


def flat_extend_mask(prefix_lens: list[int], extend_lens: list[int], trees: list[Optional[list[int]]],
                     device: torch.device) -> torch.Tensor:
    """Every request's mask (its tree's, or causal where it has none), flattened and concatenated:
    [sum(n_i * (p_i + n_i))] bool, FlashInfer's custom_mask layout."""
    parts = []
    for prefix, extend, tree in zip(prefix_lens, extend_lens, trees):
        assert tree is None or len(tree) == extend, (len(tree), extend)
        mask = prefix_causal_mask(prefix, extend, torch.device("cpu")) if tree is None else \
            tree_mask(prefix, tree, torch.device("cpu"))
        parts.append(mask.reshape(-1))
    return torch.cat(parts).to(device)
