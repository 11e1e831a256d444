"""The packed bfloat16 linear kernel (engine/kernels/cpu_linear.py) against torch's GEMM (F.linear),
side by side in one run: per shape, the median of 300 eager calls of each after 20 warm-ups (10
after 3 past a GFLOP per call), in inference mode, with torch's thread count. Shapes: the bench model's four projections and a
Llama-3-8B-sized one, at decode batch sizes and (with `1024` or `4096` in ROWS) prefill sizes.

    .venv/bin/python scripts/cpu_linear_bench.py [ROWS,...]
"""
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from baton.engine.kernels import cpu_linear

SHAPES = [(256, 512, "qkv"), (256, 256, "o"), (256, 1536, "gate_up"), (768, 256, "down"), (4096, 4096, "8B o")]


def median_us(fn, calls: int = 300, warm_ups: int = 20) -> float:
    for _ in range(warm_ups):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    reason = cpu_linear.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"the kernel cannot run here: {reason}")
    rows_list = [int(r) for r in (sys.argv[1] if len(sys.argv) > 1 else "1,8,32,64").split(",")]
    torch.manual_seed(0)
    print(f"threads {torch.get_num_threads()}")
    print(f"{'rows':>4} {'K x N':>11} {'':8} {'torch':>9} {'kernel':>9} {'torch / kernel':>15} {'kernel GFLOP/s':>15}")
    with torch.inference_mode():
        for rows in rows_list:
            for k, n, name in SHAPES:
                x, w = torch.randn(rows, k).bfloat16(), torch.randn(n, k).bfloat16()
                packed = cpu_linear.pack_weight(w)
                calls, warm_ups = (10, 3) if 2 * rows * k * n > 1e9 else (300, 20)
                ours = median_us(lambda: cpu_linear.packed_linear(x, w, packed), calls, warm_ups)
                theirs = median_us(lambda: F.linear(x, w), calls, warm_ups)
                print(f"{rows:>4} {f'{k}x{n}':>11} {name:8} {theirs:7.1f}us {ours:7.1f}us {theirs / ours:14.2f}x "
                      f"{2 * rows * k * n / ours / 1e3:15.0f}")


if __name__ == "__main__":
    main()
