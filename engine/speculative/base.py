"""The speculation strategy's interface, as its no-op implementation (no speculation), and the view of
the scheduler a strategy works through.

The scheduler holds one strategy, chosen once from --speculative-algorithm (__init__.py). Its decode
manager asks it, each decode step, whether the running batch verifies drafts this step
(`wants_verify`: cheap, before anything is drained) and then to turn the batch into a verify step
(`prepare_verify`: drafts, KV slots); the output processor hands it the verify step's result
(`process_verify_result`: append the accepted tokens, free the rejected drafts' KV).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from baton.engine.core.req import Req
    from baton.engine.core.schedule_batch import ScheduleBatch
    from baton.engine.mem_cache.allocator import TokenToKVPoolAllocator
    from baton.engine.mem_cache.base import BasePrefixCache
    from baton.engine.mem_cache.memory_pool import ReqToTokenPool
    from baton.engine.speculative.config import SpecConfig


@dataclass(frozen=True)
class SpecView:
    """What a speculation strategy may use of its scheduler."""

    config: "SpecConfig"  # the flags speculation reads
    tokenizer: Any
    req_to_token_pool: "ReqToTokenPool"
    allocator: "TokenToKVPoolAllocator"
    tree_cache: "BasePrefixCache"
    # append one token (its logprob and top logprobs, with return_logprob) to a request's output
    append_token: Callable[["Req", int, Optional[float], Optional[list]], None]
    finish_request: Callable[["Req"], None]  # release its memory (once)
    # hybrid models: the recurrent-state pool's scratch slot of (batch index, token offset, set) in a
    # verify step (mem_cache/state_pool.py scratch_slot); None for a model without recurrent state
    state_scratch: Optional[Callable[[int, int, int], int]] = None
    state_scratch_sets: int = 1  # 2: consecutive verify steps alternate (lagged verify steps)


class NoSpeculation:
    """--speculative-algorithm unset: every decode step is a plain one."""

    algorithm: Optional[str] = None
    # whether a verify step may be built and launched while the verify step before it still runs (the
    # overlap loop; verify_strategy.py prepare_lagged); else each verify step's result is processed first
    lags = False

    def allow_lagging(self, overlap: bool) -> None:
        """Told once by the scheduler: whether it runs the overlap loop (any TP size may lag)."""

    def prepare_lagged(self, batch: "ScheduleBatch", in_flight: list) -> bool:
        """Make the batch's step a verify step built behind `in_flight` (the launched batches whose
        results are not processed yet), without waiting for them; False: it cannot be (the caller drains
        them, then prepares as usual)."""
        return False

    def wants_verify(self, batch: "ScheduleBatch") -> bool:
        """Whether this decode step may verify drafts (the caller then drains the overlap loop's
        results, so that every request's last token is known, and calls prepare_verify)."""
        return False

    def prepare_verify(self, batch: "ScheduleBatch") -> bool:
        """Make the batch's step a verify step (ScheduleBatch.prepare_for_verify); False leaves it to
        a plain decode step (no request has a draft, or the KV pool has no room for drafts)."""
        return False

    def process_verify_result(self, launched: Any, result: Any) -> None:
        """A verify step's result (scheduler.LaunchedBatch, tp_worker.GenerationBatchResult)."""
        raise AssertionError("no verify step runs without speculation")

    def on_finished(self, req: "Req") -> None:
        """A request finished (once, whatever ended it)."""

    def server_info(self) -> dict:
        return {"speculative_algorithm": None}
