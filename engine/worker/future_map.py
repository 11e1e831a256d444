"""The overlap loop's future map: where a launched batch's tokens wait for the next batch.

Batch N reserves one slot per request at launch; batch N+1 is built with -slot placeholders as the
decode inputs of those requests, resolved on the device just before its forward
(triton_ops/future_resolve.py). Batches run strictly in launch order, so N's tokens are always in
the map when N+1 resolves them. The driver's executor (worker/executors/) and each TP follower
(tp_step.py) keep one.

A verify step (speculative decoding) also stores, per request, how many tokens it emitted
(`accepted`): a verify step launched behind it is built before those are known, and the worker
shifts its rows by them (TpModelWorker._resolve_lagged; speculative/verify_strategy.py); and for a hybrid
model, the node whose recurrent state follows those tokens (`state_node`: a chain's count - 1, a tree's
last accepted node), the scratch state that step's rows roll back to.
"""
from __future__ import annotations

import torch


class FutureMap:
    """A ring of token slots on the device; index 0 is never used so -index is always negative."""

    def __init__(self, max_running_requests: int, device: str) -> None:
        self.size = 5 * (max_running_requests + 1)  # room for several batches in flight
        self.token_ids = torch.zeros(self.size + 1, dtype=torch.int64, device=device)
        self.accepted = torch.zeros(self.size + 1, dtype=torch.int64, device=device)  # slot 0 stays 0
        self.state_node = torch.zeros(self.size + 1, dtype=torch.int64, device=device)
        self.ct = 0

    def reserve(self, bs: int) -> torch.Tensor:
        start = self.ct
        self.ct = (self.ct + bs) % self.size
        return torch.arange(start, start + bs, dtype=torch.int64) % self.size + 1
