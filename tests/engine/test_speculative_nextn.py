"""NEXTN speculative decoding: the checkpoint's own MTP head drafts for Qwen3-Next / Qwen3.5.

Two criteria, both on CPU in float32:
- the head computes what it should: the chain the engine drafts equals transformers' own modules run as
  the head (tiny_models.MtpReference), token for token;
- speculation changes no token: greedy output equals HF's, with the random head's low acceptance (most
  drafts rejected, the recurrent state rolled back) through chunked prefill, radix hits, both loops,
  pages, aborts and PD; nothing leaks.
"""
from __future__ import annotations

import pytest
import torch

from baton.engine.server_args import ServerArgs
from test_scheduler_vs_hf import finish_order, hf_greedy, harness_for, run_workload, workload
from test_speculative import (MAX_NEW, follow_up_and_abort, recorded_drafts, repetitive_prompts, spec_info,
                              stops_and_logprobs_equal_plain)
from baton.engine.core.spec_info import node_depths
from tiny_models import MtpReference

NEXTN = dict(speculative_algorithm="NEXTN", speculative_num_steps=3, speculative_disable_by_batch_size=64)


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    """One tiny model with an MTP head per hybrid family, built once for the module."""
    from tiny_models import make_tiny_model

    made: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in made:
            made[arch] = make_tiny_model(arch, tmp_path_factory.mktemp(arch), mtp=True, initializer_range=0.02)
        return made[arch]

    return get


@pytest.mark.parametrize("arch,steps", [("qwen3_5", 3), ("qwen3_next", 2), ("qwen3_5_moe", 1)])
def test_the_drafted_chain_is_the_mtp_heads_own(mtp_model, arch, steps):
    """The first verify step of a request drafts, after its prompt and first token, the chain the
    head gives run as transformers' modules over the model's hidden states (and, from the second
    draft on, over its own outputs)."""
    path = mtp_model(arch)
    h = harness_for(path, "plain", max_total_tokens=2048, **{**NEXTN, "speculative_num_steps": steps})
    seen = recorded_drafts(h)
    prompt = workload()[2]  # 17 tokens
    h.submit("a", prompt, max_new_tokens=8, ignore_eos=True)
    out = h.run_until_idle()["a"].ids
    assert out == hf_greedy(path, prompt, 8, ignore_eos=True)
    assert seen and len(seen[0]) == steps
    assert seen[0] == MtpReference.load(path).chain(prompt + out[:1], steps)
    assert h.scheduler.check_memory_integrity()


@pytest.mark.parametrize("arch,loop,page_size", [("qwen3_5", "plain", 1), ("qwen3_next", "overlap", 16),
                                                 ("qwen3_5_moe", "inline", 4)])
def test_nextn_greedy_equals_hf(mtp_model, arch, loop, page_size):
    """Concurrent requests, prompts past the 32-token chunk, shared prefixes (radix hits with state
    checkpoints), a follow-up turn, an abort mid-speculation: HF's tokens, nothing leaked."""
    path = mtp_model(arch)
    prompts = workload()[:6] + repetitive_prompts()[:2]
    h = harness_for(path, loop, page_size=page_size, chunked_prefill_size=32, max_total_tokens=4096, **NEXTN)
    results = run_workload(h, prompts, max_new=MAX_NEW, ignore_eos=True)
    for i, p in enumerate(prompts):
        assert results[str(i)].ids == hf_greedy(path, p, MAX_NEW, ignore_eos=True), f"request {i} differs from HF"
    info = spec_info(h)
    assert info["speculative_algorithm"] == "NEXTN" and info["speculative_num_steps"] == 3
    assert info["spec_verify_steps"] > 0 and info["spec_accept_rate"] < 1, info
    res = follow_up_and_abort(h, path, prompts[3], results["3"].ids, prompts[1])
    assert res["turn2"].cached_tokens >= (len(prompts[3]) - 1) // page_size * page_size > 0  # a state checkpoint


def test_stops_and_logprobs_inside_accepted_runs_equal_the_plain_engine(mtp_model):
    """max_tokens that cut a chain, a stop token, logprobs: what the engine without speculation gives."""
    stops_and_logprobs_equal_plain(mtp_model("qwen3_5"), workload()[3], **NEXTN)


def test_nextn_flags_and_what_is_refused(mtp_model, tiny_model_factory):
    args = ServerArgs(model_path=mtp_model("qwen3_5"), speculative_algorithm="NEXTN")
    assert (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens) == (3, 1, 4)
    with pytest.raises(ValueError, match="num-steps \\+ 1"):
        ServerArgs(model_path="x", speculative_algorithm="NEXTN", speculative_num_steps=2,
                   speculative_num_draft_tokens=5)
    with pytest.raises(ValueError, match="has none here"):  # a model without an MTP head
        harness_for(tiny_model_factory("llama"), "plain", max_total_tokens=1024, **NEXTN)
    with pytest.raises(ValueError, match="one multi-token-prediction layer"):  # a hybrid whose config has none
        harness_for(tiny_model_factory("qwen3_5", initializer_range=0.02), "plain", max_total_tokens=1024, **NEXTN)


def test_a_hybrid_drafts_the_heads_trees(mtp_model):
    """--speculative-eagle-topk 2 on a hybrid: the head's best-first trees (chosen on the device, given
    to the pass as ancestor matrices) are verified with the recurrent state run node by node; HF's
    tokens with the random head's few accepted drafts."""
    path = mtp_model("qwen3_5")
    h = harness_for(path, "plain", max_total_tokens=2048, **NEXTN, speculative_eagle_topk=2)
    trees = []
    process = h.scheduler.spec.process_verify_result
    h.scheduler.spec.process_verify_result = lambda launched, result: (
        trees.append(launched.mwb.spec_info.parents), process(launched, result))
    prompts = workload()[:2]
    results = run_workload(h, prompts, max_new=12, ignore_eos=True)
    for i, p in enumerate(prompts):
        assert results[str(i)].ids == hf_greedy(path, p, 12, ignore_eos=True), f"request {i}"
    drafted = [p for step in trees if step is not None for p in step]  # per request of each step (a chain: None)
    assert sum(p is not None for p in drafted) > len(drafted) // 2 and spec_info(h)["speculative_eagle_topk"] == 2
    assert h.scheduler.check_memory_integrity()


def test_pd_decode_drafts_with_the_prefills_head_kv(mtp_model):
    """PD, both sides NEXTN: the prefill's head fills its KV layer over the prompt, which travels with
    the target's layers, and its first draft and output at the prompt's end travel in the metadata slot:
    a transferred request drafts in its first decode step, the chain the head gives after the prompt.
    HF's tokens; both sides settle with nothing leaked."""
    from test_pd_scheduler import PDPair, _run

    path = mtp_model("qwen3_next")
    prompts = repetitive_prompts()
    pair = PDPair(path, page_size=1, max_total_tokens=4096, disable_overlap_schedule=True, **NEXTN)
    first_drafts: dict[str, tuple[int, list[int]]] = {}  # (tokens it had, its draft) when a request first drafted
    spec = pair.decode.scheduler.spec
    process = spec.process_verify_result

    def record(launched, result):
        for req, d in zip(launched.reqs, launched.mwb.spec_info.drafts):
            if d:
                first_drafts.setdefault(req.rid, (len(req.output_ids), list(d)))
        process(launched, result)

    spec.process_verify_result = record
    try:
        _run(pair, prompts, max_new_tokens=MAX_NEW, ignore_eos=True)
        reference = MtpReference.load(path)
        for i, p in enumerate(prompts):
            out = pair.decode.results[str(i)].ids
            assert out == hf_greedy(path, p, MAX_NEW, ignore_eos=True), f"request {i}"
            # drafted with the prefill's token only, the head's chain after the prompt
            assert first_drafts[str(i)] == (1, reference.chain(p + out[:1], NEXTN["speculative_num_steps"])), i
        assert spec_info(pair.decode)["spec_verify_steps"] > 0
        pair.assert_settled()
    finally:
        pair.close()


@pytest.mark.parametrize("algorithm", ["NGRAM", "NEXTN"])
def test_priority_preemption_under_speculation(mtp_model, tiny_model_factory, algorithm):
    """A high-priority arrival preempts speculating low-priority requests (a hybrid's state rolled back
    by verify steps, then checkpointed for the resume): it finishes first, everyone gets HF's tokens,
    nothing leaks."""
    from scheduler_harness import SchedulerHarness

    path = mtp_model("qwen3_5") if algorithm == "NEXTN" else tiny_model_factory("llama", initializer_range=0.08)
    prompts = repetitive_prompts() + workload(seed=3)[:2]
    spec = dict(speculative_algorithm=algorithm, speculative_disable_by_batch_size=64,
                **({"speculative_ngram_min_match_window_size": 1} if algorithm == "NGRAM" else {}))
    h = SchedulerHarness(path, enable_priority_scheduling=True, priority_preemption_threshold=5,
                         max_running_requests=4, disable_overlap_schedule=True, max_total_tokens=2048, **spec)
    for i, p in enumerate(prompts[:4]):
        h.submit(f"low{i}", p, max_new_tokens=30, ignore_eos=True, priority=0)
    for _ in range(6):
        h.step()
    h.submit("high", prompts[4], max_new_tokens=5, ignore_eos=True, priority=10)
    order = finish_order(h)
    assert h.scheduler.stats.preemptions >= 1 and order[0] == "high", order
    assert spec_info(h)["spec_verify_steps"] > 0
    for i, p in enumerate(prompts[:4]):
        assert h.results[f"low{i}"].ids == hf_greedy(path, p, 30, ignore_eos=True), f"low{i}"
    assert h.results["high"].ids == hf_greedy(path, prompts[4], 5, ignore_eos=True)
    assert h.scheduler.check_memory_integrity()


@pytest.mark.parametrize("case", ["retraction", "mixed-chunk"])
def test_nextn_under_retraction_and_mixed_chunks(mtp_model, case):
    """A pool too small for every request (decode retracts; a retracted request's prefill runs the head
    over its prompt and output again), or --enable-mixed-chunk (decode rows inside a prefill's extend,
    the head's pass taking each row's sampled token): HF's tokens, nothing leaked."""
    path = mtp_model("qwen3_next")
    prompts = workload(seed=1)
    pool = int(0.6 * (sum(map(len, prompts)) + MAX_NEW * len(prompts))) if case == "retraction" else 4096
    h = harness_for(path, "plain", chunked_prefill_size=32, max_total_tokens=pool,
                    enable_mixed_chunk=case == "mixed-chunk", **NEXTN)
    results = run_workload(h, prompts, max_new=MAX_NEW, ignore_eos=True)
    stats = h.scheduler.stats
    assert (stats.retractions if case == "retraction" else stats.mixed_decode_tokens) > 0
    assert spec_info(h)["spec_verify_steps"] > 0
    for i, p in enumerate(prompts):
        assert results[str(i)].ids == hf_greedy(path, p, MAX_NEW, ignore_eos=True), f"request {i}"
    assert h.scheduler.check_memory_integrity()


@pytest.mark.gpu
@pytest.mark.parametrize("topk", [1, 2])
def test_nextn_on_cuda_changes_no_token(mtp_model, monkeypatch, topk):
    """On CUDA (fla-core's kernels for the linear layers, the head's passes beside them): NEXTN gives
    the tokens the same engine gives without speculation, float32, the drafts verified. topk 2: trees
    whose accepted runs lie off their first chain (_oracle_head_trees over the plain engine's tokens),
    their recurrent states in waves by depth on fla-core's kernel."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    path = mtp_model("qwen3_next")
    prompts = workload()[:6] + repetitive_prompts()[:2]
    common = dict(device="cuda", dtype="float32", chunked_prefill_size=32, max_total_tokens=4096)
    plain = run_workload(harness_for(path, "overlap", **common), prompts, max_new=MAX_NEW, ignore_eos=True)
    if topk > 1:
        _oracle_head_trees(monkeypatch, {str(i): p + plain[str(i)].ids for i, p in enumerate(prompts)})
    h = harness_for(path, "overlap", **common, **NEXTN, speculative_eagle_topk=topk)
    spec = run_workload(h, prompts, max_new=MAX_NEW, ignore_eos=True)
    for i in range(len(prompts)):
        assert spec[str(i)].ids == plain[str(i)].ids, f"request {i}"
    info = spec_info(h)
    assert info["spec_verify_steps"] > 0 and (info["spec_tree_branch_accepts"] > 5) == (topk > 1), info
    assert h.scheduler.check_memory_integrity()


def _oracle_head(monkeypatch, refs: dict[str, list[int]]) -> None:
    """The MTP head's chains replaced by each request's greedy text (`refs`: rid -> prompt + HF's
    tokens; the test may add rids later), wrong at positions 0 and 3 modulo 7: verify steps accept
    none, some or all of their drafts, so the state rolls back to every offset. Requests without a
    reference keep the head's own drafts."""
    from baton.engine.speculative.head_strategy import HeadSpeculator
    from baton.engine.speculative.head_worker import HeadDrafter
    from tiny_models import VOCAB_SIZE

    rids: dict[int, str] = {}  # request row -> rid, recorded when a verify step is built
    prepare, chains = HeadSpeculator.prepare_verify, HeadDrafter._draft_chains

    def recording(self, batch, lagged=False):
        rids.update({r.req_pool_idx: r.rid for r in batch.reqs})
        return prepare(self, batch, lagged)

    def oracle(self, fb, spec, reqs):
        drafts = chains(self, fb, spec, reqs)
        positions, rows = fb.positions.tolist(), fb.req_pool_indices.tolist()
        for n, i in enumerate(reqs):
            ref = refs.get(rids.get(rows[i], ""))
            for t in range(len(spec.drafts[i]) if ref is not None else 0):
                p = positions[spec.offsets[i] + 1 + t]
                if p < len(ref):
                    drafts[n, t] = (ref[p] + 1) % VOCAB_SIZE if p % 7 in (0, 3) else ref[p]
        return drafts

    monkeypatch.setattr(HeadSpeculator, "prepare_verify", recording)
    monkeypatch.setattr(HeadDrafter, "_draft_chains", oracle)


def _oracle_head_trees(monkeypatch, refs: dict[str, list[int]]) -> None:
    """The MTP head's trees replaced in the verify pass, as the drafter puts its own there (tokens,
    positions, ancestor matrices on the device; spec.parents once read), by trees of the node count and
    depth the scheduler reserved whose first chain is wrong from its first token and whose second branch
    from the root is each request's greedy text (`refs`: rid -> prompt + HF's tokens), wrong at positions
    0 and 3 modulo 7: what a step accepts is off the first chain, from none to all of its depth, so the
    state rolls back to nodes of every depth. Requests without a reference keep the head's trees."""
    from baton.engine.layers.attention.masks import ancestors
    from baton.engine.speculative.head_strategy import HeadSpeculator
    from baton.engine.speculative.head_worker import HeadDrafter
    from tiny_models import VOCAB_SIZE

    rids: dict[int, str] = {}  # request row -> rid, recorded when a verify step is built
    prepare, into_pass = HeadSpeculator.prepare_verify, HeadDrafter._into_pass

    def recording(self, batch, lagged=False):
        rids.update({r.req_pool_idx: r.rid for r in batch.reqs})
        return prepare(self, batch, lagged)

    def tree(ref: list[int], last: int, nodes: int, depth: int) -> tuple[list[int], list[int]]:
        right = [ref[p] if p % 7 not in (0, 3) else (ref[p] + 1) % VOCAB_SIZE
                 for p in range(last + 1, last + 1 + depth)]
        tokens, parents = [(ref[last + 1] + 2) % VOCAB_SIZE], [-1, 0]  # the first chain: wrong at once
        for token in right:
            tokens.append(token)
            parents.append(0 if len(parents) == 2 else len(parents) - 1)
        while len(tokens) < nodes:
            tokens.append((ref[last + 1] + 3) % VOCAB_SIZE)
            parents.append(0)
        return tokens, parents

    def oracle(self, fb, spec, reqs, g, chosen):
        into_pass(self, fb, spec, reqs, g, chosen)
        positions, rows, dev = fb.positions.tolist(), fb.req_pool_indices.tolist(), fb.input_ids.device
        mine = {}
        for i in reqs:
            ref, last = refs.get(rids.get(rows[i], "")), positions[spec.offsets[i]]
            if spec.tree(i) is None or ref is None or last + spec.depth(i) >= len(ref):
                continue
            tokens, parents = mine[i] = tree(ref, last, len(spec.drafts[i]), spec.depth(i))
            at = torch.arange(spec.offsets[i] + 1, spec.offsets[i] + 1 + len(tokens), device=dev)
            fb.input_ids[at] = torch.tensor(tokens, device=dev)
            depths = torch.tensor([last + d for d in node_depths(parents)[1:]], device=dev)
            fb.positions[at] = depths.to(fb.positions.dtype)
            fb.tree_parents[i] = ancestors(torch.tensor([parents], device=dev), spec.depth(i))[0]
        fill = spec.pending

        def oracle_fill() -> None:
            fill()
            for i, (tokens, parents) in mine.items():
                spec.drafts[i][:], spec.parents[i] = tokens, parents

        spec.pending = oracle_fill

    monkeypatch.setattr(HeadSpeculator, "prepare_verify", recording)
    monkeypatch.setattr(HeadDrafter, "_into_pass", oracle)


def _assert_end_states_are_the_plain_engines(h, path: str, prompts: list[list[int]], refs: dict[str, list[int]]):
    """The end states the radix cache holds for the workload's requests (requests that ended with a
    lagged step behind them too) are the plain engine's."""
    plain = harness_for(path, "plain", page_size=1, max_total_tokens=4096)
    run_workload(plain, prompts, max_new=MAX_NEW, ignore_eos=True)
    for x in (h, plain):
        x.submit("next", prompts[3][:5], max_new_tokens=2)  # a pass: runs the queued end-state copies
        x.run_until_idle()
    for i, p in enumerate(prompts):
        key = refs[str(i)][:len(p) + MAX_NEW - 1]
        got, want = (_end_state(x, key) for x in (h, plain))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=lambda m: f"request {i}: {m}")


def test_a_hybrids_lagged_verify_steps_roll_its_state_back_on_the_device(mtp_model, monkeypatch):
    """The overlap loop builds a hybrid model's verify steps behind the running one: the worker rolls
    each row's recurrent state back by the running step's count on the device, from that step's scratch
    set (steps alternate sets); a request that ends inside an accepted run (max_tokens, a stop token) or
    is aborted gets its state back from its last processed step before its end state is cached. Drafts
    that pass 0..3 at a time (_oracle_head): HF's tokens, lagged steps, a follow-up turn cached up to
    the first turn's end (its end state) with HF's tokens, nothing leaked."""
    path = mtp_model("qwen3_5")
    prompts = workload()[:4]
    refs = {str(i): p + hf_greedy(path, p, MAX_NEW, ignore_eos=True) for i, p in enumerate(prompts)}
    _oracle_head(monkeypatch, refs)
    h = harness_for(path, "overlap", page_size=1, max_total_tokens=4096, **NEXTN)
    results = run_workload(h, prompts, max_new=MAX_NEW, ignore_eos=True)
    for i, p in enumerate(prompts):
        assert results[str(i)].ids == refs[str(i)][len(p):], f"request {i} differs from HF"
    info = spec_info(h)
    assert info["spec_lagged_verify_steps"] > 5 and info["spec_accept_length"] > 2, info
    stop = refs["0"][len(prompts[0]) + 9]
    refs["stop"] = refs["0"]
    h.submit("stop", prompts[0], max_new_tokens=MAX_NEW, ignore_eos=True, stop_token_ids=[stop])
    out = h.run_until_idle()["stop"].ids
    assert out[-1] == stop and out == refs["0"][len(prompts[0]):len(prompts[0]) + len(out)]
    res = follow_up_and_abort(h, path, prompts[1], results["1"].ids, prompts[2])
    assert res["turn2"].cached_tokens >= len(prompts[1]) + MAX_NEW - 1, "the first turn's end state"
    assert h.scheduler.check_memory_integrity()
    _assert_end_states_are_the_plain_engines(h, path, prompts, refs)


def test_a_hybrids_lagged_tree_steps_roll_its_state_back_to_the_last_accepted_node(mtp_model, monkeypatch):
    """Head trees (topk 2) on a hybrid in the overlap loop, their accepted runs off the first chain
    (_oracle_head_trees): each node's state follows from its parent's, the worker rolls each row back
    to the last accepted node's state on the device (future_map.state_node) at the start of the step
    behind, and a request that ends gets it from its own step: HF's tokens, lagged tree steps, the end
    states cached the plain engine's, nothing leaked."""
    path = mtp_model("qwen3_5")
    prompts = workload()[:4]
    refs = {str(i): p + hf_greedy(path, p, MAX_NEW, ignore_eos=True) for i, p in enumerate(prompts)}
    _oracle_head_trees(monkeypatch, refs)
    h = harness_for(path, "overlap", page_size=1, max_total_tokens=4096, **NEXTN, speculative_eagle_topk=2)
    results = run_workload(h, prompts, max_new=MAX_NEW, ignore_eos=True)
    for i, p in enumerate(prompts):
        assert results[str(i)].ids == refs[str(i)][len(p):], f"request {i} differs from HF"
    info = spec_info(h)
    assert info["spec_lagged_verify_steps"] > 5 and info["spec_tree_branch_accepts"] > 5, info
    assert info["spec_accept_length"] > 2, info
    assert h.scheduler.check_memory_integrity()
    _assert_end_states_are_the_plain_engines(h, path, prompts, refs)


@pytest.mark.parametrize("loop", ["plain", "overlap"])
def test_a_hybrids_verify_steps_through_the_verify_graphs_path(mtp_model, monkeypatch, loop):
    """A hybrid's chain verify steps through the graph runner's padded static path (run eagerly on CPU:
    what a verify graph replays): its linear-attention waves read and write the slots loaded into the
    runner's buffers from each step's tracks (alternating scratch sets where steps lag), a padded request
    the padding slot only. Drafts passing 0..3 at a time (_oracle_head), a batch shrinking from 4 to 1
    (buckets 1, 2 and 4, 3 requests padded into 4): HF's tokens, follow-up turns from the end states cached give HF's
    tokens, nothing leaked."""
    from baton.engine.model_executor.cuda_graph_runner import CudaGraphRunner

    path = mtp_model("qwen3_5")
    prompts = workload()[:4]
    refs = {str(i): p + hf_greedy(path, p, MAX_NEW, ignore_eos=True) for i, p in enumerate(prompts)}
    _oracle_head(monkeypatch, refs)
    h = harness_for(path, loop, page_size=1, max_total_tokens=4096, **{**NEXTN, "speculative_disable_by_batch_size": 5})
    runner = h.scheduler.worker.model_runner
    graphs = runner.cuda_graph_runner = CudaGraphRunner(runner, max_bs=8, capture=False, verify_tokens=4,
                                                        verify_max_bs=4)  # buckets 1, 2, 4
    runner.attn_backend.native_decode = False  # decode attention from per-pass metadata, as FlashInfer's
    h.scheduler.worker.drafter.use_graphs(graphs)
    replays, replay, pad = [], graphs.replay, runner.state_pool.pad_slot

    def recording(fb):
        out = replay(fb)
        replays.append((fb.spec_verify, fb.batch_size))
        if fb.spec_verify:  # a padded request's waves touch the padding slot only
            b = graphs.bucket(fb.batch_size, verify=True)
            assert (graphs.wave_read[:, fb.batch_size:b] == pad).all()
            assert (graphs.wave_dest[:, fb.batch_size:b] == pad).all()
        return out

    graphs.replay = recording
    lens = [MAX_NEW, 8, 16, 24]  # the batch shrinks from 4 to 1
    for i, (p, n) in enumerate(zip(prompts, lens)):
        h.submit(str(i), p, max_new_tokens=n, ignore_eos=True)
    results = h.run_until_idle()
    for i, (p, n) in enumerate(zip(prompts, lens)):
        assert results[str(i)].ids == refs[str(i)][len(p):len(p) + n], f"request {i} differs from HF"
    verified = {bs for verify, bs in replays if verify}
    # plain loop: every size, 3 padded into bucket 4; the overlap loop's lagged steps mostly draft short
    # (each request's room counts what the step still running may emit), so fewer are full
    assert {1, 2, 3, 4} <= verified if loop == "plain" else verified, replays
    info = spec_info(h)
    assert info["spec_accept_length"] > 2 and (info["spec_lagged_verify_steps"] > 0) == (loop == "overlap"), info
    # follow-up turns of requests that ended while others ran start from their cached end states
    for rid in ("1", "2"):
        turn2 = refs[rid][:len(prompts[int(rid)]) + lens[int(rid)]] + [7, 8]
        h.submit("turn2-" + rid, turn2, max_new_tokens=8, ignore_eos=True)
        res = h.run_until_idle()["turn2-" + rid]
        assert res.ids == hf_greedy(path, turn2, 8, ignore_eos=True), rid
        assert res.cached_tokens >= len(turn2) - 3, (rid, res.cached_tokens, len(turn2))
    assert h.scheduler.check_memory_integrity()


def _end_state(h, key: list[int]) -> list:
    """The recurrent states (every layer's conv and delta-rule state) the radix cache holds at the end
    of `key`, which it must have cached whole."""
    match = h.scheduler.tree_cache.match_prefix(key)
    assert len(match.device_indices) == len(key) and match.last_node.state is not None, "cached to its end"
    pool, slot = h.scheduler.worker.model_runner.state_pool, match.last_node.state
    return [t[slot].clone() for t in (*pool.conv, *pool.ssm)]


@pytest.mark.parametrize("case", ["retraction", "preemption", "retraction-trees"])
def test_a_hybrids_lagged_verify_steps_under_retraction_and_preemption(mtp_model, monkeypatch, case):
    """The overlap loop with lagged verify steps of a hybrid (drafts passing 0..3 at a time,
    _oracle_head; trees accepted off their first chain, _oracle_head_trees) in a pool too small for
    every request (decode retracts them: the steps in flight are processed first, the state rolled
    back, then checkpointed for the resume), or with a high-priority arrival that preempts them: HF's
    tokens, lagged steps, nothing leaked."""
    path = mtp_model("qwen3_5")
    prompts = workload(seed=1) if case != "preemption" else repetitive_prompts() + workload(seed=3)[:2]
    new = MAX_NEW if case != "preemption" else 30
    refs = {str(i): p + hf_greedy(path, p, new, ignore_eos=True) for i, p in enumerate(prompts)}
    trees = case.endswith("trees")
    (_oracle_head_trees if trees else _oracle_head)(monkeypatch, refs)
    spec = dict(NEXTN, speculative_eagle_topk=2 if trees else 1)
    if case != "preemption":
        pool = int(0.6 * (sum(map(len, prompts)) + new * len(prompts)))
        h = harness_for(path, "overlap", page_size=1, chunked_prefill_size=32, max_total_tokens=pool, **spec)
        results = run_workload(h, prompts, max_new=new, ignore_eos=True)
        assert h.scheduler.stats.retractions > 0
        assert (spec_info(h)["spec_tree_branch_accepts"] > 5) == trees
    else:
        h = harness_for(path, "overlap", page_size=1, max_total_tokens=2048, enable_priority_scheduling=True,
                        priority_preemption_threshold=5, max_running_requests=4, **spec)
        for i, p in enumerate(prompts[:4]):
            h.submit(str(i), p, max_new_tokens=new, ignore_eos=True, priority=0)
        for _ in range(6):
            h.step()
        h.submit("4", prompts[4], max_new_tokens=5, ignore_eos=True, priority=10)
        refs["4"] = refs["4"][:len(prompts[4]) + 5]
        order = finish_order(h)
        assert h.scheduler.stats.preemptions >= 1 and order[0] == "4", order
        results = h.results
    for rid, ref in refs.items():
        assert results[rid].ids == ref[len(prompts[int(rid)]):], f"request {rid}"
    assert spec_info(h)["spec_lagged_verify_steps"] > 0
    assert h.scheduler.check_memory_integrity()


@pytest.mark.parametrize("topk", [1, 2])
def test_pd_decode_lags_a_hybrids_verify_steps(mtp_model, monkeypatch, topk):
    """The seeds' setting: a Qwen3.5-shaped hybrid with its MTP head in PD, both sides in the overlap
    loop; the decode's verify steps lag (drafts passing 0..3 at a time, _oracle_head; topk 2: trees
    accepted off their first chain, _oracle_head_trees) over transferred requests whose state came from
    the prefill: HF's tokens, both sides settle with nothing leaked."""
    from test_pd_scheduler import PDPair, _run

    path = mtp_model("qwen3_5")
    prompts = workload()[:4]
    refs = {str(i): p + hf_greedy(path, p, MAX_NEW, ignore_eos=True) for i, p in enumerate(prompts)}
    (_oracle_head if topk == 1 else _oracle_head_trees)(monkeypatch, refs)
    pair = PDPair(path, page_size=1, max_total_tokens=4096, enable_overlap_schedule=True,
                  disable_overlap_schedule=False, **NEXTN, speculative_eagle_topk=topk)
    try:
        _run(pair, prompts, max_new_tokens=MAX_NEW, ignore_eos=True)
        for i, p in enumerate(prompts):
            assert pair.decode.results[str(i)].ids == refs[str(i)][len(p):], f"request {i}"
        info = spec_info(pair.decode)
        assert info["spec_lagged_verify_steps"] > 0 and info["spec_accept_length"] > 2, info
        assert (info["spec_tree_branch_accepts"] > 5) == (topk == 2), info
        pair.assert_settled()
    finally:
        pair.close()
