"""Small device-side helpers: a Triton kernel for CUDA beside a plain torch path for CPU.

Each public function picks Triton when its tensors are on CUDA and Triton imports, torch otherwise.
The `*_triton` and `*_torch` variants are public so tests can compare them (on CPU the Triton one
runs under TRITON_INTERPRET=1, which must be set before triton is imported).
"""
from __future__ import annotations

from baton.engine.triton_ops.future_resolve import resolve_future_token_ids
from baton.engine.triton_ops.kv_store import store_kv

__all__ = ["resolve_future_token_ids", "store_kv"]
