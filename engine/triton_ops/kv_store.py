"""store_kv: scatter this pass's K/V rows into one layer's KV buffers at the given slots."""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs may lack triton; the torch path serves them
    triton = None


def store_kv(
    k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """k_buffer, v_buffer: [num_slots, H, D]; loc: [n] int64 slots; k, v: [n, H, D]. In place.
    The values are cast to the buffers' dtype (the KV cache may have its own, --kv-cache-dtype). A
    float8 cache is written as bytes: index_copy_ has no float8 kernel."""
    if k.dtype != k_buffer.dtype:
        k, v = k.to(k_buffer.dtype), v.to(v_buffer.dtype)
    if k_buffer.dtype.itemsize == 1 and k_buffer.dtype.is_floating_point:
        k, v, k_buffer, v_buffer = (t.view(torch.uint8) for t in (k, v, k_buffer, v_buffer))
    if triton is not None and k_buffer.is_cuda:
        store_kv_triton(k_buffer, v_buffer, loc, k, v)
    else:
        store_kv_torch(k_buffer, v_buffer, loc, k, v)


def store_kv_torch(
    k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    # index_copy_ is several times faster than advanced-index assignment on CPU
    k_buffer.index_copy_(0, loc, k.to(k_buffer.dtype))
    v_buffer.index_copy_(0, loc, v.to(v_buffer.dtype))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """A [n, H, D] view whose rows are contiguous (the row stride may be anything, e.g. a qkv split)."""
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        x = x.contiguous()
    return x


if triton is not None:

    @triton.jit
    def _store_kv_kernel(
        k_buffer, v_buffer, loc, k, v,
        buf_stride, k_stride, v_stride,
        row_size,
        BLOCK: tl.constexpr,
    ):
        token = tl.program_id(0)
        block = tl.program_id(1)
        slot = tl.load(loc + token).to(tl.int64)
        offs = block * BLOCK + tl.arange(0, BLOCK)
        mask = offs < row_size
        k_row = tl.load(k + token.to(tl.int64) * k_stride + offs, mask=mask)
        v_row = tl.load(v + token.to(tl.int64) * v_stride + offs, mask=mask)
        tl.store(k_buffer + slot * buf_stride + offs, k_row, mask=mask)
        tl.store(v_buffer + slot * buf_stride + offs, v_row, mask=mask)


def store_kv_triton(
    k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    n = loc.numel()
    if n == 0:
        return
    assert k_buffer.is_contiguous() and v_buffer.is_contiguous() and k_buffer.stride() == v_buffer.stride()
    k, v = _rows(k), _rows(v)
    row_size = k.shape[1] * k.shape[2]
    block = min(1024, triton.next_power_of_2(row_size))
    grid = (n, triton.cdiv(row_size, block))
    _store_kv_kernel[grid](
        k_buffer, v_buffer, loc, k, v,
        k_buffer.stride(0), k.stride(0), v.stride(0),
        row_size,
        BLOCK=block,
    )
