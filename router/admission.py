"""Admission control: at most `max_concurrent` requests served, at most `queue_size` waiting (FIFO);
beyond that 429 at once, and 408 for a request that waited longer than `queue_timeout`."""
from __future__ import annotations

import asyncio
import collections

from baton.router.timeouts import timeout


class QueueFull(Exception):
    pass


class QueueTimeout(Exception):
    pass


class Admission:
    def __init__(self, max_concurrent: int, queue_size: int, queue_timeout_secs: float) -> None:
        self.max_concurrent = max_concurrent  # <= 0: unlimited
        self.queue_size = queue_size
        self.queue_timeout_secs = queue_timeout_secs
        self.in_flight = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        if self.max_concurrent <= 0 or self.in_flight < self.max_concurrent:
            self.in_flight += 1
            return
        if len(self._waiters) >= self.queue_size:
            raise QueueFull(f"{self.in_flight} requests in flight and {len(self._waiters)} queued")
        slot: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(slot)
        try:
            async with timeout(self.queue_timeout_secs):
                await asyncio.shield(slot)
        except asyncio.TimeoutError:
            if not slot.done():
                slot.cancel()
                raise QueueTimeout(f"waited {self.queue_timeout_secs}s for a slot") from None
        except asyncio.CancelledError:  # the client left while queued: give a handed-over slot back
            if slot.done() and not slot.cancelled():
                self.release()
            slot.cancel()
            raise
        finally:
            if slot in self._waiters:
                self._waiters.remove(slot)

    def release(self) -> None:
        """Hand the slot to the oldest waiter (in_flight unchanged), or free it."""
        while self._waiters:
            slot = self._waiters.popleft()
            if not slot.done():
                slot.set_result(None)
                return
        self.in_flight -= 1
