"""M-RoPE positions (placeholder until the full module lands)."""
from __future__ import annotations

from typing import Sequence

import torch


def mrope_positions(num_tokens: int, images: Sequence[tuple[int, tuple[int, int, int]]],
                    spatial_merge_size: int) -> tuple[torch.Tensor, int]:
    rows, pos, last = [], 0, 0
    for offset, (t, h, w) in images:
        n = offset - last
        rows.append(torch.arange(n, dtype=torch.int64).expand(3, -1) + pos)
        pos += n
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
        rows.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
        pos += max(gh, gw)
        last = offset + t * gh * gw
    rows.append(torch.arange(num_tokens - last, dtype=torch.int64).expand(3, -1) + pos)
    out = torch.cat(rows, dim=1)
    return out, int(out.max()) + 1 - num_tokens


def rope_positions_for(start: int, end: int, table: torch.Tensor, delta: int) -> torch.Tensor:
    n = table.shape[1]
    head = table[:, start:min(end, n)]
    if end <= n:
        return head
    tail = (torch.arange(max(start, n), end, dtype=torch.int64) + delta).expand(3, -1)
    return torch.cat([head, tail], dim=1)
