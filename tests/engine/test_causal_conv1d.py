"""The decode-step causal conv1d in place on the state pool (triton_ops/causal_conv1d.py).

Criteria:
- CPU: the dispatcher takes the torch path, which equals layers/gated_delta_net.py's
  decode_causal_conv1d exactly (output and shifted state) and writes only the batch's slots.
- CPU, under TRITON_INTERPRET=1 (a subprocess): the kernel against the torch path, slots in random
  order, K = 4, 2 and 3, C within one block and over two (the second masked), x a strided view, states
  transposed in memory, and two rows sharing a padding slot (only the other slots and the real rows'
  outputs count). float32 outputs within 1e-6 (the exp differs by an ulp), bfloat16 within a rounding
  (the interpreter's casts truncate); states exactly.
- CPU: the kernel compiles for sm_90, without fused multiply-adds (the torch path rounds each product).
- GPU (`gpu` marker): bfloat16 on CUDA against the torch path within a rounding, states exactly, with
  no device-to-host sync, and replayed from a captured CUDA graph.
"""
from __future__ import annotations

import textwrap

import pytest
import torch

from baton.engine.layers.custom_op import triton_available
from baton.engine.layers.gated_delta_net import conv1d_decode, conv1d_decode_torch
from fresh_python import run_python


def test_cpu_dispatch_equals_the_layers_decode_conv():
    from baton.engine.layers.gated_delta_net import decode_causal_conv1d

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 20, generator=g), torch.randn(20, 4, generator=g)
    states = torch.randn(8, 20, 3, generator=g)
    slots = torch.tensor([6, 1, 3])
    before = states.clone()
    want, want_state = decode_causal_conv1d(x, w, before[slots])
    y = conv1d_decode(x, w, states, slots)
    assert torch.equal(y, want) and torch.equal(states[slots], want_state)
    others = torch.ones(8, dtype=torch.bool)
    others[slots] = False
    assert torch.equal(states[others], before[others])


INTERPRETED = textwrap.dedent(
    """
    import torch
    from baton.engine.layers.gated_delta_net import conv1d_decode_torch
    from baton.engine.triton_ops.causal_conv1d import conv1d_decode_triton

    g = torch.Generator().manual_seed(0)

    def check(dtype, k, c, slots, pad=None, transposed=False):
        bs, n = len(slots), 12
        slots = torch.tensor(slots)
        x = torch.randn(bs, c + 16, generator=g).to(dtype)[:, 8:8 + c]  # rows strided like a projection's slice
        w = torch.randn(c, 1, k, generator=g).to(dtype).view(c, k)  # conv.weight.view(C, K)
        if transposed:  # states laid out [S, K - 1, C] in memory
            states = torch.randn(n, k - 1, c, generator=g).to(dtype).transpose(1, 2)
        else:
            states = torch.randn(n, c, k - 1, generator=g).to(dtype)
        got_states, want_states = states.clone(), states.clone()
        got = conv1d_decode_triton(x, w, got_states, slots)
        want = conv1d_decode_torch(x, w, want_states, slots)
        real = slots != pad
        keep = torch.ones(n, dtype=torch.bool)
        if pad is not None:
            keep[pad] = False  # what the rows sharing it leave there is garbage
        what = (dtype, k, c, slots.tolist())
        assert got.dtype == dtype and got.shape == (bs, c), what
        assert torch.equal(got_states[keep], want_states[keep]), what
        got, want = got[real].float(), want[real].float()
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6, msg=str(what))
        else:
            err = (got - want).abs()
            assert bool((err <= 2 ** -6 * want.abs() + 1e-6).all()), (what, err.max().item())

    for dtype in (torch.float32, torch.bfloat16):
        check(dtype, 4, 300, [7, 2, 0, 5, 9])
        check(dtype, 2, 70, [3, 8, 1])
        check(dtype, 3, 1500, [10, 4, 6, 0], transposed=True)  # two blocks of 1024, the second masked
        check(dtype, 4, 200, [5, 11, 1, 11, 11], pad=11)  # padded rows of a graph batch share slot 11
    print("INTERPRETED OK")
    """
)


def test_kernel_matches_torch_under_the_interpreter():
    if not triton_available():
        pytest.skip("triton is not installed")
    assert "INTERPRETED OK" in run_python(INTERPRETED, interpret=True)


SM90_COMPILE = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from baton.engine.triton_ops import causal_conv1d

    kernel = causal_conv1d._conv1d_decode_kernel
    names = kernel.arg_names
    for dt, k in (("bf16", 4), ("fp32", 2)):
        sig = {a: "constexpr" if a in ("K", "BLOCK_C") else "*i64" if a == "slot_ptr"
               else f"*{dt}" if a.endswith("_ptr") else "i32" for a in names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(names)
                 if a.endswith("_ptr") or a in ("C", "x_stride", "s_stride", "y_stride")}
        src = ASTSource(fn=kernel, signature=sig, constexprs=dict(K=k, BLOCK_C=1024), attrs=attrs)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                             options=dict(num_warps=4, enable_fp_fusion=False)).asm["ptx"]
        assert "fma.rn.f32" not in ptx, "the taps must round each product as the torch ops do"
        assert "ld.global.v4" in ptx, "x's rows are read in 16-byte loads"
        print("compiled", dt, k)
    """
)


def test_kernel_compiles_for_sm90():
    if not triton_available():
        pytest.skip("triton is not installed")
    out = run_python(SM90_COMPILE)
    assert out.count("compiled") == 2, out


@pytest.mark.gpu
def test_kernel_on_cuda_matches_torch_without_a_sync_and_in_a_graph():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if not triton_available():
        pytest.skip("needs triton")
    g = torch.Generator(device="cuda").manual_seed(0)
    bf, c, k, n, pad = torch.bfloat16, 3000, 4, 40, 39

    def rand(*shape):
        return torch.randn(*shape, generator=g, device="cuda").to(bf)

    def close(got, want, what):  # a rounding apart: the kernel's exp is not torch's
        got, want = got.float(), want.float()
        assert bool(((got - want).abs() <= 2 ** -7 * want.abs() + 1e-6).all()), (what, (got - want).abs().max())

    w = rand(c, 1, k).view(c, k)
    slots = torch.cat([torch.randperm(pad, generator=g, device="cuda")[:13], torch.full((3,), pad, device="cuda")])
    real, keep = slots[:13], torch.arange(n, device="cuda") != pad
    xw, states = rand(16, c + 64), rand(n, c, k - 1)
    x = xw[:, 32:32 + c]
    ref = states.clone()
    want = conv1d_decode_torch(x, w, ref, slots)
    conv1d_decode(x, w, states.clone(), slots)  # compiles (the graph runner's warm-up does it before a capture)
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = conv1d_decode(x, w, states, slots)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    close(got[:13], want[:13], "eager")
    assert torch.equal(states[keep], ref[keep]) and torch.equal(states[real, :, -1], x[:13])

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = conv1d_decode(x, w, states, slots)
    for step in range(2):  # each replay continues from the states the last one left
        xw.copy_(rand(16, c + 64))
        want = conv1d_decode_torch(x, w, ref, slots)
        graph.replay()
        close(y[:13], want[:13], ("replay", step))
        assert torch.equal(states[keep], ref[keep]), ("replay", step)
