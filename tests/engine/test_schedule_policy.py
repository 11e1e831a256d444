"""Unit tests: PrefillAdder budgets, waiting-queue policies, retraction math, the future map."""
from __future__ import annotations

import pytest
import torch

from baton.engine.core.req import Req
from baton.engine.core.req import CLIP_MAX_NEW_TOKENS
from baton.engine.core.schedule_batch import RETRACT_DECODE_STEPS, ScheduleBatch
from baton.engine.mem_cache.allocator import TokenToKVPoolAllocator
from baton.engine.mem_cache.memory_pool import ReqToTokenPool
from baton.engine.mem_cache.radix_cache import RadixCache
from baton.engine.sampling.sampling_params import SamplingParams
from baton.engine.scheduler.schedule_policy import (AddReqResult, PrefillAdder,
                                                    SchedulePolicy)
from baton.engine.triton_ops.future_resolve import resolve_future_token_ids
from baton.engine.worker.future_map import FutureMap


def make_req(rid: str, n: int, max_new: int = 10, start: int = 10, arrival: float = 0.0, priority: int = 0) -> Req:
    return Req(rid=rid, origin_input_ids=list(range(start, start + n)),
               sampling_params=SamplingParams(max_new_tokens=max_new), eos_token_ids=frozenset({2}),
               arrival_time=arrival, priority=priority)


@pytest.fixture
def pools():
    req_pool = ReqToTokenPool(8, 256, "cpu")
    alloc = TokenToKVPoolAllocator(512, 1, "cpu")
    return req_pool, alloc, RadixCache(req_pool, alloc, 1)


def adder(pools, running=(), ratio=0.5, max_prefill=1000, chunk=None) -> PrefillAdder:
    _, alloc, tree = pools
    return PrefillAdder(1, tree, alloc, list(running), ratio, max_prefill, chunk)


def test_total_budget_counts_running_reservation(pools):
    running = [make_req("r", 5, max_new=100)]
    a = adder(pools, running, ratio=0.5)
    assert a.rem_total_tokens == 512 - 50  # half of the running request's 100 future tokens
    req = make_req("a", 400, max_new=100)
    req.init_next_round_input(pools[2])
    assert a.add_one_req(req, False) == AddReqResult.NO_TOKEN  # 400 + 100 > 462
    small = make_req("b", 300, max_new=100)
    small.init_next_round_input(pools[2])
    assert a.add_one_req(small, False) == AddReqResult.CONTINUE
    assert a.rem_total_tokens == 462 - 400


def test_clip_max_new_tokens(pools):
    a = adder(pools, [make_req("r", 5, max_new=10 ** 6)], ratio=0.0001)
    assert a.rem_total_token_offset == pytest.approx(CLIP_MAX_NEW_TOKENS * 0.0001)


def test_prefill_token_budget(pools):
    a = adder(pools, max_prefill=50)
    r1, r2 = make_req("1", 40, 1), make_req("2", 40, 1, start=100)
    for r in (r1, r2):
        r.init_next_round_input(pools[2])
    assert a.add_one_req(r1, False) == AddReqResult.CONTINUE
    assert a.add_one_req(r2, False) == AddReqResult.OTHER  # would exceed max-prefill-tokens
    assert a.can_run_list == [r1]


def test_first_request_may_exceed_prefill_budget(pools):
    a = adder(pools, max_prefill=10)
    r = make_req("1", 40, 1)
    r.init_next_round_input(pools[2])
    a.add_one_req(r, False)
    assert a.can_run_list == [r]


def test_chunking_cuts_long_prompt(pools):
    a = adder(pools, chunk=16)
    r = make_req("1", 40, 5)
    r.init_next_round_input(pools[2])
    a.add_one_req(r, False)
    assert a.new_chunked_req is r and r.extend_input_len == 16 and len(r.fill_ids) == 16
    other = make_req("2", 40, 5, start=200)
    other.init_next_round_input(pools[2])
    assert adder(pools, chunk=16).add_one_req(other, has_chunked_req=True) == AddReqResult.OTHER


def test_chunked_req_limited_by_total_budget(pools):
    a = adder(pools, [make_req("r", 5, max_new=1000)], ratio=0.49, chunk=512)
    r = make_req("1", 200, 5)
    r.init_next_round_input(None)
    r.req_pool_idx, r.kv_committed_len = 0, 0  # holds a row: continuing a chunked prefill
    r.extend_input_len = 200
    assert a.add_chunked_req(r) is r  # more chunks follow
    assert r.extend_input_len == int(512 - 490)


def test_own_prefix_is_not_counted_as_evictable(pools):
    req_pool, alloc, tree = pools
    slots = alloc.alloc(300)
    tree.insert(list(range(10, 310)), slots)  # a cached, evictable prefix
    assert tree.evictable_size() == 300
    r = make_req("1", 310, max_new=10)
    r.init_next_round_input(tree)
    assert len(r.prefix_indices) == 300
    # free 212 + evictable 300, but the 300 become locked by this very request: 10 + 10 fit,
    a = adder(pools)
    assert a.add_one_req(r, False) == AddReqResult.CONTINUE
    assert tree.protected_size() == 300
    big = make_req("2", 250, max_new=10, start=1000)
    big.init_next_round_input(tree)
    assert a.add_one_req(big, False) == AddReqResult.NO_TOKEN  # only 212 - 20 free remain


def _queue() -> list[Req]:
    return [make_req("old", 5, max_new=1, arrival=1.0), make_req("new", 5, max_new=50, arrival=2.0, start=40),
            make_req("mid", 5, max_new=10, arrival=1.5, start=80)]


def test_fcfs_and_lof(pools):
    q = _queue()
    SchedulePolicy("fcfs", pools[2], False).calc_priority(q)
    assert [r.rid for r in q] == ["old", "mid", "new"]
    SchedulePolicy("lof", pools[2], False).calc_priority(q)
    assert [r.rid for r in q] == ["new", "mid", "old"]


def test_lpm_prefers_longest_cached_prefix(pools):
    _, alloc, tree = pools
    tree.insert(list(range(80, 84)), alloc.alloc(4))
    tree.insert(list(range(40, 42)), alloc.alloc(2))
    q = _queue()
    SchedulePolicy("lpm", tree, False).calc_priority(q)
    assert [r.rid for r in q] == ["mid", "new", "old"]


def test_dfs_weight_groups_shared_prefixes(pools):
    _, alloc, tree = pools
    tree.insert([1, 2, 3, 4], alloc.alloc(4))
    tree.insert([9, 9, 9, 9], alloc.alloc(4))
    a1, b, a2, a3 = (Req(rid, ids, SamplingParams(), frozenset()) for rid, ids in
                     (("a1", [1, 2, 3, 4, 5]), ("b", [9, 9, 9, 9, 5]), ("a2", [1, 2, 3, 4, 6]), ("a3", [1, 2, 3, 4, 7])))
    q = [b, a1, a2, a3]
    SchedulePolicy("dfs-weight", tree, False).calc_priority(q)
    assert [r.rid for r in q][:3] == ["a1", "a2", "a3"]  # the heavier subtree first, together


def test_priority_orders_before_policy(pools):
    q = [make_req("low", 5, arrival=1.0, priority=0), make_req("high", 5, arrival=2.0, priority=5)]
    SchedulePolicy("fcfs", pools[2], True).calc_priority(q)
    assert [r.rid for r in q] == ["high", "low"]


def test_retract_decode_math(pools):
    req_pool, alloc, tree = pools
    reqs = [make_req(str(i), 100, max_new=100, start=10 + 200 * i) for i in range(4)]
    batch = ScheduleBatch(reqs, req_pool, alloc, tree, "cpu")
    for r in reqs:
        r.init_next_round_input(tree)
    batch.prepare_for_extend()
    for i, r in enumerate(reqs):
        r.output_ids = [5] * (10 * (i + 1))  # request 0 has decoded least
    alloc.alloc(alloc.available_size())  # the pool is full: nobody can decode
    released = []

    def release(req):
        released.append(req.rid)
        slots = req_pool.req_to_token[req.req_pool_idx, :req.kv_allocated_len].clone()
        alloc.free(slots)
        req_pool.free(req.req_pool_idx)

    retracted, ratio = batch.retract_decode(release)
    assert [r.rid for r in retracted] == ["0"]  # fewest outputs first; its 100 slots suffice
    assert all(r.is_retracted and r.req_pool_idx is None for r in retracted)
    remaining = [r for r in reqs if r not in retracted]
    decoded = sum(len(r.output_ids) for r in remaining)
    assert ratio == pytest.approx((decoded + RETRACT_DECODE_STEPS * 3) / 300)
    assert len(batch.reqs) == 3


def test_future_map_round_trip():
    fm = FutureMap(max_running_requests=3, device="cpu")
    first = fm.reserve(3)
    assert (first >= 1).all()  # index 0 is never handed out, so -index is always negative
    fm.token_ids[first] = torch.tensor([11, 12, 13])
    ids = torch.cat([-first, torch.tensor([7])])
    resolve_future_token_ids(ids, fm.token_ids)
    assert ids.tolist() == [11, 12, 13, 7]
    seen = set(first.tolist())
    for _ in range(10):  # wraps around without ever handing out 0
        got = fm.reserve(3)
        assert got.min() >= 1 and got.max() <= fm.size
        seen |= set(got.tolist())
    assert 0 not in seen


def test_in_batch_prefix_index():
    from baton.engine.scheduler.schedule_policy import IN_BATCH_PREFIX_BLOCK as B, InBatchPrefixIndex

    idx = InBatchPrefixIndex()
    base = list(range(100, 100 + 3 * B))
    idx.add(base + [1, 2, 3])
    assert idx.shared_len(base + [9]) == 3 * B
    assert idx.shared_len(base[:2 * B] + [7] * B) == 2 * B
    assert idx.shared_len([5] + base) == 0
    assert idx.shared_len(base[:B - 1]) == 0  # shorter than one block


def test_shared_prefix_requests_wait_for_the_cache(tiny_model_factory):
    """32 requests sharing a long prefix arrive together: one computes it, the rest hit the cache."""
    from scheduler_harness import SchedulerHarness

    h = SchedulerHarness(tiny_model_factory("llama"), max_total_tokens=8192, chunked_prefill_size=-1)
    prefix = [(i * 7) % 400 + 10 for i in range(256)]
    for i in range(32):
        h.submit(str(i), prefix + [i + 3, i + 4], max_new_tokens=2)
    h.run_until_idle()
    stats = h.scheduler.stats
    assert stats.prefill_tokens < 256 + 32 * 3 + 2 * 256  # the prefix is computed about once, not 32 times
    assert stats.cache_hit_rate() > 0.8


def test_overlap_default_depends_on_device():
    from baton.engine.server_args import ServerArgs

    def overlap(native_stream_threads, **kw):
        return ServerArgs(model_path="m", **kw).event_loop(native_stream_threads).overlap

    for threads in (None, 1, 2):  # whatever serves the model
        assert overlap(threads, device="cuda", attention_backend="torch")
        assert overlap(threads, device="cpu", enable_overlap_schedule=True)
        assert not overlap(threads, device="cpu", disable_overlap_schedule=True)
        assert not overlap(threads, device="cuda", disable_overlap_schedule=True)
    # CPU without a flag: only where the native forward stream serves the model on two threads or
    # more (known once the model is loaded: test_cpu_forward.py)
    assert not overlap(None, device="cpu") and not overlap(1, device="cpu")
    assert overlap(2, device="cpu")
    choice = ServerArgs(model_path="m", device="cpu", disable_overlap_schedule=True).event_loop(2)
    assert choice.loop.value == "plain" and "--disable-overlap-schedule" in choice.reason


def test_pd_metrics_observe_each_sample_once():
    from baton.engine.metrics import EngineMetrics

    m = EngineMetrics("m", "prefill")
    info = {"disaggregation_mode": "prefill", "num_bootstrap_reqs": 2, "num_inflight_reqs": 1,
            "bootstrap_failures": 1, "transfer_failures": 0, "transfer_samples": [(1, 1 << 20, 0.01), (2, 1 << 21, 0.02)]}
    m.update_from_server_info(info)
    info["transfer_samples"] = [(2, 1 << 21, 0.02), (3, 1 << 22, 0.04)]  # sample 2 seen again: not counted twice
    info["bootstrap_failures"] = 3
    m.update_from_server_info(info)
    value = lambda name, **labels: m.registry.get_sample_value(name, {"model_name": "m", "role": "prefill", **labels})  # noqa: E731
    assert value("baton_kv_transfer_latency_seconds_count") == 3
    assert value("baton_kv_transfer_bytes_sum") == (1 << 20) + (1 << 21) + (1 << 22)
    assert value("baton_pd_failures_total", stage="bootstrap") == 3
    assert value("baton_pd_queue_requests", queue="bootstrap", dp_rank="0") == 2


def test_not_idle_while_a_prefill_awaits_its_decode(tiny_model_factory):
    """Regression: after a prefill with an empty running batch the loop must not block in its idle
    poll (it did, adding ~1 s before every such request's second token)."""
    from scheduler_harness import SchedulerHarness

    h = SchedulerHarness(tiny_model_factory("llama"), max_total_tokens=2048)
    h.submit("a", [5, 6, 7, 8], max_new_tokens=4, ignore_eos=True)
    assert h.step()  # the prefill
    assert h.scheduler.running_batch.is_empty() and not h.scheduler.is_idle()
    assert h.step()  # the first decode step runs without waiting
    h.run_until_idle()
    assert h.scheduler.is_idle() and len(h.results["a"].ids) == 4


def test_a_request_that_fails_admission_ends_alone(tiny_model_factory, monkeypatch):
    """Whatever breaks while one request is admitted (here: its sampling state) ends that request with a
    500 and leaves the scheduler serving: nothing held, the next request runs. (A float seed through
    /generate used to stop the whole engine here.)"""
    from scheduler_harness import SchedulerHarness

    from baton.engine.sampling import sampling_batch_info

    h = SchedulerHarness(tiny_model_factory("llama"), max_total_tokens=2048)
    real = sampling_batch_info.ReqSamplingState

    def broken(params, *args, **kwargs):
        if params.seed == 13:
            raise RuntimeError("manual_seed expected a long")
        return real(params, *args, **kwargs)
    monkeypatch.setattr(sampling_batch_info, "ReqSamplingState", broken)
    h.submit("bad", [5, 6, 7, 8], max_new_tokens=4, seed=13)
    h.submit("good", [5, 6, 7, 8], max_new_tokens=4, ignore_eos=True)
    h.run_until_idle()
    bad = h.results["bad"].finish
    assert (bad.kind, bad.status_code) == ("abort", 500) and "manual_seed expected a long" in bad.message
    assert h.results["bad"].ids == [] and len(h.results["good"].ids) == 4
    assert h.scheduler.is_idle() and h.scheduler.check_memory_integrity()
