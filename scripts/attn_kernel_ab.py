"""The CPU decode attention kernel of a git revision against the working tree's, side by side.

    .venv/bin/python scripts/attn_kernel_ab.py [--base REV] [--cold] [--rounds 3]

Both sources are built with the engine's flags and called through ctypes on the same inputs
(batch 32, 128 prompt + 64 decoded keys per request) in alternation; each printed figure is the
best of `--rounds` medians. Slot layouts: `contig` (each request's keys adjacent), `interleaved`
(prompt adjacent, decoded tokens one slot per request per step, as a batch decodes) and `random`.
`--cold` evicts the caches before every call (a 64 MiB write), as the other layers' weights and
KV do between two calls of one layer in a real step. The outputs must agree bit for bit, or within
`--atol` when the change rounds differently on purpose.
"""
from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from baton.engine.kernels import cpu_attention as ca

ROOT = Path(__file__).resolve().parent.parent
ARGTYPES = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64,
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
            ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]


def load(source: str, headers: dict[str, str], workdir: Path, name: str) -> ctypes.CDLL:
    """Build one version: its source beside its own headers (`#include "vec_math.h"`)."""
    (workdir / name).mkdir()
    src, lib = workdir / name / "kernel.c", workdir / f"{name}.so"
    src.write_text(source)
    for header, text in headers.items():
        (workdir / name / header).write_text(text)
    subprocess.run(["cc", *ca.CFLAGS, str(src), "-o", str(lib), "-lm"], check=True)
    handle = ctypes.CDLL(str(lib))
    handle.paged_decode_attention.argtypes = ARGTYPES
    handle.paged_decode_attention.restype = ctypes.c_int
    return handle


def layout_rows(layout: str, bs: int, prompt: int, decoded: int, num_slots: int) -> torch.Tensor:
    length = prompt + decoded
    r2t = torch.zeros(bs, length, dtype=torch.int64)
    perm = torch.randperm(num_slots - 1) + 1
    for b in range(bs):
        if layout == "contig":
            r2t[b] = torch.arange(b * length, (b + 1) * length) + 1
        elif layout == "interleaved":
            r2t[b, :prompt] = torch.arange(b * prompt, (b + 1) * prompt) + 1
            r2t[b, prompt:] = bs * prompt + 1 + torch.arange(decoded) * bs + b
        else:
            r2t[b] = perm[b * length:(b + 1) * length]
    return r2t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD", help="git revision of the baseline kernel (default HEAD)")
    parser.add_argument("--cold", action="store_true", help="evict the caches before every call")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--atol", type=float, default=0.0, help="allowed difference (default 0: bit for bit)")
    args = parser.parse_args()
    old_src = None
    for name in ("paged_attention.c", "paged_decode_attention.c"):  # the source's name before and after 2026-11
        shown = subprocess.run(["git", "show", f"{args.base}:engine/kernels/{name}"], cwd=ROOT, capture_output=True,
                               text=True)
        if shown.returncode == 0:
            old_src = shown.stdout
            break
    if old_src is None:
        raise SystemExit(f"no attention kernel source at {args.base}")
    new_src = ca.SOURCE.read_text()
    new_headers = {h.name: h.read_text() for h in ca.SOURCE.parent.glob("*.h")}
    old_headers = {}
    for header in new_headers:  # the revision's own copies, where it has them
        shown = subprocess.run(["git", "show", f"{args.base}:engine/kernels/{header}"], cwd=ROOT, capture_output=True,
                               text=True)
        if shown.returncode == 0:
            old_headers[header] = shown.stdout
    flush = torch.zeros((64 << 20) // 4)
    calls = 40 if args.cold else 200

    def timed(fn) -> float:
        for _ in range(5):
            fn()
        times = []
        for _ in range(calls):
            if args.cold:
                flush.add_(1)
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2] * 1e6

    torch.manual_seed(0)
    bs, prompt, decoded, num_slots = 32, 128, 64, 1 << 18
    with tempfile.TemporaryDirectory() as tmp:
        libs = {args.base: load(old_src, old_headers, Path(tmp), "base"),
                "tree": load(new_src, new_headers, Path(tmp), "tree")}
        print(f"{'dtype':9s} {'kv x group x dim':17s} {'layout':12s} {args.base:>10s} {'tree':>10s}  tree/base")
        for dtype, kv_heads, group, head_dim in [(torch.bfloat16, 4, 2, 32), (torch.float32, 4, 2, 32),
                                                 (torch.bfloat16, 2, 4, 64), (torch.bfloat16, 8, 2, 128),
                                                 (torch.bfloat16, 8, 4, 128), (torch.bfloat16, 4, 7, 128),
                                                 (torch.bfloat16, 3, 3, 64), (torch.bfloat16, 2, 7, 64),
                                                 (torch.bfloat16, 8, 1, 64)]:
            k = torch.randn(num_slots, kv_heads, head_dim).to(dtype)
            v = torch.randn(num_slots, kv_heads, head_dim).to(dtype)
            q = torch.randn(bs, kv_heads, group, head_dim).to(dtype)
            lens, rows = torch.full((bs,), prompt + decoded), torch.arange(bs)
            for layout in ("contig", "interleaved", "random"):
                r2t = layout_rows(layout, bs, prompt, decoded, num_slots)
                outs = {name: torch.empty(bs, kv_heads, group, head_dim) for name in libs}
                best = {name: float("inf") for name in libs}
                for _ in range(args.rounds):
                    for name, lib in libs.items():
                        def call(lib=lib, out=outs[name]):
                            failed = lib.paged_decode_attention(
                                q.data_ptr(), ca._SUPPORTED[dtype], k.data_ptr(), v.data_ptr(),
                                ca._KV_SUPPORTED[dtype], num_slots, r2t.data_ptr(), bs, r2t.stride(0),
                                rows.data_ptr(), lens.data_ptr(), bs, kv_heads, group, head_dim, 0.17,
                                out.data_ptr(), torch.get_num_threads())
                            assert failed == 0
                        best[name] = min(best[name], timed(call))
                same = (torch.equal(outs[args.base], outs["tree"]) if args.atol == 0
                        else torch.allclose(outs[args.base], outs["tree"], atol=args.atol, rtol=0))
                if not same:
                    raise SystemExit(f"outputs differ: {dtype} {kv_heads}x{group}x{head_dim} {layout}")
                shape = f"{kv_heads} x {group} x {head_dim}"
                print(f"{str(dtype)[6:]:9s} {shape:17s} {layout:12s} {best[args.base]:8.0f}us {best['tree']:8.0f}us"
                      f"  {best['tree'] / best[args.base]:.2f}")


if __name__ == "__main__":
    main()
