"""What the scheduler's parts (intake, prefill manager, output processor) read of the server args: the
flags the scheduler owns or reads (ServerArgs.view; tests/test_flags.py checks each is declared so)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class SchedulerConfig:
    device: str
    page_size: int
    # admission
    max_queued_requests: Optional[int]
    grammar_backend: str
    constrained_json_disable_any_whitespace: bool
    reasoning_parser: Optional[str]
    # prefill batches
    chunked_prefill_size: Optional[int]
    max_prefill_tokens: int
    enable_mixed_chunk: bool
    mm_encoder_max_patches: int  # images: the patches one prefill batch may bring to the vision tower
    enable_priority_scheduling: bool
    priority_preemption_threshold: int
    disable_radix_cache: bool
    # outputs
    stream_interval: int
    # multi-LoRA serving (scheduler/lora.py)
    enable_lora: bool
    lora_paths: tuple[str, ...]
    max_loras_per_batch: int
    max_loaded_loras: Optional[int]
