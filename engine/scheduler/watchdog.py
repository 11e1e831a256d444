"""The scheduler's watchdog: a step that never ends stops the engine instead of hanging it.

The event loop calls `tick()` once per iteration; even idle, an iteration ends within the receive
poll (1 s). A daemon thread checks the time since the last tick; past `timeout_s` it logs, dumps
every thread's stack (where the hang is) and ends the process with exit code 1. The HTTP process's
supervisor (entrypoints/engine.py) then fails the requests in flight and exits, so the pod restarts.
What it catches: a forward that never returns (a hung GPU kernel or collective, a KV transfer wait
without a timeout), a deadlock, a loop that never yields. Same flag and default as SGLang's
`--watchdog-timeout` (300 s).
"""
from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from typing import Callable, Optional

logger = logging.getLogger(__name__)

EXIT_CODE = 1


def _stop_process(stalled_s: float) -> None:
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    logging.shutdown()
    os._exit(EXIT_CODE)  # the main thread is stuck: no orderly exit can run


class Watchdog:
    def __init__(self, timeout_s: float, on_stall: Callable[[float], None] = _stop_process,
                 poll_s: Optional[float] = None) -> None:
        assert timeout_s > 0
        self.timeout_s = timeout_s
        self._on_stall = on_stall
        self._poll_s = poll_s if poll_s is not None else min(5.0, timeout_s / 4)
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="baton-watchdog", daemon=True)

    def tick(self) -> None:
        self._last = time.monotonic()

    def start(self) -> "Watchdog":
        self.tick()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s):
            stalled = time.monotonic() - self._last
            if stalled > self.timeout_s:
                logger.error("watchdog: the scheduler loop has not completed a step for %.0f s "
                             "(--watchdog-timeout %g); stopping the engine. Threads' stacks follow.",
                             stalled, self.timeout_s)
                self._on_stall(stalled)
                return
