"""The scheduler process: receives tokenized requests, forms batches, runs them, streams tokens.

One loop iteration (plain loop; the overlap loop differs only in when results are processed):

    recv_requests -> process_input_requests -> get_next_batch_to_run -> run_batch -> process_batch_result

The Scheduler composes plain parts, each with its own narrow inputs:

    RequestIntake (intake.py)           validate, admit (through the PD strategy), grammar queue, abort
    RequestTable (request_table.py)     rid -> Req of every request held, until its final output
    PrefillManager (prefill_manager.py) the next prefill batch under PrefillAdder's budgets; preemption
    DecodeManager (decode_manager.py)   the running batch's next step; retraction; new_token_ratio
    OutputProcessor (output_processor)  results into requests, finishing, streaming to the detokenizer
    ReqReleaser (release.py)            memory back to the cache and pool (one result later in overlap)
    forward executor (executors/)       how a batch is launched: plain, overlap (CUDA / thread / native)
    PD strategy (disaggregation/)       Colocated does nothing; prefill / decode add their queues

Batch choice is prefill first: a new prefill batch runs if one can be formed; otherwise the running
decode batch advances one token, retracting requests when the KV pool cannot hold the step.
"""
from __future__ import annotations

import gc
import logging
import os
from collections import deque
from typing import Any, Callable, Optional

from baton.engine.disaggregation.colocated import Colocated, DisaggregationMode, SchedulerView
from baton.engine.disaggregation.config import PDConfig
from baton.engine.disaggregation.strategy import create_strategy
from baton.engine.distributed.parallel_state import all_reduce_backend
from baton.engine.io_struct import FlushCacheOut
from baton.engine.scheduler.grammar_queue import GrammarQueue
from baton.engine.utils.gc_freeze import freeze_gc
from baton.engine.worker.executors import ForwardExecutor, create_executor, native_stream_threads
from baton.engine.io_struct import (AbortReq, FlushCacheReq, FreezeGCReq, GetServerInfoOut, GetServerInfoReq,
                                    TokenizedGenerateReqInput)
from baton.engine.core.batch_result import LaunchedBatch
from baton.engine.core.queues import SchedulerQueues
from baton.engine.core.req import Req
from baton.engine.core.schedule_batch import ScheduleBatch
from baton.engine.core.stats import SchedulerStats
from baton.engine.scheduler.config import SchedulerConfig
from baton.engine.scheduler.decode_manager import DecodeManager, NewTokenRatio
from baton.engine.scheduler.intake import ModelLimits, RequestIntake
from baton.engine.scheduler.operations import SchedulerOps
from baton.engine.scheduler.lora import LoraScheduler
from baton.engine.scheduler.output_processor import OutputProcessor
from baton.engine.scheduler.prefill_manager import PrefillBatch, PrefillManager
from baton.engine.scheduler.release import ReqReleaser
from baton.engine.scheduler.request_table import RequestTable
from baton.engine.scheduler.sessions import SessionController, SessionView
from baton.engine.scheduler.schedule_policy import SchedulePolicy
from baton.engine.scheduler.weights import WeightsControl
from baton.engine.server_args import ServerArgs
from baton.engine.speculative import NoSpeculation, SpecView, create_speculator
from baton.engine.speculative.config import SpecConfig
from baton.engine.worker.tp_worker import TpModelWorker

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, server_args: ServerArgs, tokenizer: Any = None, transfer_config: Any = None,
                 dp_rank: int = 0, tp: Any = None) -> None:
        """`transfer_config`: a disaggregation.base.TransferConfig overriding the one derived from the
        server args (tests: timeouts, fault injection). `dp_rank`: this replica's data-parallel rank.
        `tp`: the distributed.parallel_state.TpGroup whose driver this scheduler is (joined already)."""
        from baton.engine.mem_cache import create_prefix_cache

        self.server_args = args = server_args
        self.tokenizer = tokenizer
        self.dp_rank = dp_rank
        self.worker = TpModelWorker(args, tp)
        runner = self.worker.model_runner
        self.startup_s: dict[str, float] = dict(runner.startup_s)  # the process adds spawn, tokenizer, total
        self.req_to_token_pool, self.allocator = runner.req_to_token_pool, runner.allocator
        self.max_total_tokens = runner.pool_config.max_total_tokens
        self.max_running_requests = runner.pool_config.max_running_requests
        self.context_len = runner.pool_config.context_len
        self.vocab_size = runner.vocab_size
        self.page_size = args.page_size
        self.tree_cache = create_prefix_cache(args.disable_radix_cache, self.req_to_token_pool, self.allocator,
                                              args.page_size, runner.state_pool, args.mamba_track_interval)
        self.policy = SchedulePolicy(args.schedule_policy if not args.disable_radix_cache else "fcfs",
                                     self.tree_cache, args.enable_priority_scheduling, args.random_seed)
        self.loop_choice = args.event_loop(native_stream_threads(self.worker))  # plain or overlap, and why
        logger.info("event loop: %s (%s)", self.loop_choice.loop.value, self.loop_choice.reason)
        self.executor = create_executor(self.loop_choice.overlap, self.worker, self.max_running_requests)
        self.eos_token_ids = self._eos_ids(runner.model_config.text.eos_token_ids, tokenizer)
        self.ratio = NewTokenRatio(args.schedule_conservativeness)
        self.queues = SchedulerQueues(self._new_batch([]))  # waiting, running_batch, chunked_req
        self.grammar_queue = GrammarQueue()  # structured requests whose grammar is compiling
        self.last_batch: Optional[ScheduleBatch] = None
        self.result_queue: deque[LaunchedBatch] = deque()
        self.outbox: list[Any] = []  # messages for the detokenizer, flushed once per iteration
        self.stats = SchedulerStats()
        self.forward_ct = 0
        self.decode_ct = 0  # decode batches run, for the periodic decode log line
        # the parts: who holds which request, how results come back, how requests come in, PD
        self.table = RequestTable()
        self.releaser = ReqReleaser(self.tree_cache, deferred=self.overlap is not None)
        config = args.view(SchedulerConfig)  # what the parts below read of the server args
        self.output = OutputProcessor(config, tokenizer, self.tree_cache, self.releaser, self.table, self.stats,
                                      self.outbox)
        limits = ModelLimits(self.vocab_size, self.context_len, self.max_total_tokens, self.page_size,
                             self.eos_token_ids)
        self.intake = RequestIntake(config, limits, self.queues, self.grammar_queue, self.table, self.output, tokenizer)
        self.pd = self._init_disaggregation(transfer_config)  # PD strategy; Colocated does nothing extra
        self.output.pd = self.intake.pd = self.pd
        held = self.pd.num_reqs_holding_rows
        self.prefill = PrefillManager(config, self.max_running_requests, self.queues, self.policy, self.tree_cache,
                                      self.allocator, self.req_to_token_pool, self.ratio, self.releaser, self.output,
                                      self.stats, self._new_batch, self.drain_results, held)
        self.spec = self._init_speculation()  # NoSpeculation unless --speculative-algorithm
        self.spec.allow_lagging(self.overlap is not None)
        self.output.spec = self.spec
        self.decode = DecodeManager(self.queues, self.ratio, self.releaser, self.output, self.stats,
                                    self.drain_results, held, self.spec, lambda: self.result_queue)
        # control messages from the tokenizer manager: type -> handler, whose reply (if not None) goes back
        self.control: dict[type, Callable[[Any], Any]] = {
            FlushCacheReq: lambda _: self.flush_cache(),
            GetServerInfoReq: lambda _: GetServerInfoOut(self.get_server_info(), self.dp_rank),
            FreezeGCReq: self._freeze_gc,
        }
        self.sessions = self._init_sessions()  # sessions.py: /open_session, /close_session, session_params
        self.control.update(self.sessions.handlers)
        self.releaser.keep = self.sessions.keep  # a finished session request's KV stays for its next turn
        self.ops = SchedulerOps(self)  # pause, memory release, profiler, slow-down, internal state (operations.py)
        self.control.update(self.ops.handlers())
        self.control.update(WeightsControl(self).handlers())  # weight updates and reads (weights.py)
        # LoRA adapters: the registry, each request's adapter, a batch's adapters and the pool's slots
        self.lora = self.intake.lora = self.prefill.lora = LoraScheduler(config, runner.lora, self.table, dp_rank)
        self.control.update(self.lora.handlers())

    # ------------------------------------------------------------------ messages from the tokenizer
    def process_input_requests(self, msgs: list[Any]) -> None:
        for msg in msgs:
            if isinstance(msg, TokenizedGenerateReqInput):
                self.intake.handle_generate_request(msg)
            elif isinstance(msg, AbortReq):
                self.intake.abort_request(msg)
            elif (handler := self.control.get(type(msg))) is not None:
                if (reply := handler(msg)) is not None:
                    self.outbox.append(reply)
            else:
                logger.error("unknown message type %s dropped", type(msg).__name__)

    @staticmethod
    def _freeze_gc(_: FreezeGCReq) -> None:  # no reply
        freeze_gc("scheduler")

    @property
    def grammar_backend(self) -> Any:
        return self.intake.grammar_backend

    # the queues, shared with the PD strategy (queues.py)
    @property
    def waiting_queue(self) -> list[Req]:
        return self.queues.waiting

    @waiting_queue.setter
    def waiting_queue(self, reqs: list[Req]) -> None:
        self.queues.waiting = reqs

    @property
    def running_batch(self) -> ScheduleBatch:
        return self.queues.running_batch

    @running_batch.setter
    def running_batch(self, batch: ScheduleBatch) -> None:
        self.queues.running_batch = batch

    @property
    def chunked_req(self) -> Optional[Req]:
        return self.queues.chunked_req

    @chunked_req.setter
    def chunked_req(self, req: Optional[Req]) -> None:
        self.queues.chunked_req = req

    # ------------------------------------------------------------------ setup helpers
    @staticmethod
    def _eos_ids(model_eos: tuple[int, ...], tokenizer: Any) -> frozenset[int]:
        ids = set(model_eos)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        return frozenset(ids)

    def _init_disaggregation(self, transfer_config: Any) -> Colocated:
        """The PD strategy of --disaggregation-mode (disaggregation/strategy.py), over a view of this
        scheduler's queues and pools."""
        mode = DisaggregationMode(self.server_args.disaggregation_mode)
        runner = self.worker.model_runner
        view = SchedulerView(
            config=self.server_args.view(PDConfig), tokenizer=self.tokenizer, dp_rank=self.dp_rank, page_size=self.page_size,
            max_running_requests=self.max_running_requests, req_to_token_pool=self.req_to_token_pool,
            allocator=self.allocator, tree_cache=self.tree_cache, kv_pool=runner.token_to_kv_pool,
            tp=self.worker.tp, queues=self.queues, new_token_ratio=lambda: self.ratio.value,
            new_batch=self._new_batch, finish_request=self.output.finish_request,
            stream_output=self.output.stream_output, record_token=self.output.record_token,
            extend_result_prologue=self.output.extend_result_prologue, count_generated=self._count_generated,
            state_pool=runner.state_pool, model_config=runner.model_config, drafter=self.worker.drafter)
        return create_strategy(mode, view, transfer_config)

    def _init_speculation(self) -> NoSpeculation:
        """The speculation strategy of --speculative-algorithm (speculative/), over a view of this
        scheduler's pools. A hybrid model's verify steps keep each token's recurrent state in scratch
        slots, so its state can roll back to the last accepted token (state_pool.scratch_slot)."""
        pool = self.worker.model_runner.state_pool
        view = SpecView(config=self.server_args.view(SpecConfig), tokenizer=self.tokenizer,
                        req_to_token_pool=self.req_to_token_pool, allocator=self.allocator, tree_cache=self.tree_cache,
                        append_token=self.output.append_token, finish_request=self.output.finish_request,
                        state_scratch=None if pool is None else pool.scratch_slot,
                        state_scratch_sets=1 if pool is None else pool.scratch_sets)
        return create_speculator(view)

    def _init_sessions(self) -> SessionController:
        """Sessions over a view of this scheduler; their KV is held as radix pins, or as request rows
        without the radix cache (session_holds.py)."""
        from baton.engine.scheduler.session_holds import RadixPins, RowHolds

        args, pool = self.server_args, self.worker.model_runner.state_pool
        holds = (RowHolds(self.tree_cache, self.req_to_token_pool, self.allocator, self.page_size, pool is not None)
                 if args.disable_radix_cache else RadixPins(self.tree_cache, self.page_size))
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return SessionController(SessionView(
            dp_rank=self.dp_rank, bos_token_id=bos, pd_mode=args.disaggregation_mode, holds=holds, queues=self.queues,
            table=self.table, releaser=self.releaser, admit=self.intake.handle_generate_request,
            abort=self.intake.abort_request, stream_output=self.output.stream_output,
            drain_results=self.drain_results, in_flight=lambda: self.result_queue))

    def _count_generated(self, n: int) -> None:
        self.stats.generated_tokens += n

    def close(self) -> None:
        """Stop the KV transfer threads (PD), the grammar compiler's thread, the overlap worker
        thread, and the other TP ranks' step loops."""
        self.pd.close()
        if self.intake.grammar_backend is not None:
            self.intake.grammar_backend.close()
        if self.overlap is not None:
            self.overlap.shutdown()
        self.worker.close()

    def _new_batch(self, reqs: list[Req]) -> ScheduleBatch:
        return ScheduleBatch(reqs, self.req_to_token_pool, self.allocator, self.tree_cache, self.server_args.device)

    # ------------------------------------------------------------------ batch selection
    def get_next_batch_to_run(self) -> Optional[ScheduleBatch]:
        """The last prefill's requests join the running batch; then a new prefill batch if one can
        be formed, else the running batch's next decode step."""
        if self.last_batch is not None and self.last_batch.forward_mode.is_extend():
            self._merge_last_prefill(self.last_batch)
        if self.server_args.enable_mixed_chunk and (self.waiting_queue or self.chunked_req is not None) \
                and any(b.mwb.spec_info is not None for b in self.result_queue):
            self.drain_results()  # a prefill may carry the running requests' next step: their lengths known
        # aborted while waiting for a decode step: free them before admitting new prefills
        self.output.reap_finished(self.running_batch.reqs)
        self.running_batch.filter_batch()
        prefill = self.prefill.schedule() or self.sessions.relieve_prefill(self.prefill.schedule)
        if prefill is not None:
            self._log_prefill(prefill)
            return prefill.batch
        self.sessions.relieve_decode(self.running_batch)  # sessions' held KV goes before a running request
        return self.decode.prepare()

    def _merge_last_prefill(self, last: ScheduleBatch) -> None:
        keeps = self.pd.keeps_prefilled_requests  # False on a PD prefill: they wait for their transfer
        if keeps:
            # Aborted after this prefill's result was processed (the plain loop processes it in the
            # same step): the filters below would drop it with its memory still held and its client
            # never told. (PD prefill: the transfer queue owns it and its abort.)
            self.output.reap_finished([r for r in last.reqs if r is not self.chunked_req])
        if self.chunked_req is not None:
            last.filter_batch(exclude=self.chunked_req)
            if self.chunked_req.finished():  # aborted between chunks
                self.output.reap_finished([self.chunked_req])
                self.chunked_req = None
            elif keeps:
                # PD prefill skips this: deduplication would free pages whose KV may still be on the
                # wire; the whole prompt goes to the cache once its transfer has ended.
                self.tree_cache.cache_unfinished_req(self.chunked_req)
        last.filter_batch()
        # an embedding engine's requests end with their prefill (the overlap loop may not have
        # processed it yet): none decodes
        if keeps and not self.server_args.is_embedding:
            self.running_batch.merge_batch(last)

    def _log_prefill(self, p: PrefillBatch) -> None:
        if logger.isEnabledFor(logging.INFO):  # after the batch took its KV slots: usage includes them
            logger.info("Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
                        "#running-req: %d, #queue-req: %d%s%s", p.new_seqs, p.new_tokens, p.cached_tokens,
                        self.token_usage(), p.running, len(self.waiting_queue),
                        f", #mixed-decode: {p.running}" if p.mixed else "", self.pd.log_fields())

    # ------------------------------------------------------------------ execution
    def run_step(self) -> bool:
        """One loop iteration after intake. Returns whether a batch was launched.

        plain:    schedule N -> run N -> process N
        overlap:  schedule N+1 -> launch N+1 -> process N (N's CPU work overlaps N+1's forward)
        """
        if self.ops.holds_steps():  # paused, or memory released: requests wait (operations.py)
            return False
        self.intake.admit_compiled()
        self.pd.step()
        batch = self.get_next_batch_to_run()
        if batch is not None and batch.forward_mode.is_decode():
            self.decode_ct += 1
            if self.decode_ct % self.server_args.decode_log_interval == 0 and logger.isEnabledFor(logging.INFO):
                self._log_decode(batch)  # before the step's results can finish and free requests
        if self.overlap is None:
            if batch is not None:
                self.output.process_batch_result(self.run_batch(batch))
        else:
            if batch is not None:
                self.result_queue.append(self.run_batch(batch))
                if batch.model_worker_batch.spec_info is not None and not self.spec.lags:
                    # a verify step's accepted lengths set its requests' KV lengths: known before the
                    # next batch is built (without lagged verify steps, one at a time: verify_strategy.py)
                    self.drain_results()
            if self.result_queue and (batch is None or len(self.result_queue) > 1):
                self.output.process_batch_result(self.result_queue.popleft())
            if not self.result_queue:
                self.releaser.flush()
        self.last_batch = batch
        self.stats.tick(idle=batch is None and self.is_idle())
        if batch is not None:
            self.ops.on_forward(self.forward_ct)  # the profiler's steps, /slow_down's sleep
        return batch is not None

    def _log_decode(self, batch: ScheduleBatch) -> None:
        """SGLang's periodic decode line: batch size, KV tokens in use, output tok/s since the last line."""
        used = self.used_tokens()
        logger.info("Decode batch. #running-req: %d, #token: %d, token usage: %.2f, gen throughput (token/s): %.2f, "
                    "#queue-req: %d%s", len(batch.reqs), used, used / self.max_total_tokens,
                    self.stats.interval_throughput(), len(self.waiting_queue), self.pd.log_fields())

    def fill_grammar_masks(self, batch: ScheduleBatch) -> None:
        """Before a launch: each grammar's bitmask from its matcher. The overlap loop first processes
        the step in flight, whose tokens the matchers have not seen yet (a plain step, only for
        batches with a grammar)."""
        if not any(r.grammar is not None for r in batch.reqs):
            return
        if self.overlap is not None:
            self.drain_results()
        for req in batch.reqs:
            if req.grammar is not None and req.grammar.active and not req.finished():
                req.grammar.fill()

    def run_batch(self, batch: ScheduleBatch) -> LaunchedBatch:
        if self.grammar_backend is not None:
            self.fill_grammar_masks(batch)
        mwb = batch.model_worker_batch
        self.lora.prepare(mwb, batch.reqs)  # each row's adapter slot, the pool's loads
        self.forward_ct += 1
        if mwb.spec_info is not None and not self.spec.lags:
            # A verify step runs now, in this thread, in either loop: nothing is in flight (the decode
            # manager drained it to draft), and an overlap executor's forward thread would only wait
            # beside it (on a 2-core CPU the waiting thread took a core from the verify's kernels).
            # Lagged verify steps go through the executor: the next one is built while this one runs.
            result = self.worker.forward_batch_generation(mwb).resolve()
            batch.output_ids = result.next_token_ids_tensor
            return LaunchedBatch(list(batch.reqs), mwb, result)
        # the overlap loop's placeholders, or the plain loop's sampled ids
        batch.output_ids, result = self.executor.launch(mwb)
        return LaunchedBatch(list(batch.reqs), mwb, result)

    def drain_results(self) -> None:
        while self.result_queue:
            self.output.process_batch_result(self.result_queue.popleft())

    # ------------------------------------------------------------------ control requests
    def is_idle(self) -> bool:
        """Nothing to schedule: the loop may block waiting for requests. A prefill batch that just
        ran still has requests to merge into running_batch (to decode), so it counts as work."""
        last = self.last_batch
        pending_merge = last is not None and last.forward_mode.is_extend() and any(not r.finished() for r in last.reqs)
        return (not self.waiting_queue and not self.grammar_queue and self.running_batch.is_empty()
                and self.chunked_req is None
                and not self.result_queue and not pending_merge and self.pd.is_idle())

    def flush_cache(self) -> FlushCacheOut:
        if not self.is_idle():
            return FlushCacheOut(False, "requests are running; retry when idle", self.dp_rank)
        self.releaser.flush()
        self.sessions.release_all()
        self.tree_cache.reset()
        return FlushCacheOut(True, "", self.dp_rank)

    @property
    def overlap(self) -> Optional[ForwardExecutor]:
        """The overlap loop's executor; None in the plain loop."""
        return self.executor if self.executor.overlap else None

    def forward_threads(self) -> int:
        """The threads a forward runs on: the CPU forward stream's where the overlap loop has one
        (the scheduler thread itself then runs single-threaded), else torch's."""
        return self.executor.num_threads

    def get_server_info(self) -> dict[str, Any]:
        return {**self.pd.server_info(),
            "dp_rank": self.dp_rank,
            "max_total_num_tokens": self.max_total_tokens,
            "max_running_requests": self.max_running_requests,
            "context_length": self.context_len,
            "page_size": self.page_size,
            "dtype": str(self.worker.model_runner.dtype).removeprefix("torch."),
            "kv_cache_dtype": str(self.worker.model_runner.kv_dtype).removeprefix("torch."),
            "num_running_reqs": len(self.running_batch.reqs),
            "num_waiting_reqs": len(self.waiting_queue),
            "num_waiting_tokens": sum(len(r.origin_input_ids) for r in self.waiting_queue),  # the planner's signal
            "num_grammar_queue_reqs": len(self.grammar_queue),
            "token_usage": self.token_usage(),
            "new_token_ratio": self.ratio.value,
            "cache_hit_rate": self.stats.cache_hit_rate(),
            "radix_cache": not self.server_args.disable_radix_cache,
            "recurrent_state_bytes": (0 if self.worker.model_runner.state_pool is None
                                      else self.worker.model_runner.state_pool.size_bytes()),
            **self._state_slots_info(),
            "retractions": self.stats.retractions,
            "scheduler_pid": os.getpid(),
            "cpu_affinity": sorted(os.sched_getaffinity(0)),
            "torch_threads": self.forward_threads(),
            "event_loop": self.loop_choice.loop.value,  # the default depends on the model (CPU)
            "event_loop_reason": self.loop_choice.reason,
            **self.spec.server_info(),  # speculative_algorithm, accept rate and lengths
            **self._mm_info(),
            **self.sessions.server_info(),  # open sessions and the KV they hold
            **self.lora.server_info(),
            "tp_allreduce": all_reduce_backend(self.worker.tp),  # shm | gloo | nccl | none
            "preemptions": self.stats.preemptions,
            "mixed_decode_tokens": self.stats.mixed_decode_tokens,
            "gen_throughput": self.stats.gen_throughput,
            "queue_time_samples": list(self.stats.queue_times),
            "integrity_ok": self.check_memory_integrity() if self.is_idle() else None,
            "gc_frozen_objects": gc.get_freeze_count(),  # > 0 once start-up is over (utils/gc_freeze.py)
            "startup_s": self.startup_s,
        }

    def _mm_info(self) -> dict[str, int]:
        """A vision-language model: images encoded, the embeddings' cache (hits, misses, bytes)."""
        embedder = self.worker.model_runner.mm_embedder
        return {} if embedder is None else embedder.stats()

    def _state_slots_info(self) -> dict[str, int]:
        """A hybrid model's recurrent-state slots: a request row holds its slot (slot = row), so the
        rows in use are the slots in use; the total is max running requests + the spare row."""
        pool = self.worker.model_runner.state_pool
        if pool is None:
            return {"recurrent_state_slots_used": 0, "recurrent_state_slots_total": 0}
        used = self.req_to_token_pool.size - self.req_to_token_pool.available_size()
        cache = self.tree_cache
        return {"recurrent_state_slots_used": used, "recurrent_state_slots_total": pool.rows,
                # the radix cache's checkpoints (hybrid_radix_cache.py): on nodes, and in all
                "recurrent_state_checkpoints_cached": getattr(cache, "checkpoints_cached", lambda: 0)(),
                "recurrent_state_checkpoints_total": pool.checkpoints}

    def used_tokens(self) -> int:
        """KV slots neither free nor evictable."""
        return self.max_total_tokens - self.allocator.available_size() - self.tree_cache.evictable_size()

    def token_usage(self) -> float:
        return self.used_tokens() / self.max_total_tokens

    def check_memory_integrity(self) -> bool:
        """At idle every KV slot is free, cached or held by a session, every request row is free or
        held by a session, nothing in the cache is locked but what sessions pin, and every request
        was answered (none is left in the request table)."""
        free, cached = self.allocator.available_size(), self.tree_cache.total_size()
        held, held_rows, pinned = self.sessions.held()
        rows_free = self.req_to_token_pool.available_size() + held_rows == self.req_to_token_pool.size
        ok = free + cached + held == self.max_total_tokens and rows_free and self.tree_cache.protected_size() == pinned
        if not self.tree_cache.check_state_slots():
            logger.error("integrity check failed: recurrent-state checkpoint slots leaked or held twice")
            ok = False
        if len(self.table):
            logger.error("integrity check failed: %d requests never answered, e.g. %s", len(self.table),
                         [r.rid for r in list(self.table)[:5]])
            ok = False
        if not self.pd.check_integrity():
            logger.error("PD integrity check failed: metadata slots or transfer rooms leaked")
            ok = False
        if not ok:
            logger.error("memory integrity check failed: free=%d cached=%d total=%d rows_free=%s protected=%d",
                         free, cached, self.max_total_tokens, rows_free, self.tree_cache.protected_size())
        return ok
