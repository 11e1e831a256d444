"""Sampling state per request (worker-owned) and the per-batch view the sampler reads.

Why two objects: in overlap mode the scheduler builds batch N+1 before it has looked at batch N's
sampled tokens. Everything that depends on previously sampled tokens (penalty counts, how many
tokens were sampled for `min_new_tokens`, the seeded RNG) therefore lives in `ReqSamplingState`,
which only the forward worker mutates, in batch order, right after it samples. The scheduler
creates the state once per request and afterwards only passes it along; `SamplingBatchInfo.from_states`
reads nothing but the static parts (params, whether a generator / stop ids exist).
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Union

import torch

from baton.engine.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from baton.engine.constrained.grammar import Grammar


class ReqSamplingState:
    """One request's sampling state. Built by the scheduler; mutated only by the forward worker.

    Penalty tensors are built lazily on first use so that the scheduler never allocates device
    memory and requests without penalties never pay for a vocab-sized tensor.
    """

    def __init__(
        self,
        params: SamplingParams,
        prompt_ids: list[int],
        vocab_size: int,
        stop_ids_for_min_tokens: set[int],
        device: Union[str, torch.device],
    ) -> None:
        assert vocab_size > 0
        self.params = params
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.num_sampled = 0
        # tokens verify steps checked on the device emitted, before the host has read them (launch
        # order, a [1] int64 on the logits' device; min_new_tokens only: sampled())
        self.sampled_on_device: Optional[torch.Tensor] = None
        # the CPU sampler's draw for a step comes from (rng_seed, that step's draw number)
        # (kernels/cpu_sampling.py): the request's seed, else one drawn here from torch's generator;
        # `draws` numbers the steps that sample this request, as they are launched (next_draw)
        if params.seed is not None:
            self.rng_seed = params.seed % (1 << 63)
        else:  # a greedy request never draws: no seed to take from the generator
            self.rng_seed = 0 if params.is_greedy else int(torch.randint(0, 1 << 62, (1,)))
        self.draws = 0
        self.generator: Optional[torch.Generator] = None  # the torch sampler's (other devices)
        if params.seed is not None:
            self.generator = torch.Generator(device=self.device)
            self.generator.manual_seed(params.seed)
        # [num_stop] int64 (eos ids + stop_token_ids); None when min_new_tokens cannot block anything
        self.min_tokens_stop_ids: Optional[torch.Tensor] = None
        if params.min_new_tokens > 0 and stop_ids_for_min_tokens:
            ids = sorted(stop_ids_for_min_tokens)
            assert all(0 <= t < vocab_size for t in ids), "stop id outside the vocabulary"
            self.min_tokens_stop_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        # kept only until the penalty tensors are built (repetition penalty counts the prompt)
        self._prompt_ids: Optional[list[int]] = list(prompt_ids) if params.has_penalties else None
        self.output_counts: Optional[torch.Tensor] = None  # [vocab] int32, output tokens only
        self.seen_mask: Optional[torch.Tensor] = None  # [vocab] bool, prompt + output tokens
        self._bias: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # logit_bias as (ids, values)
        # structured output (engine/constrained/grammar.py). The one exception to "worker only": the
        # scheduler fills its bitmask before launching a batch, once the previous step's result is
        # processed (so the worker never reads a row while it is written).
        self.grammar: Optional["Grammar"] = None
        self._simple = not params.has_penalties and self.min_tokens_stop_ids is None and not params.logit_bias
        self._plain = params.is_greedy and self._simple

    @property
    def plain_greedy(self) -> bool:
        """An argmax and nothing else: greedy, no penalties, min_new_tokens, logit bias or grammar
        (the sampler would only take the argmax and bump num_sampled)."""
        return self._plain and self.grammar is None

    @property
    def plain_sampling(self) -> bool:
        """Temperature, top-k/p, min-p and a seed at most: the native CPU step can draw its token
        (no penalties, min_new_tokens, logit bias or grammar; greedy or not)."""
        return self._simple and self.grammar is None

    def next_draw(self) -> int:
        """The draw number of the step being launched for this request (then one more)."""
        self.draws += 1
        return self.draws - 1

    @property
    def has_penalties(self) -> bool:
        return self.params.has_penalties

    @property
    def min_tokens_active(self) -> bool:
        """Whether min_new_tokens may still block the stop ids. Exact for host steps (num_sampled); where
        verify steps checked on the device have run and not been read yet, it may still say True once
        they passed it: those steps block by sampled(), exact on the device."""
        return self.min_tokens_stop_ids is not None and self.num_sampled < self.params.min_new_tokens

    def sampled(self, device: torch.device) -> torch.Tensor:
        """[1] int64 on `device`: the tokens sampled so far, counting the device-checked verify steps
        launched before this point (nothing read back). num_sampled + sampled_on_device."""
        if self.sampled_on_device is None:
            self.sampled_on_device = torch.zeros(1, dtype=torch.int64, device=device)
        return self.sampled_on_device + self.num_sampled

    def on_read(self, emitted: int, counted: bool) -> None:
        """The host read a device-checked verify step's `emitted` tokens: num_sampled takes them, and
        where that step counted them on the device (`counted`) they leave sampled_on_device (the sum
        stays what it was, in launch order)."""
        self.num_sampled += emitted
        if counted:
            with torch.inference_mode():  # made by the worker's pass (inference mode)
                self.sampled_on_device -= emitted

    def logit_bias(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`params.logit_bias` as ([k] int64 ids, [k] float32 biases), built on first use (worker side)."""
        if self._bias is None:
            bias = self.params.logit_bias
            assert bias, "logit_bias() of a request without one"
            self._bias = (torch.tensor(list(bias), dtype=torch.int64, device=self.device),
                          torch.tensor(list(bias.values()), dtype=torch.float32, device=self.device))
        return self._bias

    def ensure_penalty_tensors(self) -> None:
        """Build `output_counts` / `seen_mask` on first use (worker side)."""
        if self.output_counts is not None or not self.has_penalties:
            return
        self.output_counts = torch.zeros(self.vocab_size, dtype=torch.int32, device=self.device)
        self.seen_mask = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
        # ids the LM head cannot produce are skipped, as HF's processor does
        prompt = [t for t in self._prompt_ids or () if 0 <= t < self.vocab_size]
        if prompt:
            self.seen_mask[torch.tensor(prompt, dtype=torch.int64, device=self.device)] = True
        self._prompt_ids = None

    def on_sampled(self, token_id: Union[int, torch.Tensor]) -> None:
        """Record one sampled token. A device scalar is used as is (no host sync)."""
        self.num_sampled += 1
        if not self.has_penalties:
            return
        self.ensure_penalty_tensors()
        if not isinstance(token_id, torch.Tensor):
            token_id = torch.tensor(token_id, dtype=torch.int64)
        tok = token_id.to(device=self.device, dtype=torch.int64).view(1)  # [1]
        self.output_counts.scatter_add_(0, tok, torch.ones(1, dtype=torch.int32, device=self.device))
        self.seen_mask.index_fill_(0, tok, True)


@dataclass
class SamplingBatchInfo:
    """What the sampler needs for one batch. Built by the scheduler from static request data only.

    The per-row tensors are None when `is_all_greedy`: that batch is a plain argmax (plus penalties
    when some row has them), and building them would be wasted host work on the decode hot path.
    """

    states: list[ReqSamplingState]
    is_all_greedy: bool
    need_top_p: bool
    need_top_k: bool
    need_min_p: bool
    has_penalties: bool
    has_min_tokens: bool
    has_seeds: bool
    temperatures: Optional[torch.Tensor]  # [bs, 1] float32
    top_ps: Optional[torch.Tensor]  # [bs] float32
    top_ks: Optional[torch.Tensor]  # [bs] int64, vocab size where disabled
    min_ps: Optional[torch.Tensor]  # [bs] float32
    greedy_mask: Optional[torch.Tensor]  # [bs] bool; None when no row or every row is greedy
    penalty_rows: list[int]  # rows whose request has repetition/frequency/presence penalties
    min_tokens_rows: list[int]  # rows whose request may block stop ids (min_new_tokens > 0)
    bias_rows: list[int]  # rows whose request has a logit_bias
    grammar_rows: list[int]  # rows whose request has a grammar (structured output)
    seeded_rows: list[int]  # non-greedy rows sampled with the request's own generator (torch's sampler)
    discard_rows: frozenset[int]  # rows sampled greedily and not recorded (see from_states)
    counters: list[int]  # each row's draw number for the CPU sampler (see from_states)

    @property
    def has_logit_bias(self) -> bool:
        return bool(self.bias_rows)

    @property
    def has_grammar(self) -> bool:
        return bool(self.grammar_rows)

    @property
    def batch_size(self) -> int:
        return len(self.states)

    @classmethod
    def from_states(
        cls,
        states: list[ReqSamplingState],
        device: Union[str, torch.device],
        *,
        discard_rows: Collection[int] = (),
        counters: Optional[list[int]] = None,
    ) -> "SamplingBatchInfo":
        """`discard_rows`: rows whose token the scheduler will throw away (a chunked prefill's
        non-final chunk). They are sampled greedily and leave their state untouched, so a seeded
        request draws the same numbers however its prompt was chunked. `counters`: each row's draw
        number for the CPU sampler (ModelWorkerBatch.draws; by default its count of samples)."""
        discard = frozenset(discard_rows)
        assert all(0 <= i < len(states) for i in discard)
        greedy = [i in discard or s.params.is_greedy for i, s in enumerate(states)]
        live = [i for i in range(len(states)) if i not in discard]
        penalty_rows = [i for i in live if states[i].has_penalties]
        min_tokens_rows = [i for i in live if states[i].min_tokens_stop_ids is not None]
        bias_rows = [i for i in live if states[i].params.logit_bias]
        grammar_rows = [i for i in live if states[i].grammar is not None and states[i].grammar.active]
        seeded_rows = [i for i in live if not greedy[i] and states[i].generator is not None]
        is_all_greedy = all(greedy)
        tensors = (None, None, None, None, None)
        flags = (False, False, False)
        if not is_all_greedy:
            tensors, flags = _row_tensors(states, greedy, device)
        need_top_p, need_top_k, need_min_p = flags
        return cls(
            states=states,
            is_all_greedy=is_all_greedy,
            need_top_p=need_top_p,
            need_top_k=need_top_k,
            need_min_p=need_min_p,
            has_penalties=bool(penalty_rows),
            has_min_tokens=bool(min_tokens_rows),
            has_seeds=bool(seeded_rows),
            temperatures=tensors[0],
            top_ps=tensors[1],
            top_ks=tensors[2],
            min_ps=tensors[3],
            greedy_mask=tensors[4],
            penalty_rows=penalty_rows,
            min_tokens_rows=min_tokens_rows,
            bias_rows=bias_rows,
            grammar_rows=grammar_rows,
            seeded_rows=seeded_rows,
            discard_rows=discard,
            counters=counters if counters is not None else [s.num_sampled for s in states],
        )

    def on_sampled(self, next_token_ids: torch.Tensor) -> None:
        """Worker side, right after sampling: advance every recorded row's state.

        Only penalised rows touch a tensor (one scatter each, no host sync); the rest bump a counter.
        """
        penalised = set(self.penalty_rows)
        for i, state in enumerate(self.states):
            if i in self.discard_rows:
                continue
            if i in penalised:
                state.on_sampled(next_token_ids[i])
            else:
                state.num_sampled += 1


def row_params(states: list[Optional[ReqSamplingState]], greedy: list[bool], vocab: int,
               greedy_temperature: float = 1.0) -> tuple[list[float], list[float], list[int], list[float]]:
    """Per-row temperature, top_p, top_k (vocab: off) and min_p; greedy rows (a None state must be
    one) get neutral values and `greedy_temperature` (their token comes from the argmax)."""
    temps, top_ps, top_ks, min_ps = [], [], [], []
    for s, g in zip(states, greedy):
        p = None if g else s.params
        temps.append(greedy_temperature if g else p.temperature)
        top_ps.append(1.0 if g else p.top_p)
        top_ks.append(vocab if g or p.top_k == -1 else min(p.top_k, vocab))
        min_ps.append(0.0 if g else p.min_p)
    return temps, top_ps, top_ks, min_ps


def _row_tensors(
    states: list[ReqSamplingState], greedy: list[bool], device: Union[str, torch.device]
) -> tuple[tuple[torch.Tensor, ...], tuple[bool, bool, bool]]:
    """Per-row sampling tensors; greedy rows get neutral values (their token comes from argmax)."""
    vocab = states[0].vocab_size
    temps, top_ps, top_ks, min_ps = row_params(states, greedy, vocab)
    flags = (any(x < 1.0 for x in top_ps), any(k < vocab for k in top_ks), any(x > 0.0 for x in min_ps))
    tensors = (
        torch.tensor(temps, dtype=torch.float32).view(-1, 1).to(device),  # [bs, 1]
        torch.tensor(top_ps, dtype=torch.float32).to(device),  # [bs]
        torch.tensor(top_ks, dtype=torch.int64).to(device),  # [bs]
        torch.tensor(min_ps, dtype=torch.float32).to(device),  # [bs]
        torch.tensor(greedy, dtype=torch.bool).to(device) if any(greedy) else None,  # [bs]
    )
    return tensors, flags
