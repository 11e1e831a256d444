"""Old code against new, side by side in one run: the engine in-process (no HTTP), a git revision
against this checkout, on the same prompts, rounds alternating.

    .venv/bin/python scripts/engine_ab.py --old HEAD~1 --model /tmp/bench-llama --rounds 10

Each side is a long-lived worker process that imports `baton` from its own tree (the old revision
is checked out into a temporary git worktree, removed at the end) and drives a real Scheduler
through the test harness (`tests/engine/scheduler_harness.py` of that tree): every round submits
the same fresh random prompts to both sides, runs them to the end and reports the round's wall
time and each step's, split by forward mode. Rounds alternate A B B A ..., so drift on a shared
machine falls on both. Greedy tokens must come out identical on both sides, or the run fails;
`--allow-token-diff` (for a change of numerics, such as a different but equally exact kernel in
bfloat16) counts the requests that differ instead.
Prints medians and old / new ratios (above 1: the new code is faster).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARK = "ENGINE_AB "


def worker(tree: str, model: str, overrides: dict, num: int, input_len: int, output_len: int, vocab: int,
           threads: int, temperature: float, top_p: float, top_k: int) -> None:
    sys.path.insert(0, os.path.join(tree, "tests", "engine"))
    # only the tree under test is imported: the driver's scripts/ goes off the path
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "scripts"]
    import torch
    from scheduler_harness import SchedulerHarness

    import baton.engine
    print(f"{MARK}{json.dumps({'baton': baton.engine.__file__})}", flush=True)
    if threads:
        torch.set_num_threads(threads)
    h = SchedulerHarness(model, **overrides)
    overlap = h.scheduler.overlap
    if overlap is not None and hasattr(overlap, "hand_over_openmp"):
        overlap.hand_over_openmp()  # as a scheduler process does (event_loop.py)
    with torch.inference_mode():
        for line in sys.stdin:
            seed = int(line)
            rng = random.Random(seed)
            prompts = [[rng.randrange(10, vocab) for _ in range(input_len)] for _ in range(num)]
            h.results.clear()
            for i, p in enumerate(prompts):
                sampling = ({"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed * 1000 + i}
                            if temperature else {})
                h.submit(f"{seed}-{i}", p, max_new_tokens=output_len, ignore_eos=True, **sampling)
            steps = {"decode": [], "extend": []}
            start = time.perf_counter()
            while True:
                t = time.perf_counter()
                ran = h.step()
                if not ran and h.scheduler.is_idle():
                    break
                if ran:
                    mode = h.scheduler.last_batch.forward_mode
                    steps["decode" if mode.is_decode() else "extend"].append(time.perf_counter() - t)
            wall = time.perf_counter() - start
            tokens = [h.results[f"{seed}-{i}"].ids for i in range(num)]
            print(f"{MARK}{json.dumps({'round_s': wall, 'steps': steps, 'tokens': tokens})}", flush=True)


def start_worker(tree: Path, args: argparse.Namespace, overrides: dict) -> subprocess.Popen:
    # `import baton` finds the tree's baton/ before the editable install, and baton/__init__.py
    # puts the tree's root on the package's path (engine/, router/, operator/ are its subpackages)
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, __file__, "--worker", str(tree), "--model", args.model, "--overrides", json.dumps(overrides),
           "--num", str(args.num), "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--threads", str(args.threads), "--temperature", str(args.temperature), "--top-p", str(args.top_p),
           "--top-k", str(args.top_k)]
    return subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def read(proc: subprocess.Popen) -> dict:
    for line in proc.stdout:
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise SystemExit(f"a worker exited (code {proc.wait()})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", default="HEAD~1", help="git revision to compare against this checkout")
    ap.add_argument("--model", default="/tmp/bench-llama")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warmup-rounds", type=int, default=2)
    ap.add_argument("--num", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--overrides", default='{"dtype": "bfloat16", "enable_torch_compile": true}',
                    help="ServerArgs fields for both sides, as JSON")
    ap.add_argument("--new-overrides", default="{}",
                    help="ServerArgs fields for this checkout's side only, as JSON, over --overrides (a flag's "
                         "effect: --old HEAD --new-overrides '{\"enable_overlap_schedule\": true}')")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per side (default: torch's)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample at this temperature (a seed per request, so both sides draw alike); 0: greedy")
    ap.add_argument("--top-p", type=float, default=1.0, help="with --temperature")
    ap.add_argument("--top-k", type=int, default=-1, help="with --temperature")
    ap.add_argument("--allow-token-diff", action="store_true",
                    help="report requests whose tokens differ instead of failing")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    overrides = {"device": "cpu", **json.loads(args.overrides)}
    new_overrides = {**overrides, **json.loads(args.new_overrides)}
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    if args.worker:
        worker(args.worker, args.model, overrides, args.num, args.input_len, args.output_len, vocab, args.threads,
               args.temperature, args.top_p, args.top_k)
        return

    old_tree = Path(tempfile.mkdtemp(prefix="engine-ab-old-")) / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(old_tree), args.old], check=True)
    procs = {}
    try:
        procs = {"old": start_worker(old_tree, args, overrides), "new": start_worker(ROOT, args, new_overrides)}
        for name, proc in procs.items():
            print(f"{name}: {args.old if name == 'old' else 'this checkout'} -> {read(proc)['baton']}", flush=True)
        results = {"old": [], "new": []}
        diverged = 0
        for r in range(args.warmup_rounds + args.rounds):
            order = ("old", "new") if r % 2 == 0 else ("new", "old")
            got = {}
            for name in order:
                procs[name].stdin.write(f"{1000 + r}\n")
                procs[name].stdin.flush()
                got[name] = read(procs[name])
            differ = [i for i, (a, b) in enumerate(zip(got["old"]["tokens"], got["new"]["tokens"])) if a != b]
            if differ and not args.allow_token_diff:
                raise SystemExit(f"round {r}: tokens differ between the old and the new code "
                                 f"(requests {differ}; --allow-token-diff to count them instead)")
            diverged += len(differ)
            if r >= args.warmup_rounds:
                for name in got:
                    results[name].append(got[name])
                print(f"round {r - args.warmup_rounds}: old {got['old']['round_s'] * 1e3:.1f} ms, "
                      f"new {got['new']['round_s'] * 1e3:.1f} ms", flush=True)
    finally:
        for proc in procs.values():
            proc.stdin.close()
            proc.wait(timeout=60)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old_tree)], check=False)

    def med(name: str, key: str) -> float:
        if key == "round":
            return statistics.median(x["round_s"] for x in results[name]) * 1e3
        return statistics.median(s for x in results[name] for s in x["steps"][key]) * 1e3

    total = (args.warmup_rounds + args.rounds) * args.num
    same = "tokens identical in every round" if not diverged else \
        f"tokens differ in {diverged} of {total} requests"
    print(f"\n{args.rounds} rounds of {args.num} x {args.input_len} in / {args.output_len} out, {overrides}"
          f"{'' if new_overrides == overrides else f', new side {new_overrides}'}; {same}")
    print(f"{'median':16s} {'old ms':>9s} {'new ms':>9s} {'old/new':>8s}")
    for key, label in (("round", "round"), ("extend", "extend step"), ("decode", "decode step")):
        old, new = med("old", key), med("new", key)
        print(f"{label:16s} {old:9.2f} {new:9.2f} {old / new:7.2f}x")
    per_round = [o["round_s"] / n["round_s"] for o, n in zip(results["old"], results["new"])]
    print("per-round old/new: " + " ".join(f"{x:.2f}" for x in per_round))


if __name__ == "__main__":
    main()
