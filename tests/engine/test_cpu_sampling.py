"""The native CPU sampler (engine/kernels/cpu_sampling.py) against a reference of what temperature,
top-k, top-p and min-p keep: over a vocabulary large enough to run its histogram cut, every draw
comes from the kept set and the draws follow the kept probabilities; ties at a cut go to the lower
id; a draw depends on its row's seed and counter alone; rows that cannot draw give token 0."""
from __future__ import annotations

import pytest
import torch

from baton.engine.kernels import cpu_sampling

pytestmark = pytest.mark.skipif(cpu_sampling.unavailable_reason() is not None,
                                reason=f"no native sampler here: {cpu_sampling.unavailable_reason()}")

VOCAB = 5000


def reference_kept(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The kept tokens' probabilities [vocab] (float64, renormalised; 0 where dropped), as the torch
    sampler defines them: softmax(l / T), top-k, top-p over the top-k mass, min-p, in the order most
    probable first, lower id first."""
    w = torch.exp((logits.double() - logits.double().max()) / temperature)
    order = sorted(range(len(w)), key=lambda i: (-float(w[i]), i))
    k = top_k if 0 < top_k < len(w) else len(w)
    head = order[:k]
    top_mass = float(sum(w[i] for i in head))
    kept, before = [], 0.0
    for i in head:
        if top_p < 1.0 and before > top_p * top_mass:
            break
        kept.append(i)
        before += float(w[i])
    probs = torch.zeros_like(w)
    for i in kept:
        if w[i] >= min_p * w.max():
            probs[i] = w[i]
    return probs / probs.sum()


def draw(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float, seeds: list[int],
         counter: int) -> torch.Tensor:
    bs = len(seeds)
    return cpu_sampling.sample(logits.expand(bs, -1).contiguous(), torch.full((bs,), temperature),
                               torch.full((bs,), top_k if top_k > 0 else VOCAB), torch.full((bs,), top_p),
                               torch.full((bs,), min_p), seeds, [counter] * bs)


def _spread_logits(seed: int) -> torch.Tensor:
    """Distinct logits, so the reference's order has no ties."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, generator=g) * 2.5 + torch.arange(VOCAB) * 1e-6


CASES = [  # temperature, top_k, top_p (None: half-way between two cumulative masses), min_p
    (1.0, -1, 1.0, 0.0),
    (0.7, 40, 1.0, 0.0),
    (0.8, -1, None, 0.0),
    (1.3, 200, None, 0.0),
    (0.9, -1, 1.0, 0.05),
    (0.6, 100, None, 0.02),
]


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", CASES)
def test_draws_come_from_the_kept_set_with_its_probabilities(temperature, top_k, top_p, min_p):
    logits = _spread_logits(7)
    if top_p is None:  # a p whose cut falls between two tokens by a clear margin
        w = torch.exp((logits.double() - logits.double().max()) / temperature)
        head = w.sort(descending=True).values[: (top_k if top_k > 0 else VOCAB)]
        cum = head.cumsum(0)
        j = int((cum < 0.6 * cum[-1]).sum())
        top_p = float((cum[j] + cum[j + 1]) / 2 / cum[-1])
    want = reference_kept(logits, temperature, top_k, top_p, min_p)
    kept = set(torch.nonzero(want).view(-1).tolist())
    assert len(kept) >= 3
    counts = torch.zeros(VOCAB, dtype=torch.float64)
    n = 0
    for c in range(150):
        ids = draw(logits.clone(), temperature, top_k, top_p, min_p, list(range(100, 132)), c)
        assert set(ids.tolist()) <= kept, sorted(set(ids.tolist()) - kept)
        counts.index_add_(0, ids, torch.ones(len(ids), dtype=torch.float64))
        n += len(ids)
    freq = counts / n
    assert float((freq - want).abs().max()) < 0.02  # 4,800 draws: a token's frequency within ~4 sigma
    # and by groups of ~1/8 of the mass each, most probable first (each within ~5 sigma)
    order = want.argsort(descending=True)
    group = ((want[order].cumsum(0) - want[order]) * 8).floor().clamp(max=7).long()
    for g in range(8):
        members = order[group == g]
        if len(members):
            assert abs(float(freq[members].sum() - want[members].sum())) < 0.03, (g, len(members))


def test_ties_at_a_cut_go_to_the_lower_ids():
    flat = torch.zeros(VOCAB)
    got = set()
    for c in range(200):
        got |= set(draw(flat.clone(), 1.0, 3, 1.0, 0.0, [5, 6], c).tolist())
    assert got == {0, 1, 2}
    # top-p over a flat distribution: the cut is at ceil(p * vocab) tokens, the lowest ids
    got = set()
    for c in range(200):
        got |= set(draw(flat.clone(), 1.0, -1, 0.001, 0.0, [5, 6], c).tolist())
    assert got <= set(range(6)) and 0 in got


def test_a_draw_depends_on_its_seed_and_counter_only():
    logits = _spread_logits(3)
    rows = torch.stack([logits, _spread_logits(4), logits, logits])
    args = dict(temperatures=torch.tensor([1.0, 0.5, 1.0, 1.0]), top_ks=torch.tensor([VOCAB, 10, VOCAB, VOCAB]),
                top_ps=torch.tensor([0.9, 1.0, 0.9, 0.9]), min_ps=torch.zeros(4))
    a = cpu_sampling.sample(rows.clone(), **args, seeds=[11, 99, 11, 12], counters=[4, 0, 4, 4])
    alone = cpu_sampling.sample(logits.view(1, -1).clone(), args["temperatures"][:1], args["top_ks"][:1],
                                args["top_ps"][:1], args["min_ps"][:1], seeds=[11], counters=[4])
    assert a[0] == a[2] == alone[0]
    seqs = [[int(draw(logits.clone(), 1.0, -1, 1.0, 0.0, [s], c)[0]) for c in range(30)] for s in (11, 12)]
    assert seqs[0] != seqs[1] and len(set(seqs[0])) > 5  # seeds and counters both move the draw


def test_rows_that_cannot_draw_and_extremes():
    logits = torch.full((4, VOCAB), float("-inf"))
    logits[1, 1234] = 0.0  # one finite logit: always it
    logits[2] = _spread_logits(5)
    logits[3, 17] = 5.0
    logits[3, 18] = 5.0
    ids = cpu_sampling.sample(logits.clone(), torch.tensor([1.0, 1.0, 1e-4, 1.0]), torch.tensor([VOCAB, 5, VOCAB, 1]),
                              torch.tensor([1.0, 0.5, 1.0, 1.0]), torch.zeros(4), [1, 2, 3, 4], [0, 0, 0, 0])
    assert ids.tolist() == [0, 1234, int(logits[2].argmax()), 17]  # a tiny temperature is the argmax
    with pytest.raises(ValueError):
        cpu_sampling.sample(logits.clone(), torch.ones(3), torch.ones(4, dtype=torch.int64), torch.ones(4),
                            torch.zeros(4), [1] * 4, [0] * 4)


def test_native_penalties_are_the_torch_versions_bit_for_bit():
    """Repetition, frequency and presence penalties on some rows of a batch: the native pass gives
    the stacked torch version's logits exactly (the same roundings, no fused multiply-add)."""
    from baton.engine.sampling import penalties
    from baton.engine.sampling.sampling_batch_info import ReqSamplingState, SamplingBatchInfo
    from baton.engine.sampling.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(11)
    kwargs = [dict(temperature=0.7), dict(repetition_penalty=1.3), dict(frequency_penalty=0.6, presence_penalty=-0.2),
              dict(temperature=0.7), dict(repetition_penalty=0.8, frequency_penalty=-0.4, presence_penalty=0.7)]
    states = [ReqSamplingState(SamplingParams(max_new_tokens=64, **kw),
                               torch.randint(0, VOCAB, (50,), generator=g).tolist(), VOCAB, set(), "cpu")
              for kw in kwargs]
    for s in states:
        for t in torch.randint(0, VOCAB, (40,), generator=g).tolist():
            s.on_sampled(t)
    logits = torch.randn(len(states), VOCAB, generator=g) * 4
    info = SamplingBatchInfo.from_states(states, "cpu")
    assert info.penalty_rows == [1, 2, 4]
    native = logits.clone()
    penalties.apply_penalties(native, info, native=True)
    reference = logits.clone()
    penalties.apply_penalties(reference, info, native=False)
    assert torch.equal(native, reference)
    assert not torch.equal(native[[1, 2, 4]], logits[[1, 2, 4]]) and torch.equal(native[[0, 3]], logits[[0, 3]])
