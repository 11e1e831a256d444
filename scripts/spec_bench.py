#!/usr/bin/env python3
"""Speculative decoding (NGRAM by default, or --spec-args) vs none, side by side in one run, at several concurrencies.

    .venv/bin/python scripts/spec_bench.py --model-path /tmp/smol --concurrency 1,4,16 --rounds 2

Starts one engine per variant (`baton serve`, kept up for the whole run: idle engines use no CPU),
then for each round and each concurrency draws fresh code-edit prompts (engine/bench/edit_workload.py:
answers copy the prompt) and runs them on every variant back to back, so drift on a shared machine
hits both alike. Prints output tok/s per variant, the ratio to the first variant per round and its
median, and the speculating engine's accept length (tokens per request per verify step) and accept
rate over each cell, read from /get_server_info before and after it.
"""
from __future__ import annotations

import argparse
import contextlib
import shlex
import statistics
import sys
from typing import Optional

import httpx
from transformers import AutoTokenizer

from baton.engine.bench.client import resolve_model_name, run_serving_benchmark
from baton.engine.bench.launcher import EngineProcess, engine_command, free_port
from baton.engine.bench.workload import WorkloadConfig, build_workload


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True)
    p.add_argument("--concurrency", default="1,4,16", help="comma list")
    p.add_argument("--prompts-per-request-slot", type=int, default=2,
                   help="prompts per cell = this x concurrency (at least --min-prompts)")
    p.add_argument("--min-prompts", type=int, default=4)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--engine-args", default="", help="flags for every engine")
    p.add_argument("--spec-args", default="--speculative-algorithm NGRAM",
                   help="flags of the speculating engine (besides --engine-args)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    return p.parse_args(argv)


def server_info(base_url: str) -> dict:
    info = httpx.get(base_url + "/get_server_info", timeout=30).json()
    return info[0] if isinstance(info, list) else info


def spec_delta(before: dict, after: dict) -> dict:
    """Accept length and rate over what ran between two /get_server_info reads."""
    counts = [a - b for a, b in zip(after["spec_accept_length_counts"], before["spec_accept_length_counts"])]
    steps = sum(counts)
    drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    return {"accept_length": sum(n * c for n, c in enumerate(counts)) / steps if steps else 0.0,
            "accept_rate": accepted / drafted if drafted else 0.0, "request_steps": steps}


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    common = ["--dtype", args.dtype, *shlex.split(args.engine_args)]
    spec = shlex.split(args.spec_args)
    spec_name = spec[spec.index("--speculative-algorithm") + 1].lower() if "--speculative-algorithm" in spec else "spec"
    variants = {"off": common, spec_name: common + spec}
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    table: dict[int, list[dict]] = {c: [] for c in levels}
    with contextlib.ExitStack() as stack:
        engines = {}
        for name, flags in variants.items():
            port = free_port()
            command = engine_command(args.model_path, port, flags)
            print(f"[{name}] {shlex.join(command)}", flush=True)
            engine = stack.enter_context(EngineProcess(command, port))
            engine.wait_healthy(args.startup_timeout, desc=f"[{name}] starting")
            engines[name] = (engine.base_url, resolve_model_name(engine.base_url, None))
        for round_ in range(args.rounds):
            for c in levels:
                n = max(args.min_prompts, args.prompts_per_request_slot * c)
                config = WorkloadConfig(num_prompts=n, input_len=args.input_len, output_len=args.output_len,
                                        seed=1000 * round_ + c, dataset="code-edit")
                prompts = build_workload(tokenizer, config)
                cell = {}
                for name, (url, model) in engines.items():
                    before = server_info(url)
                    summary = run_serving_benchmark(url, model, prompts, c)
                    after = server_info(url)
                    cell[name] = {"tok_s": summary["output_throughput"], "errors": summary.get("failed", 0)}
                    if after.get("speculative_algorithm"):
                        cell[name].update(spec_delta(before, after))
                table[c].append(cell)
                print(f"round {round_ + 1} concurrency {c}: " + ", ".join(
                    f"{k} {v['tok_s']:.1f} tok/s" for k, v in cell.items())
                    + f", ratio {cell[spec_name]['tok_s'] / cell['off']['tok_s']:.2f}x, accept length "
                      f"{cell[spec_name]['accept_length']:.2f} over {cell[spec_name]['request_steps']} request-steps", flush=True)
    print(f"\n| concurrency | off tok/s | {spec_name} tok/s | {spec_name} / off [rounds] | accept length | accept rate |")
    print("|---|---|---|---|---|---|")
    for c, cells in table.items():
        ratios = [x[spec_name]["tok_s"] / x["off"]["tok_s"] for x in cells]
        print(f"| {c} | {statistics.median(x['off']['tok_s'] for x in cells):.1f} | "
              f"{statistics.median(x[spec_name]['tok_s'] for x in cells):.1f} | **{statistics.median(ratios):.2f}x** "
              f"[{' '.join(f'{r:.2f}' for r in ratios)}] | "
              f"{statistics.median(x[spec_name]['accept_length'] for x in cells):.2f} | "
              f"{statistics.median(x[spec_name]['accept_rate'] for x in cells):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
