"""The PD strategy's interface, as its no-op implementation: Colocated (no disaggregation), and the
SchedulerView a strategy sees its scheduler through (strategy.py picks one)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from baton.engine.disaggregation.base import DisaggregationMode

if TYPE_CHECKING:
    from baton.engine.core.queues import SchedulerQueues
    from baton.engine.core.req import Req
    from baton.engine.core.weight_version import WeightVersion
    from baton.engine.core.schedule_batch import ScheduleBatch
    from baton.engine.io_struct import AbortReq, TokenizedGenerateReqInput
    from baton.engine.mem_cache.allocator import TokenToKVPoolAllocator
    from baton.engine.mem_cache.base import BasePrefixCache
    from baton.engine.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from baton.engine.disaggregation.config import PDConfig
    from baton.engine.model_config import ModelConfig

Error = tuple[str, int]  # (message, HTTP status)


@dataclass(frozen=True)
class SchedulerView:
    """What a PD strategy may use of its scheduler."""

    config: "PDConfig"  # the flags PD reads
    tokenizer: Any
    dp_rank: int
    page_size: int
    max_running_requests: int
    req_to_token_pool: "ReqToTokenPool"
    allocator: "TokenToKVPoolAllocator"
    tree_cache: "BasePrefixCache"
    kv_pool: "MHATokenToKVPool"
    tp: Any  # distributed.parallel_state.TpGroup
    queues: "SchedulerQueues"  # waiting, running_batch, chunked_req (mutable, shared with the scheduler)
    new_token_ratio: Callable[[], float]
    new_batch: Callable[[list["Req"]], "ScheduleBatch"]
    finish_request: Callable[["Req"], None]  # release its memory (once)
    stream_output: Callable[[list["Req"]], None]
    record_token: Callable[["Req", int, Any], None]  # append row i's sampled token of a result
    extend_result_prologue: Callable[["Req", int, Any], bool]
    count_generated: Callable[[int], None]
    state_pool: Any = None  # a hybrid model's mem_cache.state_pool.RecurrentStatePool (slot = request row)
    model_config: Optional["ModelConfig"] = None  # the model's, for the pair's handshake (base.model_identity)
    # speculation with a draft head: the worker's speculative.head_worker.HeadDrafter (a prefill sends
    # each request's first draft and the head's output with its KV, so the decode drafts at once)
    drafter: Any = None


class Colocated:
    """No disaggregation: the no-op strategy. Every hook is what a PD strategy does in addition."""

    mode = DisaggregationMode.NULL
    # prefilled requests stay here to decode (a prefill engine hands them to its inflight queue)
    keeps_prefilled_requests = True
    # the loop must keep polling while nothing runs (KV transfers progress in the background)
    polls_in_background = False
    # the weights' version: a prefill stamps it into each request's KV metadata, a decode refuses a
    # request prefilled under another (set by scheduler/weights.py)
    weight_version: Optional["WeightVersion"] = None

    def __init__(self, view: SchedulerView) -> None:
        self.view = view

    def admit(self, req: "Req", recv: "TokenizedGenerateReqInput") -> Optional[Error]:
        """A valid request enters the strategy's first queue; an error ends it instead."""
        self.view.queues.waiting.append(req)
        return None

    def step(self) -> None:
        """Once per loop iteration, before the next batch is chosen: move requests between queues."""

    def on_extend_result(self, launched: Any, result: Any) -> bool:
        """A prefill batch's result; True when the strategy processed it (its tokens leave this engine)."""
        return False

    def release(self, req: "Req") -> None:
        """A request ends (finished, aborted): drop its transfer state, telling the peer if early."""

    def abort(self, recv: "AbortReq") -> None:
        """Abort the requests the strategy's own queues hold."""

    def num_reqs_holding_rows(self) -> int:
        """Requests outside the running batch that hold a request row (they count as running)."""
        return 0

    def is_idle(self) -> bool:
        return True

    def check_integrity(self) -> bool:
        return True

    def server_info(self) -> dict:
        return {}

    def log_fields(self) -> str:
        """Extra fields of the scheduler's batch log lines (SGLang's PD servers add their queues)."""
        return ""

    def close(self) -> None:
        pass
