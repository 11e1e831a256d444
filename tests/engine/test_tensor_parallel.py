"""Tensor parallelism (--tp-size): each model replica split over TP ranks, Megatron style. Unit
tests of the shard arithmetic and of the sharded layers against the unsharded ones (the ranks'
partial sums added by hand), and of the driver's req_to_token mirror; then the real thing (the
forward's all-reduces through shared memory, once through gloo): the scheduler in this process as
TP rank 0 driving a follower process, greedy tokens equal to HF for every architecture (KV heads
split and replicated), both loops, chunked prefill, radix hits, retraction and torch.compile; and a
served engine with --tp-size 2, whose follower's death stops it."""
from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest
import torch
import torch.nn.functional as F

from baton.engine.distributed.parallel_state import TpGroup, all_reduce_backend, validate_tp
from baton.engine.layers.linear import MergedColumnLinear, RowParallelLinear, even_parts, qkv_parts
from baton.engine.server_args import ServerArgs
from scheduler_harness import SchedulerHarness
from test_scheduler_vs_hf import MAX_NEW, assert_greedy_equals_hf, assert_same_logprobs, hf_greedy, run_workload, workload
from tp_group import tp_followers


# ---------------------------------------------------------------------------- shard arithmetic

def test_kv_heads_split_or_replicated():
    assert [TpGroup(r, 2).kv_head_range(4) for r in range(2)] == [(0, 2), (2, 2)]
    assert [TpGroup(r, 4).kv_head_range(2) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        TpGroup(0, 4).kv_head_range(3)
    with pytest.raises(ValueError, match="not divisible"):
        TpGroup(0, 2).kv_head_range(3)


def test_validate_tp_names_what_does_not_divide():
    from transformers import LlamaConfig, Qwen3_5TextConfig

    from baton.engine.model_config import ModelConfig

    def llama(heads: int, kv_heads: int, intermediate: int) -> ModelConfig:
        return ModelConfig.from_hf(LlamaConfig(hidden_size=16 * heads, num_attention_heads=heads,
                                               num_key_value_heads=kv_heads, intermediate_size=intermediate))

    cfg = llama(6, 3, 100)
    validate_tp(cfg, 1)
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\), num_key_value_heads \(3\)"):
        validate_tp(cfg, 4)
    with pytest.raises(ValueError, match=r"intermediate_size \(100\)"):
        validate_tp(llama(8, 8, 100), 8)
    hybrid = Qwen3_5TextConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=8, head_dim=8,
                               intermediate_size=64, num_hidden_layers=4, linear_num_key_heads=2,
                               linear_num_value_heads=8)
    with pytest.raises(ValueError, match=r"linear_num_key_heads \(2\)"):  # a hybrid's linear-attention heads
        validate_tp(ModelConfig.from_hf(hybrid), 4)


def test_server_args():
    assert ServerArgs(model_path="m", tp_size=2).tp_size == 2
    with pytest.raises(ValueError, match="--tp-size must be >= 1"):
        ServerArgs(model_path="m", tp_size=0)
    # PD + TP (each rank moves its own shard; the in-process fake backend cannot): test_schedule_policy.py
    assert ServerArgs(model_path="m", tp_size=2, dp_size=2, base_gpu_id=1).gpu_id(1, 1) == 4


@pytest.mark.parametrize("kv_heads", [4, 1])
def test_sharded_attention_projections_equal_the_full_ones(kv_heads):
    """q/k/v column shards, concatenated per part over the ranks, are the full projection (or with
    one KV head, each rank holds that head); o_proj's per-rank partial products sum to the full one."""
    torch.manual_seed(0)
    heads, hd, hidden, tp = 4, 8, 32, 2
    wq, wk, wv = torch.randn(heads * hd, hidden), torch.randn(kv_heads * hd, hidden), torch.randn(kv_heads * hd, hidden)
    wo, x = torch.randn(hidden, heads * hd), torch.randn(5, hidden)
    qs, ks, outs = [], [], []
    for rank in range(tp):
        g = TpGroup(rank, tp)
        qkv = MergedColumnLinear(hidden, qkv_parts(heads, kv_heads, hd, g), bias=False)
        for shard, w in enumerate((wq, wk, wv)):
            qkv.load_shard("weight", shard, w)
        q, k, v = qkv(x).split(qkv.output_sizes, dim=-1)
        qs.append(q)
        ks.append(k)
        o = RowParallelLinear(heads * hd, hidden, bias=False, tp=g)
        o.weight.weight_loader(o.weight, wo)
        outs.append(F.linear(q, o.weight))  # the partial product each rank all-reduces
    torch.testing.assert_close(torch.cat(qs, -1), x @ wq.T)
    full_k = x @ wk.T
    torch.testing.assert_close(torch.cat(ks, -1) if kv_heads >= tp else ks[0], full_k)
    if kv_heads < tp:
        torch.testing.assert_close(ks[1], full_k)  # replicated
    torch.testing.assert_close(sum(outs), (x @ wq.T) @ wo.T, rtol=1e-4, atol=1e-4)


def test_sharded_mlp_and_moe_sum_to_the_full_ones():
    from baton.engine.layers.moe import SparseMoeBlock

    torch.manual_seed(0)
    hidden, inter, tp = 16, 24, 2
    gate, up, down, x = torch.randn(inter, hidden), torch.randn(inter, hidden), torch.randn(hidden, inter), torch.randn(3, hidden)
    partial = []
    for rank in range(tp):
        g = TpGroup(rank, tp)
        gu = MergedColumnLinear(hidden, even_parts([inter, inter], g), bias=False)
        gu.load_shard("weight", 0, gate)
        gu.load_shard("weight", 1, up)
        d = RowParallelLinear(inter, hidden, bias=False, tp=g)
        d.weight.weight_loader(d.weight, down)
        a, b = gu(x).split(gu.output_sizes, -1)
        partial.append(F.linear(F.silu(a) * b, d.weight))
    torch.testing.assert_close(sum(partial), (F.silu(x @ gate.T) * (x @ up.T)) @ down.T, rtol=1e-4, atol=1e-4)

    experts, top_k = 4, 2
    weights = {"gate.weight": torch.randn(experts, hidden),
               "experts.gate_up_proj": torch.randn(experts, 2 * inter, hidden),
               "experts.down_proj": torch.randn(experts, hidden, inter)}
    full = SparseMoeBlock(hidden, inter, experts, top_k, True)
    shards = [SparseMoeBlock(hidden, inter, experts, top_k, True, tp=TpGroup(r, tp)) for r in range(tp)]
    for block in [full, *shards]:
        for name, t in weights.items():
            assert block.load_weight(name, t)
    w, ids = full.route(x)
    torch.testing.assert_close(sum(b._experts(x, w, ids) for b in shards), full(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("vocab, tp", [(12, 2), (10, 3)], ids=["even", "padded"])
def test_vocab_parallel_embedding_and_lm_head_combine_to_the_full_ones(monkeypatch, vocab, tp):
    """Each rank holds ceil(vocab / tp) rows (zeros past the vocabulary); the lookups' per-rank rows
    sum to the full embedding exactly (one rank's value plus zeros), and the per-rank logits, side
    by side with the padding cut off, are the full LM head's."""
    from baton.engine.layers import vocab_parallel
    from baton.engine.layers.vocab_parallel import VocabParallelEmbedding

    monkeypatch.setattr(vocab_parallel, "all_reduce", lambda x, g: x)  # each rank's part, combined here
    monkeypatch.setattr(vocab_parallel, "all_gather_last_dim", lambda x, g: x)
    torch.manual_seed(0)
    dim = 8
    table, ids, hidden = torch.randn(vocab, dim), torch.tensor([0, vocab - 1, 3, 5, 3]), torch.randn(4, dim)
    shards = [VocabParallelEmbedding(vocab, dim, TpGroup(r, tp)) for r in range(tp)]
    per_rank = -(-vocab // tp)
    for r, e in enumerate(shards):
        e.weight.weight_loader(e.weight, table)
        assert e.weight.shape == (per_rank, dim) and e.shard.start == r * per_rank
        held = table[r * per_rank:(r + 1) * per_rank]
        assert torch.equal(e.weight[:len(held)], held) and not e.weight[len(held):].any()
    assert torch.equal(sum(e(ids) for e in shards), F.embedding(ids, table))
    scores = torch.cat([F.linear(hidden, e.weight) for e in shards], -1)[:, :vocab]
    torch.testing.assert_close(scores, hidden @ table.T)
    whole = VocabParallelEmbedding(vocab, dim)  # one rank: exactly nn.Embedding and F.linear
    whole.weight.weight_loader(whole.weight, table)
    assert torch.equal(whole(ids), F.embedding(ids, table))
    assert torch.equal(whole.logits(hidden), F.linear(hidden, table).float())


def test_the_driver_sends_only_the_table_entries_that_changed():
    from baton.engine.worker.tp_step import StepSender

    table = torch.zeros(4, 16, dtype=torch.int64)
    sender = StepSender(TpGroup(0, 2, "x", "x"), table)
    table[1, :5] = torch.arange(10, 15)  # a prefill of 5 tokens in row 1
    rows, cols, slots = sender._table_updates(torch.tensor([1]), [5])
    assert rows.tolist() == [1] * 5 and cols.tolist() == list(range(5)) and slots.tolist() == list(range(10, 15))
    table[1, 5] = 20  # a decode step: one entry
    assert [t.tolist() for t in sender._table_updates(torch.tensor([1]), [6])] == [[1], [5], [20]]
    assert [t.tolist() for t in sender._table_updates(torch.tensor([1]), [6])] == [[], [], []]
    table[1, 1] = 99  # the prefix cache swapped a slot (de-duplication): it is sent again
    table[2, :2] = torch.tensor([7, 8])  # beyond row 2's seq_len nothing is read, so nothing is sent
    assert [t.tolist() for t in sender._table_updates(torch.tensor([1, 2]), [6, 1])] == [[1, 2], [1, 0], [99, 7]]
    assert torch.equal(sender.mirror[1, :6], table[1, :6])


# ---------------------------------------------------------------------------- TP 2, in-process driver

def _run_tp(path: str, prompts, max_new: int = MAX_NEW, **overrides):
    args = dict(tp_size=2, **overrides)
    with tp_followers(ServerArgs(model_path=path, **args)) as tp:
        # the forward's all-reduces: the shared memory segment unless the test asks for gloo's
        assert all_reduce_backend(tp) == args.get("tp_cpu_allreduce", "shm")
        h = SchedulerHarness(path, tp=tp, **args)
        try:
            results = run_workload(h, prompts, max_new=max_new, **({"ignore_eos": True} if max_new != MAX_NEW else {}))
            assert h.scheduler.check_memory_integrity()
            return h.scheduler, results
        finally:
            h.scheduler.close()  # releases the follower: tp_followers checks it exited 0


def _loop(loop: str) -> dict:
    return dict(enable_overlap_schedule=loop == "overlap", disable_overlap_schedule=loop == "plain")


@pytest.mark.parametrize("arch, overrides", [("llama", {}), ("qwen2", {}), ("qwen3", {"num_key_value_heads": 1}),
                                             ("qwen3_moe", {})], ids=["llama", "qwen2", "qwen3-kv1", "qwen3_moe"])
@pytest.mark.parametrize("loop", ["plain", "overlap"])
def test_tp2_matches_hf_concurrent_chunked_radix(tiny_model_factory, arch, overrides, loop):
    path = tiny_model_factory(arch, **overrides)
    prompts = workload()
    scheduler, results = _run_tp(path, prompts, page_size=16 if loop == "plain" else 1, chunked_prefill_size=32,
                                 max_total_tokens=4096, **_loop(loop))
    assert_greedy_equals_hf(path, prompts, results)
    assert scheduler.stats.cache_hit_rate() > 0
    # 2 KV heads split over 2 ranks, or the one KV head replicated: each rank's pool holds one
    assert scheduler.worker.model_runner.token_to_kv_pool.head_num == 1


@pytest.mark.parametrize("loop", ["plain", "overlap"])
def test_tp2_mixed_chunk_matches_hf(tiny_model_factory, loop):
    """--enable-mixed-chunk under TP: the mixed extend batches (one-token decode rows behind the
    prompts) reach the follower through the same step broadcast; tokens equal HF's."""
    from test_scheduler_vs_hf import _staggered

    path = tiny_model_factory("llama")
    prompts = workload(seed=4)
    args = dict(tp_size=2, chunked_prefill_size=32, max_total_tokens=4096, enable_mixed_chunk=True, **_loop(loop))
    with tp_followers(ServerArgs(model_path=path, **args)) as tp:
        h = SchedulerHarness(path, tp=tp, **args)
        try:
            results = _staggered(h, prompts, 10, ignore_eos=True)
            assert h.scheduler.stats.mixed_decode_tokens > 0 and h.scheduler.check_memory_integrity()
        finally:
            h.scheduler.close()
    for i, p in enumerate(prompts):
        assert results[str(i)].ids == hf_greedy(path, p, 10, ignore_eos=True), f"request {i} differs from HF"


@pytest.mark.parametrize("loop, allreduce", [("plain", "shm"), ("overlap", "gloo")])
def test_tp2_matches_hf_under_retraction(tiny_model_factory, loop, allreduce):
    path = tiny_model_factory("llama")
    prompts, max_new = workload(seed=1), 40
    pool = int(0.6 * (sum(map(len, prompts)) + max_new * len(prompts)))
    scheduler, results = _run_tp(path, prompts, max_new=max_new, chunked_prefill_size=32, max_total_tokens=pool,
                                 tp_cpu_allreduce=allreduce, **_loop(loop))
    assert scheduler.stats.retractions > 0
    for i, p in enumerate(prompts):
        assert results[str(i)].ids == hf_greedy(path, p, max_new, ignore_eos=True), f"request {i} differs from HF"


@pytest.mark.parametrize("arch, loop", [("llama", "plain"), ("qwen3_5", "overlap")])
def test_tp2_ngram_speculation_matches_hf(tiny_model_factory, arch, loop):
    """NGRAM under TP 2: a verify step's LM head runs over every row on both ranks (the step says it
    is one), a hybrid's per-token scratch states ride the step's state tracks; greedy equals HF with
    drafts accepted."""
    from test_speculative import SPEC, repetitive_prompts

    path = tiny_model_factory(arch, initializer_range=0.08 if arch == "llama" else 0.02)  # the looping models
    prompts = repetitive_prompts()
    scheduler, results = _run_tp(path, prompts, max_new=30, max_total_tokens=4096, **SPEC, **_loop(loop))
    assert scheduler.spec.server_info()["spec_accepted_tokens"] > 0
    for i, p in enumerate(prompts):
        assert results[str(i)].ids == hf_greedy(path, p, 30, ignore_eos=True), f"request {i} differs from HF"


@pytest.mark.parametrize("arch, loop", [("llama", "plain"), ("llama", "overlap"), ("qwen3_5", "plain")])
def test_tp2_tree_drafts_move_the_accepted_kv_on_every_rank(tiny_model_factory, monkeypatch, arch, loop):
    """Tree verify steps under TP 2 whose accepted tokens all lie off the first chain (the oracle drafter
    of test_speculative_tree): the follower masks the same trees and moves the same accepted nodes' KV
    as the driver, so every later step reads the right KV on both ranks; greedy equals HF. A hybrid's
    ranks run their linear-attention heads' states node by node and roll them back alike."""
    from test_speculative_tree import MAX_NEW as TREE_NEW, SPEC, _oracle

    from baton.engine.speculative.ngram_strategy import NgramSpeculator

    path = tiny_model_factory(arch, **({"initializer_range": 0.02} if arch == "qwen3_5" else {}))
    prompts = workload()[:4]
    refs = {str(i): hf_greedy(path, p, TREE_NEW, ignore_eos=True) for i, p in enumerate(prompts)}
    monkeypatch.setattr(NgramSpeculator, "draft_tree", _oracle(refs))  # the driver drafts; followers are told
    monkeypatch.setattr(NgramSpeculator, "on_verified", lambda self, req, drafted, accepted: None)
    scheduler, results = _run_tp(path, prompts, max_new=TREE_NEW, max_total_tokens=4096, **SPEC, **_loop(loop))
    for rid, ref in refs.items():
        assert results[rid].ids == ref, f"request {rid} differs from HF"
    assert scheduler.spec.server_info()["spec_tree_branch_accepts"] > 10


@pytest.mark.parametrize("loop", ["plain", "overlap"])
def test_tp2_eagle_trees_match_hf(tiny_model_factory, tmp_path, loop):
    """EAGLE trees (topk 2) under TP 2 with a head that ranks a wrong first draft first and the right one
    second: both ranks draft the same branches through their branch tables, the followers move the
    accepted branch's KV (the head's layers too); greedy equals HF with runs accepted off branch 0. In
    the overlap loop verify steps lag: the driver resolves each before sending it, the followers'
    future maps take every verify step's last tokens."""
    from test_speculative import repetitive_prompts
    from tiny_models import make_eagle_draft

    path = tiny_model_factory("llama", num_hidden_layers=4)
    prompts = repetitive_prompts()
    fit = [p + hf_greedy(path, p, 24, ignore_eos=True) for p in prompts]
    draft = make_eagle_draft(path, tmp_path / "decoy", "EAGLE", fit_on=fit, decoy=0.6)
    scheduler, results = _run_tp(path, prompts, max_new=24, max_total_tokens=4096, **_loop(loop),
                                 speculative_algorithm="EAGLE", speculative_draft_model_path=draft,
                                 speculative_num_steps=2, speculative_eagle_topk=2,
                                 speculative_disable_by_batch_size=64)
    for i, p in enumerate(prompts):
        assert results[str(i)].ids == hf_greedy(path, p, 24, ignore_eos=True), f"request {i} differs from HF"
    info = scheduler.spec.server_info()
    assert info["spec_tree_branch_accepts"] > 0
    assert (info["spec_lagged_verify_steps"] > 0) == (loop == "overlap"), info


@pytest.mark.parametrize("topk", [1, 2])
def test_tp2_hybrid_lagged_verify_steps_roll_every_ranks_state_back(tiny_model_factory, tmp_path, topk):
    """A hybrid target (Qwen3-Next) under TP 2 in the overlap loop, with an EAGLE draft fitted to its
    greedy text: verify steps lag and keep 0..2 drafts, so each row's recurrent state rolls back to
    every offset of the step before; every rank makes that rollback from the state copies the driver
    puts first in the resolved step (the followers have no counts). topk 2: the head's trees, their
    states run node by node on every rank and rolled back to the last accepted node. Greedy equals HF."""
    from test_speculative import repetitive_prompts
    from tiny_models import make_eagle_draft

    path = tiny_model_factory("qwen3_next")
    prompts = repetitive_prompts()
    fit = [p + hf_greedy(path, p, 24, ignore_eos=True) for p in prompts]
    draft = make_eagle_draft(path, tmp_path / "eagle", "EAGLE", fit_on=fit, fit_steps=80)
    scheduler, results = _run_tp(path, prompts, max_new=24, max_total_tokens=4096, **_loop("overlap"),
                                 speculative_algorithm="EAGLE", speculative_draft_model_path=draft,
                                 speculative_num_steps=2, speculative_eagle_topk=topk,
                                 speculative_disable_by_batch_size=64)
    for i, p in enumerate(prompts):
        assert results[str(i)].ids == fit[i][len(p):], f"request {i} differs from HF"
    info = scheduler.spec.server_info()
    counts = info["spec_accept_length_counts"]  # requests' steps that kept 0, 1, 2 drafts
    assert info["spec_lagged_verify_steps"] > 0 and counts[1] > 0 and counts[2] > 0 and counts[3] > 0, info
    assert info["speculative_eagle_topk"] == topk


@pytest.mark.parametrize("arch, loop", [("qwen3_5", "plain"), ("qwen3_next", "overlap")])
def test_tp2_nextn_speculation_matches_hf(tiny_model_factory, arch, loop):
    """NEXTN under TP 2: both ranks run the MTP head's passes (its attention heads and MLP sharded, its
    LM head all-gathered); the follower gets the sampled ids and, after a verify pass, what each
    request kept. The drafts equal one rank's (the head's chain for the same prompt), greedy equals HF.
    In the overlap loop verify steps lag: every rank rolls its rows' recurrent states back by the
    state copies the driver puts first in the resolved step."""
    from test_speculative import recorded_drafts, repetitive_prompts
    from tiny_models import MtpReference

    path = tiny_model_factory(arch, mtp=True, initializer_range=0.02)
    prompts = repetitive_prompts()
    spec = dict(speculative_algorithm="NEXTN", speculative_num_steps=2, speculative_disable_by_batch_size=64)
    scheduler, results = _run_tp(path, prompts, max_new=24, max_total_tokens=4096, chunked_prefill_size=16,
                                 **spec, **_loop(loop))
    info = scheduler.spec.server_info()
    assert info["spec_verify_steps"] > 0 and (info["spec_lagged_verify_steps"] > 0) == (loop == "overlap"), info
    for i, p in enumerate(prompts):
        assert results[str(i)].ids == hf_greedy(path, p, 24, ignore_eos=True), f"request {i} differs from HF"
    args = dict(tp_size=2, max_total_tokens=4096, disable_overlap_schedule=True, **spec)
    with tp_followers(ServerArgs(model_path=path, **args)) as tp:
        h = SchedulerHarness(path, tp=tp, **args)
        try:
            seen = recorded_drafts(h)
            h.submit("a", prompts[2], max_new_tokens=4, ignore_eos=True)
            out = h.run_until_idle()["a"].ids
        finally:
            h.scheduler.close()
    assert seen[0] == MtpReference.load(path).chain(prompts[2] + out[:1], 2)


def test_tp2_eagle3_speculation_matches_hf(tiny_model_factory, tmp_path):
    """EAGLE3 under TP 2: both ranks capture the three layers' states the head reads and run its passes
    (attention heads and MLP sharded, its own LM head over the draft vocabulary all-gathered); the
    drafts are the reference head's chain, greedy equals HF."""
    from test_speculative import recorded_drafts, repetitive_prompts
    from tiny_models import load_eagle_reference, make_eagle_draft

    path = tiny_model_factory("llama", num_hidden_layers=4)
    draft = make_eagle_draft(path, tmp_path / "eagle3", "EAGLE3")
    prompts = repetitive_prompts()
    args = dict(tp_size=2, max_total_tokens=4096, disable_overlap_schedule=True, chunked_prefill_size=16,
                speculative_algorithm="EAGLE3", speculative_draft_model_path=draft, speculative_num_steps=2,
                speculative_disable_by_batch_size=64)
    with tp_followers(ServerArgs(model_path=path, **args)) as tp:
        h = SchedulerHarness(path, tp=tp, **args)
        try:
            seen = recorded_drafts(h)
            h.submit("first", prompts[2], max_new_tokens=4, ignore_eos=True)  # alone: the first verify step is its
            first = h.run_until_idle()["first"].ids
            results = run_workload(h, prompts, max_new=24, ignore_eos=True)
            assert h.scheduler.check_memory_integrity()
        finally:
            h.scheduler.close()
    assert seen[0] == load_eagle_reference(path, draft).chain(prompts[2] + first[:1], 2)
    for i, p in enumerate(prompts):
        assert results[str(i)].ids == hf_greedy(path, p, 24, ignore_eos=True), f"request {i} differs from HF"


@pytest.mark.parametrize("tie, vocab", [(False, 512), (True, 509)], ids=["lm_head", "tied-odd-vocab"])
def test_tp2_prompt_and_output_logprobs_match_one_rank(tiny_model_factory, tie, vocab):
    """Prompt logprobs over several chunks and output logprobs with top-k: the LM head split by
    vocabulary rows (the followers join each of the driver's logits calls, prompt spans included)
    scores as one rank does; each rank holds half the embedding and LM head rows (an odd
    vocabulary: the second rank's last row is padding, cut from the logits)."""
    path = tiny_model_factory("qwen2", tie_word_embeddings=tie, vocab_size=vocab)
    prompts = workload(seed=2)[:6]
    args = dict(chunked_prefill_size=16, max_total_tokens=4096, disable_overlap_schedule=True)
    sampling = dict(return_logprob=True, logprob_start_len=0, top_logprobs_num=3, max_new_tokens=6)

    def run(h):
        for i, p in enumerate(prompts):
            h.submit(str(i), p, **sampling)
        return h.run_until_idle()

    one = SchedulerHarness(path, **args)
    want = run(one)
    one.scheduler.close()
    with tp_followers(ServerArgs(model_path=path, tp_size=2, **args)) as tp:
        h = SchedulerHarness(path, tp=tp, tp_size=2, **args)
        try:
            got = run(h)
            assert h.scheduler.check_memory_integrity()
            model = h.scheduler.worker.model_runner.model
            assert model.config.text.vocab_size == vocab
            assert model.model.embed_tokens.weight.shape[0] == (vocab + 1) // 2
            assert (model.lm_head is None) == tie and (tie or model.lm_head.weight.shape[0] == vocab // 2)
        finally:
            h.scheduler.close()
    for i, p in enumerate(prompts):
        g, w = got[str(i)], want[str(i)]
        assert g.ids == w.ids, f"request {i}"
        assert [t for _, t in g.input_logprobs] == p and g.input_logprobs[0][0] is None
        assert len(g.output_top_logprobs) == len(g.ids) and all(len(top) == 3 for top in g.output_top_logprobs)
        assert [t for _, t in g.output_logprobs] == g.ids
        assert_same_logprobs(g, w, f"request {i}")


def test_tp2_compiled_matches_hf_without_graph_breaks(tiny_model_factory):
    """The all-reduce is one opaque custom op: each pass stays one graph, compiled at start-up on
    both ranks (their warm-ups meet in the same all-reduces), and serving compiles nothing."""
    from torch._dynamo.utils import counters

    path = tiny_model_factory("qwen3")
    prompts = workload()
    args = dict(tp_size=2, enable_torch_compile=True, chunked_prefill_size=32, max_total_tokens=4096)
    with tp_followers(ServerArgs(model_path=path, **args)) as tp:
        h = SchedulerHarness(path, tp=tp, **args)
        try:
            graphs = counters["stats"]["unique_graphs"]
            results = run_workload(h, prompts)
            assert counters["stats"]["unique_graphs"] == graphs, "serving compiled a new graph"
            assert not counters["graph_break"], dict(counters["graph_break"])
        finally:
            h.scheduler.close()
    for i, p in enumerate(prompts):
        assert results[str(i)].ids == hf_greedy(path, p), f"request {i} differs from HF"


# ---------------------------------------------------------------------------- served

def test_served_tp2_matches_hf_and_a_dead_follower_stops_the_engine(tiny_model_factory):
    from engine_server import greedy_concurrently, running_engine, wait_idle_integrity

    path = tiny_model_factory("llama", max_position_embeddings=8192)
    prompts = [[(13 * i + 7 * j) % 480 + 7 for j in range(3 + 4 * i)] for i in range(10)]
    with running_engine(path, "--tp-size", "2", "--max-total-tokens", "8192", "--page-size", "4") as eng:
        for p, out in zip(prompts, greedy_concurrently(eng.base_url, prompts, 8)):
            assert out == hf_greedy(path, p, 8)
        info = wait_idle_integrity(eng.base_url)
        assert info["integrity_ok"] is True and info["tp_size"] == 2 and info["tp_allreduce"] == "shm"
        (follower,) = info["tp_follower_pids"]

        async def killed():
            async with httpx.AsyncClient(timeout=120) as c:
                task = asyncio.create_task(c.post(f"{eng.base_url}/generate", json={
                    "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 8000, "ignore_eos": True}}))
                await asyncio.sleep(0.5)
                os.kill(follower, signal.SIGKILL)
                return await task

        resp = asyncio.run(killed())
        assert resp.status_code == 503, resp.text
        code = eng.wait_exit(timeout_s=60)
        log = eng.log_tail(200)
        assert code == 1, f"exit code {code}\n{log}"
        assert "TP rank 1" in log, log


def test_served_dp2_tp2_runs_two_sharded_replicas_equal_to_hf(tiny_model_factory):
    """--dp-size 2 --tp-size 2: four processes, two replicas each split over two ranks, each pair
    with its own rendezvous and all-reduce segment."""
    from engine_server import greedy_concurrently, running_engine, wait_idle_integrity

    path = tiny_model_factory("llama")
    prompts = [[(17 * i + 5 * j) % 480 + 7 for j in range(4 + 3 * i)] for i in range(8)]
    with running_engine(path, "--tp-size", "2", "--dp-size", "2", "--max-total-tokens", "2048") as eng:
        for p, out in zip(prompts, greedy_concurrently(eng.base_url, prompts, 6)):
            assert out == hf_greedy(path, p, 6)
        info = wait_idle_integrity(eng.base_url)
        assert info["integrity_ok"] is True and info["dp_size"] == 2 and info["tp_size"] == 2
        assert len(info["tp_follower_pids"]) == 2
        ranks = info["internal_states"]
        assert [(s["dp_rank"], s["tp_allreduce"]) for s in ranks] == [(0, "shm"), (1, "shm")], eng.log_tail(60)
        assert all(s["integrity_ok"] is True and s["num_running_reqs"] == 0 for s in ranks)


@pytest.mark.parametrize("arch, loop", [("qwen3_next", "overlap"), ("qwen3_5", "plain")])
def test_tp2_hybrid_matches_hf_with_state_checkpoints(tiny_model_factory, arch, loop):
    """Hybrids split over two ranks: each holds whole linear-attention heads (their conv channels and
    recurrent state), whole gated-attention heads, its MLP / expert / shared-expert rows; the radix
    cache's state copies and tracked checkpoints reach the follower with the step, so prefix hits
    start from the same state on both ranks. Greedy tokens equal HF's."""
    path = tiny_model_factory(arch)
    prompts = workload()
    scheduler, results = _run_tp(path, prompts, page_size=1, chunked_prefill_size=32, max_total_tokens=4096,
                                 mamba_track_interval=8, **_loop(loop))
    assert_greedy_equals_hf(path, prompts, results)
    assert scheduler.stats.cache_hit_rate() > 0, "the shared prefixes come from cached states"
    runner = scheduler.worker.model_runner
    assert runner.state_pool.shapes.ssm[0] == 2, "this rank's 2 of the 4 value heads"
    assert runner.token_to_kv_pool.head_num == 1
