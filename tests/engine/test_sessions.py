"""Sessions in the scheduler (engine/scheduler/sessions.py): a request continues an earlier one of its
session, its output equals HF's greedy output on the concatenated tokens, and its history is not
prefilled again (cached_tokens); branches with replace / offset; concurrent sessions; closing gives
everything back; bad session params are 4xx; memory pressure neither deadlocks nor leaks. Radix cache
on (pins) and off (held rows), both loops, a hybrid model."""
from __future__ import annotations

import random

import pytest

from baton.engine.io_struct import (CloseSessionReqInput, CloseSessionReqOutput, OpenSessionReqInput,
                                    OpenSessionReqOutput, SessionGenerateReqInput, SessionParams,
                                    TokenizedGenerateReqInput)
from baton.engine.sampling.sampling_params import SamplingParams
from scheduler_harness import SchedulerHarness
from test_scheduler_vs_hf import harness_for, hf_greedy

MAX_NEW = 6


def _reply(h: SchedulerHarness, msg, reply_type):
    h.scheduler.process_input_requests([msg])
    replies = [m for m in h.scheduler.outbox if isinstance(m, reply_type)]
    h.scheduler.outbox[:] = [m for m in h.scheduler.outbox if not isinstance(m, reply_type)]
    assert len(replies) == 1
    return replies[0]


def open_session(h: SchedulerHarness, sid: str, **kw) -> OpenSessionReqOutput:
    return _reply(h, OpenSessionReqInput(capacity_of_str_len=1000, session_id=sid, **kw), OpenSessionReqOutput)


def close_session(h: SchedulerHarness, sid: str) -> CloseSessionReqOutput:
    return _reply(h, CloseSessionReqInput(sid), CloseSessionReqOutput)


def submit(h: SchedulerHarness, req_id: str, ids: list[int], max_new: int = MAX_NEW, **params) -> None:
    """A generate request with SGLang's session_params (`params`: id, rid, offset, replace, ...)."""
    sp = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    req = TokenizedGenerateReqInput(rid=req_id, input_text=None, input_ids=list(ids), sampling_params=sp)
    h.scheduler.process_input_requests([SessionGenerateReqInput(req, SessionParams(**params))])
    h._collect()


def turn(h: SchedulerHarness, req_id: str, ids: list[int], max_new: int = MAX_NEW, **params):
    submit(h, req_id, ids, max_new, **params)
    return h.run_until_idle()[req_id]


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(6, 500) for _ in range(n)]


def assert_whole(h: SchedulerHarness) -> None:
    assert h.scheduler.check_memory_integrity()
    s = h.scheduler
    assert s.allocator.available_size() == s.max_total_tokens - s.tree_cache.evictable_size()
    assert s.req_to_token_pool.available_size() == s.req_to_token_pool.size
    assert s.tree_cache.protected_size() == 0


MODES = [("llama", "overlap", False, 1), ("llama", "plain", True, 1), ("qwen3", "plain", False, 16),
         ("qwen3", "overlap", True, 16)]


@pytest.mark.parametrize("arch,loop,no_radix,page_size", MODES)
def test_three_turns_equal_hf_without_prefilling_history(tiny_model_factory, arch, loop, no_radix, page_size):
    path = tiny_model_factory(arch)
    h = harness_for(path, loop, disable_radix_cache=no_radix, page_size=page_size, max_total_tokens=2048)
    assert open_session(h, "s").success
    history: list[int] = []
    for i, n in enumerate((20, 7, 5)):
        new = prompt(i, n)
        out = turn(h, f"t{i}", new, id="s", rid=f"t{i - 1}" if i else None)
        full = history + new
        assert out.finish.kind == "length" and out.ids == hf_greedy(path, full, MAX_NEW, ignore_eos=True), i
        if i:  # the history's KV was held: only what the last pass never fed (its last token) is computed
            computed = 0 if loop == "overlap" else 1  # the overlap loop's extra step fed that token too
            assert out.cached_tokens >= (len(history) - computed) // page_size * page_size, (i, out.cached_tokens)
        history = full + out.ids
    assert h.scheduler.check_memory_integrity(), "integrity must account for what the session holds"
    assert h.scheduler.get_server_info()["num_sessions"] == 1
    assert h.scheduler.get_server_info()["session_held_tokens"] > 0
    assert close_session(h, "s").success
    assert_whole(h)
    assert h.scheduler.get_server_info()["integrity_ok"]


@pytest.mark.parametrize("no_radix", [False, True])
def test_branches_replace_offset_and_dropped_output(tiny_model_factory, no_radix):
    """C branches from A at an offset and replaces B (and what continued it); D drops A's output; E cuts
    A's history from its end (a negative offset, a Python slice's end). Each equals HF on its tokens."""
    path = tiny_model_factory("llama")
    h = harness_for(path, "overlap", disable_radix_cache=no_radix, max_total_tokens=2048)
    assert open_session(h, "s").success
    a = prompt(1, 24)
    out_a = turn(h, "A", a, id="s")
    turn(h, "B", prompt(2, 5), id="s", rid="A")
    turn(h, "B2", prompt(3, 4), id="s", rid="B")
    history_a = a + out_a.ids
    cases = {"C": (dict(rid="A", offset=20, replace=True), history_a[:20]),
             "D": (dict(rid="A", drop_previous_output=True), a),
             "E": (dict(rid="A", offset=-3), history_a[:-3])}
    for i, (rid, (params, history)) in enumerate(cases.items()):
        new = prompt(10 + i, 4)
        out = turn(h, rid, new, id="s", **params)
        assert out.ids == hf_greedy(path, history + new, MAX_NEW, ignore_eos=True), rid
        if not no_radix:  # A's pin keeps its whole path: each branch hits what it shares with A
            assert out.cached_tokens == len(history), (rid, out.cached_tokens)
    session = h.scheduler.sessions.sessions["s"]
    assert "B" not in session.nodes and "B2" not in session.nodes, "replace drops the requests after A"
    gone = turn(h, "F", [7], id="s", rid="B2")
    assert gone.finish.kind == "abort" and gone.finish.status_code == 404
    assert h.scheduler.check_memory_integrity()
    assert close_session(h, "s").success
    assert_whole(h)


@pytest.mark.parametrize("loop,no_radix", [("overlap", False), ("plain", True)])
def test_concurrent_sessions(tiny_model_factory, loop, no_radix):
    """Four sessions advance together, each turn of all of them in one batch, beside requests without
    a session; each output equals HF on its session's tokens."""
    path = tiny_model_factory("qwen3")
    h = harness_for(path, loop, disable_radix_cache=no_radix, max_total_tokens=4096, chunked_prefill_size=32)
    sessions = [f"s{k}" for k in range(4)]
    histories = {s: [] for s in sessions}
    for s in sessions:
        assert open_session(h, s).success
    for t in range(3):
        news = {s: prompt(100 * k + t, 40 if t == 0 else 3 + k) for k, s in enumerate(sessions)}
        for k, s in enumerate(sessions):
            submit(h, f"{s}-{t}", news[s], id=s, rid=f"{s}-{t - 1}" if t else None)
        h.scheduler.process_input_requests([TokenizedGenerateReqInput(
            rid=f"plain-{t}", input_text=None, input_ids=prompt(999 + t, 30),
            sampling_params=SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))])
        results = h.run_until_idle()
        for s in sessions:
            full = histories[s] + news[s]
            out = results[f"{s}-{t}"]
            assert out.ids == hf_greedy(path, full, MAX_NEW, ignore_eos=True), (s, t)
            if t:
                assert out.cached_tokens >= len(histories[s]) - 1, (s, t, out.cached_tokens)
            histories[s] = full + out.ids
        assert results[f"plain-{t}"].ids == hf_greedy(path, prompt(999 + t, 30), MAX_NEW, ignore_eos=True)
    assert h.scheduler.check_memory_integrity()
    for s in sessions:
        assert close_session(h, s).success
    assert_whole(h)


def test_bad_session_params_are_4xx_and_leak_nothing(tiny_model_factory):
    path = tiny_model_factory("llama")
    h = harness_for(path, "overlap", max_total_tokens=2048)
    assert open_session(h, "s").success
    dup = open_session(h, "s")
    assert not dup.success and "already open" in dup.message
    assert not open_session(h, "t", timeout=0).success
    assert not close_session(h, "nope").success
    turn(h, "A", prompt(1, 10), id="s")
    submit(h, "running", prompt(2, 5), max_new=50, id="s", rid="A")
    h.step()
    cases = [("no-session", dict(id="nope"), 404, "not open"),
             ("no-id", dict(), 400, "session's id"),
             ("no-rid", dict(id="s", rid="ghost"), 404, "not in session"),
             ("offset", dict(id="s", rid="A", offset=1000), 400, "out of range"),
             ("offset-neg", dict(id="s", rid="A", offset=-1000), 400, "out of range"),
             ("A", dict(id="s"), 400, "own rid"),
             ("unfinished", dict(id="s", rid="running"), 409, "has not finished")]
    for rid, params, status, words in cases:
        submit(h, rid, [5, 6], **params)
        out = h.results[rid]
        assert out.finish is not None and out.finish.kind == "abort", rid
        assert out.finish.status_code == status and words in out.finish.message, (rid, out.finish)
    h.run_until_idle()
    assert close_session(h, "s").success
    closed = turn(h, "late", [5], id="s", rid="A")
    assert closed.finish.status_code == 404
    assert_whole(h)


def test_streaming_session_appends_to_the_last_request(tiny_model_factory):
    """SGLang's streaming session: no rid, each request continues the last finished one; one at a time;
    no branching."""
    path = tiny_model_factory("llama")
    h = harness_for(path, "overlap", disable_radix_cache=True, max_total_tokens=2048)
    assert open_session(h, "st", streaming=True).success
    history: list[int] = []
    for i in range(3):
        new = prompt(50 + i, 12 if i == 0 else 3)
        out = turn(h, f"r{i}", new, id="st")
        assert out.ids == hf_greedy(path, history + new, MAX_NEW, ignore_eos=True), i
        assert not i or out.cached_tokens >= len(history) - 1
        history = history + new + out.ids
    submit(h, "busy", [5], max_new=30, id="st")
    refused = {"second": dict(id="st"), "branch": dict(id="st", replace=True), "cut": dict(id="st", offset=2)}
    for rid, params in refused.items():
        submit(h, rid, [6], **params)
        assert h.results[rid].finish.status_code == (409 if rid == "second" else 400), rid
    h.run_until_idle()
    assert close_session(h, "st").success
    assert_whole(h)


@pytest.mark.parametrize("no_radix", [False, True])
def test_abort_close_flush_and_timeout_leave_pools_whole(tiny_model_factory, no_radix):
    """A continuing request aborted while it waits (it may hold its history's row), a session closed
    while its request runs, /flush_cache with sessions open (their holds go, the next turn still equals
    HF), and a session that timed out: nothing leaks."""
    from baton.engine.io_struct import AbortReq, FlushCacheOut, FlushCacheReq

    path = tiny_model_factory("llama")
    h = harness_for(path, "overlap", disable_radix_cache=no_radix, max_total_tokens=2048)
    assert open_session(h, "s").success and open_session(h, "t", timeout=5.0).success
    a = prompt(1, 16)
    out_a = turn(h, "A", a, id="s")
    submit(h, "B", [9, 10], id="s", rid="A")
    h.scheduler.process_input_requests([AbortReq(rid="B")])
    assert h.run_until_idle()["B"].finish.kind == "abort"
    assert h.scheduler.check_memory_integrity()
    assert _reply(h, FlushCacheReq(), FlushCacheOut).success
    assert h.scheduler.get_server_info()["session_held_tokens"] == 0
    assert h.scheduler.check_memory_integrity()
    out = turn(h, "C", [11, 12], id="s", rid="A")
    assert out.ids == hf_greedy(path, a + out_a.ids + [11, 12], MAX_NEW, ignore_eos=True)
    submit(h, "D", [13], max_new=20, id="s", rid="C")
    h.step()
    assert close_session(h, "s").success
    assert len(h.run_until_idle()["D"].ids) == 20
    turn(h, "T", prompt(2, 8), id="t")
    h.scheduler.sessions.sessions["t"].last_used -= 10  # its timeout passed
    assert turn(h, "T2", [5], id="t", rid="T").finish.status_code == 404
    assert h.scheduler.get_server_info()["num_sessions"] == 0
    assert_whole(h)


@pytest.mark.parametrize("loop,no_radix", [("overlap", False), ("plain", False), ("overlap", True)])
def test_memory_pressure_takes_holds_before_requests(tiny_model_factory, caplog, loop, no_radix):
    """A KV pool (and, without the radix cache, request rows) mostly held by sessions: requests
    without a session still run (the least recently used sessions' holds go first: no deadlock, no
    retraction), the sessions' next turns still equal HF (prefilling what was given up), and closing
    them leaves the pools whole."""
    path = tiny_model_factory("llama")
    h = harness_for(path, loop, disable_radix_cache=no_radix, max_total_tokens=320, max_running_requests=4,
                    chunked_prefill_size=64)
    sessions = [f"s{k}" for k in range(4)]
    firsts = {s: prompt(k, 56) for k, s in enumerate(sessions)}
    for s in sessions:
        assert open_session(h, s).success
        submit(h, f"{s}-0", firsts[s], id=s)
    outs = h.run_until_idle()
    held = h.scheduler.get_server_info()["session_held_tokens"]
    assert held >= 4 * 56, "every session holds its first turn"
    plain = [prompt(200 + k, 40) for k in range(2)]
    with caplog.at_level("WARNING", logger="baton.engine.scheduler.sessions"):
        for k, p in enumerate(plain):
            h.scheduler.process_input_requests([TokenizedGenerateReqInput(
                rid=f"p{k}", input_text=None, input_ids=p,
                sampling_params=SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True))])
        results = h.run_until_idle()
    for k, p in enumerate(plain):
        assert results[f"p{k}"].ids == hf_greedy(path, p, 60, ignore_eos=True), k
    assert "goes to waiting requests" in caplog.text and h.scheduler.get_server_info()["session_held_tokens"] < held
    assert h.scheduler.stats.retractions == 0
    assert h.scheduler.check_memory_integrity()
    for s in sessions:
        new = prompt(300, 3)
        out = turn(h, f"{s}-1", new, id=s, rid=f"{s}-0")
        assert out.ids == hf_greedy(path, firsts[s] + outs[f"{s}-0"].ids + new, MAX_NEW, ignore_eos=True), s
    assert h.scheduler.check_memory_integrity()
    for s in sessions:
        assert close_session(h, s).success
    assert_whole(h)


@pytest.mark.parametrize("arch,loop,no_radix,page_size", [("qwen3_next", "overlap", False, 1),
                                                          ("qwen3_5", "plain", False, 16),
                                                          ("qwen3_next", "plain", True, 1),
                                                          ("qwen3_5", "overlap", True, 16)])
def test_hybrid_session_continues_the_recurrent_state(tiny_model_factory, arch, loop, no_radix, page_size):
    """A hybrid model's turns: with the radix cache the state at the end of a turn is a checkpoint on
    the pinned node; without it the held row carries the state. A branch that cuts the history cannot
    take a row's state back, and starts afresh (radix off) or from the deepest checkpoint (radix on)."""
    path = tiny_model_factory(arch)
    h = harness_for(path, loop, disable_radix_cache=no_radix, page_size=page_size, max_total_tokens=2048)
    assert open_session(h, "s").success
    history: list[int] = []
    for i, n in enumerate((33, 5, 4)):
        new = prompt(i, n)
        out = turn(h, f"t{i}", new, id="s", rid=f"t{i - 1}" if i else None)
        assert out.ids == hf_greedy(path, history + new, MAX_NEW, ignore_eos=True), i
        if i and (no_radix or page_size == 1):  # (page 16: the turn's end is a checkpoint when aligned)
            assert out.cached_tokens >= len(history) - 1, (i, out.cached_tokens)
        history = history + new + out.ids
    branch = turn(h, "b", [7, 8], id="s", rid="t2", offset=30)
    assert branch.ids == hf_greedy(path, history[:30] + [7, 8], MAX_NEW, ignore_eos=True)
    assert h.scheduler.check_memory_integrity()
    assert close_session(h, "s").success
    assert_whole(h)
    assert h.scheduler.tree_cache.check_state_slots()


@pytest.mark.parametrize("loop,no_radix", [("plain", False), ("overlap", False), ("plain", True)])
def test_decode_step_takes_holds_before_retracting(tiny_model_factory, caplog, loop, no_radix):
    """B is admitted while session request A runs, A's future tokens reserved at new_token_ratio (0.7);
    A finishes and its KV is held; B, alone, then needs more than the rest of the pool: the hold goes
    (no retraction; retracting the batch's only request would be a scheduler error)."""
    path = tiny_model_factory("llama")
    h = harness_for(path, loop, disable_radix_cache=no_radix, max_total_tokens=204)
    assert open_session(h, "s").success
    a, b = prompt(1, 10), prompt(2, 10)
    submit(h, "A", a, max_new=90, id="s")
    h.step()
    h.scheduler.process_input_requests([TokenizedGenerateReqInput(
        rid="B", input_text=None, input_ids=b,
        sampling_params=SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True))])
    with caplog.at_level("WARNING", logger="baton.engine.scheduler.sessions"):
        results = h.run_until_idle()
    assert results["B"].ids == hf_greedy(path, b, 100, ignore_eos=True)
    assert results["A"].ids == hf_greedy(path, a, 90, ignore_eos=True)
    assert "goes to the running requests' next step" in caplog.text
    assert h.scheduler.stats.retractions == 0
    assert close_session(h, "s").success
    assert_whole(h)


@pytest.mark.parametrize("no_radix", [False, True])
def test_a_turn_arriving_before_its_parents_release_still_reuses_it(tiny_model_factory, no_radix):
    """The overlap loop releases a finished request one result later; a turn that continues it right
    after its last output (another request keeps the loop busy) settles that release first."""
    path = tiny_model_factory("llama")
    h = harness_for(path, "overlap", disable_radix_cache=no_radix, max_total_tokens=2048)
    assert open_session(h, "s").success
    h.scheduler.process_input_requests([TokenizedGenerateReqInput(
        rid="busy", input_text=None, input_ids=prompt(9, 8),
        sampling_params=SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True))])
    a = prompt(1, 20)
    submit(h, "A", a, id="s")
    while h.results.get("A") is None or h.results["A"].finish is None:
        h.step()
    assert any(r.rid == "A" for r in h.scheduler.releaser.waiting), "A's release waits one result"
    submit(h, "B", [5, 6], id="s", rid="A")
    out = h.run_until_idle()["B"]
    assert out.ids == hf_greedy(path, a + h.results["A"].ids + [5, 6], MAX_NEW, ignore_eos=True)
    assert out.cached_tokens >= len(a) + MAX_NEW - 1
    assert close_session(h, "s").success
    assert_whole(h)


def test_tokenizer_manager_sends_a_sessions_requests_to_one_dp_rank():
    """Every request of a session goes to the DP rank of its id (where its history is); a request naming
    another rank, a session request without the session's id, or sessions on a PD engine are 400s."""
    import zlib

    from baton.engine.metrics import EngineMetrics
    from baton.engine.tokenizer_manager import GenerateInput, RequestError, TokenizerManager

    def manager(mode: str = "null") -> TokenizerManager:
        return TokenizerManager(None, ["a", "b", "c"], "", EngineMetrics("m", "colocated"), vocab_size=100,
                                context_len=64, disaggregation_mode=mode)

    def request(**params) -> GenerateInput:
        return GenerateInput(SamplingParams(max_new_tokens=2), input_ids=[5, 6],
                             session_params=SessionParams(**params) if params else None)

    tm = manager()
    plain = request()
    assert tm._in_session(plain, tm._tokenized(plain)).__class__ is TokenizedGenerateReqInput
    for sid in ("s1", "another", "x" * 40):
        obj = request(id=sid, rid="r0")
        msg = tm._in_session(obj, tm._tokenized(obj))
        assert isinstance(msg, SessionGenerateReqInput) and msg.session_params.rid == "r0"
        rank = zlib.crc32(sid.encode()) % 3
        assert tm.pick_rank(obj) == tm.pick_rank(obj) == rank
    refused = [(tm, request(rid="r0"), "session's id"), (manager("prefill"), request(id="s"), "colocated")]
    pinned = request(id="s1")
    pinned.data_parallel_rank = (zlib.crc32(b"s1") + 1) % 3
    refused.append((tm, pinned, "runs on data-parallel rank"))
    for m, obj, words in refused:
        with pytest.raises(RequestError) as e:
            m._in_session(obj, m._tokenized(obj))
        assert e.value.status == 400 and words in e.value.message
