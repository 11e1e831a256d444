"""Giving a finished request's memory back: its KV to the prefix cache, its row to the pool.

In the overlap loop the batch launched after the one that finished a request still reads its KV
and row, so the release waits one result (`release` defers, `flush` releases what waited); the
plain loop releases at once.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    from baton.engine.core.req import Req
    from baton.engine.mem_cache.base import BasePrefixCache


class ReqReleaser:
    def __init__(self, tree_cache: "BasePrefixCache", deferred: bool) -> None:
        self.tree_cache = tree_cache
        self.deferred = deferred  # the overlap loop
        self.waiting: list["Req"] = []
        # sessions.py: keeps a finished session request's KV for its next turn; True when it released it
        self.keep: Optional[Callable[["Req"], bool]] = None

    def release(self, req: "Req") -> None:
        if self.deferred:
            self.waiting.append(req)
        else:
            self.release_now(req)

    def release_now(self, req: "Req") -> None:
        if req.req_pool_idx is None:
            return
        req.sync_fill_ids()
        if self.keep is None or not self.keep(req):
            self.tree_cache.cache_finished_req(req)
        req.req_pool_idx = None

    def take_waiting(self) -> list["Req"]:
        """The requests deferred so far (a result was reached: the batch that read them has run)."""
        ready, self.waiting = self.waiting, []
        return ready

    def flush(self) -> None:
        """Release every deferred request (nothing is in flight any more)."""
        for req in self.take_waiting():
            self.release_now(req)
