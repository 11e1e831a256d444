"""The decode step of the gated delta rule in place on the state pool (triton_ops/gated_delta_decode.py).

Criteria:
- CPU: the dispatcher takes the torch path, which equals layers/gated_delta_net.py's
  recurrent_gated_delta_rule on the gathered rows exactly (output and state) and writes only the
  batch's slots.
- CPU, under TRITON_INTERPRET=1 (a subprocess): the kernel against the torch path, slots in random
  order, GVA (Hv = 2 Hk) and Hv = Hk, Dk and Dv not powers of two or over one block of V (masked), q,
  k, v strided views of one conv output (as the layer splits it), and two rows sharing a padding slot
  (only the other slots and the real rows' outputs count). float32 states within 1e-5 (sums in another
  order), bfloat16 states and outputs within a rounding (the interpreter's casts truncate).
- CPU: the kernel compiles for sm_90 at the real head sizes (Dk = Dv = 128), its state block read and
  written in 16-byte accesses, without fused multiply-adds and with nothing spilled to local memory.
- GPU (`gpu` marker): float32 and bfloat16 states on CUDA against the torch path, with no
  device-to-host sync, and replayed from a captured CUDA graph (each replay from the states the last
  one left).
"""
from __future__ import annotations

import textwrap

import pytest
import torch

from baton.engine.layers.custom_op import triton_available
from baton.engine.layers.gated_delta_net import delta_rule_decode, delta_rule_decode_torch
from fresh_python import run_python


def test_cpu_dispatch_equals_the_layers_recurrent_rule():
    from baton.engine.layers.gated_delta_net import recurrent_gated_delta_rule

    g = torch.Generator().manual_seed(0)
    bs, hk, hv, dk, dv, n = 3, 2, 4, 16, 12, 8
    q, k = torch.randn(bs, hk, dk, generator=g), torch.randn(bs, hk, dk, generator=g)
    v, beta = torch.randn(bs, hv, dv, generator=g), torch.rand(bs, hv, generator=g)
    gate = -torch.rand(bs, hv, generator=g)
    states = torch.randn(n, hv, dk, dv, generator=g) * 0.1
    slots = torch.tensor([6, 1, 3])
    before = states.clone()
    want, want_state = recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], gate[:, None], beta[:, None],
                                                  before[slots])
    out = delta_rule_decode(q, k, v, gate, beta, states, slots)
    assert torch.equal(out, want[:, 0]) and torch.equal(states[slots], want_state)
    others = torch.ones(n, dtype=torch.bool)
    others[slots] = False
    assert torch.equal(states[others], before[others])


INTERPRETED = textwrap.dedent(
    """
    import torch
    from baton.engine.layers.gated_delta_net import delta_rule_decode_torch
    from baton.engine.triton_ops.gated_delta_decode import delta_rule_decode_triton

    gen = torch.Generator().manual_seed(0)

    def check(dtype, state_dtype, hk, hv, dk, dv, slots, pad=None):
        bs, n = len(slots), 12
        slots = torch.tensor(slots)
        y = torch.randn(bs, 2 * hk * dk + hv * dv + 8, generator=gen).to(dtype)  # the conv's output, padded rows
        q, k, v = y[:, :-8].split([hk * dk, hk * dk, hv * dv], dim=-1)
        q, k, v = q.reshape(bs, hk, dk), k.reshape(bs, hk, dk), v.reshape(bs, hv, dv)
        g = -torch.rand(bs, hv, generator=gen) * 2
        beta = torch.rand(bs, hv, generator=gen).to(dtype)
        states = (torch.randn(n, hv, dk, dv, generator=gen) * 0.3).to(state_dtype)
        got_states, want_states = states.clone(), states.clone()
        got = delta_rule_decode_triton(q, k, v, g, beta, got_states, slots)
        want = delta_rule_decode_torch(q, k, v, g, beta, want_states, slots)
        real = slots != pad
        keep = torch.ones(n, dtype=torch.bool)
        if pad is not None:
            keep[pad] = False  # what the rows sharing it leave there is garbage
        what = (dtype, state_dtype, hk, hv, dk, dv, slots.tolist())
        assert got.dtype == dtype and got.shape == (bs, hv, dv), what
        for mine, theirs, dt in ((got[real], want[real], dtype), (got_states[keep], want_states[keep], state_dtype)):
            mine, theirs = mine.float(), theirs.float()
            if dt == torch.float32:
                torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5, msg=str(what))
            else:
                err = (mine - theirs).abs()
                assert bool((err <= 2 ** -6 * theirs.abs() + 1e-5).all()), (what, err.max().item())
        assert not torch.equal(got_states[slots[real]], states[slots[real]]), "the rows' states were written"

    check(torch.float32, torch.float32, 2, 4, 32, 48, [7, 2, 0, 5, 9])  # GVA; Dv over one block of 32, masked
    check(torch.float32, torch.float32, 3, 3, 24, 20, [3, 8, 1])  # Hv = Hk; Dk and Dv masked
    check(torch.bfloat16, torch.float32, 2, 4, 64, 48, [10, 4, 6, 0])
    check(torch.bfloat16, torch.bfloat16, 2, 4, 64, 48, [10, 4, 6, 0])
    check(torch.float32, torch.float32, 2, 4, 16, 48, [5, 11, 1, 11, 11], pad=11)  # a graph's padded rows
    check(torch.bfloat16, torch.bfloat16, 1, 2, 16, 40, [5, 11, 1, 11, 11], pad=11)
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
    from baton.engine.triton_ops import gated_delta_decode

    kernel = gated_delta_decode._delta_rule_decode_kernel
    names = kernel.arg_names
    for dt, state in (("bf16", "fp32"), ("bf16", "bf16")):
        sig = {a: "constexpr" if a in ("BLOCK_K", "BLOCK_V") else "*i64" if a == "slot_ptr"
               else f"*{state}" if a == "s_ptr" else "*fp32" if a == "g_ptr" else f"*{dt}" if a.endswith("_ptr")
               else "fp32" if a in ("scale", "eps") else "i32" for a in names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(names)
                 if a.endswith("_ptr") or a in ("DK", "DV") or "stride" in a and "beta" not in a and a[:2] != "g_"}
        src = ASTSource(fn=kernel, signature=sig, constexprs=dict(BLOCK_K=128, BLOCK_V=32), attrs=attrs)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                             options=dict(num_warps=4, enable_fp_fusion=False)).asm["ptx"]
        assert "ld.global.v4" in ptx and "st.global.v4" in ptx, "the state block moves in 16-byte loads and stores"
        assert "fma.rn.f32" not in ptx, "each product rounded, as the torch ops do"
        assert "st.local" not in ptx, "nothing spills to local memory"
        print("compiled", dt, state)
    """
)


def test_kernel_compiles_for_sm90():
    if not triton_available():
        pytest.skip("triton is not installed")
    out = run_python(SM90_COMPILE)
    assert out.count("compiled") == 2, out


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_kernel_on_cuda_matches_torch_without_a_sync_and_in_a_graph(state_dtype, monkeypatch):
    from baton.engine.layers import gated_delta_net

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if not triton_available():
        pytest.skip("needs triton")

    def no_fallback(*args):
        raise AssertionError("the dispatcher took the torch path on CUDA")

    monkeypatch.setattr(gated_delta_net, "delta_rule_decode_torch", no_fallback)  # this module keeps the oracle
    gen = torch.Generator(device="cuda").manual_seed(0)
    dtype = torch.float32 if state_dtype == torch.float32 else torch.bfloat16
    bs, real_bs, hk, hv, dk, dv, n, pad = 16, 13, 4, 8, 128, 128, 40, 39

    def close(got, want, what):
        fp32, got, want = got.dtype == torch.float32, got.float(), want.float()
        if fp32:  # sums in another order; the kernel's exp and rsqrt are not torch's
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, msg=str(what))
        else:  # a bfloat16 rounding apart
            err = (got - want).abs()
            assert bool((err <= 2 ** -7 * want.abs() + 1e-5).all()), (what, err.max())

    y = torch.empty(bs, 2 * hk * dk + hv * dv, device="cuda", dtype=dtype)  # static inputs of the graph
    g, beta = torch.empty(bs, hv, device="cuda"), torch.empty(bs, hv, device="cuda", dtype=dtype)
    q, k, v = y.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.view(bs, hk, dk), k.view(bs, hk, dk), v.view(bs, hv, dv)

    def new_inputs():
        y.copy_(torch.randn(y.shape, generator=gen, device="cuda"))
        g.copy_(-2 * torch.rand(g.shape, generator=gen, device="cuda"))
        beta.copy_(torch.rand(beta.shape, generator=gen, device="cuda"))

    slots = torch.cat([torch.randperm(pad, generator=gen, device="cuda")[:real_bs],
                       torch.full((bs - real_bs,), pad, device="cuda")])
    keep = torch.arange(n, device="cuda") != pad
    states = (0.3 * torch.randn(n, hv, dk, dv, generator=gen, device="cuda")).to(state_dtype)
    new_inputs()
    delta_rule_decode(q, k, v, g, beta, states.clone(), slots)  # compiles (as the graph runner's warm-up does)
    ref = states.clone()
    want = delta_rule_decode_torch(q, k, v, g, beta, ref, slots)
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = delta_rule_decode(q, k, v, g, beta, states, slots)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    close(got[:real_bs], want[:real_bs], "eager")
    close(states[keep], ref[keep], "eager states")
    states[keep] = ref[keep]  # both go on from the same states (no drift of roundings over the steps)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = delta_rule_decode(q, k, v, g, beta, states, slots)
    for step in range(2):  # each replay continues from the states the last one left
        new_inputs()
        want = delta_rule_decode_torch(q, k, v, g, beta, ref, slots)
        graph.replay()
        close(out[:real_bs], want[:real_bs], ("replay", step))
        close(states[keep], ref[keep], ("replay", step, "states"))
        states[keep] = ref[keep]
