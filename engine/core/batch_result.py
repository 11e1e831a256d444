"""What a forward step hands back (GenerationBatchResult) and what the scheduler keeps of a launched
batch until it processes that result (LaunchedBatch)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from baton.engine.core.req import Req
    from baton.engine.core.schedule_batch import ModelWorkerBatch
    from baton.engine.core.spec_info import VerifyOutput


@dataclass
class GenerationBatchResult:
    next_token_ids: list[int]  # one per request (garbage for rows that did not sample)
    next_token_logprobs: Optional[list[float]] = None
    next_top_logprobs: Optional[list[list[tuple[float, int]]]] = None
    # batch index -> (logprobs of scored prompt tokens, their top logprobs)
    input_logprobs: dict[int, tuple[list, list]] = field(default_factory=dict)
    next_token_ids_tensor: Optional[torch.Tensor] = None  # [bs] int64 on the CPU
    next_token_ids_device: Optional[torch.Tensor] = None  # [bs] int64 on the model's device, for the future map
    # CUDA overlap only: recorded behind the non-blocking copy into next_token_ids_tensor, whose
    # values (and so next_token_ids) are only there once resolve() waited on it
    copy_done: Optional[Any] = None
    # a verify step (speculative decoding): each request's accepted tokens; next_token_ids then hold
    # each request's last one
    verify: Optional["VerifyOutput"] = None
    # a verify step accepted on the device (speculative/accept_device.py): `verify` once resolved
    pending_verify: Optional[Any] = None
    # an embedding engine's extend (--is-embedding): each request's pooled vector (layers/pooler.py);
    # nothing is sampled (next_token_ids are 0)
    embeddings: Optional[list[list[float]]] = None

    def resolve(self) -> "GenerationBatchResult":
        """Wait for the sampled ids (or a verify step's tokens) to reach the host (no-op when they already did)."""
        if self.pending_verify is not None:
            pending, self.pending_verify = self.pending_verify, None
            self.verify = pending.read()
            self.next_token_ids = self.verify.last_tokens
            self.next_token_ids_tensor = torch.tensor(self.next_token_ids, dtype=torch.int64)
        if self.copy_done is not None:
            self.copy_done.synchronize()
            self.next_token_ids = self.next_token_ids_tensor.tolist()
            self.copy_done = None
        return self

    def result(self) -> "GenerationBatchResult":
        """A result is its own handle where the batch ran at launch (executors/base.py ResultHandle)."""
        return self.resolve()


@dataclass
class LaunchedBatch:
    """What process_batch_result needs of a batch, frozen at launch (the live ScheduleBatch keeps
    changing in overlap mode)."""

    reqs: list[Req]
    mwb: ModelWorkerBatch
    result: Any  # GenerationBatchResult, or a Future of one in overlap mode

    def wait(self) -> GenerationBatchResult:
        """The batch's result, its tokens on the host (GenerationBatchResult.resolve: a no-op once done)."""
        return (self.result.result() if hasattr(self.result, "result") else self.result).resolve()
