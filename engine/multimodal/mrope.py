"""M-RoPE positions (Qwen3.5, Qwen3-VL): a temporal, a height and a width position per token.

A prompt's positions are computed once, from where its images sit and their patch grids, as HF's
get_rope_index computes them (the same code in Qwen3.5, Qwen3.5-MoE, Qwen3-VL and Qwen3-VL-MoE):

    text run of length n     all three rows: p, p+1, ..., p+n-1; then p += n
    image, llm grid t x h x w    (grid_thw in patches, h and w divided by the spatial merge size)
        token (i, r, c)      temporal p+i, height p+r, width p+c (row-major over t, h, w); then p += max(h, w)

so an image takes t*h*w tokens but advances the position by only max(h, w). The delta, max position + 1
- prompt length (<= 0), is kept per request: a token at sequence position q >= prompt length (a generated
one, also when a retracted request is prefilled again) has q + delta on all three rows, as HF's decode.
The layers' RotaryEmbedding takes the [3, n] positions (layers/rotary_embedding.py).
"""
from __future__ import annotations

from typing import Sequence

import torch


def mrope_positions(num_tokens: int, images: Sequence[tuple[int, tuple[int, int, int]]],
                    spatial_merge_size: int) -> tuple[torch.Tensor, int]:
    """The prompt's positions [3, num_tokens] int64 and its delta. `images`: per image in prompt order,
    (the index of its first placeholder token, its grid_thw in patches)."""
    pieces, cursor, pos = [], 0, 0
    for offset, (t, h, w) in images:
        assert cursor <= offset, f"image at token {offset} overlaps the one before (ends at {cursor})"
        pieces.append(_text_run(pos, offset - cursor))
        pos += offset - cursor
        grid_h, grid_w = h // spatial_merge_size, w // spatial_merge_size
        pieces.append(_image_grid(pos, t, grid_h, grid_w))
        cursor = offset + t * grid_h * grid_w
        pos += max(grid_h, grid_w)
    assert cursor <= num_tokens, f"the last image ends at token {cursor}, past the prompt's {num_tokens}"
    pieces.append(_text_run(pos, num_tokens - cursor))
    positions = torch.cat(pieces, dim=1)
    delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
    return positions, delta


def rope_positions_for(start: int, end: int, table: torch.Tensor, delta: int) -> torch.Tensor:
    """M-RoPE positions [3, end - start] of sequence positions start..end-1 of a request whose prompt has
    the positions `table` [3, L]: the table's columns below L, q + delta on all three rows from L on."""
    prompt_len = table.shape[1]
    inside = table[:, min(start, prompt_len):min(end, prompt_len)]
    first_after = max(start, prompt_len)
    if first_after >= end:
        return inside
    after = torch.arange(first_after + delta, end + delta, dtype=table.dtype).expand(3, -1)
    return torch.cat((inside, after), dim=1)


def _text_run(start: int, length: int) -> torch.Tensor:
    return torch.arange(start, start + length, dtype=torch.int64).expand(3, -1)


def _image_grid(start: int, t: int, h: int, w: int) -> torch.Tensor:
    """[3, t*h*w]: the temporal, row and column index of each merged patch, row-major, plus start."""
    grid = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack(grid).reshape(3, -1) + start
