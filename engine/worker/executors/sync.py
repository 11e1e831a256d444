"""The plain loop's executor: each batch runs at launch, in the scheduler's thread.

Its tokens are the ids its requests decode from next (schedule N -> run N -> process N). Where the
native CPU forward serves the model, each batch it can take is one native step (native_step.py);
the rest go through the worker's forward + sample.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from baton.engine.worker.executors.base import ForwardExecutor
from baton.engine.worker.executors.native_step import NativeSteps

if TYPE_CHECKING:
    from baton.engine.core.batch_result import GenerationBatchResult
    from baton.engine.core.schedule_batch import ModelWorkerBatch
    from baton.engine.worker.tp_worker import TpModelWorker


class SyncExecutor(ForwardExecutor):
    overlap = False

    def __init__(self, worker: "TpModelWorker") -> None:
        super().__init__(worker)
        self.native = NativeSteps.serving(worker)  # None: every batch through the worker

    def launch(self, mwb: "ModelWorkerBatch") -> tuple[torch.Tensor, "GenerationBatchResult"]:
        """Run the batch now; the result is its own handle (GenerationBatchResult.result())."""
        result = self.native.run(mwb) if self.native is not None else self.worker.forward_batch_generation(mwb)
        return result.next_token_ids_tensor, result
