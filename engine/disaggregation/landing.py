"""KV head slices as byte streams between TP sizes: runs, and a narrower decode's scatter.

When prefill and decode run different --tp-size, a prefill rank writes its slice of each token in
whole runs this way, and a decode rank narrower than it scatters the landed heads into place.

A layer buffer holds a token as [heads, head_dim]. Take a request's decode pages after its prefix,
in order, as one byte stream per layer buffer (T tokens: pages x page_size). The slice of decode
heads d..d+n goes there token-major, as [T, n, head_dim], from byte d * T * head_bytes:

    decode rank with H heads, one layer buffer, the request's pages as a stream of T * H heads
    | [T, n0, D] from prefill rank a | [T, n1, D] from prefill rank b | ...      (d = 0, n0, ...)
    scatter, once every rank of the plan reported Success:  [T, H, D], each slice at its heads

- A decode rank wider than its prefill (it holds exactly the slice: n = H, d = 0) reads the stream
  as its pages already: no scatter.
- A narrower one (several prefill ranks, each n < H) lands the slices packed in the request's own
  pages and scatters them in place: the slices cover its heads once (head_slices.py), so they fill
  the pages exactly. No memory beyond the request's pages, and a request that ends before its
  scatter gives back (or quarantines) those pages as before.

Writes follow the stream: a run ends only where the decode's pages or the prefill's source (its
slots, or a staging buffer of gathered slices) stop being consecutive.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
import torch


class ByteRuns(NamedTuple):
    offsets: np.ndarray  # [num_runs] bytes from a layer buffer's start
    lengths: np.ndarray  # [num_runs] bytes


def merge_runs(offsets: np.ndarray, length: int) -> ByteRuns:
    """Segments of `length` bytes at `offsets`, in stream order, merged where one ends where the next starts."""
    if len(offsets) == 0:
        return ByteRuns(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    starts = np.concatenate(([0], np.flatnonzero(np.diff(offsets) != length) + 1))
    counts = np.diff(np.concatenate((starts, [len(offsets)])))
    return ByteRuns(offsets[starts], counts * length)


def stream_runs(pages: np.ndarray, page_bytes: int, start: int, length: int) -> ByteRuns:
    """Where bytes [start, start + length) of the stream over `pages` (page_bytes each) lie in a layer buffer."""
    first, last = start // page_bytes, (start + length - 1) // page_bytes
    assert length > 0 and last < len(pages), "past the request's pages"
    runs = merge_runs(pages[first:last + 1].astype(np.int64) * page_bytes, page_bytes)
    head, tail = start - first * page_bytes, (last + 1) * page_bytes - (start + length)
    runs.offsets[0] += head
    runs.lengths[0] -= head
    runs.lengths[-1] -= tail
    return runs


class Pieces(NamedTuple):
    src: np.ndarray  # [num_pieces] source offsets
    dst: np.ndarray  # [num_pieces] destination offsets
    lengths: np.ndarray


def zip_runs(src: ByteRuns, dst: ByteRuns) -> Pieces:
    """Two cuttings of the same bytes into runs -> the pieces contiguous on both sides."""
    s_end, d_end = np.cumsum(src.lengths), np.cumsum(dst.lengths)
    assert s_end[-1] == d_end[-1], "both sides must cover the same bytes"
    ends = np.union1d(s_end, d_end)
    begins = np.concatenate(([0], ends[:-1]))
    i, j = np.searchsorted(s_end, begins, side="right"), np.searchsorted(d_end, begins, side="right")
    return Pieces(src.offsets[i] + begins - (s_end[i] - src.lengths[i]),
                  dst.offsets[j] + begins - (d_end[j] - dst.lengths[j]), ends - begins)


def slice_start(heads: Sequence[int], dest_pages: int, page_size: int, head_bytes: int, first_page: int) -> int:
    """Stream byte of the slice `heads` = (src, dst, n) for the token of page `first_page` (of the
    request's pages after its prefix, `dest_pages` of them)."""
    _, dst_head, n = heads
    return dst_head * dest_pages * page_size * head_bytes + first_page * page_size * n * head_bytes


def scatter_landed(bufs: Sequence[torch.Tensor], pages: np.ndarray, page_size: int,
                   slices: Sequence[tuple[int, int]]) -> None:
    """Put the slices landed in `pages` (the stream above) at their heads, in every layer buffer
    ([slots, heads, head_dim] each). `slices`: (first decode head, heads) of each, covering the heads."""
    device, (heads, dim) = bufs[0].device, bufs[0].shape[1:]
    assert sum(n for _, n in slices) == heads, "the slices cover every head once"
    slots = (torch.tensor(pages, dtype=torch.int64)[:, None] * page_size
             + torch.arange(page_size)).reshape(-1).to(device)  # [T]
    t = len(slots)
    consecutive = bool(np.all(np.diff(pages) == 1))
    stream = torch.empty(t * heads * dim, dtype=bufs[0].dtype, device=device)  # one buffer's, reused
    for buf in bufs:
        if consecutive:
            rows = buf[int(pages[0]) * page_size:int(pages[0]) * page_size + t]  # [T, heads, dim]
            stream.copy_(rows.reshape(-1))
        else:
            torch.index_select(buf, 0, slots, out=stream.view(t, heads, dim))
        for d, n in slices:
            part = stream[d * t * dim:(d + n) * t * dim].view(t, n, dim)
            if consecutive:
                rows[:, d:d + n].copy_(part)
            else:
                buf[slots, d:d + n] = part
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # in place before the request counts as transferred
