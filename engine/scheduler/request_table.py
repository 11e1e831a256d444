"""Every request the scheduler holds, by rid: from intake until its final output is sent. An abort
is one lookup here; at idle the table is empty (a request left in it was never answered)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Optional

if TYPE_CHECKING:
    from baton.engine.core.req import Req


class RequestTable:
    def __init__(self) -> None:
        self._reqs: dict[str, "Req"] = {}

    def add(self, req: "Req") -> None:
        # the tokenizer manager refuses a rid that is still in flight; a clash here is a bug upstream
        assert req.rid not in self._reqs, f"request {req.rid!r} is already being served"
        self._reqs[req.rid] = req

    def remove(self, req: "Req") -> None:
        if self._reqs.get(req.rid) is req:
            del self._reqs[req.rid]

    def get(self, rid: str) -> Optional["Req"]:
        return self._reqs.get(rid)

    def __iter__(self) -> Iterator["Req"]:
        return iter(list(self._reqs.values()))

    def __len__(self) -> int:
        return len(self._reqs)
