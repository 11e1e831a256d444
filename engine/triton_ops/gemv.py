"""y = x @ W.T for a few rows of x (a decode batch), one Triton kernel that reads each weight once.

    gemv(x, w, bias)          x [M, K], w [N, K] (nn.Linear's layout) -> [M, N] in x's dtype
    gemv_silu_mul(x, w)       w [2I, K] laid out [gate | up] -> silu(x @ gate.T) * (x @ up.T), [M, I]
    gemv_rmsnorm(x, residual, norm_w, eps, w, bias, silu_mul)
                              the pre-norm folded in: h = x + residual (or x), y = rmsnorm(h) @ w.T
                              (or its silu * up), returns (y, h); the norm costs no kernel of its own

A decode step at batch 1..16 is memory bound: its time is the weights' bytes over the HBM bandwidth.
Each program owns BLOCK_N rows of W and walks K in BLOCK_K chunks, multiplying each weight tile into
every row of x, so W is read exactly once whatever M is. One row (M = 1) takes fp32 multiply-adds
and a row sum; more rows are padded to a block of 16 and go through tl.dot (tensor cores). The grid
is cdiv(N, BLOCK_N), no split-K: no second kernel, no atomics, results the same run to run for a
given config.

Tile sizes are autotuned per (row block, N, K, dtype) on the first eager call of each shape (the CUDA
graph runner warms every batch size up eagerly before it captures, which also compiles the kernels).
A shape first seen during a capture takes a fixed config instead, since tuning times launches and
syncs. Under TRITON_INTERPRET=1 there is one config (tuning the interpreter would only be slow).

The pre-norm (gemv_rmsnorm, layers/norm_linear.py): RMSNorm's statistic is a sum over the row, and
every program walks the whole row of x anyway, so each program sums the squares of the x tiles it
loads, multiplies each tile by the norm's weight before the product, and scales its sums by
rsqrt(mean + eps) at the end: y = rstd * (x * w_norm) @ W.T. With a residual the tiles are x +
residual (rounded to x's dtype, as the unfused add), and program 0 writes that sum out as the next
residual (into a new tensor: the other programs still read the old one). This reorders the norm's
roundings: (x * w_norm) is rounded to x's dtype where the unfused path rounds x * rstd, then
w_norm times that; the results agree within the dtype's tolerance, not bit for bit.

Rounded as the unfused path: fp32 sums (plus the bias) rounded once to x's dtype; gemv_silu_mul
rounds gate and up to that dtype, then silu in fp32, rounded, times up, rounded, as
activation.py's silu_and_mul does with a [gate | up] product.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs may lack triton; layers/gemm.py keeps F.linear then
    triton = None

MAX_ROWS = 64  # past this a GEMM tile of many rows (cuBLAS) is the better shape
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_tuned: set[tuple] = set()  # shapes whose config the autotuner has picked (on an eager call)


def _check(x: torch.Tensor, weight: torch.Tensor, what: str) -> None:
    if x.dim() != 2 or x.stride(1) != 1 or weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"{what}: need x [M, K] and weight [N, K] with contiguous rows, got {tuple(x.shape)} "
                         f"{x.stride()} and {tuple(weight.shape)} {weight.stride()}")
    if weight.shape[1] != x.shape[1] or weight.dtype != x.dtype:
        raise ValueError(f"{what}: x {tuple(x.shape)} {x.dtype} does not match weight {tuple(weight.shape)} "
                         f"{weight.dtype}")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"{what}: {x.shape[0]} rows, more than the kernel takes ({MAX_ROWS})")


def _launch(kernel, name: str, x: torch.Tensor, n: int, k: int, *args, **meta) -> None:
    """kernel[grid](*args), its config autotuned on the first eager call of the shape. Interpreted,
    or for a shape first met inside a CUDA graph capture (tuning syncs), a fixed config instead."""
    m = x.shape[0]
    meta.update(ONE_ROW=m == 1, BLOCK_M=max(16, triton.next_power_of_2(m)))  # tl.dot takes 16 rows or more
    key = (name, meta["BLOCK_M"], m == 1, n, k, x.dtype, x.device)
    if not _INTERPRET and (key in _tuned or not (x.is_cuda and torch.cuda.is_current_stream_capturing())):
        kernel[lambda c: (triton.cdiv(n, c["BLOCK_N"]),)](*args, **meta)
        _tuned.add(key)
        return
    cfg = _fixed_config(m == 1).all_kwargs()
    kernel.fn[(triton.cdiv(n, cfg["BLOCK_N"]),)](*args, **meta, **cfg)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M <= 64, K]: [M, N] in x's dtype, fp32 accumulation."""
    return _multiply("gemv", x, weight, bias, silu_mul=False)


def gemv_silu_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) for weight [2I, K] = [gate | up] and x [M <= 64, K] -> [M, I]."""
    return _multiply("gemv_silu_mul", x, weight, None, silu_mul=True)


def gemv_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                 weight: torch.Tensor, bias: torch.Tensor | None = None,
                 silu_mul: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rmsnorm(h)), h) for h = x + residual (x without one): linear is gemv(., weight, bias),
    or with silu_mul gemv_silu_mul(., weight) (no bias). RMSNorm as layers/layernorm.py's: weight
    `norm_weight` [K] in x's dtype, statistics in fp32. h is a new tensor (x itself without a residual)."""
    what = "gemv_rmsnorm"
    if norm_weight.shape != (x.shape[-1],) or norm_weight.dtype != x.dtype or norm_weight.stride(0) != 1:
        raise ValueError(f"{what}: norm weight {tuple(norm_weight.shape)} {norm_weight.dtype} does not match x "
                         f"{tuple(x.shape)} {x.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1):
        raise ValueError(f"{what}: residual {tuple(residual.shape)} {residual.dtype} does not match x "
                         f"{tuple(x.shape)} {x.dtype}")
    h = x if residual is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    y = _multiply(what, x, weight, bias, silu_mul, residual, h, norm_weight, eps)
    if y.numel() == 0 and residual is not None and x.numel():  # no kernel ran: h is still the caller's
        torch.add(x, residual, out=h)
    return y, h


def _multiply(what: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool,
              residual: torch.Tensor | None = None, h: torch.Tensor | None = None,
              norm_weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """The GEMV (silu_mul: its silu * up over [gate | up]) of x; with norm_weight the pre-norm folded in
    (x + residual written to h by the kernel)."""
    _check(x, weight, what)
    if silu_mul and (bias is not None or weight.shape[0] % 2):
        raise ValueError(f"{what}: weight {tuple(weight.shape)} is not [gate | up] (odd row count), or a bias came")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype or bias.stride(0) != 1):
        raise ValueError(f"{what}: bias {tuple(bias.shape)} {bias.dtype} does not match {weight.shape[0]} outputs")
    (m, k), n = x.shape, weight.shape[0] // (2 if silu_mul else 1)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    norm = norm_weight is not None
    res = residual if residual is not None else x
    tail = (res, res.stride(0), h, h.stride(0), norm_weight, eps) if norm else (x, 0, x, 0, x, 0.0)
    flags = dict(NORM=norm, ADD_RESIDUAL=residual is not None)
    name = ("silu_mul" if silu_mul else "gemv") + ("+norm" if norm else "")
    if silu_mul:
        _launch(_gemv_silu_mul_kernel, name, x, n, k, x, weight, weight[n:], y, m, n, k, x.stride(0),
                weight.stride(0), y.stride(0), *tail, **flags)
    else:
        _launch(_gemv_kernel, name, x, n, k, x, weight, bias if bias is not None else weight, y, m, n, k,
                x.stride(0), weight.stride(0), y.stride(0), *tail, HAS_BIAS=bias is not None, **flags)
    return y


if triton is not None:

    def _configs(weight_tiles: int) -> list:
        """Three of each kind (every config is a compile, then a timing, per shape), each reading
        BLOCK_N rows of W by BLOCK_K columns per step:
        ROW_SUM (M = 1 only): the tile straight into registers, fp32 multiply-adds and a row sum. The
            pipeliner leaves these loads alone, so the tiles are large (32-64 KB in flight).
        tl.dot: rows of x padded to BLOCK_M, W staged through shared memory (cp.async), up to 4
            stages within 160 KB; also a candidate at M = 1.
        BLOCK_N = 16 keeps 256 programs at N = 4096 (132 SMs); wider ones suit the wide layers."""
        row = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "ROW_SUM": True}, num_warps=w, num_stages=1)
               for bn, bk, w in ((16, 1024, 4), (32, 512, 4), (64, 256, 8))]
        dot = []
        for bn, bk in ((16, 256), (32, 256), (64, 128)):
            stages = min(4, (160 << 10) // ((weight_tiles * bn + 16) * bk * 2))
            dot.append(triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "ROW_SUM": False}, num_warps=4, num_stages=stages))
        return row + dot

    def _fixed_config(one_row: bool):
        """Interpreted, or in a capture before tuning: one of the tuned configs of both kernels (so
        a warm-up of a like shape has compiled it)."""
        if one_row:
            return triton.Config({"BLOCK_N": 16, "BLOCK_K": 1024, "ROW_SUM": True}, num_warps=4, num_stages=1)
        return triton.Config({"BLOCK_N": 16, "BLOCK_K": 256, "ROW_SUM": False}, num_warps=4, num_stages=4)

    def _prune(configs, named_args, **kwargs):
        return [c for c in configs if kwargs["ONE_ROW"] or not c.kwargs["ROW_SUM"]]

    # The interpreter's tl.dot returns garbage for bfloat16 tiles (Triton 3.9): there they are
    # widened to fp32 first, which is exact, so the products and fp32 sums are the same.
    _INTERPRETED_BF16_DOT = tl.constexpr(_INTERPRET)

    @triton.jit
    def _x_tile(x_ptr, x_stride, rows_m, ks, M, K):
        return tl.load(x_ptr + rows_m[:, None] * x_stride + ks[None, :],
                       mask=(rows_m[:, None] < M) & (ks[None, :] < K), other=0.0)

    @triton.jit
    def _input_tile(x_ptr, x_stride, r_ptr, r_stride, h_ptr, h_stride, nw_ptr, rows_m, ks, M, K, sq,
                    NORM: tl.constexpr, ADD_RESIDUAL: tl.constexpr, ROW_SUM: tl.constexpr):
        """The x tile the weights multiply, and the running sum of squares of each row (NORM): x, or
        h = x + residual (program 0 stores it), times the norm's weight (kept in fp32 for the row-sum
        path's fp32 products; rounded to x's dtype for tl.dot's)."""
        x = _x_tile(x_ptr, x_stride, rows_m, ks, M, K)
        if ADD_RESIDUAL:
            x = (x.to(tl.float32) + _x_tile(r_ptr, r_stride, rows_m, ks, M, K).to(tl.float32)).to(x.dtype)
            stored_rows = tl.where(tl.program_id(0) == 0, M, 0)  # program 0 writes h out
            tl.store(h_ptr + rows_m[:, None] * h_stride + ks[None, :], x,
                     mask=(rows_m[:, None] < stored_rows) & (ks[None, :] < K))
        if NORM:
            xf = x.to(tl.float32)
            sq += tl.sum(xf * xf, axis=1)
            nw = tl.load(nw_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
            if ROW_SUM:
                x = xf * nw[None, :]
            else:
                x = (xf * nw[None, :]).to(x.dtype)
        return x, sq

    @triton.jit
    def _tile_product(w, x, acc, ROW_SUM: tl.constexpr):
        """acc [BLOCK_N, rows] += w [BLOCK_N, BLOCK_K] @ x [rows, BLOCK_K].T in fp32."""
        if ROW_SUM:
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)[:, None]
        elif _INTERPRETED_BF16_DOT and w.dtype == tl.bfloat16:
            acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
        elif w.dtype == tl.float32:
            acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")  # exact fp32 products, not tf32
        else:
            acc = tl.dot(w, tl.trans(x), acc)
        return acc

    @triton.autotune(configs=_configs(1), key=["ONE_ROW", "BLOCK_M", "N", "K", "NORM", "ADD_RESIDUAL"],
                     prune_configs_by={"early_config_prune": _prune})
    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, x_stride, w_stride, y_stride,
                     r_ptr, r_stride, h_ptr, h_stride, nw_ptr, eps, HAS_BIAS: tl.constexpr,
                     NORM: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
                     ONE_ROW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     ROW_SUM: tl.constexpr):
        ROWS: tl.constexpr = 1 if ROW_SUM else BLOCK_M
        rows_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows_m = tl.arange(0, ROWS)
        offs_k = tl.arange(0, BLOCK_K)
        w_rows = w_ptr + rows_n.to(tl.int64)[:, None] * w_stride
        acc = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
        sq = tl.zeros((ROWS,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + offs_k
            w = tl.load(w_rows + ks[None, :], mask=(rows_n[:, None] < N) & (ks[None, :] < K), other=0.0)
            x, sq = _input_tile(x_ptr, x_stride, r_ptr, r_stride, h_ptr, h_stride, nw_ptr, rows_m, ks, M, K, sq,
                                NORM, ADD_RESIDUAL, ROW_SUM)
            acc = _tile_product(w, x, acc, ROW_SUM)
        if NORM:
            acc = acc * tl.rsqrt(sq / K + eps)[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows_n, mask=rows_n < N, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptr + rows_m[None, :] * y_stride + rows_n[:, None], acc.to(y_ptr.dtype.element_ty),
                 mask=(rows_n[:, None] < N) & (rows_m[None, :] < M))

    @triton.autotune(configs=_configs(2), key=["ONE_ROW", "BLOCK_M", "N", "K", "NORM", "ADD_RESIDUAL"],
                     prune_configs_by={"early_config_prune": _prune})
    @triton.jit
    def _gemv_silu_mul_kernel(x_ptr, gate_ptr, up_ptr, y_ptr, M, N, K, x_stride, w_stride, y_stride,
                              r_ptr, r_stride, h_ptr, h_stride, nw_ptr, eps,
                              NORM: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
                              ONE_ROW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, ROW_SUM: tl.constexpr):
        # N is I: output column n is silu(x . gate row n) * (x . up row n)
        ROWS: tl.constexpr = 1 if ROW_SUM else BLOCK_M
        rows_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows_m = tl.arange(0, ROWS)
        offs_k = tl.arange(0, BLOCK_K)
        gate_rows = gate_ptr + rows_n.to(tl.int64)[:, None] * w_stride
        up_rows = up_ptr + rows_n.to(tl.int64)[:, None] * w_stride
        gate = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
        up = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
        sq = tl.zeros((ROWS,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + offs_k
            mask = (rows_n[:, None] < N) & (ks[None, :] < K)
            wg = tl.load(gate_rows + ks[None, :], mask=mask, other=0.0)
            wu = tl.load(up_rows + ks[None, :], mask=mask, other=0.0)
            x, sq = _input_tile(x_ptr, x_stride, r_ptr, r_stride, h_ptr, h_stride, nw_ptr, rows_m, ks, M, K, sq,
                                NORM, ADD_RESIDUAL, ROW_SUM)
            gate = _tile_product(wg, x, gate, ROW_SUM)
            up = _tile_product(wu, x, up, ROW_SUM)
        if NORM:
            rstd = tl.rsqrt(sq / K + eps)[None, :]
            gate = gate * rstd
            up = up * rstd
        dtype = y_ptr.dtype.element_ty
        g = gate.to(dtype).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dtype)
        y = act.to(tl.float32) * up.to(dtype).to(tl.float32)
        tl.store(y_ptr + rows_m[None, :] * y_stride + rows_n[:, None], y.to(dtype),
                 mask=(rows_n[:, None] < N) & (rows_m[None, :] < M))
