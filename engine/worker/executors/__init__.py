"""Forward executors: how the scheduler's batches reach the worker's forward + sample.

One per loop and device, chosen once at start-up (create_executor; the contract in base.py):

    sync.py           the plain loop: each batch runs at launch, in the scheduler's thread
    cuda_stream.py    the overlap loop on CUDA: the launch enqueues on a forward stream, inline
    native_stream.py  the overlap loop on CPU where the native forward serves: a C thread runs the steps
    worker_thread.py  the overlap loop on CPU with the model's own forward: a Python worker thread

native_step.py turns a batch into one native CPU step (sync.py and native_stream.py use it). Which
loop runs is ServerArgs.event_loop's rule, given native_stream_threads().
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from baton.engine.worker.executors.base import ForwardExecutor

if TYPE_CHECKING:
    from baton.engine.worker.tp_worker import TpModelWorker


def native_stream_threads(worker: "TpModelWorker") -> Optional[int]:
    """The threads the native CPU forward's steps run on, where it serves the worker's model whole
    (forward and LM head); None elsewhere. A fact ServerArgs.event_loop decides on."""
    from baton.engine.worker.executors.native_step import NativeSteps

    steps = NativeSteps.serving(worker)
    return None if steps is None else steps.num_threads


def create_executor(overlap: bool, worker: "TpModelWorker", max_running_requests: int) -> ForwardExecutor:
    """The executor of the plain loop or the overlap loop for the worker's device and forward."""
    if not overlap:
        from baton.engine.worker.executors.sync import SyncExecutor
        return SyncExecutor(worker)
    if str(worker.device).startswith("cuda"):
        from baton.engine.worker.executors.cuda_stream import CudaStreamExecutor
        return CudaStreamExecutor(worker, max_running_requests)
    if native_stream_threads(worker) is not None:
        from baton.engine.worker.executors.native_stream import NativeStreamExecutor
        return NativeStreamExecutor(worker, max_running_requests)
    from baton.engine.worker.executors.worker_thread import WorkerThreadExecutor
    return WorkerThreadExecutor(worker, max_running_requests)


__all__ = ["ForwardExecutor", "create_executor", "native_stream_threads"]
