"""The gate between admitted requests and the workers: open, or closed while the fleet is paused or its
weights change (fleet.py).

Each attempt of a request passes the gate (Dispatcher._with_retries) and is counted until it ends, so a
fleet operation can close the gate, wait for the attempts in progress to end (drain), act on every
worker, and open it again. Requests that arrive meanwhile, and retries of attempts that failed, wait at
the gate under their own deadline (--request-timeout-secs), so none is sent to a worker in between.
"""
from __future__ import annotations

import asyncio


class Gate:
    def __init__(self) -> None:
        self.active = 0  # attempts that passed and have not ended
        self._holds: set[str] = set()  # why it is closed ("paused", "weight update"); empty: open
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def closed_for(self) -> set[str]:
        return set(self._holds)

    async def enter(self) -> None:
        """Wait until the gate is open, then count an attempt in (`leave` counts it out)."""
        while self._holds:
            await self._open.wait()
        self.active += 1
        self._idle.clear()

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._idle.set()

    def close(self, why: str) -> None:
        self._holds.add(why)
        self._open.clear()

    def open(self, why: str) -> None:
        """Take back one reason to stay closed; the gate opens when none is left."""
        self._holds.discard(why)
        if not self._holds:
            self._open.set()

    async def drain(self, timeout_secs: float) -> bool:
        """Wait up to `timeout_secs` for the attempts in progress to end; whether they all did."""
        try:
            async with asyncio.timeout(timeout_secs):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True
