"""The scheduler's operational requests, in process (scheduler_harness.py): pause in each mode and
continue, memory release and resume (the pages really go back to the OS), the profiler, slow-down and
the internal-state knobs. Under the seeded random schedules of test_scheduler_fuzz.py, pauses and
releases at random moments lose nothing: every request ends, greedy ones not aborted with HF's tokens,
and the pools are whole at the end."""
from __future__ import annotations

import gzip
import json
import os
import random
import time

import pytest
import torch

from baton.engine.io_struct import (PAUSE_MODES, BatchTokenIDOut, ContinueGenerationReq, GetInternalStateReq, PauseGenerationReq,
                                    ProfileOut, ProfileReq, ReleaseMemoryOccupationReq, ResumeMemoryOccupationReq,
                                    SetInternalStateReq, SlowDownReq)
from test_scheduler_fuzz import REF_LEN, VOCAB_HI, VOCAB_LO, reference, run_random_schedule
from test_scheduler_vs_hf import LOOPS, harness_for

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def control(h, msg):
    """A control message through the scheduler, and its reply (None where it gives none)."""
    s = h.scheduler
    n = len(s.outbox)
    s.process_input_requests([msg])
    replies = [m for m in s.outbox[n:] if not isinstance(m, BatchTokenIDOut)]
    for m in replies:
        s.outbox.remove(m)
    h._collect()  # outputs it streamed (a pause's aborts)
    return replies[-1] if replies else None


def prompts(seed: int, lens: list[int]) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n)] for i, n in enumerate(lens)}


def rows_held(s) -> int:
    return s.req_to_token_pool.size - s.req_to_token_pool.available_size()


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("mode", PAUSE_MODES)
@pytest.mark.parametrize("steps_before", [2, 5])
def test_pause_modes_then_continue(tiny_model_factory, loop, mode, steps_before):
    """Requests decoding, one between two chunks of its prefill, one waiting: a pause in `mode` ends
    them (abort), sends them back to the queue with their KV freed (retract) or leaves them with their
    KV (in place). While paused nothing runs and a new request waits; after the continue every request
    not aborted produces HF's tokens, aborted ones a prefix of them, and nothing leaks."""
    path = tiny_model_factory("llama")
    h = harness_for(path, loop, chunked_prefill_size=16, max_running_requests=3, max_total_tokens=2048)
    s = h.scheduler
    reqs = prompts(steps_before, [5, 9, 70, 12])  # r2: five chunks; r3 waits for a running slot
    for rid, p in reqs.items():
        h.submit(rid, p, max_new_tokens=REF_LEN, ignore_eos=True)
    for _ in range(steps_before):
        h.step()
    running = [r.rid for r in s.running_batch.reqs]
    out = control(h, PauseGenerationReq(mode))
    assert out.success, out.message
    if mode == "abort":
        assert all(h.results[rid].finish.kind == "abort" and h.results[rid].finish.status_code == 200 for rid in reqs)
        assert rows_held(s) == 0 and not s.waiting_queue
    elif mode == "retract":
        assert s.running_batch.is_empty() and s.chunked_req is None and rows_held(s) == 0
        assert {r.rid for r in s.waiting_queue} == set(reqs) - {rid for rid, c in h.results.items() if c.finish}
    else:
        assert set(running) <= {r.rid for r in s.running_batch.reqs} and rows_held(s) >= len(running)
    reqs["late"] = [7, 8, 9, 10, 11]
    h.submit("late", reqs["late"], max_new_tokens=REF_LEN, ignore_eos=True)
    forwards, tokens = s.forward_ct, sum(len(c.ids) for c in h.results.values())
    for _ in range(3):
        assert not h.step()
    assert s.forward_ct == forwards and sum(len(c.ids) for c in h.results.values()) == tokens
    assert control(h, GetInternalStateReq()).internal_state["paused"] == mode
    control(h, ContinueGenerationReq())
    h.run_until_idle()
    for rid, p in reqs.items():
        got, want = h.results[rid], reference(path, p)
        assert got.finish is not None and got.after_finish == 0, rid
        if got.finish.kind == "abort":
            assert mode == "abort" and rid != "late" and got.ids == want[:len(got.ids)], rid
        else:
            assert got.ids == want, rid
    assert s.check_memory_integrity()


class PauseChaos:
    """Pauses in a random mode at random steps of a seeded schedule, held for a few steps, sometimes
    with the memory released meanwhile (pause modes that leave no request holding memory); checks that
    nothing runs while paused."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.mode, self.left, self.forwards, self.pauses = None, 0, 0, 0
        self.released: list[str] = []

    def step(self, h, submitted: dict, aborted: set) -> None:
        s, rng = h.scheduler, self.rng
        if self.mode is not None:
            assert s.forward_ct == self.forwards, f"a forward ran while paused ({self.mode})"
            self.left -= 1
            if self.left == 0:
                self._resume(h)
            return
        if rng.random() >= 0.04:
            return
        self.mode, self.left, self.pauses = rng.choice(PAUSE_MODES), rng.randint(1, 8), self.pauses + 1
        assert control(h, PauseGenerationReq(self.mode)).success
        if self.mode == "abort":
            aborted.update(submitted)
        if self.mode != "in_place" and rng.random() < 0.5:
            self.released = rng.choice([["kv_cache"], ["weights"], ["kv_cache", "weights"]])
            out = control(h, ReleaseMemoryOccupationReq(self.released))
            assert out.success and out.released == self.released, out
        self.forwards = s.forward_ct

    def _resume(self, h) -> None:
        if self.released:
            assert control(h, ResumeMemoryOccupationReq(self.released)).released == []
            self.released = []
        control(h, ContinueGenerationReq())
        self.mode = None

    def finish(self, h) -> None:
        if self.mode is not None:
            self._resume(h)


@pytest.mark.parametrize("seed", range(6))
def test_random_schedules_with_pauses_and_releases_lose_nothing(tiny_model_factory, seed):
    """test_scheduler_fuzz's schedules (arrivals, aborts, flushes, priorities, retractions, both loops,
    page sizes) with pauses in every mode and memory releases mixed in: the same checks hold."""
    chaos = PauseChaos(1000 + seed)
    run_random_schedule(tiny_model_factory("llama"), seed, chaos, enable_memory_saver=True,
                        enable_weights_cpu_backup=seed % 2 == 1)
    assert chaos.pauses > 0


# ---------------------------------------------------------------- memory release and resume
def test_release_needs_the_flag_and_no_request_holding_memory(tiny_model_factory):
    path = tiny_model_factory("llama")
    h = harness_for(path, "plain", max_total_tokens=1024)
    out = control(h, ReleaseMemoryOccupationReq())
    assert not out.success and "--enable-memory-saver" in out.message
    h.scheduler.close()
    h = harness_for(path, "plain", max_total_tokens=1024, enable_memory_saver=True)
    assert "unknown memory tag" in control(h, ReleaseMemoryOccupationReq(["gpu"])).message
    h.submit("a", [5, 6, 7, 8], max_new_tokens=REF_LEN, ignore_eos=True)
    h.step()
    out = control(h, ReleaseMemoryOccupationReq(["kv_cache"]))
    assert not out.success and "pause first" in out.message and out.released == []
    h.run_until_idle()
    assert h.results["a"].ids == reference(path, [5, 6, 7, 8])
    assert h.scheduler.check_memory_integrity()


@pytest.mark.parametrize("loop", ["plain", "overlap"])
def test_kv_release_returns_the_pool_to_the_os(tiny_model_factory, loop):
    """A 64 MB KV pool: its pages leave the process (RSS), the prefix cache is flushed, a request that
    arrives while released waits; after the resume it runs, with HF's tokens, and the pool is whole."""
    path = tiny_model_factory("llama")
    h = harness_for(path, loop, max_total_tokens=1 << 17, enable_memory_saver=True)
    s = h.scheduler
    pool_bytes = s.worker.model_runner.token_to_kv_pool.get_kv_size_bytes()
    assert pool_bytes >= 60e6
    h.submit("warm", [5, 6, 7, 8, 9], max_new_tokens=8, ignore_eos=True)
    h.run_until_idle()
    assert s.tree_cache.total_size() > 0
    kv = s.worker.model_runner.token_to_kv_pool
    for t in [*kv.k_buffer, *kv.v_buffer]:
        t.fill_(1.0)  # every page resident before measuring
    before = rss()
    out = control(h, ReleaseMemoryOccupationReq(["kv_cache"]))
    assert out.success and out.released == ["kv_cache"], out
    assert before - rss() >= 0.9 * pool_bytes
    assert s.tree_cache.total_size() == 0
    h.submit("a", [5, 6, 7, 8, 9], max_new_tokens=REF_LEN, ignore_eos=True)
    assert not h.step() and "a" not in h.results
    assert control(h, ReleaseMemoryOccupationReq(["kv_cache"])).success  # again: nothing more to do
    assert control(h, ResumeMemoryOccupationReq()).released == []
    h.run_until_idle()
    assert h.results["a"].ids == reference(path, [5, 6, 7, 8, 9])
    assert s.check_memory_integrity()


@pytest.mark.parametrize("backup", [False, True], ids=["reload-from-disk", "cpu-backup"])
def test_weights_release_and_resume(tiny_model_factory, backup):
    """~37 MB of weights: released, they leave the process (with a host copy, the copy stays); resumed
    from the copy or reloaded from the checkpoint, the model gives HF's tokens again."""
    path = tiny_model_factory("llama", hidden_size=384, intermediate_size=1536, num_hidden_layers=4)
    h = harness_for(path, "plain", max_total_tokens=2048, enable_memory_saver=True, enable_weights_cpu_backup=backup)
    s = h.scheduler
    weight_bytes = sum(p.numel() * p.element_size() for p in s.worker.model_runner.model.parameters())
    seed_state = torch.random.get_rng_state()
    before = rss()
    assert control(h, ReleaseMemoryOccupationReq(["weights"])).released == ["weights"]
    if not backup:
        assert before - rss() >= 0.9 * weight_bytes
    head = s.worker.model_runner.model.lm_head.weight
    assert (head == 0).float().mean() > 0.9  # its pages read as zeros now (all but the partial ones at its ends)
    h.submit("a", [5, 6, 7, 8, 9], max_new_tokens=REF_LEN, ignore_eos=True)
    assert not h.step()
    assert control(h, ResumeMemoryOccupationReq(["weights"])).success
    assert torch.equal(torch.random.get_rng_state(), seed_state)  # a reload leaves torch's RNG alone
    h.run_until_idle()
    assert h.results["a"].ids == reference(path, [5, 6, 7, 8, 9])
    assert s.check_memory_integrity()


def test_hybrid_model_releases_its_state_pool_too(tiny_model_factory):
    """A hybrid model: the recurrent-state pool goes with the KV pool, and a resumed engine's requests
    (their states started from the zeroed slots) equal HF."""
    path = tiny_model_factory("qwen3_5")
    h = harness_for(path, "plain", max_total_tokens=1 << 16, max_running_requests=64, enable_memory_saver=True)
    s = h.scheduler
    runner = s.worker.model_runner
    pool_bytes = runner.token_to_kv_pool.get_kv_size_bytes() + runner.state_pool.size_bytes()
    prompt = [11, 12, 13, 14, 15, 16]
    h.submit("warm", prompt, max_new_tokens=8, ignore_eos=True)
    h.run_until_idle()
    kv = runner.token_to_kv_pool
    for t in [*kv.k_buffer, *kv.v_buffer, *runner.state_pool.conv, *runner.state_pool.ssm]:
        t.fill_(1.0)
    before = rss()
    assert control(h, ReleaseMemoryOccupationReq(["kv_cache"])).success
    assert before - rss() >= 0.9 * pool_bytes
    assert control(h, ResumeMemoryOccupationReq(["kv_cache"])).success
    h.submit("a", prompt, max_new_tokens=REF_LEN, ignore_eos=True)
    h.run_until_idle()
    assert h.results["a"].ids == reference(path, prompt)
    assert s.check_memory_integrity()


# ---------------------------------------------------------------- profiler, slow-down, knobs
def test_profile_of_n_steps_answers_when_written(tiny_model_factory, tmp_path):
    path = tiny_model_factory("llama")
    h = harness_for(path, "overlap", max_total_tokens=1024)
    assert not control(h, ProfileReq("stop")).success  # nothing to stop
    assert "unsupported" in control(h, ProfileReq("start", activities=["RPD"])).message
    assert control(h, ProfileReq("start", output_dir=str(tmp_path), num_steps=2, profile_id="p1")) is None
    assert "already" in control(h, ProfileReq("start", output_dir=str(tmp_path))).message
    h.submit("a", [5, 6, 7, 8, 9], max_new_tokens=6, ignore_eos=True)
    for _ in range(3):  # the reply waits in the outbox with the steps' outputs
        h.scheduler.run_step()
    [reply] = [m for m in h.scheduler.outbox if isinstance(m, ProfileOut)]
    assert reply.success
    trace = tmp_path / "p1-TP-0-DP-0.trace.json.gz"
    assert trace.exists() and "traceEvents" in json.loads(gzip.decompress(trace.read_bytes()))
    h._collect()
    h.run_until_idle()
    assert h.results["a"].ids == reference(path, [5, 6, 7, 8, 9])[:6]


def test_slow_down_and_internal_state(tiny_model_factory):
    path = tiny_model_factory("llama")
    h = harness_for(path, "plain", max_total_tokens=1024, max_running_requests=4)
    control(h, SlowDownReq(0.2))
    h.submit("a", [5, 6, 7], max_new_tokens=3, ignore_eos=True)
    start = time.monotonic()
    h.step()
    assert time.monotonic() - start >= 0.2
    control(h, SlowDownReq(None))
    for bad in ({"max_running_requests": 0}, {"max_running_requests": 5}, {"max_micro_batch_size": 2},
                {"max_queued_requests": "x"}):
        out = control(h, SetInternalStateReq(bad))
        assert not out.updated and out.message, bad
    out = control(h, SetInternalStateReq({"max_running_requests": 1, "max_queued_requests": 10}))
    assert out.updated and out.server_args["max_running_requests"] == 1
    state = control(h, GetInternalStateReq()).internal_state
    assert state["max_queued_requests"] == 10 and state["paused"] is None and state["memory_released"] == []
    for rid in ("b", "c"):
        h.submit(rid, [9, 8, 7], max_new_tokens=4, ignore_eos=True)
    while h.step():
        assert len(h.scheduler.running_batch.reqs) <= 1
    h.run_until_idle()
    for rid in ("b", "c"):
        assert h.results[rid].ids == reference(path, [9, 8, 7])[:4]


@pytest.mark.gpu
@pytest.mark.parametrize("backup", [False, True], ids=["reload-from-disk", "cpu-backup"])
def test_release_and_resume_on_cuda(tiny_model_factory, backup):
    """CUDA: the pools' and the weights' storages are freed (the device's allocated bytes drop by them),
    the decode CUDA graphs are captured again on resume, and the engine decodes the same tokens as
    before the release."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import importlib.util

    if importlib.util.find_spec("flashinfer") is None:
        pytest.skip("needs flashinfer-python (scripts/gpu_check.sh installs the carried wheel)")
    path = tiny_model_factory("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    h = harness_for(path, "overlap", device="cuda", dtype="float16", attention_backend="flashinfer",
                    cuda_graph_max_bs=8, max_total_tokens=1 << 16, enable_memory_saver=True,
                    enable_weights_cpu_backup=backup)
    s, prompt = h.scheduler, [5, 6, 7, 8, 9, 10]
    runner = s.worker.model_runner
    h.submit("before", prompt, max_new_tokens=REF_LEN, ignore_eos=True)
    h.run_until_idle()
    pool = runner.token_to_kv_pool.get_kv_size_bytes()
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    assert control(h, ReleaseMemoryOccupationReq()).released == ["kv_cache", "weights"]
    assert allocated - torch.cuda.memory_allocated() >= 0.9 * (pool + weights)
    assert control(h, ResumeMemoryOccupationReq()).released == []
    assert runner.cuda_graph_runner is not None
    h.submit("after", prompt, max_new_tokens=REF_LEN, ignore_eos=True)
    h.run_until_idle()
    assert h.results["after"].ids == h.results["before"].ids
    assert s.check_memory_integrity()
