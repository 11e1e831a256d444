"""Our torch ops (`torch.ops.baton.*`), registered through the low-level `torch.library.Library` API.

Under torch.compile each op is one opaque node that the compiled graph calls through the dispatcher.
`torch.library.custom_op` puts several Python layers around the function it registers (a dispatcher
Python kernel, `torch._disable_dynamo`, an eval-frame switch). On this project's 2-core CPU that
costs ~5 us per call over the bare Python function at a decode-size GEMM (28.3 against 23.3 us) and
~10 us at decode attention (132.6 against 122.8 us); a schema plus a kernel registered directly
costs about half of that (26.0 and 128.6 us; `scripts/op_overhead.py` measures all of them in one
run). A compiled decode step calls these ops ~20 times.

What the low-level API leaves to us: the ops are functional (their schemas mutate nothing) and have
no autograd formula (the engine runs under `torch.inference_mode`).
"""
from __future__ import annotations

from typing import Callable

import torch

_LIB = torch.library.Library("baton", "FRAGMENT")


def define_op(name: str, schema: str, impl: Callable, fake: Callable, dispatch_key: str = "CPU") -> None:
    """`torch.ops.baton.<name>`: `schema` is the argument list and result, e.g.
    "(Tensor x, float scale) -> Tensor"; `impl` serves tensors of `dispatch_key` ("CPU" for a CPU
    kernel, "CompositeExplicitAutograd" for one that handles every device itself); `fake` gives the
    result's shape and dtype for tracing."""
    _LIB.define(f"{name}{schema}")
    _LIB.impl(name, impl, dispatch_key)
    torch.library.register_fake(f"baton::{name}", fake, lib=_LIB)
