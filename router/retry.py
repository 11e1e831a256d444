"""Which failures are worth another attempt, and how long to wait before it."""
from __future__ import annotations

import random

from baton.router.config import RetryConfig

RETRYABLE_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


def is_retryable_status(status: int) -> bool:
    return status in RETRYABLE_STATUSES or status >= 500


def backoff_secs(config: RetryConfig, attempt: int, rng: random.Random | None = None) -> float:
    """Delay before attempt number `attempt` + 1 (attempt counts from 1): exponential, capped, with
    jitter of +-jitter_factor so that retries from many clients do not arrive in step."""
    base = min(config.initial_backoff_ms * config.backoff_multiplier ** (attempt - 1), config.max_backoff_ms)
    jitter = (rng or random).uniform(-config.jitter_factor, config.jitter_factor)
    return max(0.0, base * (1.0 + jitter)) / 1000.0
