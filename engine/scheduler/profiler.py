"""The torch profiler over the scheduler's forward steps: SGLang's /start_profile and /stop_profile.

    start   output_dir (default $SGLANG_TORCH_PROFILER_DIR, else /tmp), start_step (the forward step
            count at which recording starts; default now), num_steps (stop by itself after that many
            forward steps; the start is answered then, as SGLang answers it), activities (CPU, GPU,
            MEM: SGLang's names; GPU where there is one), with_stack, record_shapes
    stop    stops and writes the trace now

Each DP rank writes `<output_dir>/<profile_id>-TP-0-DP-<rank>.trace.json.gz` (Chrome trace format, for
Perfetto or chrome://tracing); TP followers are not profiled.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Optional

import torch

from baton.engine.io_struct import ProfileOut, ProfileReq

logger = logging.getLogger(__name__)

PROFILE_ACTIVITIES = ("CPU", "GPU", "MEM")


class StepProfiler:
    """`send`: puts a reply in the scheduler's outbox (the deferred answer of a start with num_steps);
    `settle`: processes the forward steps still in flight, so the trace holds the last one whole."""

    def __init__(self, dp_rank: int, device: str, send: Callable[[Any], None], settle: Callable[[], None]) -> None:
        self.dp_rank, self.device, self.send, self.settle = dp_rank, device, send, settle
        self.req: Optional[ProfileReq] = None  # the profile asked for, from its start until it is written
        self.profiler: Optional[torch.profiler.profile] = None  # recording (from start_step on)
        self.start_ct = self.stop_ct = 0  # forward step counts where recording starts and stops (0: never)

    @property
    def active(self) -> bool:
        return self.req is not None

    def start(self, req: ProfileReq, forward_ct: int) -> Optional[ProfileOut]:
        """Arms the profile; None when the answer waits for the num_steps to run."""
        error = self._invalid(req)
        if error is not None:
            return ProfileOut(False, error, self.dp_rank)
        self.req = req
        self.start_ct = max(forward_ct, req.start_step or 0)
        self.stop_ct = self.start_ct + req.num_steps if req.num_steps else 0
        if self.start_ct == forward_ct:
            self._record()
        logger.info("profiling: %s steps from step %d into %s", req.num_steps or "all", self.start_ct, self._path())
        return None if req.num_steps else ProfileOut(True, "profiling started", self.dp_rank)

    def stop(self) -> ProfileOut:
        if self.req is None:
            return ProfileOut(False, "no profile is running: call /start_profile first", self.dp_rank)
        path = self._finish()
        return ProfileOut(True, f"trace written to {path}" if path else "stopped before any step was recorded",
                          self.dp_rank)

    def on_forward(self, forward_ct: int) -> None:
        """After forward step number `forward_ct` was launched."""
        if self.req is None:
            return
        if self.profiler is None and forward_ct >= self.start_ct:
            self._record()
        elif self.stop_ct and forward_ct >= self.stop_ct:
            self._finish()

    def _invalid(self, req: ProfileReq) -> Optional[str]:
        if self.req is not None:
            return "a profile is running already: call /stop_profile first"
        unknown = [a for a in req.activities or () if a not in PROFILE_ACTIVITIES]
        if unknown:
            return f"unsupported profiler activities {unknown}; use {', '.join(PROFILE_ACTIVITIES)}"
        if (req.num_steps is not None and req.num_steps < 1) or (req.start_step is not None and req.start_step < 0):
            return "num_steps must be >= 1 and start_step >= 0"
        try:
            os.makedirs(self._dir(req), exist_ok=True)
        except OSError as e:
            return f"cannot write traces to {self._dir(req)}: {e}"
        return None

    def _record(self) -> None:
        req = self.req
        wanted = set(req.activities or ("CPU", "GPU"))
        activities = [torch.profiler.ProfilerActivity.CPU] if "CPU" in wanted or "MEM" in wanted else []
        if "GPU" in wanted and self.device.startswith("cuda"):
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities or None, with_stack=bool(req.with_stack),
                                               record_shapes=bool(req.record_shapes), profile_memory="MEM" in wanted)
        self.profiler.start()

    def _finish(self) -> Optional[str]:
        """Stops and writes the trace; the start of a num_steps profile gets its answer now."""
        req, profiler, path = self.req, self.profiler, None
        if profiler is not None:
            self.settle()
            profiler.stop()
            path = self._path()
            profiler.export_chrome_trace(path)
            logger.info("profile written to %s", path)
        self.req, self.profiler = None, None
        if req.num_steps:
            self.send(ProfileOut(True, f"trace written to {path}", self.dp_rank))
        return path

    @staticmethod
    def _dir(req: ProfileReq) -> str:
        return req.output_dir or os.environ.get("SGLANG_TORCH_PROFILER_DIR", "/tmp")

    def _path(self) -> str:
        return os.path.join(self._dir(self.req), f"{self.req.profile_id}-TP-0-DP-{self.dp_rank}.trace.json.gz")
