import asyncio
import random

import pytest

from baton.router.admission import Admission, QueueFull, QueueTimeout
from baton.router.circuit_breaker import BreakerState, CircuitBreaker
from baton.router.config import CircuitBreakerConfig, RetryConfig
from baton.router.forward import FirstEvent
from baton.router.retry import backoff_secs, is_retryable_status


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_consecutive_failures_then_half_opens_then_closes():
    clock = Clock()
    breaker = CircuitBreaker(CircuitBreakerConfig(failure_threshold=3, success_threshold=2, timeout_secs=10), clock)
    breaker.record_failure()
    breaker.record_success()  # resets the count
    assert not breaker.record_failure() and not breaker.record_failure()
    assert breaker.record_failure() and breaker.state is BreakerState.OPEN and not breaker.allows()
    clock.now = 10.0
    assert breaker.state is BreakerState.HALF_OPEN and breaker.allows()
    assert not breaker.record_success()
    assert breaker.record_success() and breaker.state is BreakerState.CLOSED


def test_breaker_half_open_failure_reopens():
    clock = Clock()
    breaker = CircuitBreaker(CircuitBreakerConfig(failure_threshold=1, timeout_secs=5), clock)
    breaker.record_failure()
    clock.now = 5.0
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.record_failure() and breaker.state is BreakerState.OPEN


def test_breaker_half_opens_on_demand_and_says_when_it_would_by_itself():
    clock = Clock()
    breaker = CircuitBreaker(CircuitBreakerConfig(failure_threshold=1, timeout_secs=60), clock)
    assert not breaker.half_open() and breaker.opens_for() == 0.0  # closed: nothing to do
    breaker.record_failure()
    clock.now = 20.0
    assert breaker.opens_for() == 40.0
    assert breaker.half_open() and breaker.state is BreakerState.HALF_OPEN and breaker.allows()
    assert breaker.record_failure() and breaker.state is BreakerState.OPEN  # one failed trial reopens it


@pytest.mark.parametrize("stream,found_at", [
    ([b"data: {}\n\n"], 0),
    ([b": keep-alive\n\n", b"data: {}\n\n"], 1),
    ([b": keep", b"-alive\n", b"\n: ping\r\n\r\n", b"da", b"ta: {}\n\n"], 3),  # cut anywhere
    ([b": a\n\n: b\n\nevent: x\n"], 0),
    ([b": only comments\n\n", b":\n\n"], None),
])
def test_first_event_skips_sse_comments_in_chunks_cut_anywhere(stream, found_at):
    finder = FirstEvent()
    found = [i for i, chunk in enumerate(stream) if finder.found_in(chunk)]
    assert (found[0] if found else None) == found_at


def test_disabled_breaker_never_opens():
    breaker = CircuitBreaker(CircuitBreakerConfig(enabled=False, failure_threshold=1))
    for _ in range(5):
        breaker.record_failure()
    assert breaker.allows()


def test_backoff_grows_exponentially_is_capped_and_jittered():
    config = RetryConfig(initial_backoff_ms=100, backoff_multiplier=2, max_backoff_ms=1000, jitter_factor=0.0)
    assert [backoff_secs(config, a) for a in (1, 2, 3, 4, 5)] == [0.1, 0.2, 0.4, 0.8, 1.0]
    jittered = RetryConfig(initial_backoff_ms=100, jitter_factor=0.2)
    delays = {backoff_secs(jittered, 1, random.Random(i)) for i in range(50)}
    assert len(delays) > 40 and all(0.08 <= d <= 0.12 for d in delays)


@pytest.mark.parametrize("status,retry", [(408, True), (429, True), (500, True), (503, True), (400, False),
                                          (404, False), (200, False)])
def test_retryable_statuses(status, retry):
    assert is_retryable_status(status) is retry


async def test_admission_queues_fifo_and_rejects_when_full():
    admission = Admission(max_concurrent=1, queue_size=1, queue_timeout_secs=5)
    await admission.acquire()
    waiter = asyncio.ensure_future(admission.acquire())
    await asyncio.sleep(0)
    assert admission.queued == 1
    with pytest.raises(QueueFull):
        await admission.acquire()
    admission.release()  # hands the slot over
    await asyncio.wait_for(waiter, 1)
    assert admission.in_flight == 1 and admission.queued == 0
    admission.release()
    assert admission.in_flight == 0


async def test_admission_times_out_and_survives_cancelled_waiters():
    admission = Admission(max_concurrent=1, queue_size=5, queue_timeout_secs=0.05)
    await admission.acquire()
    with pytest.raises(QueueTimeout):
        await admission.acquire()
    admission.queue_timeout_secs = 5
    waiter = asyncio.ensure_future(admission.acquire())
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert admission.queued == 0
    admission.release()
    assert admission.in_flight == 0
