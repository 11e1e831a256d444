"""A batch as one native CPU step, where the native forward serves the model whole.

One call of kernels/cpu_forward.py: the placeholders of the future map, the forward, the LM head
over each request's last token and, for a batch without logprobs whose every sampling row is plain
(no penalties, min_new_tokens, logit bias or grammar), the argmax or the draw and the future map's
slots too; the same tokens the worker's Python sampler would have made of its logits. The plain loop runs such steps in the scheduler's thread (sync.py), the overlap loop on
the native forward stream (native_stream.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from baton.engine.core.batch_result import GenerationBatchResult
from baton.engine.worker.tp_worker import TpModelWorker

if TYPE_CHECKING:
    from baton.engine.core.schedule_batch import ModelWorkerBatch
    from baton.engine.kernels.cpu_forward import ModelStep
    from baton.engine.model_executor.native_forward import NativeForward
    from baton.engine.worker.future_map import FutureMap


class NativeSteps:
    """Prepares a batch's native step and makes its result (the worker samples where it must)."""

    def __init__(self, worker: TpModelWorker, native: "NativeForward") -> None:
        self.worker, self.native = worker, native

    @classmethod
    def serving(cls, worker: TpModelWorker) -> Optional["NativeSteps"]:
        """The native steps of this worker's model, or None where the native forward does not serve
        it whole (CUDA, the model's own forward, no packed LM head, more than one TP rank, an embedding
        engine's pooling)."""
        native = worker.model_runner.native_forward
        if (str(worker.device).startswith("cuda") or native is None or not native.has_logits
                or worker.step_sender is not None or worker.model_runner.pooler is not None):
            return None
        return cls(worker, native)

    @property
    def num_threads(self) -> int:
        """The threads a step runs on (cpu_forward.c's crew)."""
        return self.native.num_threads

    def run(self, mwb: "ModelWorkerBatch") -> GenerationBatchResult:
        """The batch now, in this thread: as a native step where one serves it, else the worker's
        forward + sample."""
        step = self.prepare(mwb)
        if step is None:
            return self.worker.forward_batch_generation(mwb)
        step.run()
        return self.result(mwb, step)

    def prepare(self, mwb: "ModelWorkerBatch", future_map: Optional["FutureMap"] = None) -> Optional["ModelStep"]:
        """The batch's step, ready to run; None where it cannot serve the batch (prompt logprobs
        need every row's hidden state). A step that ends in tokens counts each sampling row's
        sample."""
        self.worker.assign_draws(mwb)
        if mwb.input_logprob_reqs:
            return None
        states = mwb.sampling_states
        # the step ends in tokens (argmax, or a draw where a row samples), not in logits for the sampler
        tokens = not mwb.return_logprob and all(s is None or s.plain_sampling for s in states)
        sampling = None
        if tokens and not all(s is None or s.plain_greedy for s in states):
            sampling = self._sampling_rows(mwb, self.native.vocab)
        fmap, slots = (None, None) if future_map is None else (future_map.token_ids, mwb.future_indices)
        if mwb.forward_mode.is_decode():
            lens = dict(seq_lens=torch.tensor(mwb.seq_lens_cpu, dtype=torch.int64))
        elif mwb.forward_mode.is_extend() and min(mwb.extend_seq_lens_cpu, default=0) > 0:
            lens = dict(prefix_lens=torch.tensor(mwb.extend_prefix_lens_cpu, dtype=torch.int64),
                        extend_lens=torch.tensor(mwb.extend_seq_lens_cpu, dtype=torch.int64))
        else:
            return None
        step = self.native.step(mwb.input_ids, mwb.positions, mwb.out_cache_loc, mwb.req_pool_indices, **lens,
                                future_map=fmap, future_slots=slots, greedy=tokens, sampling=sampling)
        if tokens:
            for s in states:
                if s is not None:
                    s.num_sampled += 1
        return step

    @staticmethod
    def _sampling_rows(mwb: "ModelWorkerBatch", vocab: int) -> dict[str, torch.Tensor]:
        """A sampling step's per-row inputs (NativeForward.step): greedy rows and rows that sample
        nothing at temperature 0 (the argmax)."""
        from baton.engine.sampling.sampling_batch_info import row_params

        states = mwb.sampling_states
        greedy = [s is None or s.params.is_greedy for s in states]
        temps, top_ps, top_ks, min_ps = row_params(states, greedy, vocab, greedy_temperature=0.0)
        return {"temperatures": torch.tensor(temps, dtype=torch.float32), "top_ks": torch.tensor(top_ks),
                "top_ps": torch.tensor(top_ps, dtype=torch.float32), "min_ps": torch.tensor(min_ps, dtype=torch.float32),
                "seeds": torch.tensor([0 if s is None else s.rng_seed for s in states], dtype=torch.int64),
                "counters": torch.tensor(mwb.draws, dtype=torch.int64)}

    def result(self, mwb: "ModelWorkerBatch", step: "ModelStep",
               future_map: Optional["FutureMap"] = None) -> GenerationBatchResult:
        """A step's result once it ran, as the worker's forward + sample makes it: the step's tokens
        (rows that sample nothing: 0), or the worker's sampler over its logits (then stored in the
        future map)."""
        if step.logits is None:
            next_ids = step.next_ids
            if any(s is None for s in mwb.sampling_states):
                next_ids = next_ids.masked_fill(torch.tensor([s is None for s in mwb.sampling_states]), 0)
            return GenerationBatchResult(next_token_ids=next_ids.tolist(), next_token_ids_tensor=next_ids,
                                         next_token_ids_device=next_ids)
        with torch.inference_mode():
            result, next_ids = self.worker.sample(mwb, step.logits)
            result.next_token_ids_device = result.next_token_ids_tensor = next_ids
            if future_map is not None:
                future_map.token_ids[mwb.future_indices] = next_ids
        result.next_token_ids = next_ids.tolist()
        return result
