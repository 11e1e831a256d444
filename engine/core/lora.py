"""What a forward pass carries for multi-LoRA serving, from the scheduler (scheduler/lora.py) to every TP
rank's adapter pool (model_executor/lora_manager.py)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoraStep:
    """Each row's adapter slot (-1: the base model); the adapters this pass first puts into slots, as
    (slot, uid, path: a rank that has not read the adapter yet reads it from there); the uids unloaded
    since the last pass (each rank lets its host copy go)."""

    slots: list[int]
    loads: list[tuple[int, int, str]] = field(default_factory=list)
    drops: list[int] = field(default_factory=list)
