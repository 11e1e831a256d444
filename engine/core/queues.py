"""The scheduler's request queues, in one object the scheduler's parts share (the scheduler, its PD
strategy): the waiting queue, the running decode batch and the one request being prefilled in chunks."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from baton.engine.core.req import Req
    from baton.engine.core.schedule_batch import ScheduleBatch


@dataclass
class SchedulerQueues:
    running_batch: "ScheduleBatch"  # the decode batch: requests past their prefill
    waiting: list["Req"] = field(default_factory=list)  # admitted, not yet (or again) prefilled
    chunked_req: Optional["Req"] = None  # between two chunks of its prefill
