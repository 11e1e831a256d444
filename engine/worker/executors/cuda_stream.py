"""The overlap loop on CUDA: each launch enqueues its batch on a forward stream, inline.

A launch only enqueues work on the forward stream (the inputs' copy, the forward, the sampling, a
non-blocking copy of the sampled ids behind an event), so it runs in the scheduler's thread, as
SGLang's overlap loop does: the GPU computes batch N+1 while the same thread processes batch N's
result. The forward stream first waits on an event the scheduler recorded at launch (its
req_to_token writes for the batch); the scheduler waits on the copy's event only when it processes
the result. A worker thread here would buy nothing and cost a GIL hand-off per op: measured on an
H100, overlap through a thread was 0.77-0.87x the plain loop (docs/benchmarks.md).

Off CUDA (tests) the same launch runs the batch inline and synchronously, the overlap loop's
bookkeeping without its concurrency.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Optional

import torch

from baton.engine.worker.executors.base import OverlapExecutor, PendingResult

if TYPE_CHECKING:
    from baton.engine.core.batch_result import GenerationBatchResult
    from baton.engine.core.schedule_batch import ModelWorkerBatch
    from baton.engine.worker.tp_worker import TpModelWorker


class CudaStreamExecutor(OverlapExecutor):
    def __init__(self, worker: "TpModelWorker", max_running_requests: int) -> None:
        super().__init__(worker, max_running_requests)
        self.forward_stream = torch.cuda.Stream() if str(worker.device).startswith("cuda") else None

    def launch(self, mwb: "ModelWorkerBatch") -> tuple[torch.Tensor, PendingResult]:
        placeholders = self.reserve(mwb)
        inputs_ready = None
        if self.forward_stream is not None:  # behind the scheduler's req_to_token writes for this batch
            inputs_ready = torch.cuda.Event()
            inputs_ready.record()
        done: Future = Future()
        try:
            done.set_result(self._run(mwb, inputs_ready))
        except Exception as e:  # raised where the result is read, as from a worker thread
            done.set_exception(e)
        return placeholders, PendingResult(done)

    def _run(self, mwb: "ModelWorkerBatch", inputs_ready: Optional[Any]) -> "GenerationBatchResult":
        if self.forward_stream is None:
            return self.worker.forward_batch_generation(mwb, future_map=self.future_map)
        with torch.cuda.stream(self.forward_stream):
            self.forward_stream.wait_event(inputs_ready)
            return self.worker.forward_batch_generation(mwb, async_copy=True, future_map=self.future_map)
