"""The running batch's next decode step: the KV-pool check, retraction when the pool cannot hold the
step, the new_token_ratio that admission reserves future decode tokens with, and (speculative decoding)
whether the step verifies drafts instead."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

if TYPE_CHECKING:
    from baton.engine.core.queues import SchedulerQueues
    from baton.engine.core.schedule_batch import ScheduleBatch
    from baton.engine.core.stats import SchedulerStats
    from baton.engine.scheduler.output_processor import OutputProcessor
    from baton.engine.scheduler.release import ReqReleaser
    from baton.engine.speculative.base import NoSpeculation

logger = logging.getLogger(__name__)

# new_token_ratio schedule (SGLang's defaults): start conservative, decay per decode step to a floor,
# jump back up after a retraction.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600


class NewTokenRatio:
    """The share of each running request's remaining tokens that admission keeps free for it."""

    def __init__(self, schedule_conservativeness: float) -> None:
        self.init = min(INIT_NEW_TOKEN_RATIO * schedule_conservativeness, 1.0)
        self.min = self.init * MIN_NEW_TOKEN_RATIO_FACTOR
        self.step = (self.init - self.min) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.value = self.init

    def decay(self) -> None:
        """One decode step ran without running out of memory."""
        self.value = max(self.value - self.step, self.min)

    def raise_to(self, ratio: float) -> None:
        """After a retraction: at least what the retracted batch showed it needs."""
        self.value = max(ratio, self.value)


class DecodeManager:
    def __init__(self, queues: "SchedulerQueues", ratio: NewTokenRatio, releaser: "ReqReleaser",
                 output: "OutputProcessor", stats: "SchedulerStats", drain_results: Callable[[], None],
                 rows_held_elsewhere: Callable[[], int], spec: "NoSpeculation",
                 in_flight: Callable[[], Sequence[Any]] = tuple) -> None:
        self.queues, self.ratio, self.releaser, self.output, self.stats = queues, ratio, releaser, output, stats
        self.spec = spec  # the speculation strategy (speculative/; NoSpeculation: plain steps only)
        self.in_flight = in_flight  # the launched batches whose results are not processed yet (overlap)
        self.drain_results = drain_results  # process every launched batch's result (the overlap loop's)
        self.rows_held_elsewhere = rows_held_elsewhere  # PD requests holding rows outside the batch

    def prepare(self) -> Optional["ScheduleBatch"]:
        """The running batch, ready for one decode step (retracting requests back to the waiting
        queue when the KV pool cannot hold the step), or None when nothing is left to decode."""
        batch = self.queues.running_batch
        if batch.is_empty():
            return None
        speculate = self.spec.wants_verify(batch)
        if speculate and self.spec.prepare_lagged(batch, list(self.in_flight())):
            # a verify step behind the verify step in flight (speculative/verify_strategy.py); no retraction
            # here: without room it is built below, after the results are in
            self.ratio.decay()
            batch.batch_is_full = False
            return batch
        if speculate or any(b.mwb.spec_info is not None for b in self.in_flight()):
            # drafts continue each request's last token, and a verify step in flight leaves the
            # requests' lengths unknown: the overlap loop's step in flight first
            self.drain_results()
            self.releaser.flush()  # nothing is in flight now
            self.output.reap_finished(batch.reqs)
            batch.filter_batch()
            if batch.is_empty():
                return None
        if not batch.check_decode_mem():
            self._retract(batch)
            if batch.is_empty():
                return None
        else:
            self.ratio.decay()
        batch.batch_is_full = False
        if not (speculate and self.spec.prepare_verify(batch)):
            batch.prepare_for_decode()
        return batch

    def _retract(self, batch: "ScheduleBatch") -> None:
        self.drain_results()  # know every in-flight token before choosing what to retract
        self.releaser.flush()  # nothing is in flight now
        self.output.reap_finished(batch.reqs)
        batch.filter_batch()
        # rows held outside this batch: it may retract all of its own
        held_elsewhere = self.queues.chunked_req is not None or self.rows_held_elsewhere() > 0
        retracted, ratio = batch.retract_decode(self.releaser.release_now, may_empty=held_elsewhere)
        self.ratio.raise_to(ratio)
        self.queues.waiting.extend(retracted)
        self.stats.retractions += len(retracted)
        logger.warning("KV pool full: retracted %d requests; new_token_ratio=%.3f", len(retracted), self.ratio.value)
