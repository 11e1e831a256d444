"""The overlap loop on CPU where the native forward serves: its steps on a native forward stream.

The stream (kernels/cpu_forward.py ForwardStream), a C thread, runs the batches in launch order
while the scheduler's thread works, the shape of the CUDA stream's overlap.

Each batch is queued as one native step (native_step.py: placeholders, forward, LM head) that
needs no GIL, so the scheduler processes batch N while N+1 runs. A batch whose step ends in tokens
(argmax or draw, the common decode step) ends there, the future map filled in C too; any other is
followed on the stream's thread by the worker's Python sampler over its logits, which stores its
tokens in the future map before the next step reads them. A batch no native step can serve
(prompt logprobs, a verify step) is a Python call on the stream, in its turn. Once the scheduler's thread waits
for a step it computes in place of one of the step's threads (parallel.h).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from baton.engine.worker.executors.base import OverlapExecutor
from baton.engine.worker.executors.native_step import NativeSteps

if TYPE_CHECKING:
    from baton.engine.core.batch_result import GenerationBatchResult
    from baton.engine.core.schedule_batch import ModelWorkerBatch
    from baton.engine.kernels.cpu_forward import ForwardStream
    from baton.engine.worker.tp_worker import TpModelWorker


class StreamResult:
    """A batch queued on the forward stream: result() waits for it (the GIL released)."""

    def __init__(self, stream: "ForwardStream", item: Any,
                 make: Optional[Callable[[], "GenerationBatchResult"]]) -> None:
        """`make`: the result, once the item ran; None: the item's callback returned it."""
        self._stream, self._item, self._make = stream, item, make
        self._result: Optional["GenerationBatchResult"] = None

    def result(self) -> "GenerationBatchResult":
        if self._result is None:
            self._stream.wait(self._item)
            self._result = (self._make() if self._make is not None else self._item.result).resolve()
        return self._result


class NativeStreamExecutor(OverlapExecutor):
    def __init__(self, worker: "TpModelWorker", max_running_requests: int) -> None:
        from baton.engine.kernels.cpu_forward import ForwardStream, StreamCall

        steps = NativeSteps.serving(worker)
        assert steps is not None, "the native forward does not serve this model"
        super().__init__(worker, max_running_requests)
        self.steps = steps
        self._threads = steps.num_threads
        self.stream: Optional["ForwardStream"] = ForwardStream(self._threads)
        self._stream_call = StreamCall

    @property
    def num_threads(self) -> int:
        return self._threads  # the scheduler's thread runs single-threaded beside them

    def launch(self, mwb: "ModelWorkerBatch") -> tuple[torch.Tensor, StreamResult]:
        placeholders = self.reserve(mwb)  # behind the steps queued, whose KV and tokens it reads
        # a verify step (speculative decoding: its drafts, the check) is the worker's, as prompt logprobs are
        step = None if mwb.spec_info is not None else self.steps.prepare(mwb, self.future_map)
        if step is None:  # the whole batch in Python, in its turn on the stream
            item = self._stream_call(lambda: self.worker.forward_batch_generation(mwb, future_map=self.future_map))
            make = None
        elif step.logits is None:  # the step's tokens: nothing left for Python
            item, make = step, (lambda: self.steps.result(mwb, step))
        else:  # the sampler, on the stream's thread, before the next step reads its tokens
            step.then(lambda: self.steps.result(mwb, step, self.future_map))
            item, make = step, None
        self.stream.submit(item)
        return placeholders, StreamResult(self.stream, item, make)

    def hand_over_openmp(self) -> None:
        """The scheduler thread gives its OpenMP team up to the stream's (ForwardStream.hand_over_openmp)."""
        if self.stream is not None:
            self.stream.hand_over_openmp()

    def shutdown(self) -> None:
        if self.stream is not None:
            self.stream.close()  # runs what was queued first
            self.stream = None
