#!/usr/bin/env python3
"""A verify step's acceptance, host rule against the device walk, side by side in one run.

    .venv/bin/python scripts/verify_accept_bench.py [--device cuda] [--vocab 128256] [--batch-sizes 1,4,16]

Per batch size and request kind (greedy; sampled at temperature 0.7, top-p 0.9, seeded; either with
logprobs and top-2), a chain of --drafts draft tokens per request over random logits in which about
half the drafts pass: the time from the pass's logits to the emitted tokens on the host, for
accept_host.verify_drafts (the host rule: per-request work, reads as it goes) and
accept_device.accept_on_device + PendingVerify.read (the batch at once, one read at the end), and the
time the device walk's launch takes before it returns (what the scheduler's thread waits for it on
CUDA, where the read comes later). Medians of --iters runs after a warm-up; the tokens of the two
agree for greedy rows (checked), sampled rows draw differently by design (both keep the target's
distribution: tests/engine/test_speculative_tree.py).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from baton.engine.core.spec_info import VerifyInput
from baton.engine.sampling.sampling_batch_info import ReqSamplingState
from baton.engine.sampling.sampling_params import SamplingParams
from baton.engine.speculative.accept_device import PendingVerify, accept_on_device
from baton.engine.speculative.accept_host import verify_drafts


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _case(bs: int, drafts: int, vocab: int, sampled: bool, device: str, gen: torch.Generator):
    params = dict(temperature=0.7, top_p=0.9, seed=3) if sampled else dict(temperature=0.0)
    states = []
    for b in range(bs):
        p = SamplingParams(**params)
        p.verify(vocab)
        states.append(ReqSamplingState(p, [1, 2], vocab_size=vocab, stop_ids_for_min_tokens=set(), device=device))
    rows = bs * (drafts + 1)
    logits = torch.randn(rows, vocab, generator=gen)
    best = torch.randint(0, vocab, (rows,), generator=gen)
    logits[torch.arange(rows), best] += 12.0  # a clear favourite per row: drafts of it pass
    chains = []
    for b in range(bs):  # the favourite at the first half of the positions, then a miss
        base = b * (drafts + 1)
        chains.append([int(best[base + j]) if j < drafts // 2 else int(best[base + j] + 1) % vocab
                       for j in range(drafts)])
    ids = torch.tensor([t for c in chains for t in [0] + c])
    return logits.to(device), ids.to(device), chains, states


def _median_ms(fn, device: str, iters: int) -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--drafts", type=int, default=4)
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    print(f"device {args.device}, vocab {args.vocab}, chains of {args.drafts} drafts, medians of {args.iters}")
    print("| batch | kind | logprobs | host rule ms | device walk + read ms | host / device | launch returns ms |")
    print("|---|---|---|---|---|---|---|")
    for bs in [int(x) for x in args.batch_sizes.split(",")]:
        for sampled in (False, True):
            for logprobs in (False, True):
                logits, ids, chains, states = _case(bs, args.drafts, args.vocab, sampled, args.device, gen)
                nums = [2] * bs if logprobs else None
                draws = list(range(bs))

                def host():
                    return verify_drafts(logits, VerifyInput([list(c) for c in chains]), states, draws,
                                         logprobs, nums or [0] * bs)

                def launch():
                    spec = VerifyInput([list(c) for c in chains])
                    acc = accept_on_device(logits, ids, spec, None, states, draws)
                    return PendingVerify(acc, spec, args.device == "cuda", logits, nums)

                def device():
                    return launch().read()

                if not sampled:
                    assert host().tokens == device().tokens, "greedy: the two rules disagree"
                t_host = _median_ms(host, args.device, args.iters)
                t_dev = _median_ms(device, args.device, args.iters)
                launch()
                _sync(args.device)
                starts = []
                for _ in range(args.iters):  # the launch alone: no sync after it
                    _sync(args.device)
                    t0 = time.perf_counter()
                    pending = launch()
                    starts.append((time.perf_counter() - t0) * 1e3)
                    pending.read()
                t_launch = statistics.median(starts)
                print(f"| {bs} | {'sampled' if sampled else 'greedy'} | {'top-2' if logprobs else '-'} "
                      f"| {t_host:.2f} | {t_dev:.2f} | {t_host / t_dev:.2f}x | {t_launch:.2f} |")


if __name__ == "__main__":
    main()
