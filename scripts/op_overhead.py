"""What calling a CPU kernel through a torch op costs, per call, at decode sizes.

    .venv/bin/python scripts/op_overhead.py

One decode-size GEMM of the bench model (32 rows, qkv 256 -> 512, bfloat16) called four ways, in
one run: the C function through ctypes alone; the Python function around it; `torch.ops.baton.
packed_linear` as registered (torch_ops.define_op, the low-level torch.library API); and the same
Python function registered with `torch.library.custom_op`, as the ops were before. The same for
decode attention (32 requests x 192 keys, the bench model's heads). A compiled decode step calls
the op path, ~20 times. Each figure: the best of 5 medians of 2,000 calls.
"""
from __future__ import annotations

import statistics
import time

import torch

from baton.engine.kernels import cpu_attention as ca
from baton.engine.kernels import cpu_linear as cl


def per_call_us(fn, calls: int = 2000, repeats: int = 5) -> float:
    for _ in range(200):
        fn()
    best = float("inf")
    for _ in range(repeats):
        times = []
        for _ in range(calls // 100):
            t = time.perf_counter()
            for _ in range(100):
                fn()
            times.append((time.perf_counter() - t) / 100)
        best = min(best, statistics.median(times))
    return best * 1e6


def main() -> None:
    torch.manual_seed(0)
    if cl.unavailable_reason() is not None:
        raise SystemExit(f"packed linears unavailable here: {cl.unavailable_reason()}")
    w = torch.randn(512, 256, dtype=torch.bfloat16)
    packed = cl.pack_weight(w)
    x = torch.randn(32, 256, dtype=torch.bfloat16)
    y = torch.empty(32, 512, dtype=torch.bfloat16)
    lib, threads = cl._library(), torch.get_num_threads()
    xp, pp, yp = x.data_ptr(), packed.data_ptr(), y.data_ptr()
    old_linear = torch.library.custom_op("baton_old::packed_linear", cl._packed_linear, mutates_args=())

    slots, keys, kv_heads, group, head_dim = 8192, 192, 4, 2, 32
    k_buf = torch.randn(slots, kv_heads, head_dim, dtype=torch.bfloat16)
    v_buf = torch.randn_like(k_buf)
    q = torch.randn(32, kv_heads, group, head_dim, dtype=torch.bfloat16)
    req_to_token = torch.randperm(slots - 1)[:32 * keys].view(32, keys) + 1
    rows, lens = torch.arange(32), torch.full((32,), keys)
    args = (q, k_buf, v_buf, req_to_token, rows, lens, head_dim ** -0.5)
    old_attn = torch.library.custom_op("baton_old::paged_decode_attention", ca._paged_decode_attention,
                                       mutates_args=())

    cases = [
        ("packed_linear", "ctypes call alone", lambda: lib.packed_gemm_bf16(xp, 32, 256, pp, 512, yp, threads)),
        ("packed_linear", "Python function", lambda: cl._packed_linear(x, w, packed, None)),
        ("packed_linear", "torch op (define_op)", lambda: torch.ops.baton.packed_linear.default(x, w, packed, None)),
        ("packed_linear", "torch op (custom_op)", lambda: old_linear(x, w, packed, None)),
        ("decode attention", "Python function", lambda: ca._paged_decode_attention(*args)),
        ("decode attention", "torch op (define_op)", lambda: torch.ops.baton.paged_decode_attention.default(*args)),
        ("decode attention", "torch op (custom_op)", lambda: old_attn(*args)),
    ]
    with torch.inference_mode():
        same = {"rtol": 0, "atol": 0}
        torch.testing.assert_close(torch.ops.baton.packed_linear.default(x, w, packed, None),
                                   old_linear(x, w, packed, None), **same)
        torch.testing.assert_close(torch.ops.baton.paged_decode_attention.default(*args), old_attn(*args), **same)
        print(f"{'kernel':18s} {'path':24s} {'us/call':>8s}")
        for kernel, path, fn in cases:
            print(f"{kernel:18s} {path:24s} {per_call_us(fn):8.1f}", flush=True)


if __name__ == "__main__":
    main()
