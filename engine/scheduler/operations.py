"""The scheduler's operational requests, one object the loop consults: pause / continue (pause.py), memory
release / resume (memory_occupation.py), the profiler (profiler.py), slow-down and the internal-state
knobs (SGLang's /get_internal_state and /set_internal_state).

The loop asks two things of it: whether it may run a batch at all (`holds_steps`: not while paused or
while memory is released) and, after each forward step, `on_forward` (the profiler's step count, the
slow-down's sleep). `handlers()` is the scheduler's control table entry for each message.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from baton.engine.io_struct import (ContinueGenerationOut, ContinueGenerationReq, GetInternalStateOut,
                                    GetInternalStateReq, PauseGenerationReq, ProfileReq,
                                    ReleaseMemoryOccupationReq, ResumeMemoryOccupationReq, SetInternalStateOut,
                                    SetInternalStateReq, SlowDownOut, SlowDownReq)
from baton.engine.scheduler.memory_occupation import MemoryOccupation
from baton.engine.scheduler.pause import PauseController
from baton.engine.scheduler.profiler import StepProfiler

if TYPE_CHECKING:
    from baton.engine.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# /set_internal_state: the knobs that may change while serving, and what each accepts
KNOBS = {
    "max_running_requests": "requests decoded at once, 1 .. the pools' limit (admission of new prefills)",
    "max_queued_requests": "waiting requests beyond which new ones get a 503 (null: no limit)",
    "forward_sleep_time": "seconds each forward step sleeps (/slow_down; null: none)",
}


class SchedulerOps:
    """`scheduler`: the Scheduler (its queues and parts, its runner's pools)."""

    def __init__(self, scheduler: Any) -> None:
        s = self.s = scheduler
        self.dp_rank = s.dp_rank
        self.pause = PauseController(s, s.dp_rank)
        runner: "ModelRunner" = s.worker.model_runner
        self.memory = MemoryOccupation(s, runner, s.tree_cache, s.dp_rank)
        self.profiler = StepProfiler(s.dp_rank, s.server_args.device, s.outbox.append, s.drain_results)
        self.forward_sleep_time: Optional[float] = None
        self.pool_max_running = s.max_running_requests  # what the pools were sized for

    def holds_steps(self) -> bool:
        """No batch may run: paused, or memory released."""
        return self.pause.paused or bool(self.memory.saver.released)

    def on_forward(self, forward_ct: int) -> None:
        """After a forward step was launched."""
        self.profiler.on_forward(forward_ct)
        if self.forward_sleep_time:
            time.sleep(self.forward_sleep_time)

    def handlers(self) -> dict[type, Callable[[Any], Any]]:
        return {
            PauseGenerationReq: lambda r: self.pause.pause(r.mode),
            ContinueGenerationReq: self._continue,
            ReleaseMemoryOccupationReq: lambda r: self.memory.release(r.tags),
            ResumeMemoryOccupationReq: lambda r: self.memory.resume(r.tags),
            ProfileReq: self._profile,
            SlowDownReq: self._slow_down,
            GetInternalStateReq: lambda _: GetInternalStateOut(self.internal_state(), self.dp_rank),
            SetInternalStateReq: lambda r: self.set_internal_state(r.server_args),
        }

    def _continue(self, _: ContinueGenerationReq) -> ContinueGenerationOut:
        self.pause.resume()
        return ContinueGenerationOut(self.dp_rank)

    def _profile(self, req: ProfileReq) -> Any:
        if req.action == "start":
            return self.profiler.start(req, self.s.forward_ct)
        return self.profiler.stop()

    def _slow_down(self, req: SlowDownReq) -> SlowDownOut:
        self.forward_sleep_time = req.forward_sleep_time or None
        logger.info("forward steps sleep %s s each (/slow_down)", self.forward_sleep_time or 0)
        return SlowDownOut(self.dp_rank)

    # ---- internal state ----
    def internal_state(self) -> dict[str, Any]:
        s = self.s
        return {**self._knob_values(),
                "paused": self.pause.mode,  # the pause mode, or None
                "memory_released": self.memory.released,
                "profiling": self.profiler.active,
                "forward_ct": s.forward_ct,
                "last_gen_throughput": s.stats.gen_throughput,  # SGLang's name
                "num_running_reqs": len(s.running_batch.reqs),
                "num_waiting_reqs": len(s.waiting_queue),
                "settable": dict(KNOBS)}

    def _knob_values(self) -> dict[str, Any]:
        return {"max_running_requests": self.s.prefill.max_running_requests,
                "max_queued_requests": self.s.intake.config.max_queued_requests,
                "forward_sleep_time": self.forward_sleep_time}

    def set_internal_state(self, values: dict[str, Any]) -> SetInternalStateOut:
        """All of `values` or none of them: each knob checked first."""
        error = self._invalid_knobs(values)
        if error is not None:
            return SetInternalStateOut(False, self._knob_values(), error, self.dp_rank)
        s = self.s
        if "max_running_requests" in values:
            s.prefill.max_running_requests = s.max_running_requests = values["max_running_requests"]
        if "max_queued_requests" in values:
            s.intake.config = dataclasses.replace(s.intake.config, max_queued_requests=values["max_queued_requests"])
        if "forward_sleep_time" in values:
            self.forward_sleep_time = values["forward_sleep_time"] or None
        logger.info("internal state set: %s", values)
        return SetInternalStateOut(True, self._knob_values(), "", self.dp_rank)

    def _invalid_knobs(self, values: dict[str, Any]) -> Optional[str]:
        unknown = sorted(set(values) - set(KNOBS))
        if unknown:
            return f"cannot set {unknown}: the settable knobs are {sorted(KNOBS)}"

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        checks = {
            "max_running_requests": (lambda v: is_int(v) and 1 <= v <= self.pool_max_running,
                                     f"an integer in 1 .. {self.pool_max_running}"),
            "max_queued_requests": (lambda v: v is None or (is_int(v) and v >= 1), "null or an integer >= 1"),
            "forward_sleep_time": (lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)
                                                           and 0 <= v <= 60), "null or seconds in 0 .. 60"),
        }
        for name, value in values.items():
            ok, want = checks[name]
            if not ok(value):
                return f"{name} must be {want}, not {value!r}"
        return None
