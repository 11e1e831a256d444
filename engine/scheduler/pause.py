"""Pausing generation: SGLang's /pause_generation (mode abort | retract | in_place) and /continue_generation.

While paused the loop runs no batch (Scheduler.run_step); requests that arrive meanwhile are admitted
and wait, and run after the continue. (The HTTP front holds new requests too: tokenizer_manager.py.)

    abort      every request ends now with an abort and its output so far (status 200, as SGLang
               answers a pause's aborts: an RL client keeps the partial rollout); their memory is freed
    retract    running requests (and one between two chunks of its prefill) go back to the waiting
               queue, their KV given to the prefix cache; they prefill again after the continue
    in_place   requests stay where they are, their KV held; they go on after the continue

Every mode first settles the loop: the overlap loop's batches in flight are processed, the last
prefill's requests join the running batch and requests that ended are answered and freed, so nothing
is in flight while paused (a weight update may run then) and no request is left half-handled.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional, Protocol

from baton.engine.io_struct import PAUSE_MODES, AbortReq, PauseGenerationOut

if TYPE_CHECKING:
    from baton.engine.core.queues import SchedulerQueues
    from baton.engine.core.schedule_batch import ScheduleBatch
    from baton.engine.scheduler.intake import RequestIntake
    from baton.engine.scheduler.output_processor import OutputProcessor
    from baton.engine.scheduler.release import ReqReleaser

logger = logging.getLogger(__name__)

PAUSE_ABORT_MESSAGE = "aborted by /pause_generation"


class Settleable(Protocol):
    """What pausing reaches of the scheduler: its queues and the parts that end and free requests."""

    queues: "SchedulerQueues"
    intake: "RequestIntake"
    output: "OutputProcessor"
    releaser: "ReqReleaser"
    pd: Any  # the PD strategy (disaggregation/colocated.py)
    sessions: Any  # the sessions' holds on KV (scheduler/sessions.py): given up before the pools are reset
    last_batch: Optional["ScheduleBatch"]

    def drain_results(self) -> None: ...

    def _merge_last_prefill(self, last: "ScheduleBatch") -> None: ...


def settle(s: Settleable) -> None:
    """Nothing in flight, the last prefill's requests in the running batch, ended requests answered and
    freed: the state the next step would start from, reached without running one."""
    s.drain_results()
    s.releaser.flush()  # nothing is in flight any more
    last = s.last_batch
    if last is not None and last.forward_mode.is_extend():
        s._merge_last_prefill(last)
    s.last_batch = None
    q = s.queues
    if q.chunked_req is not None and q.chunked_req.finished():  # aborted between two chunks
        s.output.reap_finished([q.chunked_req])
        q.chunked_req = None
    s.output.reap_finished(q.running_batch.reqs)
    q.running_batch.filter_batch()
    s.releaser.flush()


def retract_all(s: Settleable) -> int:
    """Every running request (and a chunked prefill's) back to the waiting queue, its KV given to the
    prefix cache, so a later prefill hits it. A PD prefill's chunked request stays: its chunks may be
    on the wire to the decode already. Returns how many went back."""
    q, retracted = s.queues, list(s.queues.running_batch.reqs)
    chunked = q.chunked_req
    if chunked is not None and s.pd.keeps_prefilled_requests:
        retracted.append(chunked)
        q.chunked_req = None
    for req in retracted:
        s.releaser.release_now(req)
        req.reset_for_retract()
    q.running_batch.filter_batch(keep=[])
    q.waiting.extend(retracted)
    return len(retracted)


class PauseController:
    """The pause state the loop checks, and the pause / continue handlers."""

    def __init__(self, scheduler: Settleable, dp_rank: int) -> None:
        self.s, self.dp_rank = scheduler, dp_rank
        self.mode: Optional[str] = None  # the mode paused in; None while generating

    @property
    def paused(self) -> bool:
        return self.mode is not None

    def pause(self, mode: str) -> PauseGenerationOut:
        if mode not in PAUSE_MODES:
            return PauseGenerationOut(False, f"unknown pause mode {mode!r}; use one of {', '.join(PAUSE_MODES)}",
                                      self.dp_rank)
        s = self.s
        settle(s)
        detail = ""
        if mode == "abort":
            s.intake.abort_request(AbortReq(abort_all=True, message=PAUSE_ABORT_MESSAGE, status_code=200))
            settle(s)  # the running ones end now, not at a step the paused loop will not take
        elif mode == "retract":
            detail = f", {retract_all(s)} requests retracted"
        self.mode = mode
        logger.info("generation paused (%s)%s", mode, detail)
        return PauseGenerationOut(True, f"paused ({mode}){detail}", self.dp_rank)

    def resume(self) -> None:
        if self.mode is not None:
            logger.info("generation continues (paused in %s mode)", self.mode)
        self.mode = None
