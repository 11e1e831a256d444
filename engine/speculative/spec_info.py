"""What a verify step carries between the scheduler and the worker (SGLang: spec_info).

A verify step runs each request of the decode batch as a small extend over its last token and its
draft, on top of the KV it holds:

    row i's tokens   [ last | d1 .. dk ]             k = len(drafts[i]) (0: a plain decode step)
    positions        L_i .. L_i + k                  L_i = the request's computed KV length
    logits row L_i+j predicts the token after position L_i + j: the target's own choice where the draft
    had d_{j+1}

The worker compares them (verify.py) and returns, per request, the accepted draft tokens followed by the
target's token at the first position it disagreed (or after the last draft token): 1 to k + 1 tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class VerifyInput:
    drafts: list[list[int]]  # per request, its draft tokens (may be empty)
    # hybrid models: per request, the scratch slots that take its recurrent state after each of its
    # first len(draft) tokens (offsets 1 .. k), to roll back to where the drafts stop being accepted
    state_slots: Optional[list[list[int]]] = None
    # a draft head (head_drafter.py): batch index -> (first draft, the head's output) a PD prefill sent
    # for a transferred request, put in its row before the chain is drafted
    primes: Optional[dict[int, tuple[int, Any]]] = None
    # the first token row of each request in the batch's packed tokens (filled in __post_init__)
    offsets: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.offsets, start = [], 0
        for d in self.drafts:
            self.offsets.append(start)
            start += 1 + len(d)

    @property
    def num_draft_tokens(self) -> int:
        return sum(map(len, self.drafts))


@dataclass
class VerifyOutput:
    # per request: accepted draft tokens, then the target's token (1 .. k + 1 tokens)
    tokens: list[list[int]]
    # per request and token (with return_logprob): the target's logprob of it, its top logprobs
    logprobs: Optional[list[list[float]]] = None
    top_logprobs: Optional[list[list[list[tuple[float, int]]]]] = None

    @property
    def last_tokens(self) -> list[int]:
        """Each request's next decode input: the last token it emitted."""
        return [t[-1] for t in self.tokens]
