"""NGRAM speculative decoding: greedy tokens equal HF's (and so the engine's without
speculation) on a random model that rarely repeats itself (low acceptance) and on one whose greedy
text falls into loops (real acceptance); stops, max_tokens, min_tokens and logprobs inside accepted
runs equal the plain engine's; aborts and retractions leak nothing; the radix cache holds only accepted
tokens; sampled verification keeps the target distribution (statistically, on a tiny vocabulary)."""
from __future__ import annotations

import random
import re

import pytest
import torch
from transformers import AutoTokenizer

from baton.engine.core.spec_info import VerifyInput
from baton.engine.io_struct import AbortReq
from baton.engine.sampling.sampling_batch_info import ReqSamplingState
from baton.engine.sampling.sampling_params import SamplingParams
from baton.engine.server_args import ServerArgs
from baton.engine.speculative.accept_host import accept_greedy, target_probs, verify_drafts
from baton.engine.speculative.ngram_index import NgramIndex, NgramTreeIndex, SharedNgrams
from scheduler_harness import SchedulerHarness
from test_scheduler_vs_hf import LOOPS, harness_for, hf_greedy, run_workload, workload

# speculation on every decode step of these small batches, drafting after any one-token match (many
# drafts, most of them partly rejected: the paths under test)
SPEC = dict(speculative_algorithm="NGRAM", speculative_disable_by_batch_size=64,
            speculative_ngram_min_match_window_size=1)
# initializer_range 0.08: a random model whose greedy text falls into loops within tens of tokens, so
# n-gram drafts are accepted (tiny_models.py explains why the default 0.15 keeps greedy ties away;
# at 0.08 the top-1/top-2 gaps are still far above float32 rounding: HF equality checks that)
LOOPING = dict(initializer_range=0.08)
MAX_NEW = 40


def repetitive_prompts(seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a random segment (what a copy or edit request looks like to the index)."""
    rng = random.Random(seed)
    out = []
    for n, times in ((6, 4), (11, 3), (23, 2)):
        seg = [rng.randrange(6, 500) for _ in range(n)]
        out.append([rng.randrange(6, 500) for _ in range(3)] + seg * times)
    return out


def spec_info(h: SchedulerHarness) -> dict:
    return h.scheduler.get_server_info()


def recorded_drafts(h: SchedulerHarness) -> list[list[int]]:
    """From now on, each verify step's drafts of its batch's first request, in step order."""
    seen: list[list[int]] = []
    process = h.scheduler.spec.process_verify_result

    def record(launched, result):
        seen.append(list(launched.mwb.spec_info.drafts[0]))
        process(launched, result)

    h.scheduler.spec.process_verify_result = record
    return seen


def follow_up_and_abort(h: SchedulerHarness, path: str, first: list[int], first_out: list[int], other: list[int],
                        steps: int = 10) -> dict:
    """After a workload: a follow-up turn of `first` (its prefix cached) and `other` aborted after
    `steps` steps, under speculation: HF's tokens for the turn, the abort ends its request, nothing
    leaks. Returns the results (the caller checks what was cached)."""
    turn2 = first + first_out + [7, 8, 9]
    h.submit("turn2", turn2, max_new_tokens=MAX_NEW, ignore_eos=True)
    h.submit("gone", other, max_new_tokens=200, ignore_eos=True)
    for _ in range(steps):
        h.step()
    h.scheduler.process_input_requests([AbortReq(rid="gone")])
    res = h.run_until_idle()
    assert res["turn2"].ids == hf_greedy(path, turn2, MAX_NEW, ignore_eos=True)
    assert res["gone"].finish.kind == "abort"
    assert h.scheduler.check_memory_integrity()
    return res


def stops_and_logprobs_equal_plain(path: str, prompt: list[int], loop: str = "plain", **spec) -> SchedulerHarness:
    """max_tokens that cut a draft run, a stop token inside one, logprobs with top-2: the speculating
    engine (`spec` flags, in `loop`) gives what the engine without speculation gives. Returns its harness."""
    plain = harness_for(path, "plain", max_total_tokens=2048)
    h = harness_for(path, loop, max_total_tokens=2048, **spec)
    for x in (plain, h):
        x.submit("cut", prompt, max_new_tokens=6, ignore_eos=True)
        x.submit("lp", prompt, max_new_tokens=12, ignore_eos=True, return_logprob=True, top_logprobs_num=2)
    a, b = plain.run_until_idle(), h.run_until_idle()
    stop = a["lp"].ids[7]
    for x in (plain, h):
        x.submit("stop", prompt, max_new_tokens=20, ignore_eos=True, stop_token_ids=[stop])
    a, b = plain.run_until_idle(), h.run_until_idle()
    for rid in ("cut", "lp", "stop"):
        assert b[rid].ids == a[rid].ids, rid
    assert b["stop"].ids[-1] == stop and len(b["stop"].ids) <= 8
    (lp_a, ids_a), (lp_b, ids_b) = zip(*a["lp"].output_logprobs), zip(*b["lp"].output_logprobs)
    assert ids_b == ids_a and lp_b == pytest.approx(lp_a, abs=1e-5)
    assert [[t for _, t in top] for top in b["lp"].output_top_logprobs] == \
        [[t for _, t in top] for top in a["lp"].output_top_logprobs]
    assert spec_info(h)["spec_verify_steps"] > 0
    assert h.scheduler.check_memory_integrity()
    return h


# ---------------------------------------------------------------------------- units
def test_ngram_index_proposes_what_followed_the_longest_match():
    index = NgramIndex(min_window=1, max_window=3, max_draft=3)
    index.extend([1, 2, 3, 4, 9, 2, 3, 5, 7, 1, 2, 3])
    # suffix "1 2 3" matched (window 3) at 0..2: what followed it there
    assert index.propose(3) == [4, 9, 2]
    index.extend([8, 2, 3])
    # "8 2 3" and "2 3"... the longest earlier match is "2 3" (latest: after "1 2 3" at 9..11 came 8)
    assert index.propose(2) == [8, 2]
    assert index.propose(0) == []
    lonely = NgramIndex(min_window=2, max_window=4, max_draft=4)
    lonely.extend([1, 2, 3, 4, 5, 3])
    assert lonely.propose(4) == [], "a one-token match is below the minimum window"


def test_shared_ngrams_draft_from_the_newest_longest_match_within_capacity():
    """Other requests' text: the longest window first, within it the newest request; the oldest
    requests leave once the tokens exceed the capacity; a request longer than it never joins."""
    def index(tokens: list[int], tree: bool = False) -> NgramIndex:
        made = NgramTreeIndex(2, 4, 8, breadth=2) if tree else NgramIndex(2, 4, 8)
        made.extend(tokens)
        return made

    shared = SharedNgrams(capacity=20)
    shared.add(index([1, 2, 3, 4, 5, 6]))
    shared.add(index([7, 2, 3, 9, 9, 9], tree=True))
    assert shared.propose([0, 2, 3], 2, 2, 4) == [9, 9], "the newer request's match of window 2"
    assert shared.propose([1, 2, 3], 2, 2, 4) == [4, 5], "window 3 beats the newer request's window 2"
    assert shared.propose([5, 3], 2, 2, 4) == [] and shared.propose([2, 3], 0, 2, 4) == []
    shared.add(index(list(range(100, 110))))  # 22 tokens > 20: the oldest leaves
    assert shared.tokens == 16 and shared.propose([1, 2, 3], 2, 2, 4) == [9, 9]
    shared.add(index(list(range(200, 221))))  # longer than the capacity: not kept
    assert shared.tokens == 16 and shared.hits == 3


def test_a_request_drafts_from_a_finished_requests_text(tiny_model_factory):
    """--speculative-ngram-capacity: the same prompt asked again drafts the earlier answer from its
    first decode step (the random model's own text rarely repeats, so without sharing its drafts are
    few and short); greedy output is HF's both times and nothing leaks. Off, nothing is shared."""
    path = tiny_model_factory("llama")
    prompt = workload()[1]
    want = hf_greedy(path, prompt, MAX_NEW, ignore_eos=True)
    infos = {}
    for capacity in (0, 4096):
        h = harness_for(path, "plain", max_total_tokens=4096, **SPEC, speculative_ngram_capacity=capacity)
        for rid in ("first", "again"):
            h.submit(rid, prompt, max_new_tokens=MAX_NEW, ignore_eos=True)
            assert h.run_until_idle()[rid].ids == want, (capacity, rid)
        infos[capacity] = spec_info(h)
        assert infos[capacity]["integrity_ok"] is True
    assert "spec_ngram_shared_drafts" not in infos[0]
    shared = infos[4096]
    assert shared["spec_ngram_shared_drafts"] > 0 and shared["spec_ngram_shared_tokens"] == 2 * (len(prompt) + MAX_NEW)
    assert shared["spec_accepted_tokens"] >= infos[0]["spec_accepted_tokens"] + MAX_NEW // 2, infos


def test_greedy_acceptance_keeps_the_longest_agreeing_prefix_and_the_targets_token():
    assert accept_greedy([5, 6, 7], [5, 6, 1, 9]) == [5, 6, 1]
    assert accept_greedy([5, 6, 7], [5, 6, 7, 9]) == [5, 6, 7, 9]
    assert accept_greedy([5], [4, 9]) == [4]
    assert accept_greedy([], [3]) == [3]


def _sampling_state(**params) -> ReqSamplingState:
    p = SamplingParams(**params)
    p.verify(6)
    return ReqSamplingState(p, [1, 2], vocab_size=6, stop_ids_for_min_tokens=set(), device="cpu")


def assert_distributed_as(p: torch.Tensor, samples: list[int], where: str, least: int = 300,
                          limit: float = 30.0) -> None:
    """Chi-square test that `samples` are draws from `p` [vocab]: no token outside its support, and the
    statistic below `limit` (30: p < 1e-5 at this test's degrees of freedom)."""
    assert len(samples) > least, f"{where}: too few samples ({len(samples)})"
    counts = torch.bincount(torch.tensor(samples, dtype=torch.int64), minlength=p.numel()).double()
    expected = p.double() * len(samples)
    assert counts[expected == 0].sum() == 0, f"{where}: a token the target never draws"
    live = expected > 0
    chi2 = float(((counts[live] - expected[live]) ** 2 / expected[live]).sum())
    assert chi2 < limit, f"{where}: chi2 {chi2:.1f} over {int(live.sum()) - 1} dof"


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=3),
                                    dict(temperature=1.0, top_p=0.8)], ids=["t1", "topk", "topp"])
def test_rejection_sampling_keeps_the_target_distribution(params):
    """A deterministic draft [d1, d2] on a 6-token vocabulary: the first emitted token is distributed as
    p0, the second (present when d1 was accepted) as p1, the third (both accepted) as p2, where p is the
    sampler's filtered distribution; a chi-square test on 4,000 verified rows each."""
    torch.manual_seed(0)
    logits = torch.randn(3, 6)  # positions 0, 1, 2
    rows = 4000
    states = [_sampling_state(**params, seed=7) for _ in range(rows)]
    p = target_probs(logits, states[0].params)
    # d1: the second most likely token (accepted about as often as not), d2: the most likely one
    draft = [int(p[0].argsort(descending=True)[1]), int(p[1].argmax())]
    assert 0.1 < float(p[0, draft[0]]) < 0.6, "the test needs a draft that is accepted and rejected"
    out = verify_drafts(logits.repeat(rows, 1), VerifyInput([draft] * rows), states, list(range(rows)),
                        return_logprob=False, top_logprobs_nums=[0] * rows)

    assert_distributed_as(p[0], [t[0] for t in out.tokens], "position 0")
    assert_distributed_as(p[1], [t[1] for t in out.tokens if t[0] == draft[0]], "position 1")
    assert_distributed_as(p[2], [t[2] for t in out.tokens if t[:2] == draft], "position 2")
    assert all(t[-1] != draft[len(t) - 1] for t in out.tokens if len(t) < 3), "a rejection never emits the draft"


# ---------------------------------------------------------------------------- the engine, greedy
@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_ngram_greedy_equals_hf(tiny_model_factory, loop, page_size):
    """Concurrent, chunked, with radix hits; the usual random model (few drafts pass) and the looping
    one (accept length > 1 on average)."""
    prompts = workload()[:8] + repetitive_prompts()
    for overrides, acceptance in (({}, False), (LOOPING, True)):
        path = tiny_model_factory("llama", **overrides)
        h = harness_for(path, loop, page_size=page_size, chunked_prefill_size=32, max_total_tokens=4096, **SPEC)
        results = run_workload(h, prompts, max_new=MAX_NEW, ignore_eos=True)
        for i, p in enumerate(prompts):
            assert results[str(i)].ids == hf_greedy(path, p, MAX_NEW, ignore_eos=True), f"request {i} differs from HF"
        info = spec_info(h)
        assert info["speculative_algorithm"] == "NGRAM" and info["spec_verify_steps"] > 0
        if acceptance:
            assert info["spec_accept_length"] > 1.2 and info["spec_accept_rate"] > 0, info
        assert info["integrity_ok"] is True


@pytest.mark.parametrize("loop", ["overlap", "plain"])
def test_ngram_through_the_graph_runners_padded_paths(tiny_model_factory, loop):
    """The decode and verify graphs' padded static paths (run eagerly on CPU: what CUDA graphs replay):
    plain decode steps while the batch is too large to speculate, full-chain verify steps through the
    verify path once it shrinks, shorter drafts eagerly beside them; HF's tokens, nothing leaked."""
    from baton.engine.model_executor.cuda_graph_runner import CudaGraphRunner

    path = tiny_model_factory("llama", **LOOPING)
    h = harness_for(path, loop, page_size=16, max_total_tokens=4096,
                    **{**SPEC, "speculative_disable_by_batch_size": 3, "speculative_num_draft_tokens": 3})
    runner = h.scheduler.worker.model_runner
    graphs = runner.cuda_graph_runner = CudaGraphRunner(runner, max_bs=8, capture=False, verify_tokens=3,
                                                        verify_max_bs=2)
    replays, replay = [], graphs.replay
    graphs.replay = lambda fb: replays.append(fb.spec_verify) or replay(fb)
    prompts, lens = repetitive_prompts()[:4], [MAX_NEW, 8, 12, MAX_NEW]
    for i, (p, n) in enumerate(zip(prompts, lens)):
        h.submit(str(i), p, max_new_tokens=n, ignore_eos=True)
    results = h.run_until_idle()
    for i, (p, n) in enumerate(zip(prompts, lens)):
        assert results[str(i)].ids == hf_greedy(path, p, n, ignore_eos=True), f"request {i} differs from HF"
    assert replays.count(False) > 0 and replays.count(True) > 0, replays
    info = spec_info(h)
    assert info["spec_verify_steps"] > replays.count(True), "some verify steps ran eagerly (shorter drafts)"
    assert info["spec_accepted_tokens"] > 0 and info["integrity_ok"] is True


def _run(path: str, requests: dict[str, tuple[list[int], dict]], **overrides) -> tuple[dict, SchedulerHarness]:
    h = SchedulerHarness(path, max_total_tokens=4096, disable_overlap_schedule=True, **overrides)
    for rid, (prompt, params) in requests.items():
        h.submit(rid, prompt, **params)
    return h.run_until_idle(), h


def test_stops_max_tokens_min_tokens_and_logprobs_inside_accepted_runs(tiny_model_factory):
    """Every way a request ends, placed where the looping model's drafts are accepted in runs: the
    speculating engine emits exactly the plain engine's tokens, finish reasons and logprobs (one per
    token)."""
    path = tiny_model_factory("llama", **LOOPING)
    prompt = repetitive_prompts()[1]
    ref = hf_greedy(path, prompt, 60, ignore_eos=True)
    late = next(t for t in ref[20:] if ref.index(t) >= 12)  # first seen deep in the looping part
    first = ref.index(late)
    base = dict(ignore_eos=True, return_logprob=True, top_logprobs_num=2)
    requests = {f"len{n}": (prompt, dict(base, max_new_tokens=n)) for n in (5, 17, 26, 41)}
    requests["stop_id"] = (prompt, dict(base, max_new_tokens=60, stop_token_ids=[late]))
    requests["min_tokens"] = (prompt, dict(base, max_new_tokens=60, stop_token_ids=[late], min_new_tokens=first + 2))
    stop_text = AutoTokenizer.from_pretrained(path).decode(ref[first - 1:first + 1])
    requests["stop_str"] = (prompt, dict(base, max_new_tokens=60, stop=[stop_text]))
    plain, _ = _run(path, requests)
    spec, h = _run(path, requests, **SPEC)
    assert spec_info(h)["spec_accept_length"] > 1.2
    assert plain["stop_id"].ids == ref[:first + 1] and plain["stop_id"].finish.matched == late
    assert len(plain["min_tokens"].ids) > first + 1 and plain["stop_str"].finish.matched == stop_text
    for rid, want in plain.items():
        got = spec[rid]
        assert got.ids == want.ids, rid
        assert (got.finish.kind, got.finish.matched) == (want.finish.kind, want.finish.matched), rid
        assert [t for _, t in got.output_logprobs] == got.ids, rid
        torch.testing.assert_close([lp for lp, _ in got.output_logprobs], [lp for lp, _ in want.output_logprobs],
                                   rtol=1e-4, atol=1e-4)
        assert [[t for _, t in top] for top in got.output_top_logprobs] == \
            [[t for _, t in top] for top in want.output_top_logprobs], rid
    assert h.scheduler.check_memory_integrity()


def test_the_radix_cache_holds_only_accepted_tokens(tiny_model_factory):
    """After every request ended, the cache holds each one's prompt and output but its newest token
    (page size 1, prompts sharing nothing): exactly the plain engine's tokens, no rejected draft."""
    path = tiny_model_factory("llama", **LOOPING)
    prompts = repetitive_prompts(seed=4)
    requests = {str(i): (p, dict(max_new_tokens=MAX_NEW, ignore_eos=True)) for i, p in enumerate(prompts)}
    spec, h = _run(path, requests, **SPEC)
    assert spec_info(h)["spec_draft_tokens"] > spec_info(h)["spec_accepted_tokens"] > 0, "some drafts rejected"
    cache = h.scheduler.tree_cache
    assert cache.total_size() == sum(len(p) + MAX_NEW - 1 for p in prompts)
    for i, p in enumerate(prompts):
        accepted = p + spec[str(i)].ids[:-1]
        assert len(cache.match_prefix(accepted + [0]).device_indices) == len(accepted)


@pytest.mark.parametrize("loop", ["plain", "overlap"])
def test_abort_while_speculating_leaks_nothing(tiny_model_factory, loop):
    path = tiny_model_factory("llama", **LOOPING)
    prompts = repetitive_prompts()
    h = harness_for(path, loop, max_total_tokens=4096, **SPEC)
    for i, p in enumerate(prompts):
        h.submit(str(i), p, max_new_tokens=200, ignore_eos=True)
    def output_len(rid: str) -> int:
        return next((len(r.output_ids) for r in h.scheduler.running_batch.reqs if r.rid == rid), 0)

    for _ in range(200):  # until request 1 is well into its output, drafts being accepted
        h.step()
        if spec_info(h)["spec_accepted_tokens"] > 0 and output_len("1") > 8:
            break
    assert 8 < output_len("1") < 150
    h.scheduler.process_input_requests([AbortReq(rid="1")])
    res = h.run_until_idle()
    assert res["1"].finish.kind == "abort" and res["1"].after_finish == 0
    for i in (0, 2):
        assert res[str(i)].ids == hf_greedy(path, prompts[i], 200, ignore_eos=True)
    assert h.scheduler.check_memory_integrity()


@pytest.mark.parametrize("loop", ["plain", "overlap"])
def test_retraction_under_speculation(tiny_model_factory, loop):
    """A pool too small for every request's tokens: decode retracts, speculation goes on where drafts
    fit, and the tokens stay HF's."""
    path = tiny_model_factory("llama", **LOOPING)
    prompts = repetitive_prompts() + workload(seed=1)[:5]
    max_new = 40
    pool = int(0.6 * (sum(map(len, prompts)) + max_new * len(prompts)))
    h = harness_for(path, loop, chunked_prefill_size=32, max_total_tokens=pool, **SPEC)
    results = run_workload(h, prompts, staggered=True, max_new=max_new, ignore_eos=True)
    assert h.scheduler.stats.retractions > 0, "the pool is meant to be too small for all requests at once"
    assert spec_info(h)["spec_verify_steps"] > 0
    for i, p in enumerate(prompts):
        assert results[str(i)].ids == hf_greedy(path, p, max_new, ignore_eos=True), f"request {i}"
    assert h.scheduler.check_memory_integrity()


def test_speculation_backs_off_at_the_batch_size_threshold(tiny_model_factory):
    path = tiny_model_factory("llama", **LOOPING)
    prompts = repetitive_prompts()
    requests = {str(i): (p, dict(max_new_tokens=20, ignore_eos=True)) for i, p in enumerate(prompts)}
    _, full = _run(path, requests, speculative_algorithm="NGRAM", speculative_disable_by_batch_size=len(prompts))
    assert spec_info(full)["spec_verify_steps"] == 0, "three running requests reach the threshold of 3"
    _, under = _run(path, requests, speculative_algorithm="NGRAM", speculative_disable_by_batch_size=len(prompts) + 1)
    assert spec_info(under)["spec_verify_steps"] > 0


def test_penalties_bias_min_tokens_and_grammars_speculate_with_the_samplers_processing(tiny_model_factory):
    """Requests whose sampler processes the logits (penalties, logit bias, min_new_tokens with the
    looping text's stop id, grammars of each kind) draft and verify too: each position is processed as
    the sampler would after the drafts before it, so every greedy request gets the plain engine's
    tokens (grammar output included), and a sampled penalised one runs its length."""
    from test_scheduler_vs_hf import GRAMMARS

    path = tiny_model_factory("llama", **LOOPING)
    prompts = repetitive_prompts()
    ref = hf_greedy(path, prompts[1], 40, ignore_eos=True)
    late = next(t for t in ref[20:] if ref.index(t) >= 12)
    base = dict(max_new_tokens=30, ignore_eos=True)
    requests = {
        "frequency": (prompts[0], dict(base, frequency_penalty=0.3)),
        "presence": (prompts[1], dict(base, presence_penalty=0.4, return_logprob=True)),
        "repetition": (prompts[2], dict(base, repetition_penalty=1.3)),
        "bias": (prompts[0], dict(base, logit_bias={ref[5]: 2.0, ref[9]: -3.0})),
        "min_tokens": (prompts[1], dict(base, max_new_tokens=40, stop_token_ids=[late], min_new_tokens=ref.index(late) + 3)),
        "sampled": (prompts[2], dict(base, temperature=0.7, seed=5, frequency_penalty=0.2)),
    }
    requests.update({kind: (prompts[i % 3], dict(max_new_tokens=60, **{kind: g}))
                     for i, (kind, g) in enumerate(GRAMMARS.items())})
    spec_args = dict(SPEC, speculative_disable_by_batch_size=len(requests) + 1)
    plain, _ = _run(path, requests)
    spec, h = _run(path, requests, **spec_args)
    for rid, want in plain.items():
        if rid == "sampled":  # rejection sampling keeps the distribution, not the plain engine's draws
            assert len(spec[rid].ids) == 30
            continue
        assert spec[rid].ids == want.ids, rid
        assert spec[rid].finish.kind == want.finish.kind, rid
    torch.testing.assert_close([lp for lp, _ in spec["presence"].output_logprobs],
                               [lp for lp, _ in plain["presence"].output_logprobs], rtol=1e-4, atol=1e-4)
    assert spec["min_tokens"].ids[ref.index(late)] != late, "min_new_tokens blocked the stop id where greedy had it"
    info = spec_info(h)
    assert info["spec_verify_steps"] > 0 and info["spec_accepted_tokens"] > 0, info
    assert h.scheduler.check_memory_integrity()


def test_seeded_sampling_under_speculation_is_reproducible(tiny_model_factory):
    """Seeded sampled requests (a low temperature: the looping text's drafts pass often) give the same
    tokens on a second engine."""
    path = tiny_model_factory("llama", **LOOPING)
    prompts = repetitive_prompts()
    requests = {str(i): (p, dict(max_new_tokens=30, ignore_eos=True, temperature=0.05, seed=11 + i, top_k=20))
                for i, p in enumerate(prompts)}
    first, h = _run(path, requests, **SPEC)
    again, _ = _run(path, requests, **SPEC)
    assert spec_info(h)["spec_accepted_tokens"] >= 10, "drafts accepted (29 of 57 when written)"
    assert {r: c.ids for r, c in first.items()} == {r: c.ids for r, c in again.items()}
    assert all(len(c.ids) == 30 for c in first.values())
    assert h.scheduler.check_memory_integrity()


# ---------------------------------------------------------------------------- flags
def test_speculative_flags_use_sglangs_names_and_refuse_bad_values():
    import argparse

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(
        ["--model-path", "m", "--speculative-algorithm", "NGRAM", "--speculative-ngram-max-match-window-size", "6",
         "--speculative-ngram-min-match-window-size", "2", "--speculative-disable-by-batch-size", "8"]))
    assert (args.speculative_algorithm, args.speculative_num_draft_tokens) == ("NGRAM", 6)
    assert args.speculative_ngram_min_match_window_size == 2 and args.speculative_disable_by_batch_size == 8
    args = ServerArgs.from_cli_args(parser.parse_args(  # NEXTN: test_speculative_nextn.py, EAGLE's refusals:
        ["--model-path", "m", "--speculative-algorithm", "EAGLE3",  # test_speculative_eagle.py
         "--speculative-draft-model-path", "d", "--speculative-num-steps", "5"]))
    assert (args.speculative_draft_model_path, args.speculative_num_draft_tokens) == ("d", 6)
    with pytest.raises(ValueError, match="min-match-window-size"):
        ServerArgs(model_path="m", speculative_algorithm="NGRAM", speculative_ngram_min_match_window_size=5,
                   speculative_ngram_max_match_window_size=4)


@pytest.mark.parametrize("flags,needle", [
    ({"speculative_num_draft_tokens": 5}, "--speculative-num-draft-tokens means nothing without --speculative-algorithm"),
    ({"speculative_num_steps": 2}, "--speculative-num-steps means nothing without"),
    ({"speculative_ngram_capacity": 1000}, "--speculative-ngram-capacity means nothing without"),
    ({"speculative_disable_by_batch_size": 8}, "--speculative-disable-by-batch-size means nothing without"),
    ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 100000}, "more tokens than one step"),
    ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 600, "chunked_prefill_size": -1,
      "max_prefill_tokens": 512}, "more tokens than one step of this engine runs (512"),
    ({"speculative_algorithm": "NGRAM", "speculative_eagle_topk": 2}, "is for draft heads"),
    ({"speculative_algorithm": "NGRAM", "speculative_num_steps": 4}, "is for draft heads"),
    ({"speculative_algorithm": "NEXTN", "speculative_ngram_max_bfs_breadth": 2}, "is for --speculative-algorithm NGRAM"),
], ids=["tokens-alone", "steps-alone", "capacity-alone", "batch-size-alone", "ngram-huge", "ngram-past-prefill",
        "ngram-topk", "ngram-steps", "nextn-ngram-flag"])
def test_speculative_flags_that_would_mean_nothing_are_refused(flags, needle):
    """A flag the configuration never reads (no algorithm, or another algorithm's) or a draft no step of
    the engine would run is refused at start with a message naming it; they all started silently before."""
    with pytest.raises(ValueError, match=re.escape(needle)):
        ServerArgs(model_path="m", **flags)


def test_speculative_flags_an_algorithm_reads_still_start():
    assert ServerArgs(model_path="m", speculative_algorithm="NGRAM", speculative_num_draft_tokens=64,
                      speculative_ngram_capacity=100).speculative_num_draft_tokens == 64
    assert ServerArgs(model_path="m").speculative_num_draft_tokens is None


# ---------------------------------------------------------------------------- metrics, served
def test_metrics_turn_the_schedulers_totals_into_a_histogram_once():
    from baton.engine.metrics import EngineMetrics

    m = EngineMetrics("m", "null")
    info = {"speculative_algorithm": "NGRAM", "spec_accept_rate": 0.5, "spec_draft_tokens": 8,
            "spec_accepted_tokens": 4, "spec_accept_length_counts": [0, 2, 1, 0, 1], "spec_tree_branch_accepts": 2,
            "spec_verify_steps": 4, "spec_lagged_verify_steps": 3}
    m.update_from_server_info(info)
    m.update_from_server_info(info)  # a second scrape of the same totals adds nothing
    m.update_from_server_info({**info, "spec_accept_length_counts": [0, 3, 1, 0, 1], "spec_draft_tokens": 9})

    def sample(name: str, **labels) -> float:
        return m.registry.get_sample_value(name, {"model_name": "m", "role": "null", **labels})

    assert sample("baton_spec_accept_length_tokens_count") == 5
    assert sample("baton_spec_accept_length_tokens_sum") == 3 * 1 + 2 + 4
    assert sample("baton_spec_draft_tokens_total") == 9 and sample("baton_spec_accepted_tokens_total") == 4
    assert sample("baton_spec_tree_branch_accepts_total") == 2
    assert sample("baton_spec_verify_steps_total") == 4 and sample("baton_spec_lagged_verify_steps_total") == 3
    assert sample("baton_spec_accept_rate", dp_rank="0") == 0.5


@pytest.mark.slow
def test_served_engine_speculates_and_reports_it(tiny_model_factory):
    """`baton serve --speculative-algorithm NGRAM`: the flags reach the scheduler process, greedy tokens
    stay HF's, /get_server_info and /metrics report the accept length, nothing leaks."""
    import httpx
    from engine_server import greedy_concurrently, running_engine, wait_idle_integrity

    path = tiny_model_factory("llama", **LOOPING)
    prompts = repetitive_prompts()
    with running_engine(path, "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "6") as engine:
        outputs = greedy_concurrently(engine.base_url, prompts, MAX_NEW)
        info = wait_idle_integrity(engine.base_url)
        metrics = httpx.get(f"{engine.base_url}/metrics", timeout=10).text
    for p, out in zip(prompts, outputs):
        assert out == hf_greedy(path, p, MAX_NEW)
    assert info["integrity_ok"] and info["speculative_algorithm"] == "NGRAM"
    assert info["speculative_num_draft_tokens"] == 6 and info["spec_accept_length"] > 1.0
    count = next(float(line.split()[-1]) for line in metrics.splitlines()
                 if line.startswith("baton_spec_accept_length_tokens_count"))
    assert count == sum(info["spec_accept_length_counts"]) > 0


# ---------------------------------------------------------------------------- hybrid models
@pytest.mark.parametrize("arch,loop,page_size", [("qwen3_5", "plain", 1), ("qwen3_next", "overlap", 16)])
def test_hybrid_rolls_its_recurrent_state_back_to_the_last_accepted_token(tiny_model_factory, arch, loop,
                                                                           page_size):
    """Qwen3.5 / Qwen3-Next under NGRAM: a verify step runs every draft token through the linear-
    attention layers, so where drafts are rejected the row's recurrent state is one of the scratch
    states the layers kept per token, copied back before the next pass. Greedy tokens equal HF's with
    real acceptance (the looping model), a request aborted mid-speculation leaks nothing, and the
    radix cache's end-of-request checkpoints hold the rolled-back state (the repeat hits it, exactly)."""
    path = tiny_model_factory(arch, initializer_range=0.02)  # the hybrids' looping range (0.08 is Llama's)
    prompts = repetitive_prompts() + workload()[:3]
    h = harness_for(path, loop, page_size=page_size, chunked_prefill_size=32, max_total_tokens=4096, **SPEC)
    results = run_workload(h, prompts, max_new=MAX_NEW, ignore_eos=True)
    for i, p in enumerate(prompts):
        assert results[str(i)].ids == hf_greedy(path, p, MAX_NEW, ignore_eos=True), f"request {i} differs from HF"
    info = spec_info(h)
    assert info["spec_verify_steps"] > 0 and info["spec_accepted_tokens"] > 10, info
    assert info["spec_accept_rate"] < 1, "some drafts must be rejected for a rollback to matter"
    # a follow-up turn starts from a checkpoint taken after speculation rolled the state back
    turn2 = prompts[0] + results["0"].ids + [7, 8, 9]
    h.submit("turn2", turn2, max_new_tokens=MAX_NEW, ignore_eos=True)
    h.submit("gone", prompts[1], max_new_tokens=200, ignore_eos=True)
    for _ in range(12):
        h.step()
    h.scheduler.process_input_requests([AbortReq(rid="gone")])
    res = h.run_until_idle()
    if page_size == 1:  # the end state is a checkpoint (with pages, only page-aligned ends are)
        assert res["turn2"].cached_tokens >= len(prompts[0]) + MAX_NEW - 1
    else:  # the prompt's last page end before its final token
        assert res["turn2"].cached_tokens == (len(prompts[0]) - 1) // page_size * page_size
    assert res["turn2"].ids == hf_greedy(path, turn2, MAX_NEW, ignore_eos=True)
    assert res["gone"].finish.kind == "abort"
    assert h.scheduler.check_memory_integrity()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
def test_pd_decode_speculates_after_the_transfer(tiny_model_factory, overlap):
    """PD: the decode engine drafts from the transferred request's prompt and first token on; its
    tokens are HF's and both sides end with nothing leaked (the prefill, which never decodes, takes the
    same flags and ignores them)."""
    from test_pd_scheduler import PDPair, _run

    path = tiny_model_factory("llama", **LOOPING)
    prompts = repetitive_prompts()
    pair = PDPair(path, page_size=1, max_total_tokens=4096, enable_overlap_schedule=overlap,
                  disable_overlap_schedule=not overlap, **SPEC)
    try:
        _run(pair, prompts, max_new_tokens=MAX_NEW, ignore_eos=True)
        for i, p in enumerate(prompts):
            assert pair.decode.results[str(i)].ids == hf_greedy(path, p, MAX_NEW, ignore_eos=True), f"request {i}"
        info = spec_info(pair.decode)
        assert info["spec_accept_length"] > 1.2 and spec_info(pair.prefill)["spec_verify_steps"] == 0
        pair.assert_settled()
    finally:
        pair.close()


def test_a_request_without_drafts_looks_less_and_less_often():
    index = NgramIndex(min_window=2, max_window=4, max_draft=4)
    index.extend([1, 2, 3, 4, 5])
    waits = []
    for _ in range(5):
        index.on_lookup(bool(index.propose(3)))
        waits.append(index.backoff)
    assert waits == [1, 3, 7, 15, 15]
    index.extend([1, 2])  # "1 2" was seen: a draft, and the next lookup comes at once
    index.on_lookup(bool(index.propose(3)))
    assert index.backoff == 0
