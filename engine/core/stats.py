"""The scheduler's running counters (prefill and cache-hit tokens, retractions, throughput windows, queue
times), shared by the scheduler's parts and read by /get_server_info and /metrics."""
from __future__ import annotations

import time
from collections import deque


class SchedulerStats:
    # output throughput is measured over windows of at least this many seconds
    THROUGHPUT_WINDOW_S = 1.0

    def __init__(self) -> None:
        self.prefill_tokens = self.hit_tokens = self.retractions = self.preemptions = 0
        self.mixed_decode_tokens = 0  # decode steps run inside prefill batches (--enable-mixed-chunk)
        self.generated_tokens = 0
        self.gen_throughput = 0.0
        self._window = (time.monotonic(), 0)
        self._log_mark = self._window  # (time, generated_tokens) at the last decode log line
        # (seq, seconds waited) per departure from the waiting queue; /metrics observes the new ones
        self.queue_times: deque = deque(maxlen=4096)
        self._queue_seq = 0

    def on_dequeue(self, seconds: float) -> None:
        self._queue_seq += 1
        self.queue_times.append((self._queue_seq, seconds))

    def tick(self, idle: bool) -> None:
        start, tokens = self._window
        now = time.monotonic()
        if now - start >= self.THROUGHPUT_WINDOW_S or idle:
            self.gen_throughput = 0.0 if idle else (self.generated_tokens - tokens) / (now - start)
            self._window = (now, self.generated_tokens)
        if idle:  # an idle stretch is not part of the next decode line's interval
            self._log_mark = (now, self.generated_tokens)

    def interval_throughput(self) -> float:
        """Output tokens per second since the previous call (or since the engine was last idle)."""
        now, (start, tokens) = time.monotonic(), self._log_mark
        self._log_mark = (now, self.generated_tokens)
        return (self.generated_tokens - tokens) / max(now - start, 1e-9)

    def on_prefill(self, new_tokens: int, hit_tokens: int) -> None:
        self.prefill_tokens += new_tokens
        self.hit_tokens += hit_tokens

    def cache_hit_rate(self) -> float:
        total = self.prefill_tokens + self.hit_tokens
        return self.hit_tokens / total if total else 0.0
