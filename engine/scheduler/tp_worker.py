"""TpModelWorker: one forward + sample per batch. OverlapWorkerClient launches batches so that the
scheduler prepares batch N+1 while batch N computes ("zero-overhead" overlap).

Overlap: sampled tokens of batch N go into a future map at indices reserved when N was launched.
Batch N+1 is built with -index placeholders as the decode inputs of those requests; they are
replaced with the real ids on the device just before its forward. Batches run strictly in launch
order, so N's tokens are always in the map when N+1 resolves them.

On CUDA (as SGLang's overlap loop) the launch runs in the scheduler thread and only enqueues work
on a forward stream, which first waits on an event the scheduler recorded at launch (its
req_to_token writes for the batch); the sampled ids come to the host through a non-blocking copy
with an event behind it, and the scheduler waits on that event only when it processes the result.
On CPU the native forward's stream (a C thread, cpu_forward.c) runs the batches in launch order,
a greedy one as a single native step that also resolves and fills the future map; with the
model's own forward, a Python worker thread (see OverlapWorkerClient).

Tensor parallelism: this worker is the driver of its TP group. Before each forward it sends the
step to the other ranks (tp_step.py), in the thread that runs the forward, so the step and the
forward's all-reduces reach every rank in one order. It alone samples; the LM head is split by
vocabulary rows, so its logits calls are collectives the followers make too, on the rows the step
names.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from baton.engine.model_executor.model_runner import ModelRunner
from baton.engine.scheduler.future_map import FutureMap
from baton.engine.scheduler.schedule_batch import ModelWorkerBatch
from baton.engine.scheduler.tp_step import StepSender
from baton.engine.server_args import ServerArgs

if TYPE_CHECKING:
    from baton.engine.distributed.parallel_state import TpGroup
    from baton.engine.kernels.cpu_forward import ForwardStream, ModelStep


@dataclass
class GenerationBatchResult:
    next_token_ids: list[int]  # one per request (garbage for rows that did not sample)
    next_token_logprobs: Optional[list[float]] = None
    next_top_logprobs: Optional[list[list[tuple[float, int]]]] = None
    # batch index -> (logprobs of scored prompt tokens, their top logprobs)
    input_logprobs: dict[int, tuple[list, list]] = field(default_factory=dict)
    next_token_ids_tensor: Optional[torch.Tensor] = None  # [bs] int64 on the CPU
    next_token_ids_device: Optional[torch.Tensor] = None  # [bs] int64 on the model's device, for the future map
    # CUDA overlap only: recorded behind the non-blocking copy into next_token_ids_tensor, whose
    # values (and so next_token_ids) are only there once resolve() waited on it
    copy_done: Optional[Any] = None

    def resolve(self) -> "GenerationBatchResult":
        """Wait for the sampled ids to reach the host (no-op when they already did)."""
        if self.copy_done is not None:
            self.copy_done.synchronize()
            self.next_token_ids = self.next_token_ids_tensor.tolist()
            self.copy_done = None
        return self


class TpModelWorker:
    def __init__(self, server_args: ServerArgs, tp: Optional["TpGroup"] = None) -> None:
        """`tp`: the TP group this worker drives (joined by the caller; one rank by default)."""
        from baton.engine.layers.sampler import Sampler

        self.model_runner = ModelRunner(server_args, tp)
        self.tp = self.model_runner.tp
        self.sampler = Sampler()
        self.device = server_args.device
        self.step_sender = (StepSender(self.tp, self.model_runner.req_to_token_pool.req_to_token)
                            if self.tp.size > 1 else None)

    def close(self) -> None:
        """Release the other TP ranks from their step loop (after the last forward)."""
        if self.step_sender is not None:
            self.step_sender.stop()
            self.step_sender = None

    def forward_batch_generation(self, mwb: ModelWorkerBatch, async_copy: bool = False,
                                 future_map: Optional[FutureMap] = None) -> GenerationBatchResult:
        """`async_copy` (CUDA): copy the sampled ids to the host without waiting; call resolve().
        `future_map` (overlap): resolve the batch's placeholder inputs from it, store its samples in it."""
        self.assign_draws(mwb)
        if not async_copy:
            step = self.native_step(mwb, future_map)
            if step is not None:
                step.run()
                return self.step_result(mwb, step, future_map)
        with torch.inference_mode():
            return self._forward_and_sample(mwb, async_copy, future_map)

    @staticmethod
    def assign_draws(mwb: ModelWorkerBatch) -> None:
        """Number this batch's draw for each request that samples in it (once, at launch, in launch
        order): the CPU sampler's random numbers come from (seed, draw number)."""
        if mwb.draws is None:
            mwb.draws = [0 if s is None else s.next_draw() for s in mwb.sampling_states]

    def native_step(self, mwb: ModelWorkerBatch, future_map: Optional[FutureMap] = None) -> Optional["ModelStep"]:
        """The batch's forward as one native call, prepared (cpu_forward.c's model_step: the future
        map's placeholders, the forward, the LM head over each request's last token; for a batch
        without logprobs whose every sampling row is plain (no penalties, min_new_tokens, logit bias
        or grammar), the argmax or the draw and the future map's slots too), where the native
        forward serves it; None elsewhere (prompt logprobs need every row's hidden state). A step
        that draws its tokens counts each sampling row's sample."""
        native = self.model_runner.native_forward
        if native is None or not native.has_logits or self.step_sender is not None or mwb.input_logprob_reqs:
            return None
        states = mwb.sampling_states
        # the step ends in tokens (argmax, or a draw where a row samples), not in logits for the sampler
        tokens = not mwb.return_logprob and all(s is None or s.plain_sampling for s in states)
        sampling = None
        if tokens and not all(s is None or s.plain_greedy for s in states):
            sampling = self._sampling_rows(mwb, native.vocab)
        fmap, slots = (None, None) if future_map is None else (future_map.token_ids, mwb.future_indices)
        if mwb.forward_mode.is_decode():
            lens = dict(seq_lens=torch.tensor(mwb.seq_lens_cpu, dtype=torch.int64))
        elif mwb.forward_mode.is_extend() and min(mwb.extend_seq_lens_cpu, default=0) > 0:
            lens = dict(prefix_lens=torch.tensor(mwb.extend_prefix_lens_cpu, dtype=torch.int64),
                        extend_lens=torch.tensor(mwb.extend_seq_lens_cpu, dtype=torch.int64))
        else:
            return None
        step = native.step(mwb.input_ids, mwb.positions, mwb.out_cache_loc, mwb.req_pool_indices, **lens,
                           future_map=fmap, future_slots=slots, greedy=tokens, sampling=sampling)
        if tokens:
            for s in states:
                if s is not None:
                    s.num_sampled += 1
        return step

    @staticmethod
    def _sampling_rows(mwb: ModelWorkerBatch, vocab: int) -> dict[str, torch.Tensor]:
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

    def step_result(self, mwb: ModelWorkerBatch, step: "ModelStep",
                    future_map: Optional[FutureMap] = None) -> GenerationBatchResult:
        """A native step's result once it ran, as _forward_and_sample makes it: a greedy step's
        argmax (rows that sample nothing: 0), or the sampler over its logits (then stored in the
        future map)."""
        if step.logits is None:
            next_ids = step.next_ids
            if any(s is None for s in mwb.sampling_states):
                next_ids = next_ids.masked_fill(torch.tensor([s is None for s in mwb.sampling_states]), 0)
            return GenerationBatchResult(next_token_ids=next_ids.tolist(), next_token_ids_tensor=next_ids,
                                         next_token_ids_device=next_ids)
        with torch.inference_mode():
            result, next_ids = self._sample(mwb, step.logits)
            result.next_token_ids_device = result.next_token_ids_tensor = next_ids
            if future_map is not None:
                future_map.token_ids[mwb.future_indices] = next_ids
        result.next_token_ids = next_ids.tolist()
        return result

    def _forward_and_sample(self, mwb: ModelWorkerBatch, async_copy: bool,
                            future_map: Optional[FutureMap]) -> GenerationBatchResult:
        from baton.engine.triton_ops.future_resolve import resolve_future_token_ids

        runner = self.model_runner
        if self.step_sender is not None:
            self.step_sender.send(mwb)
        fb, future_slots = runner.forward_batch_from(mwb, None if future_map is None else mwb.future_indices)
        if future_map is not None:
            resolve_future_token_ids(fb.input_ids, future_map.token_ids)
        hidden = runner.forward(fb)  # [num_tokens, hidden]
        rows = runner.last_token_rows(fb)
        last_hidden = hidden if rows is None else hidden[rows]
        logits = runner.compute_logits(last_hidden)  # [bs, vocab] float32
        result, next_ids = self._sample(mwb, logits)
        if mwb.input_logprob_reqs:
            result.input_logprobs = self._input_logprobs(mwb, fb, hidden)
        result.next_token_ids_device = next_ids
        if future_map is not None:
            future_map.token_ids[future_slots] = next_ids
            if self.step_sender is not None:
                self.step_sender.send_sampled(next_ids)
        if async_copy:
            result.next_token_ids_tensor = next_ids.to("cpu", non_blocking=True)  # into pinned memory
            result.copy_done = torch.cuda.Event()
            result.copy_done.record()
        else:
            result.next_token_ids_tensor = next_ids.to("cpu")
            result.next_token_ids = result.next_token_ids_tensor.tolist()
        return result

    def _sample(self, mwb: ModelWorkerBatch, logits: torch.Tensor) -> tuple[GenerationBatchResult, torch.Tensor]:
        """The batch's next ids [bs] from its last-token logits [bs, vocab] (rows that sample
        nothing: 0), and a result with their logprobs where asked."""
        from baton.engine.sampling.sampling_batch_info import SamplingBatchInfo

        bs = logits.shape[0]
        sample_rows = [i for i, s in enumerate(mwb.sampling_states) if s is not None]
        result = GenerationBatchResult(next_token_ids=[])
        if len(sample_rows) == bs > 0 and not mwb.return_logprob and all(
                s.plain_greedy for s in mwb.sampling_states):
            # the common decode step: an argmax, no SamplingBatchInfo to build (the sampler's own
            # all-greedy path, ~30 us of host work less per step at batch 16)
            next_ids = torch.argmax(logits, dim=-1)  # [bs]
            for s in mwb.sampling_states:
                s.num_sampled += 1
        elif sample_rows:
            idx = torch.tensor(sample_rows, dtype=torch.int64, device=logits.device) if len(sample_rows) < bs else None
            sub_logits = logits if idx is None else logits[idx]
            states = [mwb.sampling_states[i] for i in sample_rows]
            counters = None if mwb.draws is None else [mwb.draws[i] for i in sample_rows]
            info = SamplingBatchInfo.from_states(states, logits.device, counters=counters)
            nums = [mwb.top_logprobs_nums[i] for i in sample_rows]
            out = self.sampler.forward(sub_logits, info, mwb.return_logprob, nums)
            if idx is None:
                next_ids = out.next_token_ids
            else:  # the rows that sample nothing get token 0
                next_ids = torch.zeros(bs, dtype=torch.int64, device=logits.device)
                next_ids[idx] = out.next_token_ids
            if mwb.return_logprob:
                lps = [0.0] * bs
                tops: list[list] = [[] for _ in range(bs)]
                for j, i in enumerate(sample_rows):
                    lps[i] = float(out.next_token_logprobs[j])
                    if out.top_logprobs is not None:
                        tops[i] = out.top_logprobs[j]
                result.next_token_logprobs, result.next_top_logprobs = lps, tops
        else:  # no row samples
            next_ids = torch.zeros(bs, dtype=torch.int64, device=logits.device)
        return result, next_ids

    def _input_logprobs(self, mwb: ModelWorkerBatch, fb, hidden: torch.Tensor) -> dict[int, tuple[list, list]]:
        """Logprobs of prompt tokens in this extend chunk. Row q of a request predicts token q+1.
        The LM head runs once per span with rows, in span order: a TP step names the same spans to
        the followers, whose shards take part in each call (tp_step.py)."""
        from baton.engine.layers.logits_processor import compute_input_logprobs, prompt_logprob_spans

        out: dict[int, tuple[list, list]] = {}
        starts = torch.tensor([0] + fb.extend_seq_lens_cpu, dtype=torch.int64).cumsum(0).tolist()
        spans = prompt_logprob_spans(mwb.input_logprob_reqs, fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu,
                                     fb.seq_lens_cpu)
        for (i, start_pos, _, next_after), span in zip(mwb.input_logprob_reqs, spans):
            p, s = fb.extend_prefix_lens_cpu[i], fb.seq_lens_cpu[i]
            ids = fb.input_ids[starts[i]:starts[i + 1]].to("cpu")
            # the first prompt token has no logprob (nothing predicts it)
            lps: list = [(None, int(ids[0]))] if (start_pos == 0 and p == 0) else []
            tops: list = [None] if lps else []
            if span.rows:
                targets = torch.tensor([int(ids[t - p]) if t < s else next_after
                                        for t in range(span.first_t, span.first_t + span.rows)])
                logits = self.model_runner.compute_logits(hidden[span.first_row:span.first_row + span.rows])
                k = mwb.top_logprobs_nums[i]
                tl, top = compute_input_logprobs(logits, targets.to(logits.device), k)
                lps += [(float(v), int(t)) for v, t in zip(tl.tolist(), targets.tolist())]
                tops += top if k > 0 else [None] * len(targets)
            out[i] = (lps, tops)
        return out


class PendingResult:
    """What launch() hands the scheduler: result() waits for the worker thread, then for the sampled
    ids' copy to the host."""

    def __init__(self, future: Future) -> None:
        self._future = future

    def result(self) -> GenerationBatchResult:
        return self._future.result().resolve()


class StreamResult:
    """A batch queued on the CPU's forward stream: result() waits for it (the GIL released)."""

    def __init__(self, stream: "ForwardStream", item: Any,
                 make: Optional[Callable[[], GenerationBatchResult]]) -> None:
        """`make`: the result, once the item ran; None: the item's callback returned it."""
        self._stream, self._item, self._make = stream, item, make
        self._result: Optional[GenerationBatchResult] = None

    def result(self) -> GenerationBatchResult:
        if self._result is None:
            self._stream.wait(self._item)
            self._result = self._make() if self._make is not None else self._item.result
        return self._result


class OverlapWorkerClient:
    """Launches batches in order and returns placeholders immediately.

    On CUDA a launch only enqueues work on the forward stream (the inputs' copy, the forward, the
    sampling, a non-blocking copy of the sampled ids behind an event), so it runs inline in the
    scheduler thread, as SGLang's overlap loop does: the GPU computes batch N+1 while the same thread
    processes batch N's result. A worker thread there would buy nothing and cost a GIL hand-off per
    op: measured on an H100, overlap through a thread was 0.77-0.87x the plain loop (docs/benchmarks.md).

    On CPU with the native forward, the same shape: a native forward stream (cpu_forward.c), a C
    thread, computes while the scheduler thread works. Each batch is queued on it as one native
    step (placeholders, forward, LM head) that needs no GIL, so the scheduler processes batch N
    while N+1 runs. A greedy batch (every sampling row an argmax, the common decode step) ends there
    (argmax and future map in C too); any other is followed on the stream's thread by the Python
    sampler over its logits, which stores its tokens in the future map before the next step reads
    them. A batch the native step cannot serve (prompt logprobs) is a Python call on the stream.
    Elsewhere on CPU (the model's own forward) a Python worker thread runs the forward (FIFO)."""

    def __init__(self, worker: TpModelWorker, max_running_requests: int, inline: Optional[bool] = None) -> None:
        self.worker = worker
        self.future_map = FutureMap(max_running_requests, worker.device)
        cuda = str(worker.device).startswith("cuda")
        self.forward_stream = torch.cuda.Stream() if cuda else None
        self.inline = cuda if inline is None else inline
        self.stream: Optional["ForwardStream"] = None
        if not self.inline and self.native_stream_serves(worker):
            from baton.engine.kernels.cpu_forward import ForwardStream, StreamCall

            self.stream, self._stream_call = ForwardStream(worker.model_runner.native_forward.num_threads), StreamCall
        threaded = not self.inline and self.stream is None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward") if threaded else None

    @staticmethod
    def native_stream_serves(worker: TpModelWorker) -> bool:
        """On CPU: the native forward serves this model whole (forward and LM head), so the overlap
        loop's steps run on a native forward stream, with no GIL held while they compute."""
        native = worker.model_runner.native_forward
        return not str(worker.device).startswith("cuda") and native is not None and native.has_logits

    @classmethod
    def pays_on_cpu(cls, worker: TpModelWorker) -> bool:
        """Whether the overlap loop is the default on CPU: on the native stream with two threads or
        more, where the scheduler's thread works beside the forward and, once it waits, computes
        in place of one of the forward's threads (parallel.h). A forward sized to one thread (say,
        one of two DP replicas on two cores) has no core to spare for the scheduler's work: there
        the overlap loop only time-slices it with the forward (measured even, docs/benchmarks.md)."""
        return cls.native_stream_serves(worker) and worker.model_runner.native_forward.num_threads >= 2

    def launch(self, mwb: ModelWorkerBatch) -> tuple[torch.Tensor, Any]:
        bs = len(mwb.seq_lens_cpu)
        mwb.future_indices = self.future_map.reserve(bs)
        self.worker.assign_draws(mwb)
        if self.stream is not None:  # behind the steps queued, whose KV and tokens it reads
            step = self.worker.native_step(mwb, self.future_map)
            if step is None:  # prompt logprobs: the whole batch in Python, in its turn on the stream
                item, make = self._stream_call(lambda: self._run(mwb, None)), None
            elif step.logits is None:  # greedy: nothing left for Python
                item, make = step, (lambda: self.worker.step_result(mwb, step))
            else:  # the sampler, on the stream's thread, before the next step reads its tokens
                step.then(lambda: self.worker.step_result(mwb, step, self.future_map))
                item, make = step, None
            self.stream.submit(item)
            return -mwb.future_indices, StreamResult(self.stream, item, make)
        inputs_ready = None
        if self.forward_stream is not None:  # behind the scheduler's req_to_token writes for this batch
            inputs_ready = torch.cuda.Event()
            inputs_ready.record()
        if self._executor is not None:
            return -mwb.future_indices, PendingResult(self._executor.submit(self._run, mwb, inputs_ready))
        done: Future = Future()
        try:
            done.set_result(self._run(mwb, inputs_ready))
        except Exception as e:  # raised where the result is read, as from the worker thread
            done.set_exception(e)
        return -mwb.future_indices, PendingResult(done)

    def hand_over_openmp(self) -> None:
        """In a scheduler process whose forward runs on the CPU stream: the scheduler thread gives
        its OpenMP team up to the stream's (ForwardStream.hand_over_openmp)."""
        if self.stream is not None:
            self.stream.hand_over_openmp()

    def _run(self, mwb: ModelWorkerBatch, inputs_ready: Optional[Any]) -> GenerationBatchResult:
        if self.forward_stream is None:
            return self.worker.forward_batch_generation(mwb, async_copy=False, future_map=self.future_map)
        with torch.cuda.stream(self.forward_stream):
            self.forward_stream.wait_event(inputs_ready)
            return self.worker.forward_batch_generation(mwb, async_copy=True, future_map=self.future_map)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
        if self.stream is not None:
            self.stream.close()  # runs what was queued first
            self.stream = None
