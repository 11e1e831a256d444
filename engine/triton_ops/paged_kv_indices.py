"""Paged-KV metadata for FlashInfer: page ids of every request, read off its req_to_token row.

With page size P, request i owns the pages of its first seq_len_i slots (the allocator keeps
slot % P == position % P, so every P-th entry of the row starts a page):

    kv_indptr[i] .. kv_indptr[i+1]   pages of request i, ceil(seq_len_i / P) of them
    kv_indices[kv_indptr[i] + j]      req_to_token[req_pool_indices[i], j * P] // P
    kv_last_page_len[i]               seq_len_i - (pages_i - 1) * P, in [1, P]

indptr and last_page_len are built on the host from seq_lens_cpu (FlashInfer's plan() reads them
there anyway, so a device copy would only add a sync); kv_indices is built where req_to_token lives:
a Triton kernel on CUDA (SGLang's create_flashinfer_kv_indices_triton), torch elsewhere. All int32.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs may lack triton; the torch path serves them
    triton = None


class PagedKVMetadata(NamedTuple):
    kv_indptr: torch.Tensor  # [bs + 1] int32, CPU
    kv_indices: torch.Tensor  # [kv_indptr[-1]] int32 page ids, on req_to_token's device
    kv_last_page_len: torch.Tensor  # [bs] int32, CPU


def paged_kv_layout(seq_lens: Sequence[int], page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_indptr [bs + 1], kv_last_page_len [bs]), both int32 on the CPU. Every seq_len must be >= 1."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    lens = torch.tensor(list(seq_lens), dtype=torch.int64)
    if lens.numel() and int(lens.min()) < 1:
        raise ValueError(f"every request needs at least one KV token, got seq_lens {lens.tolist()}")
    pages = (lens + page_size - 1) // page_size
    indptr = torch.zeros(lens.numel() + 1, dtype=torch.int32)
    torch.cumsum(pages, 0, out=indptr[1:])
    last_page_len = (lens - (pages - 1) * page_size).to(torch.int32)
    return indptr, last_page_len


def qo_indptr_of(extend_lens: Sequence[int]) -> torch.Tensor:
    """[bs + 1] int32 CPU: request i's new tokens are rows qo_indptr[i] .. qo_indptr[i+1] of q."""
    out = torch.zeros(len(extend_lens) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(list(extend_lens), dtype=torch.int64), 0, out=out[1:])
    return out


def build_paged_kv_metadata(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                            seq_lens: Sequence[int], page_size: int,
                            out: Optional[torch.Tensor] = None) -> PagedKVMetadata:
    """The whole metadata of one pass. `out`: a preallocated int32 buffer to write page ids into
    (CUDA graphs keep one); the returned kv_indices is then a view of its head."""
    indptr, last_page_len = paged_kv_layout(seq_lens, page_size)
    total = int(indptr[-1])
    if out is None:
        out = torch.empty(total, dtype=torch.int32, device=req_to_token.device)
    elif out.dtype != torch.int32 or out.numel() < total or out.device != req_to_token.device:
        raise ValueError(f"kv_indices buffer must be int32 on {req_to_token.device} with >= {total} entries, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    indices = out[:total]
    if total:
        paged_kv_indices(req_to_token, req_pool_indices, indptr, page_size, indices)
    return PagedKVMetadata(indptr, indices, last_page_len)


def paged_kv_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, kv_indptr: torch.Tensor,
                     page_size: int, out: torch.Tensor) -> None:
    """Fill out [kv_indptr[-1]] int32 with page ids (module docstring). kv_indptr: int32 [bs + 1], any device."""
    if triton is not None and req_to_token.is_cuda:
        paged_kv_indices_triton(req_to_token, req_pool_indices, kv_indptr, page_size, out)
    else:
        paged_kv_indices_torch(req_to_token, req_pool_indices, kv_indptr, page_size, out)


def paged_kv_indices_torch(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, kv_indptr: torch.Tensor,
                           page_size: int, out: torch.Tensor) -> None:
    indptr = kv_indptr.to(device="cpu", dtype=torch.int64)
    pages = indptr[1:] - indptr[:-1]  # [bs]
    total = int(indptr[-1])
    dev = req_to_token.device
    req = torch.repeat_interleave(torch.arange(pages.numel()), pages, output_size=total)  # [total] request
    page_in_req = torch.arange(total) - indptr[:-1][req]  # [total] j
    rows = req_pool_indices.to(dev)[req.to(dev)]
    slots = req_to_token[rows, page_in_req.to(dev) * page_size]
    out.copy_((slots // page_size).to(torch.int32))


if triton is not None:

    @triton.jit
    def _paged_kv_indices_kernel(req_to_token, req_pool_indices, kv_indptr, out,
                                 row_stride, page_size, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        row = tl.load(req_pool_indices + i).to(tl.int64)
        start = tl.load(kv_indptr + i).to(tl.int64)
        num_pages = tl.load(kv_indptr + i + 1).to(tl.int64) - start
        for first in range(0, num_pages, BLOCK):
            j = first + tl.arange(0, BLOCK)
            mask = j < num_pages
            slot = tl.load(req_to_token + row * row_stride + j * page_size, mask=mask, other=0)
            tl.store(out + start + j, (slot // page_size).to(tl.int32), mask=mask)


def paged_kv_indices_triton(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, kv_indptr: torch.Tensor,
                            page_size: int, out: torch.Tensor) -> None:
    bs = req_pool_indices.numel()
    if bs == 0:
        return
    assert req_to_token.stride(1) == 1 and out.is_contiguous() and out.dtype == torch.int32
    indptr = kv_indptr.to(torch.int32)
    if req_to_token.is_cuda and not indptr.is_cuda:  # pinned: a pageable copy may wait for the stream's earlier work
        indptr = indptr.pin_memory()
    indptr = indptr.to(req_to_token.device, non_blocking=True)
    rows = req_pool_indices.to(req_to_token.device, non_blocking=True)
    _paged_kv_indices_kernel[(bs,)](req_to_token, rows, indptr, out, req_to_token.stride(0), page_size, BLOCK=128)
