"""Pure helpers around the LM head: pick each request's last position, score prompt tokens.

EXTEND batch, requests packed back to back (e_i = extend_seq_lens_cpu[i]):

    token index:  0 .. e0-1 | e0 .. e0+e1-1 | ...
    last token:        e0-1 |       e0+e1-1 | ...      = cumsum(e) - 1

Input (prompt) logprobs: the logits at position p predict token p+1, so the caller passes
`next_ids[p] = token at p+1` (for a chunk's last position: the next chunk's first token, or the
sampled token).
"""
from __future__ import annotations

from itertools import accumulate
from typing import NamedTuple, Union

import torch

from baton.engine.layers.sampler import top_logprobs

# rows of [rows, vocab] float32 scored at once: bounds the temporary log_softmax for long prompts
_INPUT_LOGPROB_CHUNK = 2048


class PromptSpan(NamedTuple):
    """The prompt tokens one EXTEND request scores in this chunk: tokens first_t..first_t+rows-1,
    predicted by the packed hidden rows first_row..first_row+rows-1 (rows may be 0)."""
    first_t: int
    first_row: int
    rows: int


def prompt_logprob_spans(input_logprob_reqs: list[tuple[int, int, int, int]], extend_prefix_lens_cpu: list[int],
                         extend_seq_lens_cpu: list[int], seq_lens_cpu: list[int]) -> list[PromptSpan]:
    """One span per request that wants input logprobs (ModelWorkerBatch.input_logprob_reqs), in
    its order.
    Chunk positions p..s-1 are in the batch; token t is predicted by position t-1, and the first
    prompt token by nothing, so the scored tokens are t in [max(start, p + 1, 1), min(s, len - 1)]
    (t == s: the next chunk's first token, predicted by this chunk's last position)."""
    starts = list(accumulate(extend_seq_lens_cpu, initial=0))
    spans = []
    for i, start_pos, input_len, _ in input_logprob_reqs:
        p, s = extend_prefix_lens_cpu[i], seq_lens_cpu[i]
        first_t, last_t = max(start_pos, p + 1, 1), min(s, input_len - 1)
        spans.append(PromptSpan(first_t, starts[i] + first_t - 1 - p, max(0, last_t - first_t + 1)))
    return spans


class InputLogprobs(NamedTuple):
    token_logprobs: torch.Tensor  # [n_tokens] float32
    top_logprobs: list[list[tuple[float, int]]]  # per position, best first; [] each when top_k == 0


def last_token_indices(extend_seq_lens_cpu: list[int], device: Union[str, torch.device] = "cpu") -> torch.Tensor:
    """[bs] int64: index of each request's last new token in the packed EXTEND batch."""
    assert all(n >= 1 for n in extend_seq_lens_cpu), "every EXTEND request has >= 1 new token"
    ends = list(accumulate(extend_seq_lens_cpu))
    return torch.tensor(ends, dtype=torch.int64).sub_(1).to(device)


def select_last_tokens(hidden: torch.Tensor, extend_seq_lens_cpu: list[int]) -> torch.Tensor:
    """`hidden`: [num_tokens, ...] of an EXTEND batch -> [bs, ...], each request's last position."""
    assert hidden.shape[0] == sum(extend_seq_lens_cpu)
    if len(extend_seq_lens_cpu) == hidden.shape[0]:  # one token each: nothing to select
        return hidden
    return hidden.index_select(0, last_token_indices(extend_seq_lens_cpu, hidden.device))


def compute_input_logprobs(logits_all: torch.Tensor, next_ids: torch.Tensor, top_k: int) -> InputLogprobs:
    """`logits_all`: [n_tokens, vocab] raw logits; `next_ids`: [n_tokens] the token that followed
    each position. Returns log p(next_ids[p] | prefix up to p), plus the `top_k` best per position.
    Same distribution as the sampler's logprobs: log_softmax of raw float32 logits."""
    assert logits_all.dim() == 2 and next_ids.shape == (logits_all.shape[0],)
    token_parts, top = [], []
    for start in range(0, logits_all.shape[0], _INPUT_LOGPROB_CHUNK):
        chunk = logits_all[start : start + _INPUT_LOGPROB_CHUNK].float()  # [rows, vocab]
        ids = next_ids[start : start + _INPUT_LOGPROB_CHUNK].to(chunk.device, torch.int64)  # [rows]
        logprobs = torch.log_softmax(chunk, dim=-1)
        token_parts.append(logprobs.gather(1, ids.view(-1, 1)).view(-1))
        top.extend(top_logprobs(logprobs, [top_k] * chunk.shape[0]))
    if not token_parts:
        return InputLogprobs(logits_all.new_empty(0, dtype=torch.float32), [])
    return InputLogprobs(torch.cat(token_parts), top)
