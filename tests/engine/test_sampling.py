"""Device-side sampling: greedy, temperature/top-k/top-p/min-p, seeds, penalties, min_new_tokens, logprobs."""
from __future__ import annotations

import math
import re

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from baton.engine.layers import logits_processor, sampler as sampler_mod
from baton.engine.layers.logits_processor import compute_input_logprobs, last_token_indices, select_last_tokens
from baton.engine.layers.sampler import Sampler
from baton.engine.sampling.penalties import apply_penalties
from baton.engine.sampling.sampling_batch_info import ReqSamplingState, SamplingBatchInfo
from baton.engine.sampling.sampling_params import SamplingParams, SamplingParamsError

VOCAB = 8
NATIVE = Sampler("cpu").path == "cpu"  # the CPU sampler's kernels build here: what a CPU worker runs
# sorted probabilities 0.4, 0.3, 0.2, 0.1 on tokens 2, 5, 0, 7; the rest ~0
PROBS = torch.tensor([0.2, 1e-9, 0.4, 1e-9, 1e-9, 0.3, 1e-9, 0.1])


def make_state(
    device: str = "cpu", prompt: list[int] = (), vocab: int = VOCAB, stop: set[int] = frozenset(), **kw
) -> ReqSamplingState:
    return ReqSamplingState(SamplingParams(**kw), list(prompt), vocab, set(stop), device)


def sample(states: list[ReqSamplingState], logits: torch.Tensor, **kw) -> sampler_mod.SampleOutput:
    info = SamplingBatchInfo.from_states(states, logits.device, **kw)
    return Sampler(logits.device.type)(logits.clone(), info, False, [0] * len(states))


def draw_many(n: int, **kw) -> torch.Tensor:
    """n draws from PROBS: one batch of n identical rows."""
    torch.manual_seed(0)
    states = [make_state(**kw) for _ in range(n)]
    return sample(states, PROBS.log().expand(n, VOCAB)).next_token_ids


def frequencies(ids: torch.Tensor) -> dict[int, float]:
    counts = torch.bincount(ids, minlength=VOCAB)
    return {t: c / ids.numel() for t, c in enumerate(counts.tolist()) if c}


def assert_freqs(ids: torch.Tensor, expected: dict[int, float]) -> None:
    got = frequencies(ids)
    assert set(got) == set(expected), got
    for t, p in expected.items():
        assert abs(got[t] - p) < 0.05, (t, got[t], p)


# ---------------------------------------------------------------- greedy


def test_greedy_equals_argmax_with_ties():
    torch.manual_seed(1)
    logits = torch.randn(6, 50)
    logits[2] = 0.0  # all tied: lowest index
    logits[3, [7, 30]] = 100.0  # two-way tie
    states = [make_state(vocab=50, temperature=0.0) for _ in range(6)]
    out = sample(states, logits)
    assert torch.equal(out.next_token_ids, torch.argmax(logits, dim=-1))
    assert out.next_token_ids[2] == 0 and out.next_token_ids[3] == 7


def test_all_greedy_batch_takes_the_fast_path(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("the all-greedy batch must be a plain argmax")

    monkeypatch.setattr(sampler_mod, "apply_penalties", boom)
    monkeypatch.setattr(sampler_mod, "_sample", boom)
    monkeypatch.setattr(torch, "softmax", boom)
    states = [make_state(temperature=0.0), make_state(top_k=1, temperature=0.7, seed=3)]
    fresh = torch.Generator().manual_seed(3).get_state()
    info = SamplingBatchInfo.from_states(states, "cpu")
    assert info.is_all_greedy and info.temperatures is None and not info.has_seeds
    logits = torch.randn(2, VOCAB)
    out = Sampler("cpu")(logits.clone(), info, False, [0, 0])
    assert torch.equal(out.next_token_ids, torch.argmax(logits, dim=-1))
    for s in states:
        assert s.num_sampled == 1 and s.output_counts is None and s.seen_mask is None
    assert torch.equal(states[1].generator.get_state(), fresh)


def test_mixed_batch_greedy_rows_stay_argmax():
    torch.manual_seed(2)
    logits = torch.randn(4, 50)
    kwargs = [dict(temperature=0.0), dict(top_p=0.9), dict(temperature=0.0), {}]
    states = [make_state(vocab=50, **kw) for kw in kwargs]
    info = SamplingBatchInfo.from_states(states, "cpu")
    assert not info.is_all_greedy and info.greedy_mask.tolist() == [True, False, True, False]
    ids = Sampler("cpu")(logits.clone(), info, False, [0] * 4).next_token_ids
    assert ids[0] == torch.argmax(logits[0]) and ids[2] == torch.argmax(logits[2])


# ---------------------------------------------------------------- restricting the support


def test_plain_sampling_follows_the_distribution():
    assert_freqs(draw_many(4000), {0: 0.2, 2: 0.4, 5: 0.3, 7: 0.1})


def test_temperature_sharpens_and_flattens():
    for temp in (0.5, 2.0):
        p = PROBS.pow(1 / temp)
        p = p / p.sum()
        expected = {t: float(p[t]) for t in range(VOCAB) if p[t] > 0.01}
        ids = draw_many(4000, temperature=temp)
        assert set(frequencies(ids)) <= set(range(VOCAB))
        for t, q in expected.items():
            assert abs(frequencies(ids).get(t, 0.0) - q) < 0.05, (temp, t)


def test_top_k_keeps_the_k_best():
    assert_freqs(draw_many(4000, top_k=2), {2: 4 / 7, 5: 3 / 7})


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # mass before each sorted token: 0, .4, .7, .9 -> tokens starting below 0.6 stay
    assert_freqs(draw_many(4000, top_p=0.6), {2: 4 / 7, 5: 3 / 7})


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    # after top-k=2 the masses are 4/7, 3/7; the second starts at 0.571 > 0.5 and goes
    assert_freqs(draw_many(500, top_k=2, top_p=0.5), {2: 1.0})


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    # threshold 0.3 * 0.4 = 0.12: token 7 (0.1) goes
    assert_freqs(draw_many(4000, min_p=0.3), {2: 4 / 9, 5: 3 / 9, 0: 2 / 9})
    assert_freqs(draw_many(4000, min_p=0.3, top_k=3, top_p=0.99), {2: 4 / 9, 5: 3 / 9, 0: 2 / 9})


# ---------------------------------------------------------------- per-request seeds


def run_steps(batch_kwargs: list[dict], logits_rows: list[torch.Tensor], steps: int) -> list[list[int]]:
    states = [make_state(vocab=logits_rows[0].numel(), **kw) for kw in batch_kwargs]
    out = [[] for _ in states]
    for _ in range(steps):
        ids = sample(states, torch.stack(logits_rows)).next_token_ids.tolist()
        for row, tok in zip(out, ids):
            row.append(tok)
    return out


@pytest.mark.parametrize("extra", [{}, {"top_p": 0.95}, {"top_k": 20, "min_p": 0.01}])
def test_seeded_request_is_independent_of_batch_composition(extra):
    torch.manual_seed(3)
    row, other = torch.randn(100), torch.randn(100)
    alone = run_steps([dict(seed=42, **extra)], [row], 12)[0]
    torch.manual_seed(99)
    batch = [{}, dict(seed=7, **extra), dict(seed=42, **extra), dict(temperature=0.0)]
    mixed = run_steps(batch, [other, row, row, other], 12)
    assert mixed[2] == alone
    assert mixed[1] != alone  # another seed draws other numbers


def test_discarded_row_is_greedy_and_leaves_its_state_alone():
    s = make_state(seed=5, frequency_penalty=1.0, min_new_tokens=2, stop={0})
    fresh = torch.Generator().manual_seed(5).get_state()
    logits = torch.randn(1, VOCAB)
    info = SamplingBatchInfo.from_states([s], "cpu", discard_rows=[0])
    assert info.is_all_greedy and not info.has_penalties and not info.has_min_tokens
    ids = Sampler("cpu")(logits.clone(), info, False, [0]).next_token_ids
    assert ids[0] == torch.argmax(logits[0])
    assert s.num_sampled == 0 and s.output_counts is None
    assert torch.equal(s.generator.get_state(), fresh)


# ---------------------------------------------------------------- penalties


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_hf(penalty):
    torch.manual_seed(4)
    prompt, outputs = [3, 3, 17, 40], [17, 8, 8, 0]
    s = make_state(vocab=50, prompt=prompt, repetition_penalty=penalty)
    for t in outputs:
        s.on_sampled(t)
    logits = torch.randn(1, 50) * 3
    ref = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + outputs]), logits.clone())
    ours = logits.clone()
    apply_penalties(ours, SamplingBatchInfo.from_states([s], "cpu"), native=NATIVE)
    assert torch.equal(ours, ref)


def test_frequency_and_presence_penalties_follow_openai_on_outputs_only():
    torch.manual_seed(5)
    prompt, outputs = [1, 2, 2], [2, 4, 4, 4]
    penalised = make_state(vocab=10, prompt=prompt, frequency_penalty=0.5, presence_penalty=-0.25)
    plain = make_state(vocab=10, prompt=prompt)
    for t in outputs:
        penalised.on_sampled(t)
        plain.on_sampled(t)
    logits = torch.randn(2, 10)
    counts = torch.bincount(torch.tensor(outputs), minlength=10).float()
    expected = logits.clone()
    expected[1] -= 0.5 * counts + (-0.25) * (counts > 0).float()
    ours = logits.clone()
    apply_penalties(ours, SamplingBatchInfo.from_states([plain, penalised], "cpu"), native=NATIVE)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)
    assert ours[1, 1] == logits[1, 1]  # prompt-only token: untouched


def test_sampler_updates_penalty_state_step_by_step():
    logits = torch.tensor([[3.0, 2.5, 1.0, -1.0, 0.0, 0.5]])
    s = make_state(vocab=6, temperature=0.0, frequency_penalty=2.0, presence_penalty=0.1)
    got = [int(sample([s], logits).next_token_ids[0]) for _ in range(6)]
    counts, want = [0] * 6, []
    for _ in range(6):
        scores = [x - 2.0 * c - 0.1 * (c > 0) for x, c in zip(logits[0].tolist(), counts)]
        tok = max(range(6), key=lambda t: (scores[t], -t))
        counts[tok] += 1
        want.append(tok)
    assert got == want and s.num_sampled == 6
    assert s.output_counts.tolist() == counts


def test_min_new_tokens_blocks_stop_ids_until_reached():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])  # eos=0 best, stop token 1 second
    s = make_state(vocab=4, temperature=0.0, min_new_tokens=3, stop={0, 1})
    got = [int(sample([s], logits).next_token_ids[0]) for _ in range(4)]
    assert got == [2, 2, 2, 0]
    assert s.num_sampled == 4


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_of_the_raw_model_distribution():
    torch.manual_seed(6)
    logits = torch.randn(3, 30)
    kwargs = [dict(temperature=0.7, repetition_penalty=1.5, prompt=[1, 2]), dict(temperature=0.0), dict(top_k=5)]
    states = [make_state(vocab=30, **kw) for kw in kwargs]
    info = SamplingBatchInfo.from_states(states, "cpu")
    out = Sampler("cpu")(logits.clone(), info, True, [0, 2, 5])
    raw = torch.log_softmax(logits, dim=-1)
    assert torch.equal(out.next_token_logprobs, raw.gather(1, out.next_token_ids.view(-1, 1)).view(-1))
    assert out.top_logprobs[0] == []
    for row, n in ((1, 2), (2, 5)):
        values, ids = raw[row].topk(n)
        assert out.top_logprobs[row] == list(zip(values.tolist(), ids.tolist()))


def test_input_logprobs_match_a_direct_computation(monkeypatch):
    monkeypatch.setattr(logits_processor, "_INPUT_LOGPROB_CHUNK", 3)  # cross chunk boundaries
    torch.manual_seed(7)
    logits, next_ids = torch.randn(7, 40), torch.randint(0, 40, (7,))
    got = compute_input_logprobs(logits, next_ids, top_k=3)
    for p in range(7):
        probs = torch.exp(logits[p].double()) / torch.exp(logits[p].double()).sum()
        assert math.isclose(float(got.token_logprobs[p]), math.log(float(probs[next_ids[p]])), abs_tol=1e-5)
        best = probs.argsort(descending=True)[:3].tolist()
        assert [t for _, t in got.top_logprobs[p]] == best
    assert compute_input_logprobs(logits, next_ids, top_k=0).top_logprobs == [[]] * 7


def test_last_token_selection_of_an_extend_batch():
    assert last_token_indices([3, 1, 4]).tolist() == [2, 3, 7]
    hidden = torch.arange(8).view(8, 1).float()  # [num_tokens, hidden]
    assert select_last_tokens(hidden, [3, 1, 4]).view(-1).tolist() == [2.0, 3.0, 7.0]


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_seeded_and_greedy_sampling_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    torch.manual_seed(8)
    row, other = torch.randn(1000, device="cuda"), torch.randn(1000, device="cuda")

    def run(kwargs_rows, rows):
        states = [ReqSamplingState(SamplingParams(**kw), [1, 2], 1000, {0}, "cuda") for kw in kwargs_rows]
        out = []
        for _ in range(8):
            out.append(sample(states, torch.stack(rows)).next_token_ids.tolist())
        return [list(col) for col in zip(*out)], states

    seeded = dict(seed=1, top_p=0.9, frequency_penalty=0.3)
    alone, _ = run([seeded], [row])
    mixed, states = run([{}, seeded, dict(temperature=0.0)], [other, row, other])
    assert mixed[1] == alone[0]
    assert mixed[2] == [int(torch.argmax(other))] * 8
    assert int(states[1].output_counts.sum()) == 8


# ---------------------------------------------------------------- logit_bias


def test_logit_bias_is_added_to_the_logits_of_its_row_only():
    logits = PROBS.log().expand(2, VOCAB).clone()
    biased = make_state(temperature=0.0, logit_bias={3: 50.0, 2: -100.0})
    out = sample([biased, make_state(temperature=0.0)], logits).next_token_ids.tolist()
    assert out == [3, 2]  # the bias moves the argmax of its row; the other row keeps token 2
    # a sampled row: the banned best token never comes, the rest keep their odds renormalised
    torch.manual_seed(0)
    states = [make_state(logit_bias={2: -100.0}) for _ in range(4000)]
    assert_freqs(sample(states, PROBS.log().expand(4000, VOCAB)).next_token_ids, {0: 1 / 3, 5: 0.5, 7: 1 / 6})


@pytest.mark.parametrize("bias,needle", [
    ({"x": 1.0}, "not a token id"),
    ({"8": 1.0}, "out of vocabulary"),
    ({"-1": 1.0}, "out of vocabulary"),
    ({"3": 100.5}, "[-100, 100]"),
    ({"3": float("nan")}, "[-100, 100]"),
    ({"3": "1"}, "must be a number"),
    ({"3": True}, "must be a number"),
    ([3, 1.0], "must map token ids"),
])
def test_bad_logit_bias_is_rejected(bias, needle):
    with pytest.raises(SamplingParamsError, match=re.escape(needle)):
        SamplingParams(logit_bias=bias).verify(VOCAB)


def test_logit_bias_keys_arrive_as_strings_and_empty_means_none():
    p = SamplingParams(logit_bias={"3": 1, "5": -2.5})
    p.verify(VOCAB)
    assert p.logit_bias == {3: 1.0, 5: -2.5}
    p.verify(VOCAB)  # a copy of n > 1 is verified again
    assert p.logit_bias == {3: 1.0, 5: -2.5}
    empty = SamplingParams(logit_bias={})
    empty.verify(VOCAB)
    assert empty.logit_bias is None


@pytest.mark.parametrize("field,value,needle", [
    ("seed", 1e308, "seed must be an integer"),  # stopped the whole engine (torch's manual_seed) before
    ("seed", 1 << 64, "seed must be an integer in"),
    ("seed", True, "seed must be an integer"),
    ("top_k", "x", "top_k must be an integer"),
    ("max_new_tokens", 4.0, "max_new_tokens must be an integer"),
    ("min_new_tokens", None, "min_new_tokens must be an integer"),
    ("temperature", [], "temperature must be a finite number"),
    ("top_p", float("nan"), "top_p must be a finite number"),
    ("repetition_penalty", None, "repetition_penalty must be a finite number"),
    ("frequency_penalty", "0.5", "frequency_penalty must be a finite number"),
    ("ignore_eos", "yes", "ignore_eos must be true or false"),
    ("stop", 5, "stop must be a string or a list of strings"),
    ("stop_token_ids", "x", "stop_token_ids must be a list of token ids"),
    ("stop_token_ids", [1.5], "stop_token_ids must be a list of token ids"),
])
def test_a_value_of_the_wrong_type_is_a_clear_error(field, value, needle):
    with pytest.raises(SamplingParamsError, match=needle):
        SamplingParams(**{field: value}).verify(100)


def test_json_numbers_of_every_kind_are_accepted_where_they_fit():
    p = SamplingParams(temperature=1, top_p=1, repetition_penalty=2, seed=(1 << 64) - 1, stop="x", stop_token_ids=(3,))
    p.verify(100)
    assert (p.temperature, p.stop, p.stop_token_ids) == (1, ["x"], [3])
    assert SamplingParams(seed=-(1 << 63)).seed == -(1 << 63)
