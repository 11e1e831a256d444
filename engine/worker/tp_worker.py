"""TpModelWorker: one forward + sample per batch, and the result it hands back.

The scheduler reaches it through a forward executor (executors/). The plain loop's executor calls
it in the scheduler's thread; the overlap loop's executors pass a future map (future_map.py), whose
placeholders the forward resolves first and where it stores the batch's samples, and on CUDA ask
for the sampled ids' copy to the host without waiting for it (GenerationBatchResult.resolve).
Where the native CPU forward serves the model, the executors run most batches as native steps
(executors/native_step.py), calling the worker's sampler where a step leaves logits.

Tensor parallelism: this worker is the driver of its TP group. Before each forward it sends the
step to the other ranks (tp_step.py), in the thread that runs the forward, so the step and the
forward's all-reduces reach every rank in one order. It alone samples; the LM head is split by
vocabulary rows, so its logits calls are collectives the followers make too, on the rows the step
names.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from baton.engine.core.batch_result import GenerationBatchResult
from baton.engine.core.schedule_batch import ModelWorkerBatch
from baton.engine.mem_cache.state_pool import StateOps
from baton.engine.model_executor.model_runner import ModelRunner
from baton.engine.server_args import ServerArgs
from baton.engine.utils.device_lists import to_device
from baton.engine.worker.future_map import FutureMap
from baton.engine.worker.tp_step import StepSender

if TYPE_CHECKING:
    from baton.engine.distributed.parallel_state import TpGroup


class TpModelWorker:
    def __init__(self, server_args: ServerArgs, tp: Optional["TpGroup"] = None) -> None:
        """`tp`: the TP group this worker drives (joined by the caller; one rank by default)."""
        from baton.engine.layers.sampler import Sampler

        self.model_runner = ModelRunner(server_args, tp)
        self.tp = self.model_runner.tp
        self.sampler = Sampler(server_args.device)
        self.device = server_args.device
        self.step_sender = (StepSender(self.tp, self.model_runner.req_to_token_pool.req_to_token,
                                       head=self.model_runner.draft_head is not None,
                                       topk=server_args.speculative_eagle_topk or 1)
                            if self.tp.size > 1 else None)
        self.drafter = None  # NEXTN / EAGLE: the draft head's passes beside the model's (speculative/head_worker.py)
        if self.model_runner.draft_head is not None:
            from baton.engine.speculative.head_worker import HeadDrafter

            self.drafter = HeadDrafter(self.model_runner, server_args.speculative_num_steps,
                                       server_args.speculative_eagle_topk)

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
        with torch.inference_mode():
            return self._forward_and_sample(mwb, async_copy, future_map)

    @staticmethod
    def assign_draws(mwb: ModelWorkerBatch) -> None:
        """Number this batch's draw for each request that samples in it (once, at launch, in launch
        order): the CPU sampler's random numbers come from (seed, draw number)."""
        if mwb.draws is None:
            mwb.draws = [0 if s is None else s.next_draw() for s in mwb.sampling_states]

    def _forward_and_sample(self, mwb: ModelWorkerBatch, async_copy: bool,
                            future_map: Optional[FutureMap]) -> GenerationBatchResult:
        from baton.engine.triton_ops.future_resolve import resolve_future_token_ids

        runner = self.model_runner
        if mwb.spec_info is not None and mwb.spec_info.lagged is not None:
            self._resolve_lagged(mwb, future_map)
        if self.step_sender is not None:
            self.step_sender.send(mwb)
        fb, future_slots = runner.forward_batch_from(mwb, None if future_map is None else mwb.future_indices)
        if future_map is not None:
            resolve_future_token_ids(fb.input_ids, future_map.token_ids)
        if mwb.spec_info is not None and self.drafter is not None:
            self.drafter.draft(fb, mwb.spec_info)
        hidden = runner.forward(fb)  # [num_tokens, hidden]
        if runner.pooler is not None:
            return self._pooled(fb, hidden, future_map, future_slots)
        if mwb.spec_info is not None:
            return self._verify(mwb, fb, hidden, future_map, future_slots, async_copy)
        rows = runner.last_token_rows(fb)
        last_hidden = hidden if rows is None else hidden[rows]
        logits = runner.compute_logits(last_hidden)  # [bs, vocab] float32
        result, next_ids = self.sample(mwb, logits)
        if mwb.input_logprob_reqs:
            result.input_logprobs = self._input_logprobs(mwb, fb, hidden)
        result.next_token_ids_device = next_ids
        if future_map is not None:
            future_map.token_ids[future_slots] = next_ids
        if self.step_sender is not None and (future_map is not None or self.drafter is not None):
            self.step_sender.send_sampled(next_ids)  # the followers' future maps, the head's pass
        if async_copy:
            result.next_token_ids_tensor = next_ids.to("cpu", non_blocking=True)  # into pinned memory
            result.copy_done = torch.cuda.Event()
            result.copy_done.record()
        else:
            result.next_token_ids_tensor = next_ids.to("cpu")
            result.next_token_ids = result.next_token_ids_tensor.tolist()
        if self.drafter is not None:  # after the ids' copy is queued: the scheduler waits for that, not this
            self.drafter.after_pass(fb, hidden, next_ids, mwb.next_prompt_ids)
        return result

    def _pooled(self, fb, hidden: torch.Tensor, future_map: Optional[FutureMap],
                future_slots: Optional[torch.Tensor]) -> GenerationBatchResult:
        """An embedding engine's extend: each request's pooled vector, no LM head, no sampling. Its
        "next token" is 0, for the overlap loop's future map (and the TP followers' copies of it)."""
        vectors = self.model_runner.pool(fb, hidden)  # [bs, dim] float32
        next_ids = torch.zeros(vectors.shape[0], dtype=torch.int64, device=hidden.device)
        if future_map is not None:
            future_map.token_ids[future_slots] = next_ids
            if self.step_sender is not None:
                self.step_sender.send_sampled(next_ids)
        cpu_ids = next_ids.to("cpu")
        return GenerationBatchResult(next_token_ids=cpu_ids.tolist(), next_token_ids_tensor=cpu_ids,
                                     next_token_ids_device=next_ids, embeddings=vectors.to("cpu").tolist())

    def _verify(self, mwb: ModelWorkerBatch, fb, hidden: torch.Tensor, future_map: Optional[FutureMap],
                future_slots: Optional[torch.Tensor], async_copy: bool = False) -> GenerationBatchResult:
        """A verify step's result: the logits of every token row, checked against the drafts
        (speculative/accept_host.py); each request's last emitted token and emitted count go to the future
        map (overlap). A step of plain requests (greedy or sampled) is checked on the device
        (accept_device.py) and reaches the host with the result (`async_copy`: without waiting for it,
        on CUDA); with TP the followers get the host's acceptance."""
        from baton.engine.core.spec_info import state_node
        from baton.engine.speculative import accept_device
        from baton.engine.speculative.accept_host import move_accepted_kv, verify_drafts

        logits = self.model_runner.compute_logits(hidden)  # [num_tokens, vocab] float32
        spec = mwb.spec_info
        if self.step_sender is None and accept_device.accepts_on_device(mwb.sampling_states):
            acc = accept_device.accept_on_device(logits, fb.input_ids, spec, fb.tree_parents, mwb.sampling_states,
                                                 mwb.draws)
            if self.drafter is not None:  # before the move, as after_verify
                self.drafter.after_verify_on_device(fb, hidden, acc)
            if spec.parents is not None:
                accept_device.move_accepted_kv_on_device(self.model_runner, fb.out_cache_loc, acc)
            if future_map is not None:
                future_map.token_ids[future_slots] = acc.last.to(future_map.token_ids.device)
                future_map.accepted[future_slots] = (acc.count + 1).to(future_map.accepted.device)
                if spec.state_slots is not None:  # the path's last node (past the count, the path repeats it)
                    future_map.state_node[future_slots] = acc.path[:, -1].to(future_map.state_node.device)
            pending = accept_device.PendingVerify(acc, spec, async_copy, logits,
                                                  mwb.top_logprobs_nums if mwb.return_logprob else None)
            return GenerationBatchResult(next_token_ids=[], next_token_ids_device=acc.last, pending_verify=pending)
        out = verify_drafts(logits, mwb.spec_info, mwb.sampling_states, mwb.draws, mwb.return_logprob,
                            mwb.top_logprobs_nums)
        last = torch.tensor(out.last_tokens, dtype=torch.int64)
        if self.step_sender is not None and future_map is not None:  # the followers' future maps (a lagged
            self.step_sender.send_sampled(last.to(future_map.token_ids.device))  # step behind reads them)
        if self.step_sender is not None and (self.drafter is not None or out.accepted_nodes is not None):
            self.step_sender.send_accepted(out)  # the followers' head pass and KV move
        if self.drafter is not None:  # the head's KV at every node before the move, which takes its layers too
            self.drafter.after_verify(fb, hidden, mwb.spec_info, out)
        if out.accepted_nodes is not None:
            move_accepted_kv(self.model_runner, fb, mwb.spec_info, out)
        if future_map is not None:
            future_map.token_ids[future_slots] = last.to(future_map.token_ids.device)
            emitted = torch.tensor([len(t) for t in out.tokens], dtype=torch.int64)
            future_map.accepted[future_slots] = emitted.to(future_map.accepted.device)
            if spec.state_slots is not None:
                nodes = [state_node(out.accepted_nodes, i, len(t)) for i, t in enumerate(out.tokens)]
                future_map.state_node[future_slots] = torch.tensor(nodes).to(future_map.state_node.device)
        return GenerationBatchResult(next_token_ids=out.last_tokens, next_token_ids_tensor=last,
                                     next_token_ids_device=last, verify=out)

    def _resolve_lagged(self, mwb: ModelWorkerBatch, future_map: Optional[FutureMap]) -> None:
        """A verify step built while the verify step before it ran (speculative/verify_strategy.py): its rows
        start where the scheduler knew them to, and each lagged row moves on by what that step emitted
        (future_map.accepted, written by the step before this one ran): starts, lengths and positions,
        and the KV columns its tokens go to, read from the request's row of req_to_token, where the
        scheduler reserved them. A hybrid model's rows first get the recurrent state after the tokens
        that step emitted (its scratch slot for that count, spec.lagged_states), before the pass's own
        state copies and layers: on one rank by the node on the device (future_map.state_node); with
        TP as the first of the step's state copies, which every rank makes (the driver sends the step
        resolved). One read of the counts (on CUDA, behind the step before)."""
        assert future_map is not None, "a lagged verify step runs in the overlap loop"
        spec = mwb.spec_info
        at = torch.tensor(spec.lagged, dtype=torch.int64).to(future_map.accepted.device)
        lag = future_map.accepted[at]
        if spec.lagged_states is None:
            shift = lag.tolist()
        elif self.step_sender is None:
            self._roll_back_lagged_states(mwb, spec.lagged_states, future_map.state_node[at])
            shift = lag.tolist()
        else:
            shift, ends = torch.stack([lag, future_map.state_node[at]]).tolist()  # one read
            rows = mwb.req_pool_indices.tolist()
            back = [(slots[min(node, len(slots) - 1)], row) for slots, node, row in zip(spec.lagged_states, ends, rows)]
            ops = mwb.state_ops or StateOps()
            mwb.state_ops = StateOps(back + ops.copies, ops.tracks)
        starts = [p + a for p, a in zip(mwb.extend_prefix_lens_cpu, shift)]
        lens = torch.tensor(mwb.extend_seq_lens_cpu, dtype=torch.int64)
        total = int(lens.sum())
        owner = torch.repeat_interleave(torch.arange(len(starts)), lens, output_size=total)
        within = torch.arange(total) - (torch.cumsum(lens, 0) - lens)[owner]
        table = self.model_runner.req_to_token_pool.req_to_token
        cols = torch.tensor(starts, dtype=torch.int64)[owner] + within
        slots = table[mwb.req_pool_indices.to(table.device)[owner.to(table.device)], cols.to(table.device)]
        mwb.out_cache_loc = slots.to(mwb.out_cache_loc.device, mwb.out_cache_loc.dtype)
        mwb.positions = mwb.positions + torch.tensor(shift, dtype=mwb.positions.dtype)[owner].to(mwb.positions.device)
        mwb.seq_lens_cpu = [p + e for p, e in zip(starts, mwb.extend_seq_lens_cpu)]
        mwb.extend_prefix_lens_cpu = starts  # what the scheduler reads of the batch once it has run

    def _roll_back_lagged_states(self, mwb: ModelWorkerBatch, slots: list[list[int]], nodes: torch.Tensor) -> None:
        """Each row's state <- the step before's scratch slot after the node its emitted tokens end at
        (`nodes`, on the device: nothing read). The slots hold the state after each of that step's
        nodes (a chain's: after 1 .. all of its tokens)."""
        pool = self.model_runner.state_pool
        width = max(map(len, slots))
        table = to_device([s + [s[-1]] * (width - len(s)) for s in slots], pool.device)  # [bs, width]
        at = nodes.to(pool.device).clamp(0, width - 1)
        pool.copy_slot_tensors(table.gather(1, at[:, None])[:, 0], mwb.req_pool_indices.to(pool.device))

    def sample(self, mwb: ModelWorkerBatch, logits: torch.Tensor) -> tuple[GenerationBatchResult, torch.Tensor]:
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
