"""One circuit breaker per worker and side: stop sending to a worker that keeps failing.

CLOSED --failure_threshold consecutive failures--> OPEN --timeout (or half_open())--> HALF_OPEN
HALF_OPEN --success_threshold successes--> CLOSED;  HALF_OPEN --one failure--> OPEN

`half_open()` is the health checker's shortcut for a worker that was down and answers again (a
restart): waiting out the timeout would only keep a working worker idle.
"""
from __future__ import annotations

import enum
import time
from typing import Callable

from baton.router.config import CircuitBreakerConfig


class BreakerState(enum.IntEnum):
    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


class CircuitBreaker:
    """Counts outcomes of real requests. The OPEN -> HALF_OPEN step is taken lazily when the state
    is read; whoever caches routable lists must re-read after `timeout_secs` (the registry does)."""

    def __init__(self, config: CircuitBreakerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._state = BreakerState.CLOSED
        self._failures = 0  # consecutive, while CLOSED
        self._successes = 0  # while HALF_OPEN
        self._opened_at = 0.0

    @property
    def state(self) -> BreakerState:
        if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self.config.timeout_secs:
            self._state, self._successes = BreakerState.HALF_OPEN, 0
        return self._state

    def opens_for(self) -> float:
        """Seconds until an open breaker turns half-open by itself (0 when it is not open)."""
        if self.state is not BreakerState.OPEN:
            return 0.0
        return max(0.0, self._opened_at + self.config.timeout_secs - self._clock())

    def half_open(self) -> bool:
        """OPEN -> HALF_OPEN now. Returns True when the state changed."""
        if self.state is not BreakerState.OPEN:
            return False
        self._state, self._successes = BreakerState.HALF_OPEN, 0
        return True

    def allows(self) -> bool:
        return not self.config.enabled or self.state is not BreakerState.OPEN

    def record_success(self) -> bool:
        """Returns True when the state changed."""
        state = self.state
        if state is BreakerState.HALF_OPEN:
            self._successes += 1
            if self._successes >= self.config.success_threshold:
                self._state, self._failures = BreakerState.CLOSED, 0
                return True
        self._failures = 0
        return False

    def record_failure(self) -> bool:
        """Returns True when the state changed (to OPEN)."""
        if not self.config.enabled:
            return False
        state = self.state
        if state is BreakerState.HALF_OPEN:
            return self._open()
        self._failures += 1
        if state is BreakerState.CLOSED and self._failures >= self.config.failure_threshold:
            return self._open()
        return False

    def _open(self) -> bool:
        self._state, self._opened_at, self._failures = BreakerState.OPEN, self._clock(), 0
        return True
