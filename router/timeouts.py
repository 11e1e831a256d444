"""`timeout(seconds)`: asyncio.timeout on 3.11+, async_timeout (an aiohttp dependency) before;
`Deadline`: the per-request deadline of the hot path."""
from __future__ import annotations

import asyncio
import sys

if sys.version_info >= (3, 11):
    from asyncio import timeout
else:  # pragma: no cover - Python 3.10
    from async_timeout import timeout

__all__ = ["Deadline", "timeout"]


class Deadline:
    """Cancels the current task `seconds` from now. Per request this is one timer and no context
    manager, cheaper than `timeout()`; `absorb()` tells its cancellation from any other."""

    __slots__ = ("expired", "_handle", "_task")

    def __init__(self, seconds: float) -> None:
        self.expired = False
        self._task = asyncio.current_task()
        self._handle = asyncio.get_running_loop().call_later(seconds, self._fire)

    def cancel(self) -> None:
        self._handle.cancel()

    def absorb(self) -> bool:
        """After a CancelledError: True if this deadline caused it (its cancel request is then undone)."""
        if not self.expired:
            return False
        uncancel = getattr(self._task, "uncancel", None)  # Python 3.11+
        if uncancel is not None:
            uncancel()
        return True

    def _fire(self) -> None:
        self.expired = True
        if self._task is not None:
            self._task.cancel()
