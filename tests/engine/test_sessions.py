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
