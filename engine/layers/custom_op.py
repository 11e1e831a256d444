"""Layer ops that pick their implementation by device, once, at load time.

A model calls its ops (RMSNorm, the gated activation, the attention input's norm + RoPE + KV store)
as plain modules and never names a device kernel. Each op has

    forward_native   the torch reference: what CPU tests compare with HF `transformers`
    forward_cpu      the CPU path (the reference unless the op has a better one)
    forward_cuda     the CUDA path (Triton kernels of engine/triton_ops)

and `bind_layer_ops(model, device, fused)` points every op's forward at one of them after the model
is loaded (SGLang's CustomOp is the pattern). `fused=False` keeps every op on its reference path
(`--disable-fused-ops`), the slow, obvious path the fast one is tested against. An op whose CUDA
path cannot take a given call (a shape or dtype it does not handle) falls back to the reference
inside forward_cuda, so binding never changes what a model can run.
"""
from __future__ import annotations

import importlib.util
import logging
from collections import Counter
from typing import Any, Callable

from torch import nn

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

    def bind(self, device: str, fused: bool) -> str:
        """Point forward at the path for `device`; returns its name."""
        if not fused:
            self.path, self._forward = "native", self.forward_native
        elif device.startswith("cuda") and triton_available():
            self.path, self._forward = "cuda", self.forward_cuda
        elif device == "cpu":
            self.path, self._forward = "cpu", self.forward_cpu
        else:
            self.path, self._forward = "native", self.forward_native
        return self.path


def bind_layer_ops(model: nn.Module, device: str, fused: bool = True) -> dict[str, int]:
    """Bind every CustomOp of `model` for `device`; returns {"OpName/path": count} (also logged)."""
    counts: Counter[str] = Counter()
    for module in model.modules():
        if isinstance(module, CustomOp):
            counts[f"{type(module).__name__}/{module.bind(device, fused)}"] += 1
    if counts:
        logger.info("layer ops on %s: %s", device, ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())))
    return dict(counts)
