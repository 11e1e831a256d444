"""The radix cache of hybrid models (mem_cache/hybrid_radix_cache.py), on its own and through the
scheduler: a match stops at the deepest node with a state checkpoint, a node whose checkpoint was
evicted keeps its KV but ends no match (tombstone), checkpoints have their own LRU, a hit becomes a
copy of the checkpoint into the request's row, KV eviction frees a node's checkpoint; served, a
shared prefix and a conversation's next turn come from cached state with HF's tokens; the layer's
packed (CUDA) path against its reference: on CPU with the torch rule (and the in-place decode kernels'
torch twins), on CUDA with fla-core's kernels and the in-place decode kernels."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from baton.engine.mem_cache.allocator import TokenToKVPoolAllocator
from baton.engine.mem_cache.hybrid_radix_cache import HybridRadixCache
from baton.engine.mem_cache.memory_pool import ReqToTokenPool
from baton.engine.mem_cache.state_pool import LinearStateShapes, RecurrentStatePool, StateOps
from test_scheduler_vs_hf import hf_greedy, harness_for


@dataclass(eq=False)
class _Req:
    """What the cache reads of a request (mem_cache/base.py CacheReq)."""

    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    fill_ids: list[int] = field(default_factory=list)
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: object = None
    req_pool_idx: int = None
    kv_committed_len: int = 0
    kv_allocated_len: int = 0
    state_checkpoints: list = field(default_factory=list)
    lora_uid: int = 0


def _cache(page: int = 1, checkpoints: int = 4, interval: int = 8) -> HybridRadixCache:
    rows = ReqToTokenPool(4, 256, "cpu")
    alloc = TokenToKVPoolAllocator(512, page, "cpu")
    return HybridRadixCache(rows, alloc, page, list(range(100, 100 + checkpoints)), interval)


def _serve(cache: HybridRadixCache, tokens: list[int], finish: bool = True) -> tuple[_Req, StateOps]:
    """A request through the cache as the scheduler drives it: match, row, restore, one extend over
    the rest (tracks planned), then finish (end checkpoint, KV and states into the tree)."""
    req = _Req(list(tokens))
    m = cache.match_prefix(tokens[:-1])
    req.prefix_indices, req.last_node = m.device_indices, m.last_node
    cache.inc_lock_ref(req.last_node)
    req.req_pool_idx = cache.req_to_token_pool.alloc(1)[0]
    n = len(req.prefix_indices)
    table = cache.req_to_token_pool.req_to_token
    table[req.req_pool_idx, :n] = req.prefix_indices
    if n:
        cache.restore_state(req)
    page = cache.page_size
    new = cache.allocator.alloc_extend([n], [len(tokens)], [table[req.req_pool_idx, n - 1].item() if n and page > 1 else -1])
    table[req.req_pool_idx, n:len(tokens)] = new
    req.fill_ids = list(tokens)
    req.kv_committed_len = req.kv_allocated_len = len(tokens)
    tracks = cache.plan_extend_tracks(req, n, len(tokens), more_chunks=False)
    ops = cache.take_state_ops({0: tracks} if tracks else None) or StateOps()
    if finish:
        cache.cache_finished_req(req)
        ops = ops.merged(cache.take_state_ops(), 0)
    return req, ops


def test_match_stops_at_the_deepest_checkpoint_and_a_hit_restores_it():
    cache = _cache(interval=8)
    a = list(range(10, 30))  # 20 tokens: checkpoints at 8, 16 (interval), 19 (prompt end), 20 (request end)
    req, ops = _serve(cache, a)
    assert sorted(p for p, _ in ops.tracks[0]) == [8 - 0, 16, 19]  # offsets into the extend from 0
    assert len(ops.copies) == 1 and ops.copies[0][0] == req.req_pool_idx, "the end state leaves the row"
    assert cache.checkpoints_cached() == 4 and cache.checkpoints_free() == 0
    # a prompt sharing 13 tokens: the KV matches 13, the state only up to 8
    m = cache.match_prefix(a[:13] + [999, 998])
    assert len(m.device_indices) == 8 and m.last_node.state is not None
    # the same prompt again: up to its last page before the final token (19), from that checkpoint
    b, ops_b = _serve(cache, a, finish=False)
    assert len(b.prefix_indices) == 19
    assert ops_b.copies == [(b.last_node.state, b.req_pool_idx)], "the hit's state is copied into its row"
    assert not ops_b.tracks, "nothing left to track past the prompt end"
    assert cache.check_state_slots()


def test_tombstone_keeps_kv_and_checkpoints_evict_least_recently_matched_first():
    cache = _cache(checkpoints=2, interval=64)  # only prompt-end and request-end checkpoints
    x = [1] * 4 + list(range(100, 110))
    y = [2] * 4 + list(range(200, 210))
    _serve(cache, x)  # checkpoints at 13 and 14
    kv_before = cache.total_size()
    assert cache.checkpoints_cached() == 2
    cache.match_prefix(x)  # x's checkpoints are now recently used...
    _serve(cache, y)  # ...and still the only ones to evict: y takes both slots
    assert cache.checkpoints_cached() == 2 and cache.total_size() == kv_before + 14
    m = cache.match_prefix(x)
    assert len(m.device_indices) == 0 and m.last_node is cache.root, "x's nodes are tombstones: KV, no state"
    assert len(cache._match_kv(x).device_indices) == 14, "the tombstones keep their KV"
    assert len(cache.match_prefix(y).device_indices) == 14
    # both of y's checkpoints matched, then only the one at 13: the one at 14 is now the older
    cache.match_prefix(y)
    cache.match_prefix(y[:13])
    slot = cache._alloc_state()
    assert slot is not None and len(cache.match_prefix(y).device_indices) == 13, "y's end checkpoint went first"
    cache._free_states.append(slot)
    assert cache.check_state_slots()


def test_kv_eviction_frees_the_nodes_checkpoints_and_reset_frees_all():
    cache = _cache(checkpoints=4, interval=8)
    _serve(cache, list(range(40, 60)))
    assert cache.checkpoints_free() == 0
    assert cache.evict(1000) == 20
    assert cache.checkpoints_cached() == 0 and cache.checkpoints_free() == 4 and cache.check_state_slots()
    _serve(cache, list(range(40, 60)))
    cache.reset()
    assert cache.checkpoints_free() == 4 and cache.total_size() == 0 and cache.check_state_slots()


def test_page_aligned_positions_only():
    cache = _cache(page=4, checkpoints=8, interval=8)
    req, ops = _serve(cache, list(range(300, 319)))  # 19 tokens: 8, 16 and the prompt end 16 (18 -> 16)
    assert sorted(p for p, _ in ops.tracks[0]) == [8, 16] and not ops.copies, "19 is no page end: no end state"
    assert all(n.state is None or sum(len(a.key) for a in _path(n)) % 4 == 0 for n in cache._iter_nodes())
    assert len(cache.match_prefix(list(range(300, 319))).device_indices) == 16
    with pytest.raises(AssertionError, match="page-aligned"):
        _cache(page=4, interval=6)


def _path(node):
    while node.parent is not None:
        yield node
        node = node.parent


def test_state_pool_copies_run_in_order_and_checkpoint_slots_follow_the_rows():
    pool = RecurrentStatePool(LinearStateShapes(1, (2, 2), (1, 2, 2)), 3, torch.float32, torch.float32, "cpu",
                              checkpoints=2)
    assert pool.checkpoint_slots() == [3, 4] and pool.pad_slot == 5 and pool.ssm[0].shape[0] == 6
    pool.ssm[0][0] = 1.0
    pool.ssm[0][3] = 3.0
    pool.copy_slots([(0, 4), (3, 0)])  # a row's state out to a checkpoint, then a checkpoint over the row
    assert (pool.ssm[0][4] == 1.0).all() and (pool.ssm[0][0] == 3.0).all()
    pool.copy_slots([(0, 1), (1, 2)])  # a chain: one at a time
    assert (pool.ssm[0][2] == 3.0).all()


# ---------------------------------------------------------------- served through the scheduler

@pytest.mark.parametrize("arch,loop,page_size", [("qwen3_next", "overlap", 1), ("qwen3_5", "plain", 16)])
def test_shared_prefix_and_next_turn_come_from_cached_state(tiny_model_factory, arch, loop, page_size):
    """A prompt served twice, a prompt sharing a long prefix, and a conversation's next turn (prompt +
    answer + new tokens): each starts from a cached state (cached_tokens) and equals HF's tokens."""
    path = tiny_model_factory(arch)
    h = harness_for(path, loop, page_size=page_size, chunked_prefill_size=32, max_total_tokens=4096,
                    mamba_track_interval=16)
    base = [(i * 37) % 400 + 6 for i in range(70)]
    h.submit("first", base, max_new_tokens=8, ignore_eos=True)
    first = h.run_until_idle()["first"]
    assert first.ids == hf_greedy(path, base, 8, ignore_eos=True)
    turn2 = base + first.ids + [11, 12, 13]
    h.submit("again", base, max_new_tokens=8, ignore_eos=True)
    h.submit("shared", base[:50] + [7, 8, 9], max_new_tokens=8, ignore_eos=True)
    h.submit("turn2", turn2, max_new_tokens=8, ignore_eos=True)
    res = h.run_until_idle()
    for rid, prompt in (("again", base), ("shared", base[:50] + [7, 8, 9]), ("turn2", turn2)):
        assert res[rid].ids == hf_greedy(path, prompt, 8, ignore_eos=True), f"{rid} differs from HF"
    if page_size == 1:
        assert res["again"].cached_tokens == len(base) - 1, "the same prompt again: all but its last token"
        # the answer's last token was never fed in the plain loop; the overlap loop's extra step fed it
        assert res["turn2"].cached_tokens >= len(base) + len(first.ids) - 1, "the next turn: only its new tokens"
    else:  # checkpoints at page ends only: the last one before the end
        assert res["again"].cached_tokens == (len(base) - 1) // 16 * 16
        assert res["turn2"].cached_tokens >= (len(base) + len(first.ids) - 1) // 16 * 16
    assert res["shared"].cached_tokens == 48, "the shared 50 tokens: up to the checkpoint at 48 (interval 16)"
    s = h.scheduler
    assert s.check_memory_integrity() and s.get_server_info()["recurrent_state_checkpoints_cached"] > 0


def test_aborted_and_retracted_requests_leave_no_checkpoint_slot_behind(tiny_model_factory):
    """Aborts mid-prefill and mid-decode and retractions under a small KV pool, with checkpoints
    tracked every page: at idle every checkpoint slot is free or on one node, and reruns are exact."""
    from baton.engine.io_struct import AbortReq
    from test_scheduler_vs_hf import workload

    path = tiny_model_factory("qwen3_next")
    prompts = workload(seed=3)
    pool = int(0.6 * (sum(map(len, prompts)) + 30 * len(prompts)))
    h = harness_for(path, "overlap", page_size=1, chunked_prefill_size=16, max_total_tokens=pool,
                    mamba_track_interval=4)
    for i, p in enumerate(prompts):
        h.submit(str(i), p, max_new_tokens=30, ignore_eos=True)
    for _ in range(3):
        h.step()
    h.scheduler.process_input_requests([AbortReq(rid="0"), AbortReq(rid="5")])
    res = h.run_until_idle()
    s = h.scheduler
    assert res["0"].finish.kind == "abort" and res["5"].finish.kind == "abort"
    assert s.stats.retractions > 0, "the pool is meant to be too small for all requests at once"
    assert s.check_memory_integrity() and s.tree_cache.check_state_slots()
    for i, p in enumerate(prompts):
        if str(i) not in ("0", "5"):
            assert res[str(i)].ids == hf_greedy(path, p, 30, ignore_eos=True), f"request {i} differs from HF"


def test_metrics_report_the_state_pool_and_its_checkpoints(tiny_model_factory):
    """/metrics of a hybrid engine: state slots and radix-cache checkpoints, from the scheduler's info."""
    from prometheus_client import generate_latest

    from baton.engine.metrics import EngineMetrics

    h = harness_for(tiny_model_factory("qwen3_5"), "plain", max_total_tokens=2048, max_running_requests=3)
    h.submit("a", [(i * 7) % 400 + 6 for i in range(40)], max_new_tokens=4, ignore_eos=True)
    h.run_until_idle()
    info = h.scheduler.get_server_info()
    metrics = EngineMetrics("m", "colocated")
    metrics.update_from_server_info(info)
    text = generate_latest(metrics.registry).decode()

    def value(name: str) -> float:
        line = next(ln for ln in text.splitlines() if ln.startswith(name + "{"))
        return float(line.rsplit(" ", 1)[1])

    assert value("baton_recurrent_state_slots_capacity") == 4 and value("baton_recurrent_state_slots_used") == 0
    assert value("baton_recurrent_state_checkpoints_capacity") == 3
    assert value("baton_recurrent_state_checkpoints_cached") == info["recurrent_state_checkpoints_cached"] > 0


def test_track_interval_must_be_a_positive_multiple_of_the_page_size():
    from baton.engine.server_args import ServerArgs

    assert ServerArgs(model_path="m", page_size=16, mamba_track_interval=64).mamba_track_interval == 64
    assert ServerArgs(model_path="m").mamba_track_interval == 256
    assert ServerArgs(model_path="m", page_size=1024).mamba_track_interval == 1024, "the default rounds up to a page"
    for page, interval in ((16, 24), (1, 0)):
        with pytest.raises(ValueError, match="--mamba-track-interval must be a positive multiple of --page-size"):
            ServerArgs(model_path="m", page_size=page, mamba_track_interval=interval)


# ---------------------------------------------------------------- the packed (CUDA) path of the layer

def _core_and_batches(device: str, dtype: torch.dtype):
    """A Gated DeltaNet core with random weights, a pool with random states, and an extend batch
    (fresh and continuing requests, tracked cuts inside extends and at their ends) and a decode batch."""
    from types import SimpleNamespace

    from baton.engine.core.forward_batch import ForwardMode
    from baton.engine.layers.gated_delta_net import GatedDeltaNet
    from baton.engine.model_config import LinearAttentionHeads
    from baton.engine.core.forward_batch import ForwardMode

    torch.manual_seed(0)
    heads = LinearAttentionHeads(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=8, conv_kernel=4)
    layer = GatedDeltaNet(32, heads, 1e-6, 0, split_projections=True).to(device, dtype)
    torch.nn.init.normal_(layer.conv1d.weight, std=0.5)
    conv, ssm = layer.state_shapes()
    pool = RecurrentStatePool(LinearStateShapes(1, conv, ssm), 6, dtype, torch.float32, device, checkpoints=6)
    pool.conv[0].normal_()
    pool.ssm[0].normal_(std=0.1)
    lens, prefix = [5, 70, 1, 33], [0, 0, 3, 10]
    extend = SimpleNamespace(
        forward_mode=ForwardMode.EXTEND, batch_size=4, req_pool_indices=torch.tensor([4, 0, 2, 1], device=device),
        state_slots=torch.tensor([4, 0, 2, 1], device=device),
        extend_seq_lens_cpu=lens, extend_prefix_lens_cpu=prefix, state_pool=pool,
        state_ops=StateOps([], {1: [(16, 6), (64, 7), (70, 8)], 3: [(8, 9)], 0: [(5, 10)]}), spec_verify=False)
    decode = SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=3,
                             req_pool_indices=torch.tensor([1, 3, 5], device=device),
                             state_slots=torch.tensor([1, 3, 5], device=device), state_pool=pool,
                             state_ops=StateOps([], {2: [(1, 11)]}), spec_verify=False)
    n = sum(lens)
    inputs = [(torch.randn(n, layer.conv_dim, device=device, dtype=dtype), -torch.rand(n, 4, device=device),
               torch.rand(n, 4, device=device, dtype=dtype)) for _ in range(1)]
    inputs.append((torch.randn(3, layer.conv_dim, device=device, dtype=dtype), -torch.rand(3, 4, device=device),
                   torch.rand(3, 4, device=device, dtype=dtype)))
    return layer.core, pool, [extend, decode], inputs


@torch.no_grad()
def _compare_packed_with_reference(core, pool, batches, inputs, packed, atol: float, rtol: float) -> None:
    import copy

    for fb, (x, g, beta) in zip(batches, inputs):
        ref_pool = copy.deepcopy(pool)
        want = core.forward_native(x, g, beta, copy.copy(fb).__class__(**{**vars(fb), "state_pool": ref_pool}))
        got = packed(x, g, beta, fb)
        torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)
        for mine, theirs in ((pool.conv[0], ref_pool.conv[0]), (pool.ssm[0], ref_pool.ssm[0])):
            torch.testing.assert_close(mine.float(), theirs.float(), atol=atol, rtol=rtol)  # rows and tracked slots


@pytest.mark.parametrize("in_place", ["", "conv", "conv+state"])
def test_packed_path_equals_the_reference_on_cpu(in_place):
    """The CUDA path's packing (conv by gathers over one buffer, waves at tracked cuts, states and
    checkpoints written back) with the reference rule: the same outputs and states as forward_native.
    `in_place`: the decode step's conv on the pool rows (conv1d_decode's torch twin), and the delta
    rule too (delta_rule_decode's), its tracked end read back from the rows."""
    from baton.engine.layers.gated_delta_net import torch_varlen_rule
    from baton.engine.layers.gated_delta_net import conv1d_decode_torch, delta_rule_decode_torch

    core, pool, batches, inputs = _core_and_batches("cpu", torch.float32)
    conv_decode = conv1d_decode_torch if in_place else None
    state_decode = delta_rule_decode_torch if in_place == "conv+state" else None
    _compare_packed_with_reference(
        core, pool, batches, inputs,
        lambda x, g, b, fb: core.forward_varlen(x, g, b, fb, torch_varlen_rule, conv_decode, state_decode), 1e-5, 1e-5)


TREE = [-1, 0, 0, 1, 2, 1]  # node 5's chain: 0 -> 1 -> 5; node 4's: 0 -> 2 -> 4


def test_tree_waves_go_by_depth():
    """A tree on the host runs each depth in one wave (a chain: a node a wave); a head's tree on the
    device, whose depths the host does not know, runs nodes d.. in wave d, as many waves as it may be deep."""
    from baton.engine.layers.gated_delta_net import tree_wave_plan

    assert tree_wave_plan([TREE, None], [6, 2], None) == [[[0], [0]], [[1, 2], [1]], [[3, 4, 5], []]]
    matrix = torch.ones(6, 6, dtype=torch.bool)  # its content is the device's business
    assert tree_wave_plan([matrix, None], [6, 3], [2, 2]) == [[[0, 1, 2, 3, 4, 5], [0]], [[1, 2, 3, 4, 5], [1]],
                                                            [[2, 3, 4, 5], [2]]]
    assert len(tree_wave_plan([matrix], [6], None)) == 6  # the depth not known: as deep as a chain


@pytest.mark.parametrize("given", ["parents", "ancestors"])
@pytest.mark.parametrize("path", ["native", "packed"])
def test_a_trees_nodes_each_run_as_their_chain_alone(path, given):
    """A verify step with a tree (its parents, or a draft head's ancestor matrix on the device) beside a
    chain, through the reference and the packed path (GatedDeltaCore._tree_waves): each node's output,
    and the state it leaves in its scratch slot (the last node's in the row), are those of the chain
    root -> node run alone as an extend from the row's state."""
    from baton.engine.layers.gated_delta_net import torch_varlen_rule

    _tree_nodes_against_their_chains(
        "cpu", torch.float32, given, lambda core: core.forward_native if path == "native" else
        lambda x, g, b, fb: core.forward_varlen(x, g, b, fb, torch_varlen_rule), 1e-5)


@pytest.mark.gpu
def test_a_trees_nodes_on_cuda_run_as_their_chain_alone():
    """The same on CUDA, bfloat16: forward_cuda's tree waves (fla-core's recurrent rule) against the
    torch reference's chains (bf16 tolerances)."""
    from baton.engine.layers.gated_delta_net import fla_kernels

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if fla_kernels() is None:
        pytest.skip("needs fla-core (scripts/gpu_check.sh installs the carried wheel)")
    _tree_nodes_against_their_chains("cuda", torch.bfloat16, "ancestors", lambda core: core.forward_cuda, 3e-2)


def _tree_nodes_against_their_chains(device: str, dtype: torch.dtype, given: str, run, tol: float) -> None:
    import copy
    from types import SimpleNamespace

    from baton.engine.core.forward_batch import ForwardMode
    from baton.engine.layers.attention.masks import ancestors

    core, pool, _, _ = _core_and_batches(device, dtype)
    rows, prefix, parents = [4, 1], [9, 12], [TREE, [-1, 0]]
    lens, starts = [len(p) for p in parents], [0, len(TREE)]
    tracks = {0: [(j + 1, 6 + j) for j in range(5)], 1: [(1, 11)]}  # the slot after each node but the last
    n = sum(lens)
    x = torch.randn(n, core.key_dim * 2 + core.value_dim, device=device, dtype=dtype)
    g, beta = -torch.rand(n, 4, device=device), torch.rand(n, 4, device=device, dtype=dtype)
    tree = TREE if given == "parents" else ancestors(torch.tensor([TREE], device=device), 3)[0]

    def batch(pool, rows, lens, prefix, tracks, trees, depths=None):
        idx = torch.tensor(rows, device=device)
        return SimpleNamespace(forward_mode=ForwardMode.EXTEND, batch_size=len(rows), req_pool_indices=idx,
                               state_slots=idx, extend_seq_lens_cpu=lens, extend_prefix_lens_cpu=prefix,
                               state_pool=pool, state_ops=StateOps([], tracks), spec_verify=trees is not None,
                               tree_parents=trees, tree_depths=depths, tree_waves=None)

    before = copy.deepcopy(pool)
    out = run(core)(x, g, beta, batch(pool, rows, lens, prefix, tracks, [tree, None], [2, 1]))  # TREE: 2 deep
    for i, row in enumerate(rows):
        slot_after = dict(tracks[i])
        for j in range(lens[i]):
            chain = [j]
            while parents[i][chain[0]] >= 0:
                chain.insert(0, parents[i][chain[0]])
            at = [starts[i] + c for c in chain]
            alone = copy.deepcopy(before)
            want = core.forward_native(x[at], g[at], beta[at], batch(alone, [row], [len(at)], [prefix[i]], {}, None))
            torch.testing.assert_close(out[starts[i] + j].float(), want[-1].float(), atol=tol, rtol=tol,
                                       msg=f"node {j}: output")
            slot = row if j == lens[i] - 1 else slot_after[j + 1]
            for mine, theirs in ((pool.conv[0], alone.conv[0]), (pool.ssm[0], alone.ssm[0])):
                torch.testing.assert_close(mine[slot].float(), theirs[row].float(), atol=tol, rtol=tol,
                                           msg=f"node {j}: state")


@pytest.mark.gpu
def test_fla_path_matches_the_reference_on_cuda():
    """fla-core's kernels in the packed path against the torch reference, bfloat16 on CUDA (tolerances
    of bf16 rounding: the kernels accumulate in another order)."""
    from baton.engine.layers.gated_delta_net import fla_kernels

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if fla_kernels() is None:
        pytest.skip("needs fla-core (scripts/gpu_check.sh installs the carried wheel)")
    core, pool, batches, inputs = _core_and_batches("cuda", torch.bfloat16)
    _compare_packed_with_reference(core, pool, batches, inputs, core.forward_cuda, 3e-2, 3e-2)
