"""The forward executor contract: how the scheduler's batches reach the worker's forward + sample.

A launch starts a batch's forward and sampling, batches strictly in launch order, and returns at
once with what the scheduler needs to go on: the ids the batch's requests decode from next, and a
handle whose result() waits for the batch's result. A plain executor has run the batch by then
(the ids are its tokens); an overlap executor has only queued it (the ids are -slots of its future
map, future_map.py, resolved on the device before the next batch's forward), so the scheduler
prepares batch N+1 while batch N computes.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

from baton.engine.worker.future_map import FutureMap

if TYPE_CHECKING:
    from baton.engine.core.batch_result import GenerationBatchResult
    from baton.engine.core.schedule_batch import ModelWorkerBatch
    from baton.engine.worker.tp_worker import TpModelWorker


class ResultHandle(Protocol):
    def result(self) -> "GenerationBatchResult":
        """The batch's result, its sampled ids on the host (blocks until then)."""


class ForwardExecutor(ABC):
    overlap: ClassVar[bool]  # whether launch() returns before the batch's tokens exist

    def __init__(self, worker: "TpModelWorker") -> None:
        self.worker = worker

    @abstractmethod
    def launch(self, mwb: "ModelWorkerBatch") -> tuple[torch.Tensor, ResultHandle]:
        """Start the batch (after every batch launched before it). Returns its requests' next
        input ids [bs] (placeholders where the executor overlaps) and the handle of its result.
        An error of the batch's forward is raised by the handle's result()."""

    @property
    def num_threads(self) -> int:
        """The threads a forward runs on (/get_server_info's torch_threads)."""
        return torch.get_num_threads()

    def hand_over_openmp(self) -> None:
        """Called once from the scheduler process's thread before its loop starts (event_loop.py):
        an executor whose forward runs on other threads may take that thread's OpenMP team."""

    def shutdown(self) -> None:
        """Run or drop what is queued, then stop the executor's threads (engine shutdown)."""


class OverlapExecutor(ForwardExecutor):
    """An executor whose batches reserve future-map slots at launch (the overlap loop's)."""

    overlap = True

    def __init__(self, worker: "TpModelWorker", max_running_requests: int) -> None:
        super().__init__(worker)
        self.future_map = FutureMap(max_running_requests, worker.device)

    def reserve(self, mwb: "ModelWorkerBatch") -> torch.Tensor:
        """In launch order: the batch's future-map slots and its draw numbers. Returns its
        placeholders (-slot per request)."""
        mwb.future_indices = self.future_map.reserve(len(mwb.seq_lens_cpu))
        self.worker.assign_draws(mwb)
        return -mwb.future_indices


class PendingResult:
    """A batch's result behind a Future (a worker thread's, or one set at launch): result() waits
    for it, then for the sampled ids' copy to the host."""

    def __init__(self, future: Future) -> None:
        self._future = future

    def result(self) -> "GenerationBatchResult":
        return self._future.result().resolve()
