"""The overlap loop on CPU with the model's own (Python) forward: a worker thread runs it.

One thread runs the batches in launch order while the scheduler's thread processes the previous
result. It only pays where the forward releases the GIL for long stretches; between small ops the
two threads contend for it, which is why the CPU's default is the plain loop there
(ServerArgs.event_loop).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from baton.engine.worker.executors.base import OverlapExecutor, PendingResult

if TYPE_CHECKING:
    from baton.engine.core.schedule_batch import ModelWorkerBatch
    from baton.engine.worker.tp_worker import TpModelWorker


class WorkerThreadExecutor(OverlapExecutor):
    def __init__(self, worker: "TpModelWorker", max_running_requests: int) -> None:
        super().__init__(worker, max_running_requests)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")

    def launch(self, mwb: "ModelWorkerBatch") -> tuple[torch.Tensor, PendingResult]:
        placeholders = self.reserve(mwb)
        future = self._thread.submit(self.worker.forward_batch_generation, mwb, future_map=self.future_map)
        return placeholders, PendingResult(future)

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)
