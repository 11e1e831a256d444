"""One generation request as the scheduler sees it."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch

from baton.engine.io_struct import FinishReason
from baton.engine.mem_cache.base import cache_key
from baton.engine.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from baton.engine.mem_cache.base import BasePrefixCache
    from baton.engine.multimodal.inputs import MultimodalInputs
    from baton.engine.sampling.sampling_batch_info import ReqSamplingState

_EMPTY = torch.empty((0,), dtype=torch.int64)
# stop strings are searched in the decoded tail of this many tokens
_STOP_STR_TAIL_TOKENS = 32
# Reserve at most this many future decode tokens per request when budgeting (SGLang's
# CLIP_MAX_NEW_TOKENS): a request asking for 32k tokens should not block admission by itself.
CLIP_MAX_NEW_TOKENS = 4096


@dataclass(eq=False)  # identity comparison: requests live in sets and lists
class Req:
    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    origin_input_text: Optional[str] = None
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    priority: int = 0
    require_reasoning: bool = False  # the output starts with reasoning (a grammar waits for its end)
    arrival_time: float = field(default_factory=time.time)
    # a vision-language model's images (multimodal/inputs.py): their prompt positions, pixels and the
    # prompt's M-RoPE positions; None for text
    mm_inputs: Optional["MultimodalInputs"] = None
    # what a position past the prompt adds to its index for RoPE (M-RoPE: images take fewer positions
    # than tokens); 0 for text. A PD decode takes it from the transfer metadata.
    rope_delta: int = 0

    def __post_init__(self) -> None:
        if self.mm_inputs is not None:
            self.rope_delta = self.mm_inputs.mrope_delta

    output_ids: list[int] = field(default_factory=list)
    # Filled by init_next_round_input() each time the request is scheduled for an extend.
    fill_ids: list[int] = field(default_factory=list)
    prefix_indices: torch.Tensor = _EMPTY
    last_node: Any = None
    extend_input_len: int = 0
    # Memory ownership (see mem_cache/base.py): set by ScheduleBatch.prepare_for_extend/decode.
    req_pool_idx: Optional[int] = None
    kv_committed_len: int = 0
    kv_allocated_len: int = 0
    # hybrid models: recurrent-state checkpoints tracked for this request and not yet on a radix node,
    # as (position, slot) (mem_cache/hybrid_radix_cache.py)
    state_checkpoints: list[tuple[int, int]] = field(default_factory=list)

    finished_reason: Optional[FinishReason] = None
    is_chunked: int = 0  # > 0 while a chunk of this request is in flight and more chunks follow
    is_retracted: bool = False
    cached_tokens: int = 0  # prompt tokens served from the prefix cache, for usage reporting
    sampling_state: Optional["ReqSamplingState"] = None  # created by the scheduler; mutated only by the worker
    sent_offset: int = 0  # output tokens already streamed to the detokenizer
    # logprobs, accumulated by the output processor
    input_token_logprobs: list = field(default_factory=list)
    input_top_logprobs: list = field(default_factory=list)
    output_token_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    input_logprobs_sent: bool = False
    first_token_time: Optional[float] = None
    queue_start_time: float = field(default_factory=time.time)
    # PD disaggregation (disaggregation/prefill.py, decode.py): where the prefill's bootstrap server
    # is, the pairing key, and this request's KV sender (prefill) or receiver (decode) while it lives.
    bootstrap_host: Optional[str] = None
    bootstrap_port: Optional[int] = None
    bootstrap_room: Optional[int] = None
    kv_transfer: Any = None
    kv_transfer_started: float = 0.0  # decode: when the destination was sent (transfer latency)
    kv_meta_slot: Optional[int] = None  # metadata buffer slot of the transfer, while kv_transfer lives
    kv_pages_sent: int = 0  # prefill: pages handed to the sender so far
    # speculative decoding (NGRAM): the index of this request's tokens its drafts come from
    # (speculative/ngram_index.py), built by the speculator on the request's first draft
    spec_index: Any = None
    # NEXTN / EAGLE: whether the draft head's row holds a first draft for the request
    # (speculative/head_strategy.py): False for a PD decode's transferred request until its first
    # step, unless the prefill sent its head's (`spec_prime`: first-draft candidates, head output and
    # the candidates' log-probabilities, HeadDrafter.prime_from), which its first step puts in the row
    spec_primed: bool = True
    spec_prime: Any = None
    # verify steps (speculative/verify_strategy.py): how many are launched and not yet processed; the latest
    # one's start as the scheduler knew it when building it, whether the worker moved that start on by
    # what the step before emitted (a lagged step), and the most it may emit (1 + its deepest branch);
    # what the last processed step emitted; a hybrid model's: the latest step's scratch slots (the state
    # after each of its tokens), and whether the state the request ends with is queued already
    spec_flight: int = 0
    spec_start: int = 0
    spec_lag: bool = False
    spec_reach: int = 0
    spec_emitted: int = 0
    spec_state_slots: Optional[list[int]] = None
    spec_state_final: bool = False
    # an embedding engine's result (--is-embedding): the pooled vector of the prompt's last token,
    # set by the output processor when the prefill's last chunk has run, which ends the request
    embedding: Optional[list[float]] = None
    # multi-LoRA serving (scheduler/lora.py): the uid of the adapter the request runs under, 0 for the base
    # model; set at intake. The prefix cache keys its tokens in that adapter's namespace.
    lora_uid: int = 0

    @property
    def grammar(self) -> Any:
        """Structured output (constrained/grammar.py): the matcher lives in the sampling state."""
        return None if self.sampling_state is None else self.sampling_state.grammar

    def finished(self) -> bool:
        return self.finished_reason is not None

    def remaining_token_budget(self) -> int:
        """The decode tokens to reserve for this request: what it may still generate, clipped. The
        one budget rule of admission, preemption and the PD decode's preallocation."""
        return min(self.sampling_params.max_new_tokens - len(self.output_ids), CLIP_MAX_NEW_TOKENS)

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def init_next_round_input(self, tree_cache: Optional["BasePrefixCache"]) -> None:
        """Set fill_ids and match the longest cached prefix before an extend."""
        self.fill_ids = self.origin_input_ids + self.output_ids
        if tree_cache is not None and self.req_pool_idx is None:
            # Compute at least one token so the pass yields logits; keep the positions whose input
            # logprobs were asked for out of the match.
            max_prefix = len(self.fill_ids) - 1
            if self.return_logprob and self.logprob_start_len >= 0:
                max_prefix = min(max_prefix, max(self.logprob_start_len - 1, 0))
            match = tree_cache.match_prefix(cache_key(self.fill_ids[:max_prefix], self.lora_uid))
            self.prefix_indices, self.last_node = match.device_indices, match.last_node
        self.extend_input_len = len(self.fill_ids) - self.kv_start_len

    @property
    def kv_start_len(self) -> int:
        """Where the next extend starts: after the cached prefix, or after this request's own
        computed KV when it already holds a row (the next chunk of a chunked prefill)."""
        if self.req_pool_idx is None:
            return len(self.prefix_indices)
        return self.kv_committed_len

    def sync_fill_ids(self) -> None:
        """Point fill_ids at exactly the tokens whose KV is computed (or launched): outputs may have
        arrived since the last extend, and in overlap mode a launched step may have run ahead."""
        self.fill_ids = (self.origin_input_ids + self.output_ids)[:self.kv_committed_len]
        self.kv_committed_len = len(self.fill_ids)

    def reset_for_retract(self) -> None:
        self.prefix_indices, self.last_node = _EMPTY, None
        self.req_pool_idx, self.kv_committed_len, self.kv_allocated_len = None, 0, 0
        self.extend_input_len, self.is_chunked, self.is_retracted = 0, 0, True
        self.queue_start_time = time.time()  # back in the waiting queue: its queue time starts again

    def check_finished(self, tokenizer: Any) -> None:
        """Length, EOS / stop token, or stop string, checked after each appended token."""
        if self.finished_reason is not None or not self.output_ids:
            return
        params, last = self.sampling_params, self.output_ids[-1]
        if len(self.output_ids) >= params.max_new_tokens:
            self.finished_reason = FinishReason("length")
            return
        if len(self.output_ids) < params.min_new_tokens:
            return
        if last in params.stop_token_ids or (not params.ignore_eos and last in self.eos_token_ids):
            self.finished_reason = FinishReason("stop", matched=last)
            return
        if params.stop and tokenizer is not None:
            tail = tokenizer.decode(self.output_ids[-_STOP_STR_TAIL_TOKENS:], skip_special_tokens=False)
            for stop in params.stop:
                if stop in tail:
                    self.finished_reason = FinishReason("stop", matched=stop)
                    return

    def accept_grammar_token(self, token_id: int) -> None:
        """Feed a sampled (or transferred) token to the request's grammar; a grammar that has
        accepted its stop token ends the request. A grammar waiting for the end of the reasoning
        starts after that token, which it does not see."""
        if self.finished_reason is not None:
            return
        if not self.grammar.active:
            self.grammar.note_reasoning_token(token_id)
            return
        if not self.grammar.accept(token_id):  # the mask makes this a bug, not a client error
            self.abort(f"token {token_id} is not allowed by the request's grammar", 500)
        elif self.grammar.terminated:
            self.finished_reason = FinishReason("stop", matched=token_id)

    def abort(self, message: str, status_code: int) -> None:
        if self.finished_reason is None:
            self.finished_reason = FinishReason("abort", message=message, status_code=status_code)
