"""Sampling on CPU (`cpu_sampling.c`): temperature, top-k, top-p, min-p and one draw per row.

    next_ids = sample(logits, temperatures, top_ks, top_ps, min_ps, seeds, counters)

torch's sampler over a real vocabulary costs more than a decode step of a small model: softmax, a
full sort of every row for top-k or top-p, a cumulative sum and multinomial (32 rows of SmolLM2's
49,152 tokens: tens of milliseconds on two cores). This does one exp pass per row and sorts only
the best tokens that top-k or top-p keep, found by selection. Its draws come from the request's
own seed and its count of samples (engine/sampling/sampling_batch_info.py): independent of the
batch, the same on every run. `BATON_DISABLE_CPU_KERNELS=1` keeps torch's sampler.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Optional

import torch

from baton.engine.kernels.build import DEFAULT_CFLAGS, build_library, load_failure
from baton.engine.kernels.cpu_attention import switched_off  # one switch for every CPU kernel

SOURCE = Path(__file__).with_name("cpu_sampling.c")


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build_library(SOURCE, DEFAULT_CFLAGS)))
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    # logits, bs, vocab, temperatures, top_ks, top_ps, min_ps, seeds, counters, out, num_threads
    lib.sample_rows.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_int]
    lib.sample_rows.restype = ctypes.c_int
    lib.uniform_draw.argtypes, lib.uniform_draw.restype = [ctypes.c_uint64, ctypes.c_uint64], ctypes.c_double
    # logits, vocab, n, rows, counts, seen, rep, freq, pres, num_threads
    lib.apply_penalty_rows.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_int]
    lib.apply_penalty_rows.restype = None
    return lib


@functools.lru_cache(maxsize=4)
def unavailable_reason(device: str = "cpu") -> Optional[str]:
    """None when the native sampler can serve this device; otherwise why not."""
    return switched_off(device) or load_failure(_library)


def sample(logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
           min_ps: torch.Tensor, seeds: list[int], counters: list[int]) -> torch.Tensor:
    """logits [bs, vocab] float32 (penalties and masks applied; overwritten); per row: temperature
    (> 0), top_k (vocab or more: off), top_p (1: off), min_p (0: off), the seed (any int; 64 bits of
    it) and how many draws that seed made before. Returns the sampled ids [bs] int64."""
    assert logits.dim() == 2 and logits.dtype == torch.float32 and logits.is_contiguous()
    bs, vocab = logits.shape
    temps = temperatures.reshape(-1).to(torch.float32).contiguous()
    ks = top_ks.reshape(-1).to(torch.int64).contiguous()
    ps, mins = top_ps.to(torch.float32).contiguous(), min_ps.to(torch.float32).contiguous()
    if not all(t.shape == (bs,) for t in (temps, ks, ps, mins)) or len(seeds) != bs or len(counters) != bs:
        raise ValueError(f"native sampling: every per-row input must have {bs} rows")
    mask = (1 << 64) - 1
    seed_buf = (ctypes.c_uint64 * bs)(*[s & mask for s in seeds])
    count_buf = (ctypes.c_uint64 * bs)(*[c & mask for c in counters])
    out = torch.empty(bs, dtype=torch.int64)
    if _library().sample_rows(logits.data_ptr(), bs, vocab, temps.data_ptr(), ks.data_ptr(), ps.data_ptr(),
                              mins.data_ptr(), seed_buf, count_buf, out.data_ptr(), torch.get_num_threads()):
        raise MemoryError("native sampling: out of memory")
    return out


def apply_penalties(logits: torch.Tensor, rows: list[int], counts: list[torch.Tensor], seen: list[torch.Tensor],
                    repetition: list[float], frequency: list[float], presence: list[float]) -> None:
    """Token penalties on rows of logits [bs, vocab] float32, in place (engine/sampling/penalties.py's
    semantics and roundings): rows[j] with its request's output counts[j] ([vocab] int32) and
    seen[j] ([vocab] bool), without stacking them."""
    assert logits.dim() == 2 and logits.dtype == torch.float32 and logits.is_contiguous()
    bs, vocab = logits.shape
    n = len(rows)
    assert all(0 <= r < bs for r in rows) and len(counts) == len(seen) == n
    for c, m in zip(counts, seen):
        assert c.dtype == torch.int32 and m.dtype == torch.bool and c.shape == m.shape == (vocab,)
        assert c.is_contiguous() and m.is_contiguous() and c.device.type == m.device.type == "cpu"
    f32 = ctypes.c_float * n
    _library().apply_penalty_rows(
        logits.data_ptr(), vocab, n, (ctypes.c_int64 * n)(*rows), (ctypes.c_void_p * n)(*[c.data_ptr() for c in counts]),
        (ctypes.c_void_p * n)(*[m.data_ptr() for m in seen]), f32(*repetition), f32(*frequency), f32(*presence),
        torch.get_num_threads())
