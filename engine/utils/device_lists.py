"""Host lists onto the device without stalling the stream."""
from __future__ import annotations

import torch


def to_device(values: list, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A host list on the device. On CUDA through pinned memory without waiting: a copy from pageable
    memory synchronizes the stream, which would stall the host on the work queued before."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else t.to(device)
