"""Prefill admission: which waiting requests (and which chunk of the one being chunked) run in the
next prefill batch, under PrefillAdder's budgets (schedule_policy.py); priority preemption; the
mixed chunk (--enable-mixed-chunk: the running requests' decode step rides in the prefill batch)."""
from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional

from baton.engine.mem_cache.base import cache_key
from baton.engine.scheduler.schedule_policy import AddReqResult, InBatchPrefixIndex, PrefillAdder

if TYPE_CHECKING:
    from baton.engine.core.queues import SchedulerQueues
    from baton.engine.core.req import Req
    from baton.engine.core.schedule_batch import ScheduleBatch
    from baton.engine.core.stats import SchedulerStats
    from baton.engine.mem_cache.allocator import TokenToKVPoolAllocator
    from baton.engine.mem_cache.base import BasePrefixCache
    from baton.engine.mem_cache.memory_pool import ReqToTokenPool
    from baton.engine.scheduler.decode_manager import NewTokenRatio
    from baton.engine.scheduler.lora import LoraScheduler
    from baton.engine.scheduler.output_processor import OutputProcessor
    from baton.engine.scheduler.release import ReqReleaser
    from baton.engine.scheduler.schedule_policy import SchedulePolicy
    from baton.engine.scheduler.config import SchedulerConfig

logger = logging.getLogger(__name__)


class PrefillBatch(NamedTuple):
    batch: "ScheduleBatch"
    new_seqs: int
    new_tokens: int
    cached_tokens: int
    running: int  # requests decoding beside it
    mixed: bool  # their decode step rides in this batch


class PrefillManager:
    def __init__(self, config: "SchedulerConfig", max_running_requests: int, queues: "SchedulerQueues",
                 policy: "SchedulePolicy", tree_cache: "BasePrefixCache", allocator: "TokenToKVPoolAllocator",
                 req_to_token_pool: "ReqToTokenPool", ratio: "NewTokenRatio", releaser: "ReqReleaser",
                 output: "OutputProcessor", stats: "SchedulerStats", new_batch: Callable[[list["Req"]], "ScheduleBatch"],
                 drain_results: Callable[[], None], rows_held_elsewhere: Callable[[], int]) -> None:
        self.args, self.max_running_requests, self.queues, self.policy = config, max_running_requests, queues, policy
        self.tree_cache, self.allocator, self.req_to_token_pool = tree_cache, allocator, req_to_token_pool
        self.ratio, self.releaser, self.output, self.stats, self.new_batch = ratio, releaser, output, stats, new_batch
        self.drain_results = drain_results  # process every launched batch's result (the overlap loop's)
        self.rows_held_elsewhere = rows_held_elsewhere  # PD requests holding rows outside the running batch
        size = config.chunked_prefill_size
        self.chunked_prefill_size = None if size in (-1, 0) else size
        self.lora: "LoraScheduler" = None  # the adapters a batch may hold, set by the Scheduler

    def schedule(self) -> Optional[PrefillBatch]:
        q, args = self.queues, self.args
        if not q.waiting and q.chunked_req is None:
            return None
        self.policy.calc_priority(q.waiting)
        if args.enable_priority_scheduling and q.waiting:
            self.preempt_for(q.waiting[0])
        running = len(q.running_batch.reqs) + self.rows_held_elsewhere()
        if running >= self.max_running_requests and q.chunked_req is None:
            return None
        mixing = args.enable_mixed_chunk and not q.running_batch.is_empty()
        adder = PrefillAdder(args.page_size, self.tree_cache, self.allocator, q.running_batch.reqs, self.ratio.value,
                             args.max_prefill_tokens, self.chunked_prefill_size,
                             mixed_with_decode_tokens=len(q.running_batch.reqs) if mixing else 0)
        continued = q.chunked_req  # its next chunk is no new departure from the waiting queue
        if q.chunked_req is not None:
            q.chunked_req.init_next_round_input(None)
            q.chunked_req = adder.add_chunked_req(q.chunked_req)
        self._admit_waiting(adder, running)
        if not adder.can_run_list:
            return None
        chosen = set(map(id, adder.can_run_list))
        q.waiting = [r for r in q.waiting if id(r) not in chosen]
        if adder.new_chunked_req is not None:
            assert q.chunked_req is None
            q.chunked_req = adder.new_chunked_req
        if q.chunked_req is not None:
            q.chunked_req.is_chunked += 1
        now = time.time()
        for req in adder.can_run_list:
            if req is continued:  # its prefix now includes its own earlier chunks: none of that was cached
                continue
            if req.cached_tokens == 0 and not req.is_retracted:
                req.cached_tokens = len(req.prefix_indices)
            self.stats.on_dequeue(now - req.queue_start_time)
        self.stats.on_prefill(adder.log_input_tokens, adder.log_hit_tokens)
        batch = self.new_batch(adder.can_run_list)
        batch.prepare_for_extend(q.chunked_req)
        running = len(q.running_batch.reqs)
        mixed = mixing and self._mix_running_into(batch)
        return PrefillBatch(batch, len(adder.can_run_list), adder.log_input_tokens, adder.log_hit_tokens, running, mixed)

    def _admit_waiting(self, adder: PrefillAdder, running: int) -> None:
        """Waiting requests into the adder, in policy order, while rows and budgets last."""
        q = self.queues
        in_batch = InBatchPrefixIndex() if not self.args.disable_radix_cache else None
        # rows actually free: in overlap mode a request that just ended keeps its row one more result
        free_rows, new_rows = self.req_to_token_pool.available_size(), 0
        patches = 0  # the images' patches this batch brings to the vision tower (their activations' budget)
        adapters = self.lora.adapters_of(q.running_batch.reqs + adder.can_run_list)  # LoRA: in the batch so far
        for req in q.waiting:
            if running + len(adder.can_run_list) >= self.max_running_requests or new_rows >= free_rows:
                break
            if (p := _image_patches(req)) and patches and patches + p > self.args.mm_encoder_max_patches:
                break
            if not self.lora.fits(adapters, req):
                continue  # its adapter would be one too many for this batch: a later one takes it
            patches += p
            req.init_next_round_input(self.tree_cache)
            if in_batch is not None:
                key = cache_key(req.origin_input_ids, req.lora_uid)
                if in_batch.shared_len(key) > len(req.prefix_indices):
                    continue  # its prefix is being computed right now: take the cache hit next round
                in_batch.add(key)
            taken = len(adder.can_run_list)
            result = adder.add_one_req(req, has_chunked_req=q.chunked_req is not None)
            new_rows += sum(r.req_pool_idx is None for r in adder.can_run_list[taken:])
            adapters |= self.lora.adapters_of(adder.can_run_list[taken:])
            if result != AddReqResult.CONTINUE:
                if result == AddReqResult.NO_TOKEN:
                    q.running_batch.batch_is_full = True
                break

    def _mix_running_into(self, batch: "ScheduleBatch") -> bool:
        """--enable-mixed-chunk: the running requests' next decode step rides in this prefill batch,
        unless it does not fit in the KV pool now (then they decode, or are retracted, next step)."""
        running = self.queues.running_batch
        if not running.check_decode_mem():
            return False
        self.ratio.decay()
        self.stats.mixed_decode_tokens += len(running.reqs)
        batch.mix_with_running(running)
        return True

    def preempt_for(self, req: "Req") -> None:
        """Priority preemption: retract running requests whose priority is lower than `req`'s by at
        least --priority-preemption-threshold until `req` fits (memory and running slots)."""
        threshold = self.args.priority_preemption_threshold
        batch = self.queues.running_batch
        victims = sorted((r for r in batch.reqs if req.priority - r.priority >= threshold),
                         key=lambda r: (r.priority, -r.arrival_time))
        if not victims or self._fits(req, len(batch.reqs)):
            return
        self.drain_results()  # every in-flight token known before a request leaves the batch
        self.releaser.flush()
        self.output.reap_finished(batch.reqs)  # the drain may have ended some: they leave the batch too
        batch.filter_batch()
        chosen: list["Req"] = []
        for victim in victims:
            if victim.finished():
                continue
            self.releaser.release_now(victim)
            victim.reset_for_retract()
            chosen.append(victim)
            if self._fits(req, len(batch.reqs) - len(chosen)):
                break
        gone = set(map(id, chosen))
        batch.filter_batch(keep=[i for i, r in enumerate(batch.reqs) if id(r) not in gone])
        self.queues.waiting.extend(chosen)
        self.stats.preemptions += len(chosen)
        logger.info("preempted %d lower-priority requests for %s (priority %d)", len(chosen), req.rid, req.priority)

    def _fits(self, req: "Req", running: int) -> bool:
        need = len(req.origin_input_ids) + len(req.output_ids) + req.remaining_token_budget()
        room = self.allocator.available_size() + self.tree_cache.evictable_size()
        return running < self.max_running_requests and need <= room


def _image_patches(req: "Req") -> int:
    """The patches of a request's images (0 for text): what its prefill may give the vision tower."""
    mm = req.mm_inputs
    return 0 if mm is None else sum(math.prod(item.grid_thw) for item in mm.items)

