"""What a PD strategy reads of the server args (ServerArgs.view; tests/test_flags.py checks each field is a
flag declared as PD's)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class PDConfig:
    host: str  # the engine's bind address (peers reach it at its advertised form)
    dp_size: int
    disaggregation_transfer_backend: str
    disaggregation_bootstrap_port: int
    disaggregation_protocol: str
    disaggregation_ib_device: Optional[str]
    # None: SGLang's environment variable of the same meaning, else its default (disaggregated.py)
    disaggregation_bootstrap_timeout: Optional[float]
    disaggregation_waiting_timeout: Optional[float]
    disaggregation_heartbeat_interval: Optional[float]
    disaggregation_heartbeat_max_failures: Optional[int]
    disaggregation_fault_probability: float
