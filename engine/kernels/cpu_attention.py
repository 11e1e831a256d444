"""Paged attention on CPU (`paged_attention.c`): decode and extend, built on first use and cached.

    out = paged_decode_attention(q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, scale)
    out = paged_extend_attention(q, k, v, k_buf, v_buf, req_to_token, req_pool_indices, prefix_lens,
                                 extend_lens, scale)

Decode: q is [bs, kv_heads, group, head_dim] (the query heads grouped by the KV head they share), the
pool buffers are [slots, kv_heads, head_dim]; the result is [bs, kv_heads, group, head_dim] in q's
dtype. Extend: q is this pass's [n, heads, head_dim] and k, v its [n, kv_heads, head_dim]
(request after request, extend_lens[i] tokens each); token j of request i sees the prefix_lens[i]
cached keys of its req_to_token row, then the pass's own keys up to itself; the result is
[n, heads, head_dim] in q's dtype. One call serves the whole batch, prefixes included, with no
gather and no mask.
q is float32, bfloat16 or float16; the pool may be in any of those or in float8 e5m2 (a KV cache
dtype of its own, `--kv-cache-dtype`).
It is a torch op (`baton::paged_decode_attention`, registered in torch_ops.py), so `torch.compile`
keeps it as one opaque call instead of breaking the graph.

Built on first use with `-O3 -march=native -fopenmp` and cached per source, compiler and CPU
(engine/kernels/build.py).
Set `BATON_DISABLE_CPU_KERNELS=1` to use the pure-torch path (the benchmarks compare the two).
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path
from typing import Optional

import torch

from baton.engine.kernels.build import DEFAULT_CFLAGS, build_library, load_failure
from baton.engine.kernels.torch_ops import define_op

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention.c")
CFLAGS = DEFAULT_CFLAGS
DISABLE_ENV = "BATON_DISABLE_CPU_KERNELS"
_SUPPORTED = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # DTYPE_F32 / _BF16 / _F16 in the C source
_KV_SUPPORTED = {**_SUPPORTED, torch.float8_e5m2: 3}  # DTYPE_E5M2
_BAD_INDEX = 2  # KERNEL_BAD_INDEX in the C source


def build() -> Path:
    """Compile the kernel unless a library for this source, compiler and CPU is already cached."""
    return build_library(SOURCE, CFLAGS)


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL:
    # torch is imported first, so the library's libgomp.so.1 dependency resolves to the copy torch
    # already loaded: one OpenMP runtime and one thread pool in the process, not two competing.
    lib = ctypes.CDLL(str(build()))
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    # q, q_dtype, k, v, kv_dtype, num_slots, r2t, r2t_rows, r2t_stride, rows, lens, bs, kv_heads, group,
    # head_dim, scale, out, num_threads
    lib.paged_decode_attention.argtypes = [ptr, ctypes.c_int, ptr, ptr, ctypes.c_int, i64, ptr, i64, i64, ptr, ptr,
                                           i64, i64, i64, i64, ctypes.c_float, ptr, ctypes.c_int]
    lib.paged_decode_attention.restype = ctypes.c_int
    # q, q_dtype, k_new, v_new, k, v, kv_dtype, num_slots, r2t, r2t_rows, r2t_stride, rows, prefix_lens,
    # extend_lens, q_starts, bs, kv_heads, group, head_dim, scale, out, num_threads
    lib.paged_extend_attention.argtypes = [ptr, ctypes.c_int, ptr, ptr, ptr, ptr, ctypes.c_int, i64, ptr, i64, i64, ptr,
                                           ptr, ptr, ptr, i64, i64, i64, i64, ctypes.c_float, ptr, ctypes.c_int]
    lib.paged_extend_attention.restype = ctypes.c_int
    return lib


def switched_off(device: str) -> Optional[str]:
    """Why no CPU kernel serves here, before any is built: BATON_DISABLE_CPU_KERNELS, or another device."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return f"{DISABLE_ENV} is set"
    if not str(device).startswith("cpu"):
        return f"device {device} is not the CPU"
    return None


def unavailable_reason(dtype: torch.dtype, device: str, kv_dtype: Optional[torch.dtype] = None) -> Optional[str]:
    """None when the kernel can serve this model dtype, KV cache dtype (default: the model's) and
    device; otherwise why not (for one log line)."""
    if (off := switched_off(device)) is not None:
        return off
    if dtype not in _SUPPORTED:
        return f"dtype {dtype} is not supported (float32, bfloat16, float16)"
    if (kv_dtype or dtype) not in _KV_SUPPORTED:
        return f"KV cache dtype {kv_dtype} is not supported (float32, bfloat16, float16, float8_e5m2)"
    return load_failure(_library)


def paged_decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor,
                           req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Eager calls go straight to the library (the op's dispatcher round trip is a few us per call);
    under torch.compile the op keeps the kernel one opaque node of the graph."""
    if torch.compiler.is_compiling():
        return torch.ops.baton.paged_decode_attention(q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens,
                                                      scale)
    return _paged_decode_attention(q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, scale)


def _check_inputs(op: str, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, index_names: str,
                  indices: tuple[torch.Tensor, ...], others: tuple[torch.Tensor, ...] = ()) -> None:
    """What both kernels require: supported dtypes, int64 index tensors, everything on the CPU."""
    if q.dtype not in _SUPPORTED or k_buf.dtype not in _KV_SUPPORTED or k_buf.dtype != v_buf.dtype:
        raise TypeError(f"{op}: q must be one of {list(_SUPPORTED)} and k/v share one of "
                        f"{list(_KV_SUPPORTED)}, got {q.dtype}/{k_buf.dtype}/{v_buf.dtype}")
    for t in indices:
        if t.dtype != torch.int64:
            raise TypeError(f"{op}: {index_names} must be int64")
    for t in (q, k_buf, v_buf, *indices, *others):
        if not t.is_cpu:
            raise ValueError(f"{op}: every tensor must be on the CPU")


def _raise_on_failure(op: str, failed: int, buffers: str) -> None:
    if failed & _BAD_INDEX:
        raise IndexError(f"{op}: a request row, length or KV slot is out of range")
    if failed:
        raise MemoryError(f"{op}: out of memory for the {buffers}")


def _paged_decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor,
                            req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    bs, kv_heads, group, head_dim = q.shape
    _check_inputs("paged_decode_attention", q, k_buf, v_buf, "req_to_token, req_pool_indices and seq_lens",
                  (req_to_token, req_pool_indices, seq_lens))
    if k_buf.shape[1:] != (kv_heads, head_dim) or v_buf.shape != k_buf.shape:
        raise ValueError(f"paged_decode_attention: pool {tuple(k_buf.shape)} does not match q {tuple(q.shape)}")
    if req_pool_indices.shape != (bs,) or seq_lens.shape != (bs,):
        raise ValueError(f"paged_decode_attention: {bs} queries need {bs} rows and lengths")
    q, k_buf, v_buf = q.contiguous(), k_buf.contiguous(), v_buf.contiguous()
    req_to_token = req_to_token.contiguous()
    rows, lens = req_pool_indices.contiguous(), seq_lens.contiguous()
    out = torch.empty((bs, kv_heads, group, head_dim), dtype=torch.float32)
    failed = _library().paged_decode_attention(
        q.data_ptr(), _SUPPORTED[q.dtype], k_buf.data_ptr(), v_buf.data_ptr(), _KV_SUPPORTED[k_buf.dtype],
        k_buf.shape[0], req_to_token.data_ptr(),
        req_to_token.shape[0], req_to_token.stride(0), rows.data_ptr(), lens.data_ptr(), bs, kv_heads, group,
        head_dim, scale, out.data_ptr(), torch.get_num_threads())
    _raise_on_failure("paged_decode_attention", failed, "score buffer")
    return out if q.dtype == torch.float32 else out.to(q.dtype)


define_op("paged_decode_attention", "(Tensor q, Tensor k_buf, Tensor v_buf, Tensor req_to_token, "
          "Tensor req_pool_indices, Tensor seq_lens, float scale) -> Tensor", _paged_decode_attention,
          lambda q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, scale: torch.empty_like(q))


EXTEND_MAX_HEAD_DIM = 128


def paged_extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                           req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
                           scale: float, q_starts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of every request's new tokens over its prefix and themselves, read from the
    pool in place (see the module docstring). Not a torch op of its own: under torch.compile the
    backend's `baton::extend_attention` op is the opaque node, and it calls this.
    q_starts: where each request's tokens start in q, for a subset of q's requests (the rows of q
    no request owns are left unspecified in the result); default: the requests fill q in order."""
    n, heads, head_dim = q.shape
    kv_heads = k_buf.shape[1] if k_buf.dim() == 3 else -1
    _check_inputs("paged_extend_attention", q, k_buf, v_buf, "req_to_token, req_pool_indices and the lengths",
                  (req_to_token, req_pool_indices, prefix_lens, extend_lens), (k, v))
    if kv_heads <= 0 or heads % kv_heads or k_buf.shape[2] != head_dim or v_buf.shape != k_buf.shape:
        raise ValueError(f"paged_extend_attention: pool {tuple(k_buf.shape)} does not match q {tuple(q.shape)}")
    if k.shape != (n, kv_heads, head_dim) or v.shape != k.shape or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"paged_extend_attention: this pass's k/v must be [{n}, {kv_heads}, {head_dim}] in {q.dtype}")
    if head_dim > EXTEND_MAX_HEAD_DIM:
        raise ValueError(f"paged_extend_attention: head_dim {head_dim} > {EXTEND_MAX_HEAD_DIM}")
    bs = req_pool_indices.shape[0]
    if prefix_lens.shape != (bs,) or extend_lens.shape != (bs,):
        raise ValueError(f"paged_extend_attention: {bs} requests need {bs} prefix and extend lengths")
    if q_starts is None:
        q_starts = torch.zeros(bs, dtype=torch.int64)
        if bs:
            torch.cumsum(extend_lens[:-1], 0, out=q_starts[1:])
        if int(extend_lens.sum()) != n:
            raise ValueError(f"paged_extend_attention: the extend lengths sum to {int(extend_lens.sum())}, "
                             f"q has {n} tokens")
    elif q_starts.dtype != torch.int64 or q_starts.shape != (bs,):
        raise ValueError(f"paged_extend_attention: q_starts must be {bs} int64 offsets")
    elif bs and (int(q_starts.min()) < 0 or int((q_starts + extend_lens).max()) > n):
        raise IndexError("paged_extend_attention: a request's tokens run past q")
    q_starts = q_starts.contiguous()
    q, k, v, req_to_token = q.contiguous(), k.contiguous(), v.contiguous(), req_to_token.contiguous()
    k_buf, v_buf = k_buf.contiguous(), v_buf.contiguous()
    rows, prefix_lens, extend_lens = req_pool_indices.contiguous(), prefix_lens.contiguous(), extend_lens.contiguous()
    out = torch.empty((n, heads, head_dim), dtype=torch.float32)
    failed = _library().paged_extend_attention(
        q.data_ptr(), _SUPPORTED[q.dtype], k.data_ptr(), v.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(),
        _KV_SUPPORTED[k_buf.dtype], k_buf.shape[0], req_to_token.data_ptr(), req_to_token.shape[0], req_to_token.stride(0),
        rows.data_ptr(), prefix_lens.data_ptr(), extend_lens.data_ptr(), q_starts.data_ptr(), bs, kv_heads, heads // kv_heads,
        head_dim, scale, out.data_ptr(), torch.get_num_threads())
    _raise_on_failure("paged_extend_attention", failed, "K/V and score buffers")
    return out if q.dtype == torch.float32 else out.to(q.dtype)
