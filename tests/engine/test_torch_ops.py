"""The engine's torch ops (kernels/torch_ops.py): registered with their schemas, traced through their
fake kernels, and kept as one opaque call by torch.compile."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import baton.engine.distributed.parallel_state  # noqa: F401  (registers tp_all_reduce / tp_all_gather)
import baton.engine.kernels.cpu_linear  # noqa: F401  (registers packed_linear)
import baton.engine.layers.attention.torch_backend  # noqa: F401  (registers extend_attention)
from baton.engine.kernels.torch_ops import define_op

_calls: list[tuple[int, ...]] = []


def _scale_rows(x: torch.Tensor, factor: float) -> torch.Tensor:
    _calls.append(tuple(x.shape))
    return x * factor


define_op("test_scale_rows", "(Tensor x, float factor) -> Tensor", _scale_rows, lambda x, factor: torch.empty_like(x))


@pytest.mark.parametrize("name, args", [
    ("packed_linear", "Tensor x, Tensor weight, Tensor packed, Tensor? bias"),
    ("paged_decode_attention", "Tensor q, Tensor k_buf, Tensor v_buf, Tensor req_to_token, "
                               "Tensor req_pool_indices, Tensor seq_lens, float scale"),
    ("extend_attention", "Tensor q3, Tensor k3, Tensor v3, Tensor k_buf, Tensor v_buf, Tensor req_to_token, "
                         "Tensor req_pool_indices, Tensor prefix_lens, Tensor extend_lens, float scale, bool native"),
    ("tp_all_reduce", "Tensor x, str group_name"),
    ("tp_all_gather", "Tensor x, str group_name, int size"),
])
def test_engine_ops_are_registered_with_their_schemas(name, args):
    schema = str(getattr(torch.ops.baton, name).default._schema)
    assert schema == f"baton::{name}({args}) -> Tensor"


def test_define_op_runs_eager_traces_fake_and_stays_opaque_under_compile():
    x = torch.arange(12, dtype=torch.float32).view(3, 4)
    _calls.clear()
    torch.testing.assert_close(torch.ops.baton.test_scale_rows(x, 2.0), x * 2, rtol=0, atol=0)
    assert _calls == [(3, 4)]

    with FakeTensorMode() as mode:  # tracing runs the fake kernel, never the real one
        fake = torch.ops.baton.test_scale_rows(mode.from_tensor(x), 2.0)
    assert fake.shape == (3, 4) and fake.dtype == torch.float32
    assert _calls == [(3, 4)]

    torch._dynamo.reset()
    compiled = torch.compile(lambda t: torch.ops.baton.test_scale_rows(t + 1, 3.0) - 1, fullgraph=True, dynamic=True)
    for rows in (3, 5):
        y = torch.ones(rows, 4)
        _calls.clear()
        torch.testing.assert_close(compiled(y), (y + 1) * 3 - 1, rtol=0, atol=0)
        assert _calls == [(rows, 4)], "the compiled graph should call the op's kernel exactly once"


def test_meta_tensors_get_the_fake_kernel():
    """Meta tensors (shape inference without data, as when a model is built on the meta device)
    get the fake kernel's answer; the real kernel never sees them."""
    _calls.clear()
    out = torch.ops.baton.test_scale_rows(torch.empty(2, 5, device="meta"), 1.0)
    assert out.device.type == "meta" and out.shape == (2, 5)
    assert _calls == []
