"""A CPU TP group's collectives through shared memory (`engine/kernels/shm_group.c`).

On CPU the TP ranks are processes of one machine, and gloo goes through loopback TCP: ~1.2 ms per
all-reduce of a few KB on the 2-core VM (docs/benchmarks.md), two per layer per step, plus the
driver's two step broadcasts. Through a shared memory segment an all-reduce is a copy in, a barrier
on a flag per rank and a sum; a broadcast is a copy in, a flag, and a copy out. TP rank 0 makes the
segment in /dev/shm, every rank maps it, and rank 0 unlinks the file once all have: the mapping
lives as long as the processes, and nothing is left behind if one crashes.

Every rank sums the slots in rank order, so the ranks' activations stay bit-identical, as they
must (each rank runs the rest of the layer on its copy). A rank that waits more than `timeout_s`
for a peer inside a collective raises: the peer's process is gone, and the engine stops. A
follower waiting for the driver's next step waits as long as the engine is idle.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import uuid
from pathlib import Path
from typing import Optional

import torch

from baton.engine.kernels.build import KernelUnavailable, build_library

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent.parent / "kernels" / "shm_group.c"
SHM_DIR = "/dev/shm"
SLOT_BYTES = 1 << 20  # all-reduce, per rank and buffer; bigger tensors go in rounds of this size
BCAST_BYTES = 1 << 20  # broadcast, per buffer
TIMEOUT_S = 120.0
_LINE = 64  # one flag per cache line
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # DTYPE_* in the C source


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build_library(SOURCE)))
    i64, ptr, seq = ctypes.c_int64, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64)
    # base, rank, size, slot_bytes, data, numel, dtype, seq*, timeout_s
    lib.shm_allreduce.argtypes = [ptr, ctypes.c_int, ctypes.c_int, i64, ptr, i64, ctypes.c_int, seq, ctypes.c_double]
    lib.shm_allreduce.restype = ctypes.c_int
    # base, rank, size, slot_bytes, data, nbytes, out, seq*, timeout_s
    lib.shm_allgather.argtypes = [ptr, ctypes.c_int, ctypes.c_int, i64, ptr, i64, ptr, seq, ctypes.c_double]
    lib.shm_allgather.restype = ctypes.c_int
    # bbase, size, buf_bytes, data, nbytes, seq*, timeout_s
    lib.shm_bcast_send.argtypes = [ptr, ctypes.c_int, i64, ptr, i64, seq, ctypes.c_double]
    lib.shm_bcast_send.restype = ctypes.c_int
    # bbase, rank, size, buf_bytes, out, nbytes, seq*
    lib.shm_bcast_recv.argtypes = [ptr, ctypes.c_int, ctypes.c_int, i64, ptr, i64, seq]
    lib.shm_bcast_recv.restype = None
    return lib


def _reduce_bytes(size: int, slot_bytes: int) -> int:
    return size * _LINE + 2 * size * slot_bytes


def segment_bytes(size: int, slot_bytes: int, bcast_bytes: int) -> int:
    return _reduce_bytes(size, slot_bytes) + (1 + size) * _LINE + 2 * bcast_bytes


class ShmGroup:
    """One rank's view of its TP group's segment."""

    def __init__(self, path: str, rank: int, size: int, slot_bytes: int = SLOT_BYTES, bcast_bytes: int = BCAST_BYTES,
                 create: bool = False, timeout_s: float = TIMEOUT_S) -> None:
        assert slot_bytes % 4 == 0 and bcast_bytes > 0 and 0 <= rank < size
        self.rank, self.size, self.slot_bytes, self.bcast_bytes = rank, size, slot_bytes, bcast_bytes
        self.timeout_s = timeout_s
        self._lib = _library()
        nbytes = segment_bytes(size, slot_bytes, bcast_bytes)
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, nbytes)  # zero-filled: every flag starts at 0
            elif os.fstat(fd).st_size != nbytes:
                raise ValueError(f"{path}: {os.fstat(fd).st_size} bytes, expected {nbytes}")
            self._map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._bbase = self._base + _reduce_bytes(size, slot_bytes)
        self._reduce_seq = ctypes.c_int64(0)
        self._bcast_seq = ctypes.c_int64(0)

    def supports(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.dtype in _DTYPES

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks (a new tensor; x is left alone)."""
        out = x.contiguous().clone()
        failed = self._lib.shm_allreduce(self._base, self.rank, self.size, self.slot_bytes, out.data_ptr(),
                                         out.numel(), _DTYPES[out.dtype], ctypes.byref(self._reduce_seq),
                                         self.timeout_s)
        if failed:
            raise RuntimeError(f"TP all-reduce: a rank of {self.size} did not arrive within {self.timeout_s:g}s "
                               "(its process is gone)")
        return out

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x (same shape and dtype on each), stacked in rank order: [size, *x.shape]."""
        x = x.contiguous()
        out = x.new_empty((self.size, *x.shape))
        # the all-reduce's round counter: both use the same slots and flags, in one order on every rank
        failed = self._lib.shm_allgather(self._base, self.rank, self.size, self.slot_bytes, x.data_ptr(),
                                         x.numel() * x.element_size(), out.data_ptr(),
                                         ctypes.byref(self._reduce_seq), self.timeout_s)
        if failed:
            raise RuntimeError(f"TP all-gather: a rank of {self.size} did not arrive within {self.timeout_s:g}s "
                               "(its process is gone)")
        return out

    def broadcast(self, t: torch.Tensor) -> None:
        """Rank 0's t into every other rank's t (in place; a contiguous CPU tensor of the same size
        on every rank). Rank 0 returns once the followers took the data's last round but one."""
        assert t.device.type == "cpu" and t.is_contiguous()
        nbytes = t.numel() * t.element_size()
        if self.rank == 0:
            failed = self._lib.shm_bcast_send(self._bbase, self.size, self.bcast_bytes, t.data_ptr(), nbytes,
                                              ctypes.byref(self._bcast_seq), self.timeout_s)
            if failed:
                raise RuntimeError(f"TP broadcast: a rank of {self.size} did not take the data within "
                                   f"{self.timeout_s:g}s (its process is gone)")
        else:
            self._lib.shm_bcast_recv(self._bbase, self.rank, self.size, self.bcast_bytes, t.data_ptr(), nbytes,
                                     ctypes.byref(self._bcast_seq))


def new_segment_path() -> Optional[str]:
    """A fresh path in /dev/shm, or None where there is none (the group then keeps gloo)."""
    if not (os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)):
        return None
    return os.path.join(SHM_DIR, f"baton-tp-{os.getpid()}-{uuid.uuid4().hex[:12]}")


def unavailable_reason() -> Optional[str]:
    """None when the kernel builds here; otherwise why not."""
    try:
        _library()
    except (KernelUnavailable, OSError) as e:
        return str(e)
    return None
