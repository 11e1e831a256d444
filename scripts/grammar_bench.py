"""Structured output on the CPU, in one process: what a grammar costs per decode step, and what a
grammar compile does to the requests already running.

    .venv/bin/python scripts/grammar_bench.py --model-path models/SmolLM2-135M-Instruct

1. Throughput: the same N prompts decode M tokens with and without a regex (one that cannot end
   before M tokens), alternating rounds; prints tok/s of each and the ratio.
2. Compile stall: N requests decode; a request with a new regex arrives mid-run. Prints how long
   the running requests take for the 4 steps from its arrival, with the compile in the scheduler's
   step (the old, synchronous path, emulated by waiting on the compile inside submit) and on the
   backend's thread (now), beside 4 median decode steps and the compile alone.
"""
from __future__ import annotations

import argparse
import statistics
import time
import uuid

from transformers import AutoTokenizer

from baton.engine.io_struct import TokenizedGenerateReqInput
from baton.engine.sampling.sampling_params import SamplingParams
from baton.engine.scheduler.scheduler import Scheduler
from baton.engine.server_args import ServerArgs

FILL_REGEX = "[a-z ,.]{400}"


def prompts(tokenizer, n: int) -> list[list[int]]:
    return [tokenizer.encode(f"Write a long story about the number {i} and a cat.") for i in range(n)]


def submit(s: Scheduler, ids: list[int], max_new: int, **extra) -> str:
    rid = uuid.uuid4().hex
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, **extra)
    params.verify(s.vocab_size)
    s.process_input_requests([TokenizedGenerateReqInput(rid=rid, input_text=None, input_ids=ids,
                                                        sampling_params=params)])
    return rid


def drain(s: Scheduler) -> list[float]:
    """Steps until idle; returns each step's wall time (s)."""
    times = []
    while True:
        t = time.perf_counter()
        ran = s.run_step()
        s.outbox.clear()
        if ran:
            times.append(time.perf_counter() - t)
        elif s.is_idle():
            return times
        else:
            s.grammar_queue.wait(1.0)


def throughput(s: Scheduler, batch: list[list[int]], max_new: int, regex: bool) -> float:
    t = time.perf_counter()
    for ids in batch:
        submit(s, ids, max_new, ignore_eos=not regex, **({"regex": FILL_REGEX} if regex else {}))
    drain(s)
    return len(batch) * max_new / (time.perf_counter() - t)


def paragraph(width: int) -> str:
    """Up to 5 lines of `width` characters: ~1 s to compile over a 49k vocabulary on this VM."""
    return rf"([A-Za-z0-9 ,.]{{1,{width}}}\n){{1,5}}"


def stall(s: Scheduler, batch: list[list[int]], max_new: int, sync: bool, salt: int) -> tuple[float, float, float]:
    """(median decode step, the 4 steps from the new request's arrival, its compile alone), while a
    request with a new (uncached) regex arrives among running requests."""
    backend = s.grammar_backend
    real = backend.submit
    if sync:  # the old path: the step that takes the request waits for its compile
        def waiting(kind, spec):
            f = real(kind, spec)
            f.result()
            return f
        backend.submit = waiting
    try:
        for ids in batch:
            submit(s, ids, max_new, ignore_eos=True)
        steps = []
        for _ in range(6):  # the prefill, then decode steps
            t = time.perf_counter()
            s.run_step()
            s.outbox.clear()
            steps.append(time.perf_counter() - t)
        regex = paragraph(200 + salt)
        t = time.perf_counter()
        submit(s, batch[0], 8, regex=regex)
        for _ in range(4):  # the step that takes the request and the next three
            s.run_step()
            s.outbox.clear()
        arrival = time.perf_counter() - t
        drain(s)
    finally:
        backend.submit = real
    t = time.perf_counter()
    backend.submit("regex", paragraph(300 + salt)).result()  # a like compile, alone (xgrammar caches equal parts)
    return statistics.median(steps[2:]), arrival, time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", required=True)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    tok = AutoTokenizer.from_pretrained(a.model_path)
    s = Scheduler(ServerArgs(model_path=a.model_path, max_total_tokens=8192), tok)
    s.grammar_backend.submit("regex", FILL_REGEX).result()  # compiled once, outside the timings
    batch = prompts(tok, a.num_prompts)
    throughput(s, batch[:2], 4, regex=True)  # warm-up
    print(f"model {a.model_path}, vocab {s.vocab_size}, {a.num_prompts} requests x {a.max_new_tokens} tokens")
    for r in range(a.rounds):
        free = throughput(s, batch, a.max_new_tokens, regex=False)
        con = throughput(s, batch, a.max_new_tokens, regex=True)
        print(f"round {r}: plain {free:.1f} tok/s, regex {con:.1f} tok/s, regex/plain {con / free:.2f}")
    for r in range(a.rounds):
        for sync in (True, False):
            med, arrival, compile_s = stall(s, batch, 24, sync, salt=2 * r + sync)
            print(f"round {r}: compile {'in the step  ' if sync else 'on its thread'}: 4 decode steps "
                  f"{4 * med * 1e3:.0f} ms at the median step, {arrival * 1e3:.0f} ms from the arrival "
                  f"(the compile alone {compile_s * 1e3:.0f} ms)")
    assert s.check_memory_integrity()


if __name__ == "__main__":
    main()
