"""Attention backend registry. Implementations are imported lazily: FlashInfer must not be imported on CPU."""
from __future__ import annotations

import importlib

from baton.engine.core.forward_batch import AttentionBackend

# name -> (module under baton.engine.layers.attention, class name)
_BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("torch_backend", "TorchAttnBackend"),
    "flashinfer": ("flashinfer_backend", "FlashInferAttnBackend"),
}


def use_tensor_core_decode(setting: str, group_size: int) -> bool:
    """FlashInfer decode on tensor cores? --flashinfer-decode-tensor-cores auto|on|off for a GQA group
    of `group_size` query heads per KV head (auto: 4 or more, SGLang's rule)."""
    return setting == "on" or (setting == "auto" and group_size >= 4)


def create_attention_backend(name: str, **kwargs) -> AttentionBackend:
    """Build the backend `name` (see server_args.ATTENTION_BACKENDS); kwargs go to its constructor."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(_BACKENDS)}")
    module_name, class_name = _BACKENDS[name]
    try:
        module = importlib.import_module(f"{__name__}.{module_name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{module_name}":
            raise  # the backend exists but one of its dependencies is missing: show that error
        raise NotImplementedError(f"attention backend {name!r} is not implemented yet "
                                  f"({__name__}.{module_name} does not exist); use 'torch'") from e
    return getattr(module, class_name)(**kwargs)


__all__ = ["AttentionBackend", "create_attention_backend", "use_tensor_core_decode"]
