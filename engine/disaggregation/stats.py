"""PD counters and per-transfer samples a scheduler keeps for metrics.

Samples carry a sequence number: /get_server_info returns the recent ones, and the metrics exporter
observes only those newer than what it saw, so several readers never lose or double-count one.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

MAX_SAMPLES = 4096  # between two scrapes; older samples are dropped


@dataclass
class PDStats:
    bootstrap_failures: int = 0  # requests that never got a decode peer (timeout, peer gone, abort)
    transfer_failures: int = 0  # requests whose KV transfer failed after the handshake
    _seq: int = 0
    # (seq, bytes, seconds) per finished transfer
    samples: deque = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))

    def transfer_done(self, nbytes: int, seconds: float) -> None:
        self._seq += 1
        self.samples.append((self._seq, nbytes, seconds))

    def to_info(self) -> dict:
        return {"bootstrap_failures": self.bootstrap_failures, "transfer_failures": self.transfer_failures,
                "transfer_samples": list(self.samples)}
