"""One all-reduce and one step broadcast of a CPU TP group, gloo against the shared memory segment,
side by side in one run (docs/benchmarks.md, 2026-11-24).

    .venv/bin/python scripts/allreduce_bench.py [--size 2] [--calls 200]

Each rank is a process with one torch thread, as a TP rank of `baton serve` on CPU. Prints the
median per-call time of each over `--calls` calls after 20 warm-up calls, and gloo / shm.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

ELEMENTS = (256, 8192, 1 << 16, 1 << 20)  # floats: tiny, a decode step's hidden state (bs 32 x 256), 256 KiB, 4 MiB


def _time(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _rank(rank: int, size: int, addr: str, calls: int, queue) -> None:
    torch.set_num_threads(1)
    from baton.engine.distributed.parallel_state import init_tp_group, resolve_group
    import torch.distributed as dist

    tp = init_tp_group(rank, size, addr, "cpu", "shm")
    from baton.engine.distributed.parallel_state import shm_group_of

    shm, group = shm_group_of(tp.device_group), resolve_group(tp.device_group)
    rows = []
    for n in ELEMENTS:
        x = torch.randn(n)
        gloo = _time(lambda: dist.all_reduce(x.clone(), group=group), calls)
        fast = _time(lambda: shm.all_reduce(x), calls)
        rows.append(("all_reduce", n, gloo, fast))
    for n in (8, 2000):  # int64s: a step header, a decode step's payload at batch 32
        t = torch.zeros(n, dtype=torch.int64)
        gloo = _time(lambda: dist.broadcast(t, src=0, group=group), calls)
        fast = _time(lambda: shm.broadcast(t), calls)
        rows.append(("broadcast", n, gloo, fast))
    if rank == 0:
        queue.put(rows)
    dist.barrier(group=group)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=2)
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args()
    from baton.engine.utils.process import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    addr = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank, args=(r, args.size, addr, args.calls, queue)) for r in range(args.size)]
    for proc in procs:
        proc.start()
    rows = queue.get(timeout=600)
    for proc in procs:
        proc.join(60)
    print(f"{args.size} ranks, median of {args.calls} calls, one torch thread per rank")
    print(f"{'op':<11}{'elements':>10}{'gloo us':>11}{'shm us':>10}{'gloo/shm':>10}")
    for op, n, gloo, fast in rows:
        print(f"{op:<11}{n:>10}{gloo * 1e6:>11.1f}{fast * 1e6:>10.1f}{gloo / fast:>9.1f}x")


if __name__ == "__main__":
    main()
