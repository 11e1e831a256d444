"""Logit penalties and min_new_tokens, applied in place before temperature.

- repetition: HF `RepetitionPenaltyLogitsProcessor` over prompt + output tokens, each token once:
  logit > 0 -> logit / penalty, else logit * penalty.
- frequency / presence: OpenAI semantics over output tokens only (as in SGLang):
  logit -= frequency * count + presence * (count > 0).
- logit_bias: OpenAI semantics, the bias is added to the token's logit (after the penalties, as
  vLLM's logits processor does; a greedy request takes the argmax of the biased logits).
- grammar (structured output): tokens the request's grammar does not allow next are -inf.
- min_new_tokens: while fewer tokens were sampled, the request's stop ids (eos + stop_token_ids)
  are -inf.
"""
from __future__ import annotations

import torch

from baton.engine.kernels import cpu_sampling
from baton.engine.sampling.sampling_batch_info import SamplingBatchInfo


def apply_penalties(logits: torch.Tensor, info: SamplingBatchInfo, native: bool = False) -> None:
    """`logits`: [bs, vocab] float32, modified in place. Worker side (reads the request states).
    `native`: the token penalties on the CPU sampler's kernel (a sampler bound for CPU, which chose it
    at load: layers/sampler.py), for contiguous logits; else torch's ops."""
    assert logits.dim() == 2 and logits.shape[0] == info.batch_size
    if info.has_penalties:
        _apply_token_penalties(logits, info, native)
    for i in info.bias_rows:
        ids, values = info.states[i].logit_bias()
        logits[i].index_add_(0, ids.to(logits.device), values.to(logits.device))
    if info.has_grammar:
        from baton.engine.constrained.grammar import apply_bitmasks

        apply_bitmasks(logits, info.grammar_rows, [info.states[i].grammar for i in info.grammar_rows])
    if info.has_min_tokens:
        _block_stop_ids(logits, info)


def _apply_token_penalties(logits: torch.Tensor, info: SamplingBatchInfo, native: bool) -> None:
    states = [info.states[i] for i in info.penalty_rows]
    for s in states:
        s.ensure_penalty_tensors()
        assert s.output_counts.shape[0] == logits.shape[1], "state vocab != logits vocab"
    if native and logits.is_contiguous():
        # one pass per row over its own count and mask (the stacked torch version below: ~10 full
        # [rows, vocab] temporaries)
        params = [s.params for s in states]
        cpu_sampling.apply_penalties(logits, info.penalty_rows, [s.output_counts for s in states],
                                     [s.seen_mask for s in states], [p.repetition_penalty for p in params],
                                     [p.frequency_penalty for p in params], [p.presence_penalty for p in params])
        return
    device = logits.device
    rows = torch.tensor(info.penalty_rows, dtype=torch.int64, device=device)  # [n]
    counts = torch.stack([s.output_counts for s in states]).to(device)  # [n, vocab] int32
    seen = torch.stack([s.seen_mask for s in states]).to(device)  # [n, vocab] bool
    params = [s.params for s in states]
    rep = _column([p.repetition_penalty for p in params], device)  # [n, 1]
    freq = _column([p.frequency_penalty for p in params], device)  # [n, 1]
    pres = _column([p.presence_penalty for p in params], device)  # [n, 1]
    sub = logits.index_select(0, rows)  # [n, vocab]
    penalised = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(seen, penalised, sub)
    sub -= freq * counts.to(torch.float32)
    sub -= pres * (counts > 0).to(torch.float32)
    logits.index_copy_(0, rows, sub)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).view(-1, 1)


def _block_stop_ids(logits: torch.Tensor, info: SamplingBatchInfo) -> None:
    for i in info.min_tokens_rows:
        state = info.states[i]
        if state.min_tokens_active and state.grammar is None:  # a finished grammar allows only stop ids
            logits[i].index_fill_(0, state.min_tokens_stop_ids.to(logits.device), float("-inf"))
