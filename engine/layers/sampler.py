"""Sample the next token of every request in a batch from its last-position logits.

Order: penalties, logit_bias, grammar mask -> greedy rows: argmax -> temperature -> softmax -> top-k -> top-p -> min-p ->
multinomial. top-p is taken over the top-k-restricted distribution (renormalised), as in HF
`generate` and vLLM. An all-greedy batch without penalties is one `argmax` and nothing else.

The sampler is a layer op (layers/custom_op.py) bound once, for the worker's device: its torch
reference serves CUDA; on CPU the native sampler (kernels/cpu_sampling.py) applies the penalties and,
from temperature on, does the same without sorting the vocabulary; its draws come from each
request's rng_seed and draw number, where torch's come from the request's generator (seeded) or the
global one. `BATON_DISABLE_CPU_KERNELS=1` (or a kernel that does not build) binds the reference on CPU
too; `--disable-fused-ops` does not change the sampler (its draws would change with it).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from baton.engine.kernels import cpu_sampling
from baton.engine.layers.custom_op import CustomOp
from baton.engine.sampling.penalties import apply_penalties
from baton.engine.sampling.sampling_batch_info import SamplingBatchInfo


class SampleOutput(NamedTuple):
    next_token_ids: torch.Tensor  # [bs] int64
    next_token_logprobs: Optional[torch.Tensor]  # [bs] float32
    top_logprobs: Optional[list[list[tuple[float, int]]]]  # per row, best first


class Sampler(CustomOp):
    def __init__(self, device: Optional[str] = None) -> None:
        """`device`: bind for it now (a worker's sampler is no model's layer: bind_layer_ops never
        reaches it). Unbound, it is the torch reference."""
        super().__init__()
        if device is not None:
            self.bind(device, fused=True)

    def path_available(self, path: str) -> bool:
        return path != "cpu" or cpu_sampling.unavailable_reason() is None

    def forward_native(self, logits: torch.Tensor, info: SamplingBatchInfo, return_logprob: bool,
                       top_logprobs_nums: list[int]) -> SampleOutput:
        """`logits`: [bs, vocab] float32; clobbered in place.

        Logprobs are those of the unmodified model distribution: log_softmax of the raw logits,
        before penalties, temperature and top-k/top-p/min-p (SGLang's default). Worker side: after
        sampling, the request states in `info` are advanced (`info.on_sampled`).
        """
        return _sample_batch(logits, info, return_logprob, top_logprobs_nums, native=False)

    def forward_cpu(self, logits: torch.Tensor, info: SamplingBatchInfo, return_logprob: bool,
                    top_logprobs_nums: list[int]) -> SampleOutput:
        """forward_native's contract, the penalties and the draws on the native sampler."""
        return _sample_batch(logits, info, return_logprob, top_logprobs_nums, native=True)


def _sample_batch(logits: torch.Tensor, info: SamplingBatchInfo, return_logprob: bool,
                  top_logprobs_nums: list[int], native: bool) -> SampleOutput:
    assert logits.dim() == 2 and logits.shape[0] == info.batch_size
    assert logits.dtype == torch.float32, "sample from float32 logits"
    logprobs = torch.log_softmax(logits, dim=-1) if return_logprob else None  # [bs, vocab]
    if info.has_penalties or info.has_min_tokens or info.has_logit_bias or info.has_grammar:
        apply_penalties(logits, info, native)
    if info.is_all_greedy:
        next_ids = torch.argmax(logits, dim=-1)  # [bs]
    else:
        next_ids = _sample(logits, info, native)
    info.on_sampled(next_ids)
    if logprobs is None:
        return SampleOutput(next_ids, None, None)
    token_logprobs = logprobs.gather(1, next_ids.view(-1, 1)).view(-1)  # [bs]
    return SampleOutput(next_ids, token_logprobs, top_logprobs(logprobs, top_logprobs_nums))


def top_logprobs(logprobs: torch.Tensor, nums: list[int]) -> list[list[tuple[float, int]]]:
    """`logprobs`: [rows, vocab]; row i keeps its best `nums[i]` as (logprob, token_id)."""
    assert len(nums) == logprobs.shape[0]
    k = min(max(nums, default=0), logprobs.shape[1])
    if k <= 0:
        return [[] for _ in nums]
    values, ids = logprobs.topk(k, dim=-1)  # [rows, k]
    values, ids = values.tolist(), ids.tolist()
    return [list(zip(values[i][:n], ids[i][:n])) for i, n in enumerate(nums)]


def _sample(logits: torch.Tensor, info: SamplingBatchInfo, native: bool) -> torch.Tensor:
    """Mixed batch: greedy rows take argmax of the penalised logits, the rest are sampled (`native`: by
    the CPU sampler, whose draws come from each request's rng_seed and draw number)."""
    greedy_ids = torch.argmax(logits, dim=-1) if info.greedy_mask is not None else None  # [bs]
    if native:
        next_ids = cpu_sampling.sample(logits, info.temperatures, info.top_ks, info.top_ps, info.min_ps,
                                       [s.rng_seed for s in info.states], info.counters)
        return next_ids if greedy_ids is None else torch.where(info.greedy_mask, greedy_ids, next_ids)
    logits.div_(info.temperatures)
    probs = torch.softmax(logits, dim=-1)  # [bs, vocab]
    if info.need_top_k or info.need_top_p:
        next_ids = _sample_sorted(probs, info)
    else:
        if info.need_min_p:
            _mask_min_p(probs, info.min_ps)
        next_ids = _multinomial(probs, info)
    if greedy_ids is not None:
        next_ids = torch.where(info.greedy_mask, greedy_ids, next_ids)
    return next_ids


def _sample_sorted(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    probs_sort, probs_idx = probs.sort(dim=-1, descending=True)  # [bs, vocab] each
    if info.need_top_k:
        ranks = torch.arange(probs.shape[1], device=probs.device).view(1, -1)  # [1, vocab]
        probs_sort.masked_fill_(ranks >= info.top_ks.view(-1, 1), 0.0)
    if info.need_top_p:
        cumsum = probs_sort.cumsum(dim=-1)  # [bs, vocab]
        mass = cumsum[:, -1:]  # [bs, 1], what top-k left (renormalising without dividing)
        mass_before = cumsum - probs_sort
        drop = (mass_before > info.top_ps.view(-1, 1) * mass) & (info.top_ps < 1.0).view(-1, 1)
        probs_sort.masked_fill_(drop, 0.0)
    if info.need_min_p:
        _mask_min_p(probs_sort, info.min_ps)
    picked = _multinomial(probs_sort, info)  # [bs], positions in sorted order
    return probs_idx.gather(1, picked.view(-1, 1)).view(-1)


def _mask_min_p(probs: torch.Tensor, min_ps: torch.Tensor) -> None:
    """Drop tokens below min_p * (top probability); the ratio does not care about normalisation."""
    threshold = probs.max(dim=-1, keepdim=True).values * min_ps.view(-1, 1)  # [bs, 1]
    probs.masked_fill_(probs < threshold, 0.0)


def _multinomial(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """One draw per row from unnormalised `probs` [bs, n]. Seeded rows use their own generator,
    one row at a time, so their draws do not depend on what else is in the batch."""
    seeded = info.seeded_rows
    if len(seeded) < probs.shape[0]:
        next_ids = torch.multinomial(probs, num_samples=1).view(-1)  # [bs]
    else:
        next_ids = torch.empty(probs.shape[0], dtype=torch.int64, device=probs.device)
    for i in seeded:
        generator = info.states[i].generator
        next_ids[i : i + 1] = torch.multinomial(probs[i], num_samples=1, generator=generator)
    return next_ids
