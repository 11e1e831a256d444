"""SGLang's /release_memory_occupation and /resume_memory_occupation on the scheduler's side (tags
`kv_cache`, `weights`; none or an empty list: both). The memory itself: model_executor/memory_saver.py.

A release needs no request to hold memory: nothing running, no prefill between chunks, no PD transfer
(pause first, in abort or retract mode, or wait for idle); waiting requests hold none and may stay.
Releasing `kv_cache` flushes the prefix cache first, since the pools' content is lost. While anything
is released the loop runs no batch (requests wait; the HTTP front answers new ones 503), and resume
brings the memory back; with both tags resumed the engine serves as before.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from baton.engine.io_struct import MEMORY_TAGS, ReleaseMemoryOccupationOut, ResumeMemoryOccupationOut
from baton.engine.model_executor.memory_saver import KV_CACHE, MemoryOccupationError, MemorySaver
from baton.engine.scheduler.pause import Settleable, settle

if TYPE_CHECKING:
    from baton.engine.mem_cache.base import BasePrefixCache
    from baton.engine.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def memory_tags(tags: Optional[list[str]]) -> list[str]:
    """The tags a request names (SGLang: none or empty means all), each known, in MEMORY_TAGS order."""
    if not tags:
        return list(MEMORY_TAGS)
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise MemoryOccupationError(f"unknown memory tag(s) {unknown}; use {' and '.join(MEMORY_TAGS)}")
    return [t for t in MEMORY_TAGS if t in tags]


class MemoryOccupation:
    def __init__(self, scheduler: Settleable, runner: "ModelRunner", tree_cache: "BasePrefixCache",
                 dp_rank: int) -> None:
        self.s, self.tree_cache, self.dp_rank = scheduler, tree_cache, dp_rank
        self.saver = MemorySaver(runner)

    @property
    def released(self) -> list[str]:
        return [t for t in MEMORY_TAGS if t in self.saver.released]

    def release(self, tags: Optional[list[str]]) -> ReleaseMemoryOccupationOut:
        try:
            wanted = memory_tags(tags)
            for tag in wanted:
                self.saver.check(tag)
            self._check_no_request_holds_memory()
            for tag in wanted:
                if tag == KV_CACHE and tag not in self.saver.released:
                    self.s.sessions.release_all()  # a session's held history goes with the pools' content
                    self.tree_cache.reset()  # the pools' content is about to go
                self.saver.release(tag)
        except MemoryOccupationError as e:
            return ReleaseMemoryOccupationOut(False, str(e), self.released, self.dp_rank)
        return ReleaseMemoryOccupationOut(True, f"released {', '.join(wanted)}", self.released, self.dp_rank)

    def resume(self, tags: Optional[list[str]]) -> ResumeMemoryOccupationOut:
        try:
            wanted = [t for t in memory_tags(tags) if t in self.saver.released]
            for tag in wanted:
                self.saver.resume(tag)
        except MemoryOccupationError as e:
            return ResumeMemoryOccupationOut(False, str(e), self.released, self.dp_rank)
        return ResumeMemoryOccupationOut(True, f"resumed {', '.join(wanted) or 'nothing (nothing was released)'}",
                                         self.released, self.dp_rank)

    def _check_no_request_holds_memory(self) -> None:
        s = self.s
        settle(s)  # in-flight results processed, ended requests freed
        q = s.queues
        busy = [what for what, held in (("running", len(q.running_batch.reqs)),
                                         ("being prefilled", int(q.chunked_req is not None)),
                                         ("in PD transfer queues", int(not s.pd.is_idle())))
                if held]
        if busy:
            raise MemoryOccupationError(
                "requests hold memory (" + ", ".join(busy) + "): pause first with /pause_generation in mode "
                "abort or retract, or wait until they finish")
