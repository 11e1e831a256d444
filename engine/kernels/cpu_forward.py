"""The C side of the native CPU forward (`cpu_forward.c`): its library, structs, model steps and stream.

    lib = library()                 # built once per machine (build.py); the step functions below
    step.run()                      # a ModelStep (model_executor/native_forward.py makes them)
    stream = ForwardStream(num_threads); stream.submit(step); stream.wait(step)   # on a C thread

This module knows no model: model_executor/native_forward.py (NativeForward) fills the structs from a
loaded model's structure and its pools. A ForwardStream runs steps, each maybe followed by a Python
sampler, on a C thread in submission order: the overlap loop's forward on CPU
(worker/executors/native_stream.py).

Its parallel loops run on parallel.h's crew rather than OpenMP: chunks claimed by whoever is free,
no barrier that waits for a thread the OS took off its core, and, on a stream, the thread waiting
for the step working in place of a helper thread.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from baton.engine.kernels.build import DEFAULT_CFLAGS, build_library

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_forward.c")
_ERRORS = {1: "out of memory", 2: "a token id, position, slot or request row out of range",
           3: "this build has no AVX512_BF16",  # KERNEL_NO_MEMORY, KERNEL_BAD_INDEX, FORWARD_UNSUPPORTED
           4: "a placeholder token id or slot outside the future map"}  # STEP_BAD_FUTURE

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64


class LayerWeights(ctypes.Structure):  # LayerWeights in cpu_forward.c, field for field
    _fields_ = [(name, _ptr) for name in ("input_norm", "post_norm", "q_norm", "k_norm", "qkv", "o", "gate_up",
                                          "down", "qkv_bias", "k_cache", "v_cache")]


class NativeModel(ctypes.Structure):  # NativeModel in cpu_forward.c
    _fields_ = ([(name, _i64) for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate",
                                           "vocab", "max_positions", "num_slots", "r2t_rows", "r2t_stride")]
                + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]
                + [(name, _ptr) for name in ("embed", "final_norm", "cos", "sin", "r2t")]
                + [("layer", ctypes.POINTER(LayerWeights))])


class ModelStepStruct(ctypes.Structure):  # ModelStep in cpu_forward.c
    _fields_ = ([("model", ctypes.POINTER(NativeModel)), ("lm_head", _ptr), ("n", _i64), ("bs", _i64)]
                + [(name, _ptr) for name in ("ids", "positions", "loc", "rows", "lens", "prefix_lens", "extend_lens",
                                             "future_map")]
                + [("future_len", _i64), ("future_slots", _ptr), ("next_ids", _ptr), ("logits", _ptr)]
                + [(name, _ptr) for name in ("temperatures", "top_ps", "min_ps", "top_ks", "seeds", "counters")]
                + [("num_threads", ctypes.c_int), ("err", ctypes.c_int), ("done", ctypes.c_int), ("next", _ptr),
                   ("call", _ptr)])


_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int)
# a sampling step's per-row inputs and their dtypes (seeds and counters: uint64 in C, same bits)
SAMPLING_ROWS = {"temperatures": torch.float32, "top_ps": torch.float32, "min_ps": torch.float32,
                 "top_ks": torch.int64, "seeds": torch.int64, "counters": torch.int64}


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build_library(SOURCE, DEFAULT_CFLAGS)))
    # model, ids, positions, rows, lens, loc, bs, out, num_threads
    lib.decode_step.argtypes = [ctypes.POINTER(NativeModel), _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, ctypes.c_int]
    lib.decode_step.restype = ctypes.c_int
    # model, ids, positions, loc, n, rows, prefix_lens, extend_lens, bs, out, num_threads
    lib.extend_step.argtypes = [ctypes.POINTER(NativeModel), _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr,
                                ctypes.c_int]
    lib.extend_step.restype = ctypes.c_int
    # model, hidden, rows, packed LM head, out, num_threads
    lib.logits_step.argtypes = [ctypes.POINTER(NativeModel), _ptr, _i64, _ptr, _ptr, ctypes.c_int]
    lib.logits_step.restype = ctypes.c_int
    lib.model_step.argtypes = [ctypes.POINTER(ModelStepStruct)]
    lib.model_step.restype = ctypes.c_int
    lib.stream_create.argtypes, lib.stream_create.restype = [ctypes.c_int], _ptr
    lib.openmp_hand_over.argtypes, lib.openmp_hand_over.restype = [], ctypes.c_int
    lib.stream_submit.argtypes, lib.stream_submit.restype = [_ptr, ctypes.POINTER(ModelStepStruct)], None
    lib.stream_wait.argtypes, lib.stream_wait.restype = [_ptr, ctypes.POINTER(ModelStepStruct)], ctypes.c_int
    lib.stream_destroy.argtypes, lib.stream_destroy.restype = [_ptr], None
    lib.rms_norm_bf16.argtypes = [_ptr, _i64, _i64, _ptr, ctypes.c_float, _ptr]  # x, rows, n, weight, eps, y
    lib.rms_norm_bf16.restype = None
    # num_threads, n, grain, wait_ms, hits, slots (int32 [n] each): parallel.h's crew, for the tests
    lib.par_selftest.argtypes, lib.par_selftest.restype = [ctypes.c_int, _i64, _i64, ctypes.c_int, _ptr, _ptr], \
        ctypes.c_int
    return lib


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The native forward's RMSNorm alone, over the rows of a contiguous bfloat16 x (for the tests)."""
    y = torch.empty_like(x)
    library().rms_norm_bf16(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), eps, y.data_ptr())
    return y


def ptr_of(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


class _Queued:
    """Something a ForwardStream runs: a C struct, and maybe a Python callback run after it on the
    stream's thread (with the GIL), whose outcome wait() hands back."""

    struct: ModelStepStruct
    outcome: Optional[tuple] = None  # the callback's, once it ran: (True, value) or (False, exception)

    def then(self, fn: Callable[[], Any]) -> None:
        """Run fn() on the stream's thread once the rest of this item has run (before the next item)."""
        self.outcome = (False, RuntimeError("the callback did not run"))

        def run() -> int:
            try:
                self.outcome = (True, fn())
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits for it
                self.outcome = (False, e)
            return 0

        self._callback: Optional[Any] = _CALLBACK(run)  # alive as long as the struct that points to it
        self.struct.call = ctypes.cast(self._callback, _ptr)

    def release(self) -> None:
        """Once the stream is done with it: drop the callback (its closure usually refers back here)."""
        self.struct.call, self._callback = None, None

    @property
    def result(self) -> Any:
        """The callback's return value (its exception raised), once it ran."""
        ok, value = self.outcome
        if not ok:
            raise value
        return value


class ModelStep(_Queued):
    """One prepared model step (NativeForward.step): the C struct and every tensor it points into."""

    def __init__(self, struct: ModelStepStruct, next_ids: torch.Tensor, logits: Optional[torch.Tensor],
                 keep: tuple) -> None:
        self.struct = struct
        self.next_ids = next_ids  # [bs] int64, once a greedy step ran
        self.logits = logits  # [bs, vocab] float32, once a step that is not greedy ran
        self._keep = keep

    def run(self) -> None:
        """Run it here, now (without its callback)."""
        raise_on(library().model_step(ctypes.byref(self.struct)))


class StreamCall(_Queued):
    """A bare Python call for a ForwardStream: fn() on the stream's thread, in its turn."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.struct = ModelStepStruct()
        self.then(fn)


class ForwardStream:
    """A native thread that runs what is submitted in order: model steps without the GIL (a
    sampler's callback after its step, and bare Python calls, with it). The overlap loop's forward
    on CPU: the scheduler thread processes step N while step N+1 runs.

    A model step's loops run on parallel.h's crew, `num_threads` wide: the stream's thread and, in
    place of one helper, the thread blocked in wait() (so the scheduler's thread computes once it
    has nothing else to do, and no thread is ever waited for while it runs Python). The callbacks'
    torch ops run on the stream thread's OpenMP team; a process that serves through the stream
    calls hand_over_openmp() from the creating thread once, so that thread's idle OpenMP team does
    not slow the stream's down (see openmp_hand_over in cpu_forward.c)."""

    def __init__(self, num_threads: int) -> None:
        self._lib = library()
        self.num_threads = num_threads
        self._stream = self._lib.stream_create(num_threads)
        if not self._stream:
            raise OSError("native forward stream: could not start its thread")

    def submit(self, item: _Queued) -> None:
        """Queue a ModelStep or StreamCall; the caller keeps it alive until wait() returns for it."""
        self._lib.stream_submit(self._stream, ctypes.byref(item.struct))

    def wait(self, item: _Queued) -> None:
        """Block (the GIL released) until a submitted item has run; its error, or its callback's
        exception, raised here."""
        err = self._lib.stream_wait(self._stream, ctypes.byref(item.struct))
        item.release()
        raise_on(err)
        if item.outcome is not None:
            item.result  # noqa: B018 - raises the callback's exception

    def hand_over_openmp(self) -> None:
        """From the thread that made the stream, once: free its idle OpenMP team, run its own regions
        single-threaded from now on (that thread then computes nothing big: the stream does)."""
        if self._lib.openmp_hand_over() != 0:
            logger.warning("could not free the scheduler thread's OpenMP team; the forward stream's may spin less")

    def close(self) -> None:
        """Run what was submitted, then end the thread."""
        if self._stream:
            self._lib.stream_destroy(self._stream)
            self._stream = None


def as_int64(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t if t.dtype == torch.int64 and t.is_contiguous() and t.dim() == 1 else t.to(torch.int64).contiguous()
            for t in tensors]


def check_len(step: str, n: int, *tensors: torch.Tensor) -> None:
    if any(t.shape != (n,) for t in tensors):
        raise ValueError(f"native {step} step: inputs must be [{n}], got {[tuple(t.shape) for t in tensors]}")


def raise_on(err: int) -> None:
    if err:
        raise RuntimeError(f"native forward: {_ERRORS.get(err, f'error {err}')}")
