#!/usr/bin/env python3
"""Accept length of speculative decoding settings side by side, in process, one request at a time.

    .venv/bin/python scripts/spec_accept.py --model models/SmolLM2-135M-Instruct --prompts 4 --tokens 96 \
        --variant 'chain:{"speculative_algorithm": "EAGLE", "speculative_draft_model_path": "/tmp/smol-eagle"}' \
        --variant 'topk4:{"speculative_algorithm": "EAGLE", "speculative_draft_model_path": "/tmp/smol-eagle", "speculative_eagle_topk": 4}'

Each variant is a scheduler (the tests' SchedulerHarness, float32 by default) over the same code-edit
prompts (engine/bench/edit_workload.py); the script prints per variant the accept length (tokens a
request emits per verify step), decode steps in all (plain and verify: what the time follows), verify
steps, runs accepted off a tree's first chain, and whether its
tokens equal the first variant's (greedy; with --temperature, seeded per prompt). `--tree DIR` runs
another checkout's engine (a git worktree) for before/after figures. Accept lengths are deterministic;
the tok/s it prints is for orientation only (one process, no warm-up).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--variant", action="append", required=True, metavar="NAME:JSON",
                    help="engine overrides of one variant (ServerArgs fields), e.g. 'b3:{\"speculative_algorithm\": "
                         "\"NGRAM\", \"speculative_ngram_max_bfs_breadth\": 3}'")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=7, help="the prompts' seed (edit_workload)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeat", type=int, default=1, help="ask each prompt this many times (one after another)")
    ap.add_argument("--tree", default=str(ROOT), help="the checkout whose engine runs (default: this one)")
    args = ap.parse_args()

    tree = Path(args.tree).resolve()
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "scripts"]
    sys.path.insert(0, str(tree / "tests" / "engine"))
    sys.path.insert(0, str(tree))
    from transformers import AutoTokenizer

    from baton.engine.bench.edit_workload import build_edit_prompts
    from scheduler_harness import SchedulerHarness

    model = os.path.abspath(args.model)
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [ids for _, ids in build_edit_prompts(tok, args.prompts, args.input_len, seed=args.seed)]
    prompts = [p for p in prompts for _ in range(args.repeat)]
    sampling = {} if args.temperature == 0 else {"temperature": args.temperature}
    first = None
    for spec in args.variant:
        name, _, overrides = spec.partition(":")
        engine = dict(dtype=args.dtype, max_total_tokens=8192, attention_backend="torch",
                      disable_overlap_schedule=True, speculative_disable_by_batch_size=64)
        h = SchedulerHarness(model, **{**engine, **json.loads(overrides)})  # a variant may turn the overlap loop on
        host = _time_scheduler_work(h.scheduler)
        start, outs = time.perf_counter(), []
        for i, p in enumerate(prompts):
            h.submit(str(i), p, max_new_tokens=args.tokens, ignore_eos=True, **sampling,
                     **({"seed": 100 + i // args.repeat} if sampling else {}))
            outs.append(h.run_until_idle()[str(i)].ids)
        took = time.perf_counter() - start
        info = h.scheduler.get_server_info()
        first = outs if first is None else first
        # one request at a time: every token but each request's first (its prefill's) came from a decode
        # step, plain (one token) or verify (accept length tokens)
        verify, accept = info.get("spec_verify_steps", 0), info.get("spec_accept_length", 0.0)
        steps = verify + len(prompts) * (args.tokens - 1) - round(verify * accept)
        print(f"{name}: decode steps {steps}, accept length {accept:.3f}, verify steps {verify} "
              f"({info.get('spec_lagged_verify_steps', 0)} lagged), "
              f"runs off the first chain {info.get('spec_tree_branch_accepts', 0)}, tokens equal to "
              f"{args.variant[0].partition(':')[0]}'s: {outs == first} ({len(prompts) * args.tokens / took:.1f} tok/s; "
              f"scheduler work per verify step: build {1e3 * host['build'] / max(verify, 1):.2f} ms, "
              f"process {1e3 * host['process'] / max(verify, 1):.2f} ms)", flush=True)


def _time_scheduler_work(scheduler) -> dict:
    """Seconds the scheduler's thread spends building decode steps (drafting's host side included) and
    processing verify results (after the wait for them): the host work a lagged verify step overlaps
    with the forward."""
    spent = {"build": 0.0, "process": 0.0}

    def timed(obj, name, key):
        fn = getattr(obj, name)

        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t

        setattr(obj, name, wrapper)

    timed(scheduler.decode, "prepare", "build")
    timed(scheduler.spec, "process_verify_result", "process")
    return spent


if __name__ == "__main__":
    main()
