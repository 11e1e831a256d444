"""resolve_future_token_ids: swap the overlap loop's negative placeholders for sampled tokens.

The overlap scheduler launches batch N+1 before batch N's tokens reach the CPU, so N+1's input ids
hold -j for "the token that future slot j will contain"; the device fills future_token_ids_map[j]
when batch N samples, and this runs on the device right before N+1's forward.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs may lack triton; the torch path covers them
    triton = None


def resolve_future_token_ids(input_ids: torch.Tensor, future_token_ids_map: torch.Tensor) -> None:
    """input_ids: [n] int; future_token_ids_map: [num_future_slots] int. In place."""
    if triton is not None and input_ids.is_cuda:
        resolve_future_token_ids_triton(input_ids, future_token_ids_map)
    else:
        resolve_future_token_ids_torch(input_ids, future_token_ids_map)


def resolve_future_token_ids_torch(input_ids: torch.Tensor, future_token_ids_map: torch.Tensor) -> None:
    future = input_ids < 0
    resolved = future_token_ids_map[torch.clamp(-input_ids, min=0)].to(input_ids.dtype)
    input_ids.copy_(torch.where(future, resolved, input_ids))


if triton is not None:

    @triton.jit
    def _resolve_kernel(input_ids, future_map, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        ids = tl.load(input_ids + offs, mask=mask, other=0)
        future = ids < 0
        resolved = tl.load(future_map + (-ids).to(tl.int64), mask=mask & future, other=0)
        tl.store(input_ids + offs, resolved.to(ids.dtype), mask=mask & future)


def resolve_future_token_ids_triton(input_ids: torch.Tensor, future_token_ids_map: torch.Tensor) -> None:
    assert input_ids.is_contiguous()
    n = input_ids.numel()
    if n == 0:
        return
    block = 1024
    _resolve_kernel[(triton.cdiv(n, block),)](input_ids, future_token_ids_map, n, BLOCK=block)
