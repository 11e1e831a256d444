"""Layer ops that pick their implementation by device, once, at load time.

A model calls its ops (RMSNorm, the gated activation, the attention input's norm + RoPE + KV store)
as plain modules and never names a device kernel. Each op has

    forward_native   the torch reference: what CPU tests compare with HF `transformers`
    forward_cpu      the CPU path (the reference unless the op has a better one)
    forward_cuda     the CUDA path (Triton kernels of engine/triton_ops)

and `bind_layer_ops(model, device, fused, gemv)` points every op's forward at one of them after the
model is loaded (SGLang's CustomOp is the pattern), and gives the model's linear layers their GEMM
choice (layers/gemm.py): what a layer runs is decided there, once, and held by the layer, so two
models of one process may run different paths. `fused=False` keeps every op on its reference path
(`--disable-fused-ops`), the slow, obvious path the fast one is tested against. A path whose kernels
are missing here (an op's `path_available`) binds the reference instead. An op whose CUDA path cannot
take a given call (a shape or dtype it does not handle) falls back to the reference inside
forward_cuda, so binding never changes what a model can run.
"""
from __future__ import annotations

import importlib.util
import logging
from collections import Counter
from typing import Any, Callable

from torch import nn

from baton.engine.layers.gemm import GEMV_OFF, SmallBatchGemv, bind_gemv

logger = logging.getLogger(__name__)


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


class CustomOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self._forward: Callable[..., Any] = self.forward_native
        self.path = "native"  # which forward is bound: native, cpu or cuda

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(*args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def forward_cuda(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def path_available(self, path: str) -> bool:
        """Whether the `path` forward can run in this process (its kernels built or installed)."""
        return True

    def bind(self, device: str, fused: bool) -> str:
        """Point forward at the path for `device`; returns its name."""
        path = "native"
        if fused and device.startswith("cuda") and triton_available():
            path = "cuda"
        elif fused and device == "cpu":
            path = "cpu"
        if not self.path_available(path):
            path = "native"
        self.path, self._forward = path, getattr(self, f"forward_{path}")
        return self.path


def bind_layer_ops(model: nn.Module, device: str, fused: bool = True,
                   gemv: SmallBatchGemv = GEMV_OFF) -> dict[str, int]:
    """Bind every CustomOp of `model` for `device`, and give its linear layers `gemv` where it serves
    (CUDA, the fused ops), else GEMV_OFF; returns {"OpName/path": count} (also logged)."""
    counts: Counter[str] = Counter()
    for module in model.modules():
        if isinstance(module, CustomOp):
            counts[f"{type(module).__name__}/{module.bind(device, fused)}"] += 1
    gemv = gemv if fused and device.startswith("cuda") else GEMV_OFF
    layers = bind_gemv(model, gemv)
    if gemv.max_rows and layers:
        counts[f"SmallBatchGemv/1..{gemv.max_rows} rows"] = layers
    if counts:
        logger.info("layer ops on %s: %s", device, ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())))
    return dict(counts)
