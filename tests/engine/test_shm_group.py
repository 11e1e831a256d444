"""The shared memory collectives of CPU TP groups (engine/distributed/shm_group.py): real ranks in
separate processes. All-reduce against sums computed here in the same order (tensors of several
rounds, every dtype, size 0); the step broadcast byte for byte, in several rounds, after an idle
wait; all-gather stacked in rank order, interleaved with all-reduces (they share rounds); a missing
peer is an error, not a hang. The TP tests (test_tensor_parallel.py) run their
steps and forwards through it and match HF."""
from __future__ import annotations

import io
import multiprocessing as mp
import os

import pytest
import torch

from baton.engine.distributed import shm_group
from baton.engine.distributed.shm_group import ShmGroup

if shm_group.unavailable_reason() is not None or shm_group.new_segment_path() is None:
    pytest.fail(f"the shared memory all-reduce cannot run here: {shm_group.unavailable_reason() or '/dev/shm'}")

SLOT = 64  # bytes: 16 float32s per round, so most tensors below take several rounds
BCAST = 64  # bytes per broadcast round
SHAPES = [(0,), (1,), (3, 5), (16,), (17,), (4, 33), (1000,)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(shape, generator=gen) * 10).to(dtype) for dtype in DTYPES for shape in SHAPES]


def _expected(size: int) -> list[torch.Tensor]:
    """Rank order, in float32, rounded once: what every rank must produce, bit for bit."""
    per_rank = [_inputs(r) for r in range(size)]
    out = []
    for parts in zip(*per_rank):
        acc = parts[0].float()
        for p in parts[1:]:
            acc = acc + p.float()
        out.append(acc.to(parts[0].dtype))
    return out


def _rank(path: str, rank: int, size: int, queue) -> None:
    shm = ShmGroup(path, rank, size, slot_bytes=SLOT, bcast_bytes=BCAST)
    results = []
    for x in _inputs(rank):
        before = x.clone()
        results.append(shm.all_reduce(x))
        assert torch.equal(x, before), "the input was changed"
    _put(queue, rank, results)


def _run_ranks(target, size: int) -> dict[int, list[torch.Tensor]]:
    """`target(path, rank, size, queue)` in one process per rank on a segment made here (as TP rank
    0 makes it); returns what each rank put on the queue."""
    path = shm_group.new_segment_path()
    ShmGroup(path, 0, size, slot_bytes=SLOT, bcast_bytes=BCAST, create=True)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(path, r, size, queue), daemon=True) for r in range(size)]
    try:
        for p in procs:
            p.start()
        got = {rank: torch.load(io.BytesIO(data)) for rank, data in (queue.get(timeout=120) for _ in procs)}
        for p in procs:
            p.join(30)
        assert [p.exitcode for p in procs] == [0] * size
        return got
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        os.unlink(path)


def _put(queue, rank: int, tensors: list[torch.Tensor]) -> None:
    buf = io.BytesIO()
    torch.save(tensors, buf)  # bytes, not tensors: a queued tensor's memory dies with this process
    queue.put((rank, buf.getvalue()))


@pytest.mark.parametrize("size", [2, 3])
def test_every_rank_gets_the_same_sum_in_every_dtype(size):
    got = _run_ranks(_rank, size)
    want = _expected(size)
    for rank in range(size):
        for i, (g, w) in enumerate(zip(got[rank], want)):
            assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w), (rank, i, g.dtype, g.shape)


def _gather_rank(path: str, rank: int, size: int, queue) -> None:
    """All-gathers interleaved with all-reduces: the two share the segment's slots and round counter."""
    shm = ShmGroup(path, rank, size, slot_bytes=SLOT, bcast_bytes=BCAST)
    results = []
    for x in _inputs(rank):
        results.append(shm.all_gather(x))
        results.append(shm.all_reduce(x))
    _put(queue, rank, results)


@pytest.mark.parametrize("size", [2, 3])
def test_all_gather_stacks_every_rank_in_rank_order(size):
    got = _run_ranks(_gather_rank, size)
    per_rank, sums = [_inputs(r) for r in range(size)], _expected(size)
    for rank in range(size):
        gathered, reduced = got[rank][0::2], got[rank][1::2]
        for i, (g, s) in enumerate(zip(gathered, reduced)):
            want = torch.stack([per_rank[r][i] for r in range(size)])
            assert g.dtype == want.dtype and g.shape == want.shape and torch.equal(g, want), (rank, i)
            assert torch.equal(s, sums[i]), (rank, i)


def test_a_missing_peer_is_an_error_not_a_hang():
    path = shm_group.new_segment_path()
    try:
        shm = ShmGroup(path, 0, 2, slot_bytes=SLOT, create=True, timeout_s=0.3)
        with pytest.raises(RuntimeError, match="did not arrive within 0.3s"):
            shm.all_reduce(torch.ones(4))
        with pytest.raises(RuntimeError, match="all-gather: a rank of 2 did not arrive within 0.3s"):
            shm.all_gather(torch.ones(4))
    finally:
        os.unlink(path)


def test_a_segment_of_another_group_size_is_refused():
    path = shm_group.new_segment_path()
    try:
        ShmGroup(path, 0, 2, slot_bytes=SLOT, create=True)
        with pytest.raises(ValueError, match="expected"):
            ShmGroup(path, 1, 3, slot_bytes=SLOT)
    finally:
        os.unlink(path)



def _messages() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(-2**40, 2**40, (n,), generator=gen) for n in (8, 1, 7, 8, 9, 100, 3)]


def _bcast_rank(path: str, rank: int, size: int, queue) -> None:
    import time

    shm = ShmGroup(path, rank, size, slot_bytes=SLOT, bcast_bytes=BCAST)
    got = []
    for i, msg in enumerate(_messages()):
        if rank == 0:
            if i == 3:
                time.sleep(0.5)  # the followers wait idle (spin, yield, then sleep) meanwhile
            shm.broadcast(msg.clone())
        else:
            out = torch.zeros_like(msg)
            shm.broadcast(out)
            got.append(out)
    _put(queue, rank, got)


def test_the_step_broadcast_reaches_every_follower_byte_for_byte():
    got = _run_ranks(_bcast_rank, 3)
    for rank in (1, 2):
        assert [g.tolist() for g in got[rank]] == [m.tolist() for m in _messages()], rank


def test_a_broadcast_no_follower_takes_is_an_error_not_a_hang():
    path = shm_group.new_segment_path()
    try:
        shm = ShmGroup(path, 0, 2, slot_bytes=SLOT, bcast_bytes=BCAST, create=True, timeout_s=0.3)
        shm.broadcast(torch.zeros(8, dtype=torch.int64))  # rounds 1 and 2 need no acknowledgement yet
        shm.broadcast(torch.zeros(8, dtype=torch.int64))
        with pytest.raises(RuntimeError, match="did not take the data within 0.3s"):
            shm.broadcast(torch.zeros(8, dtype=torch.int64))
    finally:
        os.unlink(path)
