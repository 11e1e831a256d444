"""EAGLE / EAGLE3 speculative decoding: a draft checkpoint's head drafts from the target's
hidden states (models/eagle.py, speculative/head_worker.py).

Criteria, on CPU in float32:
- the head is the published architecture: the chain the engine drafts equals the head built from
  transformers' Llama modules as the EAGLE authors define it (tiny_models.EagleReference), token for
  token, EAGLE over the target's final states and EAGLE-3 over three of its layers' inputs with its
  own reduced vocabulary;
- speculation changes no token: greedy output equals HF's, with a head trained on the target's own
  continuations (so drafts are accepted, runs cut by stops) and with a random one (mostly rejected),
  through chunked prefill, radix hits, both loops, pages and aborts; nothing leaks.
On CPU in bfloat16 (the native forward serves the target, the head beside it): the tokens the same
engine gives without speculation.
"""
from __future__ import annotations

import warnings

from typing import Optional

import pytest
import torch

from baton.engine.core.spec_info import tree_size
from baton.engine.server_args import ServerArgs
from test_scheduler_vs_hf import hf_greedy, harness_for, run_workload, workload
from test_speculative import (MAX_NEW, follow_up_and_abort, recorded_drafts, repetitive_prompts, spec_info,
                              stops_and_logprobs_equal_plain)
from tiny_models import load_eagle_reference, make_eagle_draft

STEPS = 3


def eagle(kind: str, draft: str, **more) -> dict:
    return dict(speculative_algorithm=kind, speculative_draft_model_path=draft, speculative_num_steps=STEPS,
                speculative_disable_by_batch_size=64, **more)


def prompts() -> list[list[int]]:
    return workload()[:6] + repetitive_prompts()[:2]


@pytest.fixture(scope="module")
def target(tiny_model_factory):
    """Four layers, so that EAGLE-3 reads three distinct ones (the inputs of layers 1, 2, 3)."""
    return tiny_model_factory("llama", num_hidden_layers=4)


@pytest.fixture(scope="module")
def drafts(target, tmp_path_factory):
    """kind -> draft directory: random EAGLE and EAGLE3 heads, and heads trained on the target's greedy
    continuations of prompts(): "-trained" to predict them, "-decoy" to rank a wrong token first and
    the right one second (EagleReference.fit)."""
    made: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in made:
            base, trained, decoy = kind.split("-")[0], kind.endswith("-trained"), kind.endswith("-decoy")
            fit = ([p + hf_greedy(target, p, MAX_NEW, ignore_eos=True) for p in prompts()]
                   if trained or decoy else None)
            made[kind] = make_eagle_draft(target, tmp_path_factory.mktemp(kind), base, fit_on=fit,
                                          decoy=0.6 if decoy else 0.0)
        return made[kind]

    return get


@pytest.mark.parametrize("kind", ["EAGLE", "EAGLE3"])
def test_the_drafted_chain_is_the_eagle_heads_own(target, drafts, kind):
    """The first verify step of a request drafts, after its prompt and first token, the chain the
    reference head gives over the target's states (and, from the second draft on, its own outputs)."""
    draft = drafts(kind)
    h = harness_for(target, "plain", max_total_tokens=2048, **eagle(kind, draft))
    seen = recorded_drafts(h)
    prompt = workload()[2]
    h.submit("a", prompt, max_new_tokens=8, ignore_eos=True)
    out = h.run_until_idle()["a"].ids
    assert out == hf_greedy(target, prompt, 8, ignore_eos=True)
    assert seen and seen[0] == load_eagle_reference(target, draft).chain(prompt + out[:1], STEPS)
    assert spec_info(h)["speculative_algorithm"] == kind and h.scheduler.check_memory_integrity()


@pytest.mark.parametrize("topk", [1, 2])
def test_drafts_stay_on_the_device_until_the_verify_pass_is_queued(target, drafts, topk):
    """A head's chains and trees are read back with the verify result, not before: when the verify pass
    runs, its VerifyInput still holds them on the device only (`pending`; the host lists hold
    placeholders: a tree's parents its reserved shape, its masks come from ancestor matrices), and the
    tokens are HF's with drafts accepted."""
    args = eagle("EAGLE", drafts("EAGLE-trained")) if topk == 1 else tree("EAGLE", drafts("EAGLE-trained"), topk)
    h = harness_for(target, "plain", max_total_tokens=2048, **args)
    worker = h.scheduler.worker
    runner, drafter, seen = worker.model_runner, worker.drafter, []
    draft, forward = drafter.draft, runner.forward
    last_spec = []

    def drafting(fb, spec):
        last_spec[:] = [spec]
        draft(fb, spec)

    def forwarding(fb):
        if fb.spec_verify and last_spec and any(last_spec[0].drafts):
            spec = last_spec[0]
            placeholders = all(t == 0 for d in spec.drafts for t in d)
            if topk > 1 and fb.tree_parents is not None:  # the masks' trees are on the device (near its end
                # a request's tree may be one node: a chain)
                placeholders &= all(t is None or isinstance(t, torch.Tensor) for t in fb.tree_parents)
            seen.append((spec.pending is not None, placeholders))
        return forward(fb)

    drafter.draft, runner.forward = drafting, forwarding
    prompt = prompts()[0]
    h.submit("a", prompt, max_new_tokens=MAX_NEW, ignore_eos=True)
    assert h.run_until_idle()["a"].ids == hf_greedy(target, prompt, MAX_NEW, ignore_eos=True)
    assert seen and all(p and placeholders for p, placeholders in seen), seen
    assert spec_info(h)["spec_accept_length"] > 1.5 and h.scheduler.check_memory_integrity()


@pytest.mark.parametrize("kind,loop,page_size", [("EAGLE-trained", "overlap", 16), ("EAGLE3", "inline", 4),
                                                 ("EAGLE-trained", "plain", 1)])
def test_eagle_greedy_equals_hf(target, drafts, kind, loop, page_size):
    """Concurrent requests, prompts past the 32-token chunk, shared prefixes, a follow-up turn, an
    abort mid-speculation: HF's tokens; the trained head's drafts accepted; nothing leaked."""
    ps = prompts()
    h = harness_for(target, loop, page_size=page_size, chunked_prefill_size=32, max_total_tokens=4096,
                    **eagle(kind.split("-")[0], drafts(kind)))
    results = run_workload(h, ps, max_new=MAX_NEW, ignore_eos=True)
    for i, p in enumerate(ps):
        assert results[str(i)].ids == hf_greedy(target, p, MAX_NEW, ignore_eos=True), f"request {i} differs from HF"
    info = spec_info(h)
    assert info["spec_verify_steps"] > 0, info
    if kind.endswith("trained"):
        assert info["spec_accept_length"] > 1.5, info
    assert follow_up_and_abort(h, target, ps[3], results["3"].ids, ps[1])["turn2"].cached_tokens > 0


def run_through_graph_paths(h, target, verify_tokens: int, trees: bool = False):
    """Four requests through the graph runner's padded static paths (run eagerly on CPU: what CUDA graphs
    replay): decode steps while the batch is too large to speculate (the harness's
    --speculative-disable-by-batch-size 3), full verify steps through the verify graphs' path (masked
    by trees with `trees`) once it shrinks, every draft step through the draft-step graphs' path
    (chains: buckets 1, 2; trees' leaves: 1, 2, 4, 8, some padded) and the head's pass after each decode
    and verify replay through its graph's path; HF's tokens. Returns the replays
    (verify step?, batch size, masked by trees?) and per verify step request 0's (tokens so far,
    drafts, tree parents or None)."""
    from baton.engine.model_executor.cuda_graph_runner import CudaGraphRunner

    runner = h.scheduler.worker.model_runner
    graphs = runner.cuda_graph_runner = CudaGraphRunner(runner, max_bs=8, capture=False, verify_tokens=verify_tokens,
                                                        verify_max_bs=2, verify_trees=trees)
    runner.attn_backend.native_decode = False  # decode attention from per-pass metadata, as FlashInfer's
    replays, replay = [], graphs.replay
    graphs.replay = lambda fb: (replays.append((fb.spec_verify, fb.batch_size, fb.tree_parents is not None))
                                or replay(fb))
    drafter = h.scheduler.worker.drafter
    drafter.use_graphs(graphs)
    heads = drafter.graphs
    assert heads.sizes == ([1, 2, 4, 8] if trees else [1, 2])
    draft_steps, replay_draft = [], heads.replay_draft
    heads.replay_draft = lambda fb, states: draft_steps.append(fb.batch_size) or replay_draft(fb, states)
    head_passes, replay_head = [], heads.replay_head_after
    heads.replay_head_after = lambda fb, ids, states: head_passes.append(fb.spec_verify) or replay_head(fb, ids,
                                                                                                       states)
    seen: list[tuple[list[int], list[int], Optional[list[int]]]] = []
    process = h.scheduler.spec.process_verify_result

    def record(launched, result):
        for i, req in enumerate(launched.reqs):
            if req.rid == "0":
                spec = launched.mwb.spec_info
                seen.append((req.origin_input_ids + req.output_ids, list(spec.drafts[i]), spec.tree(i)))
        process(launched, result)

    h.scheduler.spec.process_verify_result = record
    ps, lens = prompts()[:4], [30, 6, 9, 30]
    for i, (p, n) in enumerate(zip(ps, lens)):
        h.submit(str(i), p, max_new_tokens=n, ignore_eos=True)
    results = h.run_until_idle()
    for i, (p, n) in enumerate(zip(ps, lens)):
        assert results[str(i)].ids == hf_greedy(target, p, n, ignore_eos=True), f"request {i}"
    assert max(b for verify, b, _ in replays if not verify) >= 3, "the big batch decoded through the graph runner"
    assert any(verify for verify, _, _ in replays), "full verify steps went through the verify graphs' path"
    assert draft_steps, "draft steps went through the draft-step graphs' path"
    assert sorted(head_passes) == sorted(verify for verify, _, _ in replays), "the head's pass after each replay"
    assert any(b not in heads.sizes for b in draft_steps) == trees, "a tree's leaves padded (2 x 3 in 8)"
    return replays, seen


@pytest.mark.parametrize("kind", ["EAGLE", "EAGLE3"])
def test_a_draft_step_over_one_static_batch_reads_its_positions_every_time(target, drafts, kind):
    """What a captured draft-step graph replays: the head's pass over the same static batch object, new
    positions loaded into its buffer, attends as a pass built for those positions does. (The rotary
    embedding memoizes cos/sin by the positions tensor's identity: a pass that handed it the static
    batch's own tensor would be captured without computing them, and replay the warm-up's.)"""
    from baton.engine.model_executor.cuda_graph_runner import CudaGraphRunner

    h = harness_for(target, "plain", max_total_tokens=1024, **eagle(kind, drafts(kind)))
    runner, drafter = h.scheduler.worker.model_runner, h.scheduler.worker.drafter
    with torch.inference_mode():  # as the worker runs (the graph runner's buffers are inference tensors)
        graphs = CudaGraphRunner(runner, max_bs=4, capture=False)
        drafter.use_graphs(graphs)
        pool, table = runner.token_to_kv_pool, runner.req_to_token_pool.req_to_token
        torch.manual_seed(0)
        for buf in pool.k_buffer + pool.v_buffer:  # keys at other positions than the pass's own
            buf.normal_()
        table[0, :5], table[1, :5] = torch.arange(8, 13), torch.arange(16, 21)
        graphs.req_pool_indices[:2] = torch.tensor([0, 1])
        graphs.seq_lens[:2] = 5
        graphs.out_cache_loc[:2] = torch.tensor([12, 20])
        graphs.input_ids[:2] = torch.tensor([7, 9])
        states = torch.randn(2, drafter.hidden.shape[1], dtype=drafter.hidden.dtype)

        def run(fb, positions):
            graphs.positions[:2] = torch.tensor(positions)
            runner.attn_backend.init_forward_metadata(fb)
            return drafter._draft_pass(fb, states).clone()

        static = graphs.static_batch(2, [5, 5])
        first, again = run(static, [4, 4]), run(static, [40, 90])
        fresh = run(graphs.static_batch(2, [5, 5]), [40, 90])
        assert not torch.allclose(first, again), "the positions change the head's attention"
        torch.testing.assert_close(again, fresh)


@pytest.mark.parametrize("kind", ["EAGLE", "EAGLE3"])
def test_head_passes_around_graph_replays(target, drafts, kind):
    """Through the graph runner's paths (run_through_graph_paths), verify steps of full chains: the head's
    passes after each replay plan the batch's own attention metadata (EAGLE-3 reads the layer states the
    replay left), so every later draft is the reference head's chain over the tokens so far."""
    draft = drafts(kind)
    h = harness_for(target, "plain", max_total_tokens=4096,
                    **{**eagle(kind, draft), "speculative_disable_by_batch_size": 3})
    _, seen = run_through_graph_paths(h, target, STEPS + 1)
    reference = load_eagle_reference(target, draft)
    assert len(seen) >= 3
    for tokens, drafted, _ in seen:
        assert drafted == reference.chain(tokens, STEPS)[:len(drafted)], len(tokens)
    assert h.scheduler.check_memory_integrity()


@pytest.mark.parametrize("case,loop", [("retraction", "plain"), ("priority-preemption", "plain"),
                                       ("retraction", "overlap"), ("priority-preemption", "overlap")])
def test_eagle_under_retraction_and_preemption(target, drafts, case, loop):
    """A pool too small for every request (decode retracts speculating requests; a retracted request's
    prefill runs the head over its prompt and output again), or a high-priority arrival preempting
    speculating ones: HF's tokens, drafts accepted, nothing leaked. In the overlap loop the verify steps
    lag until then: both wait for the step in flight first."""
    ps = prompts()
    spec = eagle("EAGLE", drafts("EAGLE-trained"))
    if case == "retraction":
        pool = int(0.45 * (sum(map(len, ps)) + MAX_NEW * len(ps)))
        h = harness_for(target, loop, chunked_prefill_size=32, max_total_tokens=pool, **spec)
        results = run_workload(h, ps, max_new=MAX_NEW, ignore_eos=True)
        assert h.scheduler.stats.retractions > 0
    else:
        from scheduler_harness import SchedulerHarness

        overlap = loop == "overlap"
        h = SchedulerHarness(target, enable_priority_scheduling=True, priority_preemption_threshold=5,
                             max_running_requests=4, enable_overlap_schedule=overlap,
                             disable_overlap_schedule=not overlap, max_total_tokens=2048, **spec)
        for i, p in enumerate(ps[:4]):
            h.submit(str(i), p, max_new_tokens=MAX_NEW, ignore_eos=True, priority=0)
        for _ in range(6):
            h.step()
        h.submit("high", ps[4], max_new_tokens=5, ignore_eos=True, priority=10)
        results = h.run_until_idle()
        assert h.scheduler.stats.preemptions >= 1
        assert results["high"].ids == hf_greedy(target, ps[4], 5, ignore_eos=True)
        ps = ps[:4]
    for i, p in enumerate(ps):
        assert results[str(i)].ids == hf_greedy(target, p, MAX_NEW, ignore_eos=True), f"request {i}"
    info = spec_info(h)
    assert info["spec_accepted_tokens"] > 0 and h.scheduler.check_memory_integrity()
    assert (info["spec_lagged_verify_steps"] > 0) == (loop == "overlap"), info


def test_stops_and_logprobs_inside_accepted_runs(target, drafts):
    """With drafts accepted: max_tokens that cut a chain, a stop token inside an accepted run, logprobs:
    what the engine without speculation gives."""
    spec = stops_and_logprobs_equal_plain(target, prompts()[3], **eagle("EAGLE", drafts("EAGLE-trained")))
    assert spec_info(spec)["spec_accepted_tokens"] > 0


@pytest.mark.parametrize("loop", ["plain", "overlap"])
def test_eagle_beside_the_native_bf16_forward(target, drafts, loop):
    """CPU bfloat16: the native forward serves the target's passes (extends, decodes, verifies), the
    head's passes plan their own attention metadata beside it; the tokens are the same engine's
    without speculation, drafts accepted. In the overlap loop the native forward stream runs the
    plain steps, and the verify steps, lagged, as Python calls in their turn on it."""
    ps = prompts()[:4]
    common = dict(dtype="bfloat16", max_total_tokens=2048)
    plain = run_workload(harness_for(target, "plain", **common), ps, max_new=24, ignore_eos=True)
    h = harness_for(target, loop, **common, **eagle("EAGLE", drafts("EAGLE-trained")))
    assert h.scheduler.worker.model_runner.native_forward is not None
    spec = run_workload(h, ps, max_new=24, ignore_eos=True)
    for i in range(len(ps)):
        assert spec[str(i)].ids == plain[str(i)].ids, f"request {i}"
    info = spec_info(h)
    assert info["spec_accepted_tokens"] > 0 and h.scheduler.check_memory_integrity()
    assert (info["spec_lagged_verify_steps"] > 0) == (loop == "overlap"), info


@pytest.mark.parametrize("topk", [1, 2])
def test_pd_decode_drafts_with_the_prefills_head_kv(target, drafts, topk):
    """PD, both sides EAGLE: the prefill's head fills its KV layer over the prompt, which travels with
    the target's layers, and its first draft and output at the prompt's end travel in the metadata slot:
    the decode drafts in a request's first step the reference head's chain, or with topk 2 its best-first
    tree (the slot carries the head's candidates and their log-probabilities); drafts accepted; HF's tokens, both sides settle with nothing
    leaked."""
    from test_pd_scheduler import PDPair, _run

    ps = repetitive_prompts()
    draft = drafts("EAGLE-trained")
    pair = PDPair(target, page_size=1, max_total_tokens=4096, disable_overlap_schedule=True,
                  **eagle("EAGLE", draft, speculative_eagle_topk=topk))
    first: dict[str, tuple[int, list[int], Optional[list[int]]]] = {}
    trees = []
    spec = pair.decode.scheduler.spec
    process = spec.process_verify_result

    def record(launched, result):
        for i, (req, d) in enumerate(zip(launched.reqs, launched.mwb.spec_info.drafts)):
            first.setdefault(req.rid, (len(req.output_ids), list(d), launched.mwb.spec_info.tree(i)))
            trees.append(launched.mwb.spec_info.tree(i))
        process(launched, result)

    spec.process_verify_result = record
    try:
        _run(pair, ps, max_new_tokens=MAX_NEW, ignore_eos=True)
        reference = load_eagle_reference(target, draft)
        for i, p in enumerate(ps):
            out = pair.decode.results[str(i)].ids
            assert out == hf_greedy(target, p, MAX_NEW, ignore_eos=True), f"request {i}"
            if topk == 1:
                assert first[str(i)] == (1, reference.chain(p + out[:1], STEPS), None), i
            else:
                n, drafted, parents = first[str(i)]
                nodes, depth = tree_size(STEPS, 2, 2 * STEPS)
                assert n == 1 and (parents, drafted) == reference.best_first(p + out[:1], depth, 2, nodes), i
        assert spec_info(pair.decode)["spec_accepted_tokens"] > 0
        assert any(t is not None for t in trees) == (topk > 1)
        pair.assert_settled()
    finally:
        pair.close()


def test_a_token_map_cuts_the_eagle_heads_vocabulary(target, drafts, tmp_path):
    """--speculative-token-map (SGLang's flag): an EAGLE head drafts among the map's tokens only, the
    reference head's chain with its argmax over those; greedy output is still HF's."""
    import torch

    hot = torch.arange(6, 512, 2)  # every other id
    path = tmp_path / "hot.pt"
    torch.save(hot, path)
    draft = drafts("EAGLE-trained")
    h = harness_for(target, "plain", max_total_tokens=2048, **eagle("EAGLE", draft, speculative_token_map=str(path)))
    seen = recorded_drafts(h)
    prompt = prompts()[3]
    h.submit("a", prompt, max_new_tokens=MAX_NEW, ignore_eos=True)
    out = h.run_until_idle()["a"].ids
    assert out == hf_greedy(target, prompt, MAX_NEW, ignore_eos=True)
    reference = load_eagle_reference(target, draft)
    reference.hot = hot
    assert seen[0] == reference.chain(prompt + out[:1], STEPS)
    assert all(t % 2 == 0 for d in seen for t in d) and h.scheduler.check_memory_integrity()
    with pytest.raises(ValueError, match="EAGLE with --tp-size 1 only"):
        ServerArgs(model_path=target, **eagle("EAGLE3", drafts("EAGLE3"), speculative_token_map=str(path)))


def test_an_eagle3_draft_saved_with_layers_0_names_loads_the_same(target, drafts, tmp_path):
    """A draft whose one layer is saved as `layers.0.*` (some trainers' layout) instead of `midlayer.*`
    is the same head: the same first drafts."""
    import shutil

    from safetensors.torch import load_file, save_file

    draft = drafts("EAGLE3")
    renamed = tmp_path / "renamed"
    shutil.copytree(draft, renamed)
    tensors = load_file(renamed / "model.safetensors")
    save_file({k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}, renamed / "model.safetensors")
    firsts = []
    for path in (draft, str(renamed)):
        h = harness_for(target, "plain", max_total_tokens=1024, **eagle("EAGLE3", path))
        seen = recorded_drafts(h)
        h.submit("a", workload()[2], max_new_tokens=6, ignore_eos=True)
        h.run_until_idle()
        firsts.append(seen)
    assert firsts[0] and firsts[0] == firsts[1]


def test_eagle_flags_and_what_is_refused(target, drafts, tiny_model_factory, tmp_path):
    from transformers import LlamaConfig

    from baton.engine.model_config import ModelConfig
    from baton.engine.models.eagle import eagle3_aux_layers

    args = ServerArgs(model_path=target, **eagle("EAGLE3", drafts("EAGLE3")))
    assert (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens) == (3, 1, 4)
    with pytest.raises(ValueError, match="needs --speculative-draft-model-path"):
        ServerArgs(model_path=target, speculative_algorithm="EAGLE")
    with pytest.raises(ValueError, match="is for EAGLE and EAGLE3"):
        ServerArgs(model_path=target, speculative_algorithm="NGRAM", speculative_draft_model_path=drafts("EAGLE"))
    # a draft whose KV layers would not fit the target's pool
    other = tiny_model_factory("llama", num_key_value_heads=4)
    with pytest.raises(ValueError, match="must be the target's"):
        harness_for(other, "plain", max_total_tokens=1024, **eagle("EAGLE", drafts("EAGLE")))
    # the other kind of draft than the algorithm names (EAGLE-3 reads layer states EAGLE does not capture)
    with pytest.raises(ValueError, match="is an EAGLE3 draft .*pass --speculative-algorithm EAGLE3"):
        harness_for(target, "plain", max_total_tokens=1024, **eagle("EAGLE", drafts("EAGLE3")))
    # a checkpoint that is no EAGLE draft
    with pytest.raises(ValueError, match="is not an EAGLE draft"):
        harness_for(target, "plain", max_total_tokens=1024, **eagle("EAGLE", target))
    config = ModelConfig.from_hf(LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1,
                                             architectures=["LlamaForCausalLMEagle3"]))  # no eagle_config
    assert eagle3_aux_layers(config, 32) == (2, 16, 29)  # SGLang's default for a 32-layer target


# ---------------------------------------------------------------------------- trees (--speculative-eagle-topk)
def tree(kind: str, draft: str, topk: int, **more) -> dict:
    return eagle(kind, draft, speculative_eagle_topk=topk, attention_backend="torch", **more)


def test_a_best_first_trees_reserved_size_and_placeholder():
    """What the scheduler reserves for a head's tree before the head runs: within the node budget, at
    most nodes - 1 deep (n nodes n deep would be a chain), room for the drafting's scratch slots (topk
    per step past the first, among the step's 1 + nodes slots), and a placeholder that is a tree of that
    depth (so the step is verified as one) with every node's parent before it."""
    from baton.engine.core.spec_info import is_chain, node_depths, placeholder_tree

    for steps in range(1, 7):
        for topk in range(2, 6):
            for budget in range(steps, 1 + topk + (steps - 1) * topk * topk):
                nodes, depth = tree_size(steps, topk, budget)
                if budget == 1:  # one node: a chain
                    assert (nodes, depth) == (1, 1)
                    continue
                assert 2 <= nodes <= budget and 1 <= depth <= steps and depth < nodes, (steps, topk, budget)
                assert (depth - 1) * topk <= nodes + 1, (steps, topk, budget)
                tree = placeholder_tree(depth, nodes)
                assert len(tree) == nodes + 1 and not is_chain(tree) and max(node_depths(tree)) == depth
                assert all(0 <= p < j for j, p in enumerate(tree) if j)
    assert tree_size(3, 2, 6) == (6, 3) and tree_size(3, 4, 4) == (4, 2) and tree_size(5, 8, 63) == (63, 5)


@pytest.mark.parametrize("kind", ["EAGLE-decoy", "EAGLE3-decoy"])
def test_the_drafted_tree_is_the_eagle_heads_best_first_tree(target, drafts, kind):
    """With topk 3 and 8 nodes every verify step drafts the reference head's best-first tree (SGLang's:
    the 3 best children of each of the 3 best leaves per step, the 8 best candidates by summed
    log-probability), the same shape and tokens. The decoy head's runs are accepted off the first chain,
    so from the second step on this holds only if the head's KV at the accepted nodes moved with the
    target's; the trees are no fixed shape (at least two shapes seen)."""
    draft = drafts(kind)
    h = harness_for(target, "plain", max_total_tokens=2048,
                    **tree(kind.split("-")[0], draft, 3, speculative_num_draft_tokens=9))
    seen: list[tuple[list[int], list[int], list[int]]] = []
    process = h.scheduler.spec.process_verify_result
    h.scheduler.spec.process_verify_result = lambda launched, result: (
        seen.append((list(launched.reqs[0].output_ids), list(launched.mwb.spec_info.drafts[0]),
                     launched.mwb.spec_info.tree(0))), process(launched, result))
    prompt = workload()[2]
    h.submit("a", prompt, max_new_tokens=12, ignore_eos=True)
    out = h.run_until_idle()["a"].ids
    assert out == hf_greedy(target, prompt, 12, ignore_eos=True)
    reference = load_eagle_reference(target, draft)
    assert len(seen) > 2 and spec_info(h)["spec_tree_branch_accepts"] > 0
    for before, drafted, parents in seen:
        room = 12 - len(before) - 1  # near the end the tree is cut to the columns left (a node takes one)
        nodes, depth = tree_size(min(STEPS, room), 3, min(8, room))
        want_parents, want = reference.best_first(prompt + before, depth, 3, nodes)
        assert (parents, drafted) == (want_parents if nodes > 1 else None, want), len(before)  # one node: a chain
    assert len({tuple(p) for _, _, p in seen if p is not None}) > 1
    assert spec_info(h)["speculative_eagle_topk"] == 3 and h.scheduler.check_memory_integrity()


def test_head_trees_through_the_tree_verify_graphs_path(target, drafts):
    """With topk 3 the verify graphs are masked by each step's tree (run_through_graph_paths: what a CUDA
    graph replays, its mask planned before): every drafted tree is the reference head's best-first tree
    (so the head's pass after each replay read the tree's own mask and its KV moved with the target's)."""
    draft = drafts("EAGLE-decoy")
    spec = {**tree("EAGLE", draft, 3, speculative_num_draft_tokens=9), "speculative_disable_by_batch_size": 3}
    h = harness_for(target, "plain", max_total_tokens=4096, **spec)
    replays, seen = run_through_graph_paths(h, target, 9, trees=True)
    assert any(verify and masked for verify, _, masked in replays), "tree steps went through the tree graphs' path"
    reference = load_eagle_reference(target, draft)
    prompt = prompts()[0]
    assert len(seen) >= 3 and spec_info(h)["spec_tree_branch_accepts"] > 0
    for tokens, drafted, parents in seen:
        before = tokens[len(prompt):]
        room = 30 - len(before) - 1
        nodes, depth = tree_size(min(STEPS, room), 3, min(8, room))
        want_parents, want = reference.best_first(tokens, depth, 3, nodes)
        assert (parents, drafted) == (want_parents if nodes > 1 else None, want), len(before)
    assert h.scheduler.check_memory_integrity()


@pytest.mark.parametrize("loop,page_size", [("plain", 1), ("overlap", 16)])
def test_head_trees_greedy_equals_hf(target, drafts, loop, page_size):
    """A head whose argmax is mostly wrong and second choice right (a decoy): with topk 2 most runs are
    accepted off the first chain; HF's tokens through chunked prefill, shared prefixes, a follow-up turn
    (the moved KV cached) and an abort; nothing leaked. Topk 1 with the same head gets far less."""
    ps = prompts()
    common = dict(page_size=page_size, chunked_prefill_size=32, max_total_tokens=4096)
    h = harness_for(target, loop, **common, **tree("EAGLE", drafts("EAGLE-decoy"), 2))
    results = run_workload(h, ps, max_new=MAX_NEW, ignore_eos=True)
    for i, p in enumerate(ps):
        assert results[str(i)].ids == hf_greedy(target, p, MAX_NEW, ignore_eos=True), f"request {i} differs from HF"
    info = spec_info(h)
    assert info["spec_tree_branch_accepts"] > info["spec_verify_steps"] // 2 and info["spec_accept_length"] > 1.5, info
    assert follow_up_and_abort(h, target, ps[3], results["3"].ids, ps[1])["turn2"].cached_tokens > 0


def test_stops_and_logprobs_inside_accepted_branches(target, drafts):
    """max_tokens, a stop token and logprobs inside runs accepted off the first chain: the plain engine's."""
    spec = stops_and_logprobs_equal_plain(target, prompts()[3], **tree("EAGLE", drafts("EAGLE-decoy"), 2))
    assert spec_info(spec)["spec_tree_branch_accepts"] > 0


@pytest.mark.parametrize("loop", ["plain", "overlap"])
def test_head_trees_at_the_end_of_the_context(target, drafts, loop):
    """A request that fills the context (max_tokens capped to it): its last steps' trees have no more
    nodes than the positions left before the end of its row (a tree's nodes take a column each, more
    than its depth), in both loops; HF's tokens, nothing leaked."""
    prompt = prompts()[0]
    h = harness_for(target, loop, context_length=64, max_total_tokens=2048,
                    **tree("EAGLE", drafts("EAGLE-decoy"), 2))
    h.submit("full", prompt, max_new_tokens=1000, ignore_eos=True)
    out = h.run_until_idle()["full"].ids
    assert len(prompt) + len(out) == 64 and out == hf_greedy(target, prompt, len(out), ignore_eos=True)
    assert spec_info(h)["spec_verify_steps"] > 0 and h.scheduler.check_memory_integrity()


def test_head_tree_flags_and_what_is_refused(target, drafts):
    draft = drafts("EAGLE")
    args = ServerArgs(model_path=target, **tree("EAGLE", draft, 2))
    assert (args.speculative_eagle_topk, args.speculative_num_draft_tokens) == (2, 1 + 2 * STEPS)
    assert ServerArgs(model_path=target, **tree("EAGLE", draft, 4, speculative_num_draft_tokens=5)
                      ).speculative_num_draft_tokens == 5
    # SGLang's EAGLE settings ask for more nodes than topk x steps: up to every candidate drafted
    assert ServerArgs(model_path=target, **tree("EAGLE", draft, 4, speculative_num_draft_tokens=37)
                      ).speculative_num_draft_tokens == 1 + 4 + (STEPS - 1) * 16
    for n in (STEPS, 2 + 4 + (STEPS - 1) * 16):
        with pytest.raises(ValueError, match="must be between"):
            ServerArgs(model_path=target, **tree("EAGLE", draft, 4, speculative_num_draft_tokens=n))
    assert ServerArgs(model_path=target, device="cuda", **{**tree("EAGLE", draft, 2), "attention_backend": "flashinfer"}
                      ).speculative_eagle_topk == 2, "FlashInfer masks trees too"
    assert ServerArgs(model_path=target, tp_size=2, **tree("EAGLE", draft, 2)).speculative_eagle_topk == 2


# ------------------------------------------------------------------ lagged verify steps (overlap loop)
def lagging(h) -> list[bool]:
    """From now on: for each verify step built, whether it was built while the one before it ran; and
    after each lagged build, every running request's KV as it must be while two steps hold it: its
    reservation within its row's limit (prompt + max_new_tokens), its own slots allocated (no page of
    them free) and no slot held by two requests."""
    seen: list[bool] = []
    s = h.scheduler
    spec, allocator, table = s.spec, s.allocator, s.req_to_token_pool.req_to_token
    prepare = spec.prepare_verify

    def record(batch, lagged=False):
        built = prepare(batch, lagged)
        if built:
            seen.append(lagged)
        if built and lagged:
            owned = []
            for r in batch.reqs:
                assert r.kv_committed_len <= r.kv_allocated_len <= len(r.origin_input_ids) + r.sampling_params.max_new_tokens
                owned.append(table[r.req_pool_idx, len(r.prefix_indices):r.kv_allocated_len])
            owned = torch.cat(owned)
            assert len(set(owned.tolist())) == len(owned), "a slot held by two requests"
            assert not allocator._is_free[owned // allocator.page_size].any(), "a reserved slot's page is free"
        return built

    spec.prepare_verify = record
    return seen


@pytest.mark.parametrize("loop,topk,page_size", [("overlap", 1, 16), ("inline", 2, 1), ("overlap", 2, 4)])
def test_lagged_verify_steps_change_no_token(target, drafts, loop, topk, page_size):
    """The overlap loop builds a verify step while the one before it still runs, so neither the
    running step's tokens nor where each row starts are known to the scheduler (the worker moves the
    rows on): HF's tokens with drafts accepted, through chunked prefill, staggered arrivals, shared
    prefixes, a follow-up turn and an abort while steps are in flight; most verify steps lagged, the KV
    held right while they run (lagging()). Chains and best-first trees, the worker thread and the inline
    (CUDA-form) launch, pages of 1, 4 and 16 tokens; nothing leaked."""
    ps = prompts()
    args = eagle("EAGLE", drafts("EAGLE-trained")) if topk == 1 else tree("EAGLE", drafts("EAGLE-decoy"), topk)
    h = harness_for(target, loop, page_size=page_size, chunked_prefill_size=32, max_total_tokens=4096, **args)
    assert h.scheduler.spec.lags
    lagged = lagging(h)
    results = run_workload(h, ps, max_new=MAX_NEW, ignore_eos=True)
    for i, p in enumerate(ps):
        assert results[str(i)].ids == hf_greedy(target, p, MAX_NEW, ignore_eos=True), f"request {i} differs from HF"
    info = spec_info(h)
    assert info["spec_lagged_verify_steps"] == sum(lagged) > len(lagged) // 2, (sum(lagged), len(lagged))
    assert info["spec_accept_length"] > 1.5, info
    assert h.scheduler.check_memory_integrity() and not any(r.spec_flight for r in h.scheduler.running_batch.reqs)
    assert follow_up_and_abort(h, target, ps[3], results["3"].ids, ps[1])["turn2"].cached_tokens > 0


@pytest.mark.parametrize("topk", [1, 2])
def test_a_plain_verify_launch_reads_nothing_back(target, drafts, topk):
    """The inline launch (the CUDA stream executor's form, on the CPU): a verify step of plain requests
    (greedy, or sampled with a temperature and a seed, or penalised) returns from its launch with its
    acceptance still on the device (the result's tokens unread, the head's drafts unread; logprobs too),
    its last tokens and counts in the future map for the step built behind it; the host reads them
    once, when the scheduler processes the result. Greedy: HF's tokens, and the plain engine's for the
    penalised one (trees too: each node processed for its own path). A request with min_new_tokens is
    checked on the device too, its stop ids blocked there by the count on the device, and lags."""
    args = eagle("EAGLE", drafts("EAGLE-trained")) if topk == 1 else tree("EAGLE", drafts("EAGLE-decoy"), topk)
    h = harness_for(target, "inline", max_total_tokens=2048, **args)
    executor, launches = h.scheduler.executor, []
    launch = executor.launch

    def recording(mwb):
        placeholders, handle = launch(mwb)
        if mwb.spec_info is not None:
            result = handle._future.result()  # what the worker returned, before anyone resolved it
            launches.append((result.pending_verify is not None and result.verify is None,
                             mwb.spec_info.pending is not None or not any(mwb.spec_info.drafts)))
        return placeholders, handle

    executor.launch = recording
    ps = prompts()[:3]
    for i, p in enumerate(ps):
        h.submit(str(i), p, max_new_tokens=MAX_NEW, ignore_eos=True)
    h.submit("sampled", ps[0], max_new_tokens=MAX_NEW, ignore_eos=True, temperature=0.7, seed=5)
    h.submit("logprobs", ps[1], max_new_tokens=MAX_NEW, ignore_eos=True, return_logprob=True, top_logprobs_num=2)
    penalised = dict(max_new_tokens=MAX_NEW, ignore_eos=True, frequency_penalty=0.5, logit_bias={5: 1.0})
    h.submit("penalised", ps[2], **penalised)
    out = h.run_until_idle()
    for i, p in enumerate(ps):
        assert out[str(i)].ids == hf_greedy(target, p, MAX_NEW, ignore_eos=True), f"request {i}"
    assert len(out["sampled"].ids) == MAX_NEW and out["logprobs"].ids == out["1"].ids
    plain = harness_for(target, "plain", max_total_tokens=2048)
    plain.submit("penalised", ps[2], **penalised)
    assert out["penalised"].ids == plain.run_until_idle()["penalised"].ids, "the plain engine's penalised tokens"
    assert len(out["logprobs"].output_logprobs) == MAX_NEW
    assert all(len(top) == 2 and top[0][1] == t for top, t in zip(out["logprobs"].output_top_logprobs,
                                                                  out["logprobs"].ids))
    assert launches and all(on_device and unread for on_device, unread in launches), launches
    lagged = spec_info(h)["spec_lagged_verify_steps"]
    assert lagged > 0
    launches.clear()
    # stop ids greedy has early, blocked below min_new_tokens, and one the blocked output has first past
    # it, which ends the request there: on the device, the steps lagging (the count includes what the
    # running step emitted, unread), the plain engine's tokens
    stops = out["0"].ids[1:3]
    blocked = dict(max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW // 2, stop_token_ids=stops)
    plain.submit("blocked", ps[0], **blocked)
    trail = plain.run_until_idle()["blocked"].ids
    assert trail[1] not in stops, "min_new_tokens blocked the stop id where greedy had it"
    at, late = next((j, t) for j, t in enumerate(trail) if j >= MAX_NEW // 2 and t not in trail[:j])
    min_tokens = dict(blocked, stop_token_ids=stops + [late])
    h.submit("min_tokens", ps[0], **min_tokens)
    plain.submit("min_tokens", ps[0], **min_tokens)
    got, want = h.run_until_idle()["min_tokens"].ids, plain.run_until_idle()["min_tokens"].ids
    assert got == want and len(got) == at + 1 and got[-1] == late, (got, want, at)
    assert launches and all(on_device and unread for on_device, unread in launches), launches
    assert spec_info(h)["spec_lagged_verify_steps"] > lagged and h.scheduler.check_memory_integrity()


def test_lagged_verify_steps_stop_and_score_as_plain(target, drafts):
    """In the overlap loop, with lagged verify steps: max_tokens that cut an accepted run, a stop token
    inside one (the request ends while the step built behind it runs: that step's tokens are dropped,
    its KV freed once it is in) and logprobs: what the engine without speculation gives."""
    h = stops_and_logprobs_equal_plain(target, prompts()[3], loop="overlap", **eagle("EAGLE", drafts("EAGLE-trained")))
    info = spec_info(h)
    assert info["spec_lagged_verify_steps"] > 0 and info["spec_accepted_tokens"] > 0, info
    assert h.scheduler.check_memory_integrity()


def test_pd_decode_lags_verify_steps_after_the_transfer(target, drafts):
    """PD with the overlap loop on both sides, EAGLE chains: the decode's verify steps lag behind each
    other from the transferred requests' second step on; HF's tokens, both sides settle with nothing
    leaked."""
    from test_pd_scheduler import PDPair, _run

    ps = repetitive_prompts()
    pair = PDPair(target, page_size=1, max_total_tokens=4096, enable_overlap_schedule=True,
                  disable_overlap_schedule=False, **eagle("EAGLE", drafts("EAGLE-trained")))
    try:
        _run(pair, ps, max_new_tokens=MAX_NEW, ignore_eos=True)
        for i, p in enumerate(ps):
            assert pair.decode.results[str(i)].ids == hf_greedy(target, p, MAX_NEW, ignore_eos=True), f"request {i}"
        info = spec_info(pair.decode)
        assert info["spec_lagged_verify_steps"] > info["spec_verify_steps"] // 2 and info["spec_accepted_tokens"] > 0
        pair.assert_settled()
    finally:
        pair.close()


def test_verify_steps_lag_only_where_they_can(target, drafts, tiny_model_factory):
    """The plain loop never lags (nothing runs behind the scheduler's back); NGRAM, whose drafts are the
    scheduler's own, never does; and a batch that grows (a new request joins) or drops to plain steps
    waits for the verify step in flight: the tokens are HF's all the same."""
    plain = harness_for(target, "plain", max_total_tokens=2048, **eagle("EAGLE", drafts("EAGLE-trained")))
    assert not plain.scheduler.spec.lags
    ngram = harness_for(target, "overlap", max_total_tokens=2048, speculative_algorithm="NGRAM")
    assert not ngram.scheduler.spec.lags
    # two requests: lagging until the batch grows past the speculation limit, then plain steps
    h = harness_for(target, "overlap", max_total_tokens=2048,
                    **{**eagle("EAGLE", drafts("EAGLE-trained")), "speculative_disable_by_batch_size": 3})
    lagged = lagging(h)
    ps = prompts()
    h.submit("a", ps[0], max_new_tokens=MAX_NEW, ignore_eos=True)
    h.submit("b", ps[1], max_new_tokens=MAX_NEW, ignore_eos=True)
    for _ in range(8):
        h.step()
    assert any(lagged), lagged
    h.submit("c", ps[2], max_new_tokens=MAX_NEW, ignore_eos=True)  # three running: plain decode steps
    out = h.run_until_idle()
    for rid, p in zip("abc", ps):
        assert out[rid].ids == hf_greedy(target, p, MAX_NEW, ignore_eos=True), rid
    assert h.scheduler.check_memory_integrity()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["EAGLE-trained", "EAGLE3"])
def test_eagle_on_cuda_changes_no_token(target, drafts, kind):
    """On CUDA (the model's plain forward, the head's passes beside it, the overlap loop): EAGLE gives
    the tokens the same engine gives without speculation, float32, the drafts verified."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    ps = prompts()
    common = dict(device="cuda", dtype="float32", chunked_prefill_size=32, max_total_tokens=4096)
    plain = run_workload(harness_for(target, "overlap", **common), ps, max_new=MAX_NEW, ignore_eos=True)
    h = harness_for(target, "overlap", **common, **eagle(kind.split("-")[0], drafts(kind)))
    # what a verify launch makes the host wait for (torch's sync warnings), lagged or not: printed for
    # the record (a lagged one reads the running step's emitted counts once; a greedy one reads nothing else)
    executor, syncs = h.scheduler.executor, {False: [], True: []}
    launch = executor.launch

    def counted(mwb):
        if mwb.spec_info is None:
            return launch(mwb)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return launch(mwb)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                syncs[mwb.spec_info.lagged is not None].append(sum("synchroniz" in str(w.message) for w in seen))

    executor.launch = counted
    spec = run_workload(h, ps, max_new=MAX_NEW, ignore_eos=True)
    for lagged, counts in syncs.items():
        print(f"host syncs per {'lagged' if lagged else 'first'} verify launch: {counts[:8]} ... "
              f"mean {sum(counts) / max(len(counts), 1):.2f} over {len(counts)}")
    for i in range(len(ps)):
        assert spec[str(i)].ids == plain[str(i)].ids, f"request {i}"
    info = spec_info(h)
    assert info["spec_lagged_verify_steps"] > 0 and h.scheduler.check_memory_integrity(), info


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["EAGLE", "EAGLE3"])
def test_eagle_with_decode_graphs_on_flashinfer(tiny_model_factory, tmp_path, kind):
    """On CUDA, fp16, FlashInfer: the batch too large to speculate replays captured decode graphs and
    the head's passes follow each replay; once it shrinks, full-chain verify steps replay the verify
    graphs and the head's draft steps and its passes after the replays theirs. Tokens: HF's greedy
    ones by the fp16 criterion of test_gpu_paths (teacher-forced); nothing leaks."""
    from test_gpu_paths import GPU_MODEL, hf_consistency, need_gpu

    need_gpu()
    path = tiny_model_factory("llama", num_hidden_layers=4, **GPU_MODEL)
    ps, lens = prompts()[:4], [30, 6, 9, 30]
    draft = make_eagle_draft(path, tmp_path / kind, kind,
                             fit_on=[p + hf_greedy(path, p, 30, ignore_eos=True) for p in ps])
    h = harness_for(path, "overlap", device="cuda", dtype="float16", attention_backend="flashinfer",
                    cuda_graph_max_bs=8, max_total_tokens=4096,
                    **{**eagle(kind, draft), "speculative_disable_by_batch_size": 3})
    graphs = h.scheduler.worker.model_runner.cuda_graph_runner
    assert graphs is not None and graphs.use_graphs and graphs.verify_sizes == [1, 2]
    heads = h.scheduler.worker.drafter.graphs
    assert heads.sizes == [1, 2] and ("draft", 2) in heads.graphs, "the head's draft steps captured"
    assert ("head-verify", 2) in heads.graphs and ("head-decode", 8) in heads.graphs, "the head's passes after"
    replays, replay = [], graphs.replay
    graphs.replay = lambda fb: replays.append((fb.spec_verify, fb.batch_size)) or replay(fb)
    draft_steps, replay_draft = [], heads.replay_draft
    heads.replay_draft = lambda fb, states: draft_steps.append(fb.batch_size) or replay_draft(fb, states)
    head_passes, replay_head = [], heads.replay_head_after
    heads.replay_head_after = lambda fb, ids, states: head_passes.append(fb.spec_verify) or replay_head(fb, ids,
                                                                                                       states)
    for i, (p, n) in enumerate(zip(ps, lens)):
        h.submit(str(i), p, max_new_tokens=n, ignore_eos=True)
    results = h.run_until_idle()
    exact = sum(hf_consistency(path, p, results[str(i)].ids, tol=0.1) for i, p in enumerate(ps))
    assert exact >= 0.9 * sum(lens)
    assert max(b for verify, b in replays if not verify) >= 3 and any(v for v, _ in replays), replays
    assert draft_steps and sorted(head_passes) == sorted(v for v, _ in replays), "the head's graphs replayed"
    info = spec_info(h)
    assert info["spec_verify_steps"] > 0 and info["spec_accepted_tokens"] > 0, info
    assert h.scheduler.check_memory_integrity()


@pytest.mark.gpu
def test_best_first_head_trees_on_flashinfer(tiny_model_factory, tmp_path):
    """On CUDA, fp16, FlashInfer: a decoy head's best-first trees (topk 2; the head's scores on the GPU,
    its leaves' steps replaying the draft-step graphs, FlashInfer's custom mask over the drafter's tree,
    positions rewritten by the drafter; tree verify graphs) verified greedily and sampled: greedy
    tokens are HF's by the fp16 criterion of test_gpu_paths (teacher-forced), runs are accepted off the
    first chain, nothing leaks."""
    from test_gpu_paths import GPU_MODEL, hf_consistency, need_gpu

    need_gpu()
    path = tiny_model_factory("llama", num_hidden_layers=4, **GPU_MODEL)
    ps = prompts()[:4]
    draft = make_eagle_draft(path, tmp_path / "decoy", "EAGLE",
                             fit_on=[p + hf_greedy(path, p, 30, ignore_eos=True) for p in ps], decoy=0.6)
    h = harness_for(path, "overlap", device="cuda", dtype="float16", max_total_tokens=4096,
                    **{**tree("EAGLE", draft, 2), "attention_backend": "flashinfer"})
    for i, p in enumerate(ps):
        h.submit(str(i), p, max_new_tokens=30, ignore_eos=True)
    h.submit("sampled", ps[0], max_new_tokens=30, ignore_eos=True, temperature=0.7, seed=3)
    # what the drafter's passes make the host wait for (torch's sync warnings; the tree is read back
    # once, at the end: printed for the record, the attention planning's own copies included)
    drafter = h.scheduler.worker.drafter
    draft, syncs = drafter.draft, []

    def counted(fb, spec):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                draft(fb, spec)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs.append(sum("synchroniz" in str(w.message) for w in seen))

    drafter.draft = counted
    graphs = h.scheduler.worker.model_runner.cuda_graph_runner
    heads = drafter.graphs
    assert graphs.verify_trees and heads is not None and heads.target is graphs, \
        "tree verify graphs and the draft steps' graphs"
    replays, replay_draft = [], heads.replay_draft
    heads.replay_draft = lambda fb, states: replays.append(fb.batch_size) or replay_draft(fb, states)
    head_passes, replay_head = [], heads.replay_head_after
    heads.replay_head_after = lambda fb, ids, states: head_passes.append(fb.spec_verify) or replay_head(fb, ids,
                                                                                                       states)
    results = h.run_until_idle()
    assert replays and any(head_passes), "the leaves' draft steps and the head's pass after a tree replay, in graphs"
    print(f"host syncs per tree draft: {syncs[:8]} ... mean {sum(syncs) / max(len(syncs), 1):.2f}")
    exact = sum(hf_consistency(path, p, results[str(i)].ids, tol=0.1) for i, p in enumerate(ps))
    assert exact >= 0.9 * 30 * len(ps) and len(results["sampled"].ids) == 30
    info = spec_info(h)
    assert info["spec_tree_branch_accepts"] > 0 and info["spec_accept_length"] > 1.3, info
    assert h.scheduler.check_memory_integrity()

