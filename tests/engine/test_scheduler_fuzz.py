"""Seeded random schedules through the real scheduler: arrivals at random steps, shared prefixes,
aborts at any stage (waiting, mid-chunk, running, retracted), abort-all, cache flushes, priorities
with preemption, a waiting-queue limit (503), stop token ids, sampled requests (penalties, seeds, min_tokens) and logprobs beside
greedy ones, a KV pool small enough to retract, every policy, both loops, page
sizes 1/4/16, radix on and off. Whatever the interleaving:

- every request finishes exactly once and nothing is sent for it afterwards;
- a greedy request that was not aborted produces HF's greedy tokens (cut at its stop token or
  length), whatever else shares its batches; a sampled one ends where its tokens say it should;
- an aborted one produced a prefix of them;
- at idle, every KV slot is free or cached and every request row is free.

Each case prints its seed and configuration on failure, so it replays alone."""
from __future__ import annotations

import inspect
import random

import pytest
import torch
from transformers import DynamicCache

from baton.engine.disaggregation.base import TransferConfig
from baton.engine.io_struct import AbortReq, FlushCacheReq
from baton.engine.server_args import SCHEDULE_POLICIES
from test_scheduler_vs_hf import LOOPS, _hf_model, harness_for

REF_LEN = 40  # the longest max_new_tokens drawn
VOCAB_LO, VOCAB_HI = 6, 500
_REFS: dict[tuple, list[int]] = {}


def reference(path: str, prompt: list[int]) -> list[int]:
    """HF's greedy continuation of REF_LEN tokens (EOS ignored): the HF model's own forward with its
    KV cache, argmax per step (what `generate` does greedily, without its per-call set-up, which
    dominated this test's time); shorter requests take a prefix."""
    key = (path, tuple(prompt))
    if key not in _REFS:
        model = _hf_model(path)
        out, ids, cache = [], torch.tensor([prompt]), DynamicCache(config=model.config)  # (a hybrid: its layer kinds)
        # transformers 5.x renames past_key_values to cache (the old name warns); the cache fills in place
        kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        with torch.no_grad():
            for _ in range(REF_LEN):
                step = model(input_ids=ids, use_cache=True, **{kwarg: cache})
                out.append(int(step.logits[0, -1].argmax()))
                ids = torch.tensor([[out[-1]]])
        _REFS[key] = out
    return _REFS[key]


def expected(ref: list[int], max_new: int, stop_id: int | None) -> list[int]:
    out = ref[:max_new]
    if stop_id is not None and stop_id in out:
        out = out[:out.index(stop_id) + 1]
    return out


def draw_config(rng: random.Random) -> dict:
    page = rng.choice([1, 4, 16])
    return dict(
        loop=rng.choice(LOOPS),
        page_size=page,
        schedule_policy=rng.choice(SCHEDULE_POLICIES),
        disable_radix_cache=rng.random() < 0.25,
        enable_priority_scheduling=rng.random() < 0.5,
        priority_preemption_threshold=rng.choice([1, 5]),
        chunked_prefill_size=rng.choice([16, 32, 64]),
        max_running_requests=rng.randint(3, 12),
        max_queued_requests=rng.choice([None, None, 30]),  # beyond it: 503 at once
        # one request needs at most 80 + 40 tokens (the scheduler caps max_new_tokens to the pool); a pool of a few of them makes decode retract
        max_total_tokens=rng.randint(160, 400) // page * page,
    )


# 12 and 27 (inline overlap, priority preemption): a request ended by preemption's drain of the
# in-flight result stayed in the running batch without its row (found by a wider seed sweep)
@pytest.mark.parametrize("seed", [*range(12), 27])
def test_random_schedules_keep_outputs_and_memory(tiny_model_factory, seed):
    run_random_schedule(tiny_model_factory("llama"), seed)


def run_random_schedule(path: str, seed: int, chaos=None, **extra_args) -> None:
    """One seeded schedule and its checks. `chaos`: more control traffic mixed in (test_operations.py:
    pauses, memory releases), with its own random stream, so the schedule itself stays the seed's:
    `chaos.step(h, submitted, aborted)` before every step (it adds to `aborted` what it ends), and
    `chaos.finish(h)` before the run to idle."""
    rng = random.Random(seed)
    config = draw_config(rng)
    context = f"seed {seed}, config {config}"
    h = harness_for(path, **config, **extra_args)
    s = h.scheduler

    # a small pool of prompts (HF's reference is computed once per prompt); requests draw from it
    # whole, cut short or extended, so identical prompts and shared prefixes both hit the radix cache
    pool = [[rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(rng.randint(1, 80))] for _ in range(24)]
    submitted: dict[str, dict] = {}
    aborted: set[str] = set()

    def new_request() -> None:
        rid = f"r{len(submitted)}"
        prompt = rng.choice(pool)
        if rng.random() < 0.3:  # a prefix of another prompt, cut anywhere (also inside a page)
            prompt = prompt[:rng.randint(1, len(prompt))]
        max_new = rng.randint(1, REF_LEN) if rng.random() < 0.3 else rng.randint(REF_LEN // 2, REF_LEN)
        ref = reference(path, prompt)
        stop_id = rng.choice(ref[:max_new]) if rng.random() < 0.2 else None
        sampling = {}
        if rng.random() < 0.25:  # sampled, beside the greedy requests in the same batches
            sampling = dict(temperature=rng.uniform(0.5, 1.5), top_k=rng.choice([-1, 5, 50]),
                            top_p=rng.choice([1.0, 0.9]), min_p=rng.choice([0.0, 0.05]),
                            repetition_penalty=rng.choice([1.0, 1.2]), frequency_penalty=rng.choice([0.0, 0.5]),
                            presence_penalty=rng.choice([0.0, 0.5]), seed=rng.choice([None, rng.randrange(1 << 30)]),
                            min_new_tokens=rng.randint(0, max_new))
        logprobs = rng.random() < 0.2
        submitted[rid] = dict(prompt=prompt, max_new=max_new, stop_id=stop_id, ref=ref, sampled=bool(sampling),
                              min_new=sampling.get("min_new_tokens", 0), logprobs=logprobs)
        h.submit(rid, prompt, max_new_tokens=max_new, ignore_eos=True, priority=rng.randint(0, 10),
                 stop_token_ids=[stop_id] if stop_id is not None else None, return_logprob=logprobs,
                 logprob_start_len=rng.choice([-1, 0, len(prompt) - 1]) if logprobs else -1, **sampling)

    for _ in range(rng.randint(120, 220)):
        if rng.random() < 0.3:
            for _ in range(rng.randint(1, 4)):
                new_request()
        if submitted and rng.random() < 0.08:
            rid = rng.choice(list(submitted))
            aborted.add(rid)
            s.process_input_requests([AbortReq(rid=rid)])
        if rng.random() < 0.004:
            aborted.update(submitted)
            s.process_input_requests([AbortReq(abort_all=True)])
        if rng.random() < 0.04:
            s.process_input_requests([FlushCacheReq()])
            reply = s.outbox.pop()
            if reply.success:
                assert s.tree_cache.total_size() == 0, context
        if chaos is not None:
            chaos.step(h, submitted, aborted)
        h.step()
    if chaos is not None:
        chaos.finish(h)
    h.run_until_idle(max_steps=20_000)  # the queue can be long: up to ~190 requests, 3 running at once

    assert submitted, context
    queue_full = 0
    for rid, req in submitted.items():
        got = h.results.get(rid)
        assert got is not None and got.finish is not None, f"{rid} never finished ({context})"
        assert got.after_finish == 0, f"{rid}: {got.after_finish} outputs after its finish ({context})"
        if req["logprobs"]:
            assert [t for _, t in got.output_logprobs] == got.ids, f"{rid}: logprobs out of step ({context})"
            assert all(lp <= 1e-5 for lp, _ in got.output_logprobs), f"{rid}: {got.output_logprobs} ({context})"
        if got.finish.kind == "abort" and got.finish.status_code == 503:
            assert config["max_queued_requests"] and not got.ids, f"{rid}: {got.finish} ({context})"
            queue_full += 1
        elif got.finish.kind == "abort":
            assert rid in aborted, f"{rid} aborted without being asked: {got.finish} ({context})"
        if req["sampled"]:  # no reference: the finish must agree with the tokens
            assert len(got.ids) <= req["max_new"], context
            if got.finish.kind == "length":
                assert len(got.ids) == req["max_new"], f"{rid}: {got.finish} after {len(got.ids)} ({context})"
            elif got.finish.kind == "stop":
                assert got.ids[-1] == req["stop_id"] and req["min_new"] <= len(got.ids) < req["max_new"], context
                assert req["stop_id"] not in got.ids[max(req["min_new"] - 1, 0):-1], f"{rid} ran past its stop ({context})"
            continue
        want = expected(req["ref"], req["max_new"], req["stop_id"])
        if got.finish.kind == "abort":
            assert got.ids == want[:len(got.ids)], f"{rid} (aborted) is not a prefix of HF's tokens ({context})"
        else:
            assert got.ids == want, f"{rid} differs from HF: {got.ids} != {want} ({context})"
            # the length check comes first (as SGLang's): a stop token as the last allowed token is "length"
            kind = "stop" if len(want) < req["max_new"] else "length"
            assert got.finish.kind == kind, f"{rid}: {got.finish} ({context})"
    if config["max_queued_requests"] is None:
        assert queue_full == 0, context
    assert s.is_idle(), context
    assert s.check_memory_integrity(), context


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("steps_before", [0, 1, 2, 6], ids=["waiting", "after-1-step", "after-2-steps", "decoding"])
@pytest.mark.parametrize("prompt_len", [20, 70], ids=["one-chunk", "three-chunks"])
def test_abort_at_every_stage_ends_the_request_and_frees_it(tiny_model_factory, loop, steps_before, prompt_len):
    """An abort after N steps: still queued, between chunks, right after its prefill result was
    processed (before it joined the running batch: the plain loop once dropped it there without
    freeing its KV or telling the client), or while decoding. It ends once, with an abort, having
    produced a prefix of HF's tokens; a neighbour is untouched; nothing leaks."""
    path = tiny_model_factory("llama")
    rng = random.Random(prompt_len)
    victim = [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(prompt_len)]
    other = [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(30)]
    h = harness_for(path, loop, chunked_prefill_size=32, max_total_tokens=1024)
    h.submit("victim", victim, max_new_tokens=REF_LEN, ignore_eos=True)
    h.submit("other", other, max_new_tokens=REF_LEN, ignore_eos=True)
    for _ in range(steps_before):
        h.step()
    h.scheduler.process_input_requests([AbortReq(rid="victim")])
    h.run_until_idle()
    got = h.results["victim"]
    assert got.finish is not None and got.finish.kind == "abort", got.finish
    assert got.after_finish == 0
    assert got.ids == reference(path, victim)[:len(got.ids)]
    assert h.results["other"].ids == reference(path, other)
    assert h.scheduler.check_memory_integrity()


@pytest.mark.parametrize("seed", range(6))
def test_random_pd_schedules_keep_outputs_and_memory(tiny_model_factory, seed):
    """The same for a PD pair (prefill + decode schedulers, the in-process fake transfer): requests
    reach the two engines in either order, sometimes steps apart; aborts hit the decode, the prefill
    or both at random stages; some transfers fail by injection; the decode pool is small enough to
    retract. Every request ends on both engines; the decode's tokens are HF's (a prefix if it was
    aborted); both engines settle with no memory, metadata slot or transfer room held."""
    from test_pd_scheduler import PDPair

    rng = random.Random(1000 + seed)
    page = rng.choice([1, 4, 16])
    overlap = rng.random() < 0.5
    config = dict(page_size=page, overlap=overlap, decode_pool=rng.randint(140, 320) // page * page,
                  chunk=rng.choice([16, 32, 64]), fault=rng.choice([0.0, 0.0, 0.1]))
    context = f"seed {seed}, config {config}"
    path = tiny_model_factory("llama")
    pair = PDPair(path, prefill_config=TransferConfig(fault_probability=config["fault"], fault_seed=seed),
                  decode_config=TransferConfig(waiting_timeout_s=2.0),
                  page_size=page, enable_overlap_schedule=overlap, disable_overlap_schedule=not overlap,
                  max_total_tokens=config["decode_pool"],
                  prefill_args={"chunked_prefill_size": config["chunk"], "max_total_tokens": 2048})
    try:
        pool = [[rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(rng.randint(1, 80))] for _ in range(16)]
        submitted: dict[str, dict] = {}
        late: list[tuple[int, str]] = []  # (step, rid): the second engine hears of it then
        aborted: set[str] = set()
        for step in range(rng.randint(80, 140)):
            if rng.random() < 0.25:
                rid = f"r{len(submitted)}"
                prompt = rng.choice(pool)
                max_new = rng.randint(1, REF_LEN) if rng.random() < 0.3 else rng.randint(REF_LEN // 2, REF_LEN)
                room = next(pair.rooms)
                first, second = (pair.decode, pair.prefill) if rng.random() < 0.5 else (pair.prefill, pair.decode)
                submitted[rid] = dict(prompt=prompt, max_new=max_new, room=room, second=second, ref=reference(path, prompt))
                first.submit_pd(rid, prompt, room, pair.port, max_new_tokens=max_new, ignore_eos=True)
                if rng.random() < 0.3:
                    late.append((step + rng.randint(1, 6), rid))
                else:
                    second.submit_pd(rid, prompt, room, pair.port, max_new_tokens=max_new, ignore_eos=True)
            for due, rid in [x for x in late if x[0] <= step]:
                late.remove((due, rid))
                req = submitted[rid]
                req["second"].submit_pd(rid, req["prompt"], req["room"], pair.port, max_new_tokens=req["max_new"],
                                        ignore_eos=True)
            if submitted and rng.random() < 0.06:
                rid = rng.choice(list(submitted))
                aborted.add(rid)
                for side in rng.choice([(pair.decode,), (pair.prefill,), (pair.decode, pair.prefill)]):
                    side.abort(rid)
            pair.step()
        for _, rid in late:
            req = submitted[rid]
            req["second"].submit_pd(rid, req["prompt"], req["room"], pair.port, max_new_tokens=req["max_new"],
                                    ignore_eos=True)
        pair.run_until_idle(timeout_s=120)

        for rid, req in submitted.items():
            got, pre = pair.decode.results.get(rid), pair.prefill.results.get(rid)
            assert got is not None and got.finish is not None, f"{rid} never finished on the decode ({context})"
            assert pre is not None and pre.finish is not None, f"{rid} never finished on the prefill ({context})"
            assert got.after_finish == 0 and pre.after_finish == 0, f"{rid}: outputs after the finish ({context})"
            want = req["ref"][:req["max_new"]]
            if got.finish.kind == "abort":
                assert rid in aborted or config["fault"] > 0, f"{rid}: {got.finish} ({context})"
                assert got.ids == want[:len(got.ids)], f"{rid} (aborted) is not a prefix of HF's tokens ({context})"
            else:
                assert got.ids == want, f"{rid} differs from HF: {got.ids} != {want} ({context})"
                assert got.finish.kind == "length", f"{rid}: {got.finish} ({context})"
                if pre.finish.kind != "abort":
                    assert pre.ids == want[:1], f"{rid}: the prefill's token 1 ({context})"
        assert pair.prefill.settled(), f"prefill: memory, metadata slots or rooms leaked ({context})"
        assert pair.decode.settled(), f"decode: memory, metadata slots or rooms leaked ({context})"
    finally:
        pair.close()


@pytest.mark.parametrize("loop", LOOPS)
def test_abort_of_a_decoding_request_is_not_held_back_by_prefills(tiny_model_factory, loop):
    """Prefill goes first, so a long chunked prefill delays decode steps; a request aborted while
    decoding still ends (and frees its memory) at the next step, not after the whole prefill."""
    path = tiny_model_factory("llama")
    h = harness_for(path, loop, chunked_prefill_size=16, max_total_tokens=1024)
    decoding = [9, 8, 7, 6, 5]
    h.submit("decoding", decoding, max_new_tokens=REF_LEN, ignore_eos=True)
    for _ in range(4):
        h.step()
    assert [r.rid for r in h.scheduler.running_batch.reqs] == ["decoding"] and "decoding" not in h.results
    h.submit("long", list(range(6, 6 + 90)), max_new_tokens=4, ignore_eos=True)  # six chunks
    h.scheduler.process_input_requests([AbortReq(rid="decoding")])
    h.step()
    h.step()  # overlap: the step after the one that saw the abort carries its result
    got = h.results["decoding"]
    assert got.finish is not None and got.finish.kind == "abort"
    assert "long" not in h.results, "the long prefill should still be running"
    assert got.ids == reference(path, decoding)[:len(got.ids)]
    h.run_until_idle()
    assert h.results["long"].ids == reference(path, list(range(6, 6 + 90)))[:4]
    assert h.scheduler.check_memory_integrity()


@pytest.mark.parametrize("loop", LOOPS)
def test_admission_waits_for_rows_still_held_by_ended_requests(tiny_model_factory, loop):
    """Overlap keeps an ended request's row until the next result (the batch in flight may still
    read it). Requests aborted while decoding leave the running batch at once, so admission must
    count the rows actually free, not max_running_requests minus the running batch."""
    path = tiny_model_factory("llama")
    h = harness_for(path, loop, max_running_requests=2, max_total_tokens=1024)
    for rid in ("a", "b"):
        h.submit(rid, [7, 8, 9, 10], max_new_tokens=REF_LEN, ignore_eos=True)
    for _ in range(4):
        h.step()
    h.scheduler.process_input_requests([AbortReq(abort_all=True)])
    for rid in ("c", "d"):
        h.submit(rid, [11, 12, 13, 14, 15], max_new_tokens=6, ignore_eos=True)
    h.run_until_idle()  # raised "no free request rows" in the overlap loops before
    assert h.results["a"].finish.kind == h.results["b"].finish.kind == "abort"
    for rid in ("c", "d"):
        assert h.results[rid].ids == reference(path, [11, 12, 13, 14, 15])[:6]
    assert h.scheduler.check_memory_integrity()
