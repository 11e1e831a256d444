"""Which prefill TP rank sends which KV heads to which decode TP rank, when the two engines run
different --tp-size. Pure functions: both sides compute the same plan from the total KV
head count and the two TP sizes (the decode learns the prefill's from its bootstrap server).

TP rank r of an engine holds KV heads kv_head_range(total, tp, r): a contiguous range, or, with
fewer KV heads than ranks, one head replicated on tp // total consecutive ranks (as the model's
attention shards them; distributed/parallel_state.py). Each decode rank takes each of its heads from
the first prefill rank that holds it:

    4 KV heads   prefill TP 1: [h0 h1 h2 h3]          prefill TP 2: [h0 h1] [h2 h3]
                                 │     │                               │       │
                 decode TP 2:  [h0 h1] [h2 h3]        decode TP 1:   [h0 h1 h2 h3]
                 one sender, two receivers            two senders, one receiver

    2 KV heads, prefill TP 4: [h0] [h0] [h1] [h1] -> decode TP 1 takes h0 from rank 0, h1 from rank 2;
    ranks 1 and 3 send nothing, but each still gets an empty destination (so it can finish the
    request) from decode rank p % decode_tp.

A slice is a head range that is contiguous on both ranks. With equal TP sizes every decode rank
gets its own prefill rank's whole shard: one slice covering every local head on both sides, which
moves whole pages per contiguous page run, as before.

A hybrid model's recurrent state (per request, not per token) splits by linear-attention heads: rank
r holds key heads r * Hk/tp .. and the value heads that read them (layers/gated_delta_net.py). Its
conv state's channel rows are [q | k | v] of those heads and its delta-rule state one row per value
head, so what a decode rank takes from a prefill rank, for the heads both hold, is three conv row
ranges and one state row range (state_row_slices):

    conv rows   prefill TP 2, rank 0: [q0 | k0 | v0]   rank 1: [q1 | k1 | v1]
                decode TP 1:          [q0 q1 | k0 k1 | v0 v1]      (three slices from each rank)

Every prefill rank whose linear heads a decode rank needs is in its plan (an empty KV slice where the
rank holds none of its KV heads, e.g. replicated KV heads); state_heads turns this on.
"""
from __future__ import annotations

from typing import NamedTuple


def kv_head_range(total: int, tp_size: int, rank: int) -> tuple[int, int]:
    """(first KV head, count) on TP rank `rank` of `tp_size` (TpGroup.kv_head_range's rule)."""
    assert total > 0 and 0 <= rank < tp_size
    if total >= tp_size:
        assert total % tp_size == 0, f"{total} KV heads do not split over TP {tp_size}"
        n = total // tp_size
        return rank * n, n
    assert tp_size % total == 0, f"TP {tp_size} is not a multiple of {total} KV heads"
    return rank // (tp_size // total), 1


class HeadSlice(NamedTuple):
    prefill_rank: int
    src_head: int  # first head of the slice within the prefill rank's local heads
    dst_head: int  # ... within the decode rank's local heads
    num_heads: int  # 0: an empty destination (this prefill rank holds nothing the decode rank needs)


def decode_rank_plan(total: int, prefill_tp: int, decode_tp: int, decode_rank: int,
                     state_heads: int = 0) -> list[HeadSlice]:
    """The slices decode rank `decode_rank` receives, one per prefill rank it talks to (prefill rank
    order), empty destinations for prefill ranks no decode rank needs included. `state_heads`: a
    hybrid model's linear-attention key heads; every prefill rank holding some of this rank's is in
    the plan too."""
    d_start, d_num = kv_head_range(total, decode_tp, decode_rank)
    slices: dict[int, HeadSlice] = {}
    for head in range(d_start, d_start + d_num):
        p = _first_holder(total, prefill_tp, head)
        p_start, _ = kv_head_range(total, prefill_tp, p)
        s = slices.get(p)
        if s is not None and s.dst_head + s.num_heads == head - d_start and s.src_head + s.num_heads == head - p_start:
            slices[p] = s._replace(num_heads=s.num_heads + 1)
        else:
            assert s is None, "a prefill rank's heads are contiguous"
            slices[p] = HeadSlice(p, head - p_start, head - d_start, 1)
    for p in range(prefill_tp):
        if p not in slices and ((p % decode_tp == decode_rank and not _needed(total, prefill_tp, decode_tp, p))
                                or (state_heads and _overlap(state_heads, prefill_tp, p, decode_tp, decode_rank))):
            slices[p] = HeadSlice(p, 0, 0, 0)
    return [slices[p] for p in sorted(slices)]


def receivers_of(total: int, prefill_tp: int, decode_tp: int, prefill_rank: int, state_heads: int = 0) -> int:
    """How many decode ranks send prefill rank `prefill_rank` a destination for one request."""
    return sum(any(s.prefill_rank == prefill_rank
                   for s in decode_rank_plan(total, prefill_tp, decode_tp, r, state_heads))
               for r in range(decode_tp))


CONV, SSM = 0, 1  # a state slice's buffers: every linear layer's conv state, or its delta-rule state


def state_row_slices(linear_heads: tuple[int, int, int, int], prefill_tp: int, prefill_rank: int, decode_tp: int,
                     decode_rank: int) -> list[tuple[int, int, int, int]]:
    """(buffers, first row on the prefill rank, first row on the decode rank, rows) of the recurrent
    state decode rank `decode_rank` takes from prefill rank `prefill_rank`, for the linear heads both
    hold. `linear_heads`: the model's (key heads, value heads, key head dim, value head dim). Conv
    rows are channels ([q | k | v] of the rank's heads), delta-rule rows value heads."""
    hk, hv, dk, dv = linear_heads
    kp, kp_n = kv_head_range(hk, prefill_tp, prefill_rank)
    kd, kd_n = kv_head_range(hk, decode_tp, decode_rank)
    first, end = max(kp, kd), min(kp + kp_n, kd + kd_n)
    if first >= end:
        return []
    group = hv // hk  # value heads per key head
    vp, vd, v_first, v_n = kp * group, kd * group, first * group, (end - first) * group
    return [(CONV, (first - kp) * dk, (first - kd) * dk, (end - first) * dk),  # q
            (CONV, (kp_n + first - kp) * dk, (kd_n + first - kd) * dk, (end - first) * dk),  # k
            (CONV, 2 * kp_n * dk + (v_first - vp) * dv, 2 * kd_n * dk + (v_first - vd) * dv, v_n * dv),  # v
            (SSM, v_first - vp, v_first - vd, v_n)]


def _overlap(heads: int, prefill_tp: int, prefill_rank: int, decode_tp: int, decode_rank: int) -> bool:
    ps, pn = kv_head_range(heads, prefill_tp, prefill_rank)
    ds, dn = kv_head_range(heads, decode_tp, decode_rank)
    return max(ps, ds) < min(ps + pn, ds + dn)


def _first_holder(total: int, prefill_tp: int, head: int) -> int:
    for p in range(prefill_tp):
        start, n = kv_head_range(total, prefill_tp, p)
        if start <= head < start + n:
            return p
    raise AssertionError(f"no prefill rank holds KV head {head}")


def _needed(total: int, prefill_tp: int, decode_tp: int, prefill_rank: int) -> bool:
    start, n = kv_head_range(total, prefill_tp, prefill_rank)
    return any(_first_holder(total, prefill_tp, h) == prefill_rank for h in range(start, start + n))
