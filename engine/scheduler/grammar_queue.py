"""Requests whose grammar is still compiling (SGLang's grammar queue).

A structured request waits here, holding no KV memory, while its grammar compiles on the backend's
thread; the scheduler polls the queue at the top of every step and admits each request whose
grammar is ready (or ends it with a 400 when the grammar is bad). An abort finds it here too.
"""
from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from baton.engine.core.req import Req


@dataclass(eq=False)
class GrammarWait:
    req: Req
    recv: Any  # the TokenizedGenerateReqInput (PD admission reads its bootstrap fields)
    future: concurrent.futures.Future


class GrammarQueue:
    def __init__(self) -> None:
        self.waits: list[GrammarWait] = []

    def __len__(self) -> int:
        return len(self.waits)

    def add(self, req: Req, recv: Any, future: concurrent.futures.Future) -> None:
        self.waits.append(GrammarWait(req, recv, future))

    def pop_ready(self) -> Iterator[GrammarWait]:
        """The waits whose compile has ended (well or not), in arrival order."""
        if not self.waits:
            return iter(())
        ready = [w for w in self.waits if w.future.done()]
        if ready:
            taken = {id(w) for w in ready}
            self.waits = [w for w in self.waits if id(w) not in taken]
        return iter(ready)

    def remove(self, rid: Optional[str]) -> list[Req]:
        """Take out the request `rid` (every request when None); its compile result is dropped."""
        taken = [w.req for w in self.waits if rid is None or w.req.rid == rid]
        self.waits = [w for w in self.waits if not (rid is None or w.req.rid == rid)]
        return taken

    def wait(self, timeout_s: float) -> None:
        """Block until some compile ends (or the timeout): a loop with nothing else to do."""
        if self.waits:
            concurrent.futures.wait([w.future for w in self.waits], timeout=timeout_s,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
