"""Releasing the pools and the weights between rollouts, and taking them back (SGLang's memory saver:
/release_memory_occupation and /resume_memory_occupation, tags `kv_cache` and `weights`).

Released memory is really returned, and every tensor object stays the one it was, so what holds one
(the attention backend, the native forward's pointers, a PD transfer engine's registered buffers,
compiled graphs) goes on holding it:

    CPU    each storage's pages go back to the OS (madvise MADV_DONTNEED); the addresses stay mapped
           and read as zeros until written. Resume allocates nothing.
    CUDA   each storage shrinks to nothing (and the caching allocator is emptied, so the device gets
           the memory) and grows again on resume, at a new address; the decode CUDA graphs, which
           hold the old addresses, are dropped at release and captured again once nothing is released.

kv_cache: the KV pool, a hybrid model's recurrent-state pool and the request table. Their content is
lost (resume finds zeros), so the scheduler flushes the prefix cache first.
weights: every parameter and buffer of the model. Resume copies them back from the host copy taken at
release (--enable-weights-cpu-backup), or else loads the checkpoint at --model-path again. (SGLang,
without a backup, resumes with the memory uninitialized for a weight update to fill; a reload serves
the same clients and never serves garbage.)

Only whole pages inside a storage are dropped on CPU: a storage's first and last partial pages may be
shared with other allocations, and stay.
"""
from __future__ import annotations

import copy
import ctypes
import logging
import os
from typing import TYPE_CHECKING, Iterable, Optional

import torch

if TYPE_CHECKING:
    from baton.engine.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

KV_CACHE, WEIGHTS = "kv_cache", "weights"
_MADV_DONTNEED = 4  # Linux
_PAGE = os.sysconf("SC_PAGE_SIZE")


class MemoryOccupationError(Exception):
    """A release or resume this engine cannot do; the message says why (the client gets a 400)."""


def _madvise():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise


def drop_pages(ptr: int, nbytes: int) -> int:
    """The whole pages of [ptr, ptr + nbytes) back to the OS; returns the bytes dropped."""
    lo, hi = -(-ptr // _PAGE) * _PAGE, (ptr + nbytes) // _PAGE * _PAGE
    if hi <= lo:
        return 0
    if _madvise()(lo, hi - lo, _MADV_DONTNEED) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed")
    return hi - lo


def _byte_view(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,))


class _Region:
    """The distinct storages behind a set of tensors (each once, however many tensors view it)."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        seen: dict[int, torch.UntypedStorage] = {}
        for t in tensors:
            storage = t.untyped_storage()
            if storage.nbytes() >= _PAGE:  # smaller ones (a released linear's placeholder) hold nothing
                seen.setdefault(storage.data_ptr(), storage)
        self.storages = list(seen.values())
        self.sizes = [s.nbytes() for s in self.storages]
        self.backups: Optional[list[torch.Tensor]] = None

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)

    def data_ptrs(self) -> set[int]:
        return {s.data_ptr() for s in self.storages}

    def back_up(self) -> None:
        self.backups = [_byte_view(s, n).to("cpu", copy=True) for s, n in zip(self.storages, self.sizes)]

    def release(self) -> int:
        """Returns the bytes given back."""
        freed = 0
        for storage, n in zip(self.storages, self.sizes):
            if storage.device.type == "cpu":
                freed += drop_pages(storage.data_ptr(), n)
            else:
                storage.resize_(0)
                freed += n
        if any(s.device.type == "cuda" for s in self.storages):
            torch.cuda.empty_cache()
        return freed

    def restore(self, zero: bool) -> None:
        """The memory back (CUDA: allocated again); zeroed where asked and not CPU's fresh pages, or
        filled from the backup."""
        for i, (storage, n) in enumerate(zip(self.storages, self.sizes)):
            if storage.device.type != "cpu":
                storage.resize_(n)
            view = _byte_view(storage, n)
            if self.backups is not None:
                view.copy_(self.backups[i])
            elif zero and storage.device.type != "cpu":
                view.zero_()
        self.backups = None


class MemorySaver:
    """Release and resume of one model runner's memory, by tag. One TP rank only (a follower would have
    to release its shard too)."""

    def __init__(self, runner: "ModelRunner") -> None:
        self.runner = runner
        self.released: dict[str, _Region] = {}

    def release(self, tag: str) -> int:
        """Frees the tag's memory (a no-op when it is released already); returns the bytes freed."""
        self.check(tag)
        if tag in self.released:
            return 0
        region = _Region(self._kv_tensors() if tag == KV_CACHE else self._weights().values())
        if tag == WEIGHTS and self.runner.config.enable_weights_cpu_backup:
            region.back_up()
        self.runner.cuda_graph_runner = None  # its graphs read the old addresses (CUDA only); captured again
        freed = region.release()
        self.released[tag] = region
        logger.info("released %s: %.1f MB", tag, freed / 1e6)
        return freed

    def resume(self, tag: str) -> None:
        """The tag's memory back, with the weights' values (a no-op when it is not released)."""
        region = self.released.get(tag)
        if region is None:
            return
        if tag == WEIGHTS and region.backups is None:
            region.restore(zero=False)
            self._reload_weights(region)
        else:
            region.restore(zero=tag == KV_CACHE)
        del self.released[tag]
        if not self.released and self.runner.device.startswith("cuda"):
            self.runner.cuda_graph_runner = self.runner._init_cuda_graph_runner()
        logger.info("resumed %s", tag)

    def check(self, tag: str) -> None:
        """Raises MemoryOccupationError when this engine cannot release `tag`."""
        runner = self.runner
        if not runner.config.enable_memory_saver:
            raise MemoryOccupationError("releasing memory needs --enable-memory-saver")
        if runner.tp.size > 1:
            raise MemoryOccupationError("releasing memory is not supported with --tp-size > 1 yet")
        if tag not in (KV_CACHE, WEIGHTS):
            raise MemoryOccupationError(f"unknown memory tag {tag!r}; use {KV_CACHE} or {WEIGHTS}")
        if runner.device.startswith("cuda") and runner.draft_head is not None and not runner.config.disable_cuda_graph:
            # the draft head's graphs (speculative/draft_graphs.py) would keep the old addresses
            raise MemoryOccupationError("releasing memory with speculative decoding's CUDA graphs is not supported "
                                        "yet (--disable-cuda-graph)")

    def _kv_tensors(self) -> list[torch.Tensor]:
        runner = self.runner
        pool = runner.token_to_kv_pool
        tensors = [runner.req_to_token_pool.req_to_token, *pool.k_buffer, *pool.v_buffer]
        if runner.state_pool is not None:
            tensors += [*runner.state_pool.conv, *runner.state_pool.ssm]
        return tensors

    def _weights(self, model: Optional[torch.nn.Module] = None) -> dict[str, torch.Tensor]:
        model = self.runner.model if model is None else model
        return {**dict(model.named_parameters()), **dict(model.named_buffers())}

    def _reload_weights(self, region: _Region) -> None:
        """Every released weight from a fresh load of the checkpoint, built as the runner built its own
        (the same loader, then the same preparation: packed linears, layer ops)."""
        fresh = self._weights(_fresh_model(self.runner))
        held = region.data_ptrs()
        with torch.no_grad():
            for name, t in self._weights().items():
                if t.untyped_storage().data_ptr() not in held:
                    continue
                src = fresh.get(name)
                if src is None or src.shape != t.shape or src.dtype != t.dtype:
                    raise MemoryOccupationError(f"reloading the weights: {name} is not in {self.runner.config.model_path} "
                                                "as loaded before")
                t.copy_(src)


def _fresh_model(runner: "ModelRunner") -> torch.nn.Module:
    """The checkpoint loaded and prepared again by the runner's own steps, on a shallow copy of it, so
    that nothing of the runner changes; torch's RNG is left as it was (the load seeds it)."""
    shim = copy.copy(runner)
    devices = [torch.cuda.current_device()] if runner.device.startswith("cuda") else []
    with torch.random.fork_rng(devices=devices):
        shim._load_model()
        shim._prepare_model()
    return shim.model
