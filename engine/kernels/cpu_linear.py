"""bfloat16 linear layers on CPU (`cpu_linear.c`), on AVX512_BF16 dot products over packed weights.

    packed = pack_weight(weight)                       # once, after the weights are loaded
    y = packed_linear(x, weight, packed, bias)         # every call

At decode a linear layer multiplies a few dozen rows, where oneDNN's per-call set-up costs more than
its arithmetic; the kernel runs the same product over a weight copy packed at load time: 1.2-2.3x
torch's GEMM at 1-32 rows on the bench model's shapes and a Llama-3-8B one, and still 1.0-1.1x at
prefill sizes (up to 4,096 rows, K up to 14,336; docs/benchmarks.md), so it serves every call, and the layer's
original weight is released once packed (`released_placeholder`: same shape, one element of
storage), so packing costs no memory. `--disable-packed-linear` keeps torch's GEMM instead.
Under torch.compile it is one opaque op (`baton::packed_linear`, see torch_ops.py). A gated MLP's
gate|up layer can instead give silu(gate) * up straight from its tiles (`packed_linear_silu_mul`):
the [rows, 2I] product is never written, and the compiled graph loses its SiLU kernel.
`BATON_DISABLE_CPU_KERNELS=1` turns it off with the attention kernels.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from baton.engine.kernels.build import DEFAULT_CFLAGS, build_library, load_failure
from baton.engine.kernels.cpu_attention import switched_off  # one switch for every CPU kernel
from baton.engine.kernels.torch_ops import define_op

SOURCE = Path(__file__).with_name("cpu_linear.c")


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build_library(SOURCE, DEFAULT_CFLAGS)))
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.packed_gemm_available.argtypes, lib.packed_gemm_available.restype = [], ctypes.c_int
    lib.pack_bf16_weight.argtypes, lib.pack_bf16_weight.restype = [ptr, i64, i64, ptr], None
    lib.packed_gemm_bf16.argtypes = [ptr, i64, i64, ptr, i64, ptr, ctypes.c_int]
    lib.packed_gemm_bf16.restype = ctypes.c_int
    lib.packed_gemm_silu_mul_bf16.argtypes = [ptr, i64, i64, ptr, i64, ptr, ctypes.c_int]
    lib.packed_gemm_silu_mul_bf16.restype = ctypes.c_int
    return lib


def unavailable_reason(device: str = "cpu") -> Optional[str]:
    """None when packed bfloat16 linears can run here; otherwise why not (for one log line)."""
    if (off := switched_off(device) or load_failure(_library)) is not None:
        return off
    return None if _library().packed_gemm_available() else "this CPU has no AVX512_BF16"


def packable(weight: torch.Tensor) -> bool:
    """A [N, K] bfloat16 CPU weight with N a multiple of 16 and K even."""
    return (weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 2 == 0 and weight.shape[1] > 0)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The kernel's copy of a [N, K] weight: [N / 16, K / 2, 16, 2], bfloat16."""
    if not packable(weight):
        raise ValueError(f"pack_weight: need a [N, K] bfloat16 CPU weight with N % 16 == 0 and even K, "
                         f"got {tuple(weight.shape)} {weight.dtype} on {weight.device}")
    n, k = weight.shape
    weight = weight.detach().contiguous()
    out = torch.empty((n // 16, k // 2, 16, 2), dtype=torch.bfloat16)
    _library().pack_bf16_weight(weight.data_ptr(), n, k, out.data_ptr())
    return out


def unpack_weight(packed: torch.Tensor) -> torch.Tensor:
    """The [N, K] weight pack_weight made `packed` from (a new tensor)."""
    nb, pairs, rows, two = packed.shape
    return packed.permute(0, 2, 1, 3).reshape(nb * rows, pairs * two).contiguous()


def released_placeholder(weight: torch.Tensor) -> torch.Tensor:
    """What stands in for a weight whose packed copy now serves it: its shape and dtype, no data."""
    return torch.zeros(1, dtype=weight.dtype).expand(weight.shape)


def is_released(weight: torch.Tensor) -> bool:
    return weight.numel() > 1 and all(stride == 0 for stride in weight.stride())


def packed_linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor,
                  bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, weight, bias), computed from the packed copy (bfloat16 CPU inputs; others take
    torch's GEMM on `weight`, unless it was released). Eager calls go straight to the library;
    under torch.compile it is one opaque op."""
    if torch.compiler.is_compiling():
        return torch.ops.baton.packed_linear(x, weight, packed, bias)
    return _packed_linear(x, weight, packed, bias)


def _packed_linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor,
                   bias: Optional[torch.Tensor]) -> torch.Tensor:
    n, k = weight.shape
    if x.dtype != torch.bfloat16 or not x.is_cpu or x.shape[-1] != k:
        if is_released(weight):
            raise TypeError(f"packed_linear: this layer computes bfloat16 CPU inputs of {k} features only "
                            f"(its weight lives in the packed copy), got {x.dtype} {tuple(x.shape)} on {x.device}")
        return F.linear(x, weight, bias)
    if packed.dtype != torch.bfloat16 or packed.shape != (n // 16, k // 2, 16, 2):
        raise ValueError(f"packed_linear: packed weight {tuple(packed.shape)} does not match weight {tuple(weight.shape)}")
    y = _run(_library().packed_gemm_bf16, "packed_linear", x, packed, n, n)
    if bias is not None:
        y += bias
    return y


def _run(kernel, name: str, x: torch.Tensor, packed: torch.Tensor, n: int, out_features: int) -> torch.Tensor:
    """`kernel` over x's rows as one [rows, k] matrix (a weight of n rows); [..., out_features]."""
    k = x.shape[-1]
    flat = x.dim() == 2  # a compiled graph's calls: [rows, k], contiguous
    x2 = x if flat and x.is_contiguous() else x.reshape(-1, k).contiguous()
    rows = x2.shape[0]
    y = torch.empty((rows, out_features), dtype=torch.bfloat16)
    if rows and kernel(x2.data_ptr(), rows, k, packed.data_ptr(), n, y.data_ptr(), torch.get_num_threads()):
        raise RuntimeError(f"{name}: the kernel refused the shape (or has no AVX512_BF16 here)")
    return y if flat else y.view(*x.shape[:-1], out_features)


define_op("packed_linear", "(Tensor x, Tensor weight, Tensor packed, Tensor? bias) -> Tensor", _packed_linear,
          lambda x, weight, packed, bias: x.new_empty((*x.shape[:-1], weight.shape[0])))


def silu_mul_fusable(weight: torch.Tensor, packed: Optional[torch.Tensor], bias: Optional[torch.Tensor]) -> bool:
    """A gate|up layer whose silu(gate) * up can come out of its packed GEMM (no bias; each half
    whole blocks of 16 outputs)."""
    return packed is not None and bias is None and weight.shape[0] % 32 == 0


def packed_linear_silu_mul(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of F.linear(x, weight) laid out [gate | up], in one pass over the packed
    weight: the [rows, 2I] product is never stored. Rounds as the unfused layer under
    torch.compile does (gate and up to bfloat16, then silu(gate) * up once)."""
    if torch.compiler.is_compiling():
        return torch.ops.baton.packed_linear_silu_mul(x, weight, packed)
    return _packed_linear_silu_mul(x, weight, packed)


def _packed_linear_silu_mul(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    n, k = weight.shape
    if x.dtype != torch.bfloat16 or not x.is_cpu or x.shape[-1] != k or n % 32:
        raise TypeError(f"packed_linear_silu_mul: bfloat16 CPU inputs of {k} features and a gate|up weight of "
                        f"whole 16-row blocks per half, got {x.dtype} {tuple(x.shape)} on {x.device}, weight {tuple(weight.shape)}")
    if packed.dtype != torch.bfloat16 or packed.shape != (n // 16, k // 2, 16, 2):
        raise ValueError(f"packed_linear_silu_mul: packed weight {tuple(packed.shape)} does not match weight "
                         f"{tuple(weight.shape)}")
    return _run(_library().packed_gemm_silu_mul_bf16, "packed_linear_silu_mul", x, packed, n, n // 2)


define_op("packed_linear_silu_mul", "(Tensor x, Tensor weight, Tensor packed) -> Tensor", _packed_linear_silu_mul,
          lambda x, weight, packed: x.new_empty((*x.shape[:-1], weight.shape[0] // 2)))
