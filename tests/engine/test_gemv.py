"""The small-batch Triton GEMV (triton_ops/gemv.py) and the layers' load-time choice of it (layers/gemm.py).

Criteria:
- CPU, under TRITON_INTERPRET=1 (a subprocess): gemv against F.linear and gemv_silu_mul against the
  unfused rounding (gate|up to the dtype, silu in fp32, rounded, times up, rounded), for M = 1 (the
  row-sum path) and M = 3, 16, 40 (tl.dot), N and K not multiples of the tiles, with and without a
  bias. float32 within 1e-5; float16 within two roundings of the result, bfloat16 within four
  (the interpreter's bfloat16 casts truncate where a GPU rounds to nearest).
- CPU: both kernels compile for sm_90, the row-sum path with 16-byte loads, the dot path with MMAs.
- CPU: a layer's choice is off until bound; bind_layer_ops gives it to a model bound for CUDA with the
  fused ops only (a model bound for CPU keeps F.linear), and two models bound differently in one
  process keep their own; with a layer's choice set directly (on CPU, a stand-in kernel),
  linear_forward, MergedColumnLinear.gated and the LM head take the GEMV exactly for 1..max_rows rows
  of a 2-D contiguous bf16/fp16 x matching the weight, and gated fuses silu * up only for SiLU
  without a bias.
- GPU (`gpu` marker): bf16 on CUDA against the fp32 product within a rounding or two, without a
  device-to-host sync once tuned, and replayed from a captured CUDA graph, including a shape first
  met inside the capture (the fixed config, no tuning).
"""
from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F

from baton.engine.layers import gemm
from baton.engine.layers.custom_op import triton_available
from baton.engine.layers.gemm import GEMV_OFF, SmallBatchGemv
from fresh_python import run_python

INTERPRETED = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from baton.engine.triton_ops.gemv import gemv, gemv_rmsnorm, gemv_silu_mul

    g = torch.Generator().manual_seed(0)

    def close(got, want, dtype, what, roundings=(2, 4)):
        assert got.dtype == dtype and got.shape == want.shape, (what, got.dtype, got.shape)
        got, want = got.float(), want.float()
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=str(what))
        else:
            rel = roundings[0] * 2 ** -10 if dtype == torch.float16 else roundings[1] * 2 ** -7
            err = (got - want).abs()
            assert bool((err <= rel * want.abs().clamp_min(1.0)).all()), (what, err.max().item())

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for m, n, k in ((1, 70, 300), (3, 100, 257), (16, 33, 130), (40, 20, 64)):
            x = torch.randn(m, k, generator=g).to(dtype)
            w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
            b = torch.randn(n, generator=g).to(dtype)
            exact = F.linear(x.float(), w.float())
            close(gemv(x, w), exact.to(dtype), dtype, ("gemv", dtype, m, n, k))
            close(gemv(x, w, b), (exact + b.float()).to(dtype), dtype, ("gemv bias", dtype, m, n, k))
            w2 = (torch.randn(2 * n, k, generator=g) / k ** 0.5).to(dtype)
            gu = F.linear(x.float(), w2.float()).to(dtype).float()
            want = (F.silu(gu[:, :n]).to(dtype).float() * gu[:, n:]).to(dtype)
            close(gemv_silu_mul(x, w2), want, dtype, ("gemv_silu_mul", dtype, m, n, k))
        wide = torch.randn(2, 96, generator=g).to(dtype)  # rows strided like a slice of a wider tensor
        w = torch.randn(24, 64, generator=g).to(dtype)
        close(gemv(wide[:, 16:80], w), F.linear(wide[:, 16:80].float(), w.float()).to(dtype), dtype, "strided x")
        assert gemv(torch.zeros(0, 64, dtype=dtype), w).shape == (0, 24)

    # the pre-norm folded in: against the fp32 norm and product (the result rounded to the dtype),
    # one rounding more than the plain kernels (x * norm weight, rounded for tl.dot), silu * up two
    # more (the rstd-scaled gate and up); h = x + residual equal to torch's add (bfloat16: within one
    # truncation, the interpreter's casts)
    eps = 1e-6
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for m, n, k in ((1, 70, 300), (3, 100, 257), (16, 33, 130)):
            for with_residual in (False, True):
                x = torch.randn(m, k, generator=g).to(dtype)
                r = torch.randn(m, k, generator=g).to(dtype) if with_residual else None
                nw = (1 + 0.2 * torch.randn(k, generator=g)).to(dtype)
                w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
                w2 = (torch.randn(2 * n, k, generator=g) / k ** 0.5).to(dtype)
                b = torch.randn(n, generator=g).to(dtype)
                h_want = x if r is None else x + r
                hf = h_want.float()
                normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * nw.float()
                what = ("gemv_rmsnorm", dtype, m, n, k, with_residual)
                y, h = gemv_rmsnorm(x, r, nw, eps, w, b)
                close(y, F.linear(normed, w.float(), b.float()).to(dtype), dtype, what, (3, 5))
                if r is None:
                    assert h is x, what
                elif dtype == torch.bfloat16:
                    assert bool(((h.float() - hf).abs() <= 2 ** -7 * hf.abs()).all()), what
                else:
                    assert torch.equal(h, h_want), what
                assert torch.equal(r if r is not None else x, h_want if r is None else r), "inputs kept"
                y2, _ = gemv_rmsnorm(x, r, nw, eps, w2, silu_mul=True)
                gu = F.linear(normed, w2.float()).to(dtype).float()
                close(y2, (F.silu(gu[:, :n]).to(dtype).float() * gu[:, n:]).to(dtype), dtype, what + ("silu",), (4, 6))
        y, h = gemv_rmsnorm(torch.zeros(0, 64, dtype=dtype), torch.zeros(0, 64, dtype=dtype),
                            torch.ones(64, dtype=dtype), eps, torch.ones(8, 64, dtype=dtype))
        assert y.shape == (0, 8) and h.shape == (0, 64)
    try:
        gemv_rmsnorm(x, r, nw[:-1], eps, w)
        raise AssertionError("a norm weight of the wrong width was taken")
    except ValueError as e:
        assert "norm weight" in str(e)
    print("INTERPRETED OK")
    """
)


def test_gemv_matches_torch_under_the_interpreter():
    if not triton_available():
        pytest.skip("triton is not installed")
    assert "INTERPRETED OK" in run_python(INTERPRETED, interpret=True)


SM90_COMPILE = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from baton.engine.triton_ops import gemv

    CONSTEXPRS = ("HAS_BIAS", "NORM", "ADD_RESIDUAL", "ONE_ROW", "BLOCK_M", "BLOCK_N", "BLOCK_K", "ROW_SUM")
    PLAIN = dict(NORM=False, ADD_RESIDUAL=False)

    def type_of(a, dt):
        return "constexpr" if a in CONSTEXPRS else "fp32" if a == "eps" else f"*{dt}" if a.endswith("_ptr") else "i32"

    def compile_(kernel, dt, consts, num_warps, num_stages):
        names = kernel.fn.arg_names
        sig = {a: type_of(a, dt) for a in names}
        # what the launcher sees at run time: 16-byte aligned pointers, sizes and strides divisible by 16
        attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(names)
                 if sig[a] not in ("constexpr", "fp32") and a != "M"}
        src = ASTSource(fn=kernel.fn, signature=sig, constexprs=consts, attrs=attrs)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                             options=dict(num_warps=num_warps, num_stages=num_stages)).asm["ptx"]
        print("compiled", kernel.fn.__name__, dt, consts)
        return ptx

    row = dict(PLAIN, ONE_ROW=True, BLOCK_M=16, BLOCK_N=16, BLOCK_K=1024, ROW_SUM=True)
    dot = dict(PLAIN, ONE_ROW=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, ROW_SUM=False)
    normed = dict(NORM=True, ADD_RESIDUAL=True)  # the pre-norm folded in keeps the loads wide and the MMAs
    assert "ld.global.v4" in compile_(gemv._gemv_kernel, "bf16", dict(row, HAS_BIAS=True), 4, 1)
    assert "mma" in compile_(gemv._gemv_kernel, "bf16", dict(dot, HAS_BIAS=False), 4, 4)
    compile_(gemv._gemv_kernel, "fp32", dict(dot, BLOCK_N=16, HAS_BIAS=True), 4, 3)  # exact fp32: FMAs, no MMA
    assert "ld.global.v4" in compile_(gemv._gemv_silu_mul_kernel, "fp16", row, 8, 1)
    assert "mma" in compile_(gemv._gemv_silu_mul_kernel, "bf16", dict(dot, BLOCK_N=32), 4, 4)
    assert "ld.global.v4" in compile_(gemv._gemv_kernel, "bf16", dict(row, **normed, HAS_BIAS=False), 4, 1)
    assert "mma" in compile_(gemv._gemv_kernel, "bf16", dict(dot, **normed, HAS_BIAS=True), 4, 4)
    assert "ld.global.v4" in compile_(gemv._gemv_silu_mul_kernel, "bf16", dict(row, NORM=True), 8, 1)
    assert "mma" in compile_(gemv._gemv_silu_mul_kernel, "bf16", dict(dot, **normed, BLOCK_N=32), 4, 4)
    """
)


def test_gemv_kernels_compile_for_sm90():
    """Triton's compiler is stricter than its interpreter; this also checks the loads are vectorized
    (scalar 2-byte loads would waste the bandwidth the kernel exists for) and the dot path uses MMAs."""
    if not triton_available():
        pytest.skip("triton is not installed")
    out = run_python(SM90_COMPILE)
    assert out.count("compiled") == 9, out


# ---------------------------------------------------------------- the choice, made at load

def _tiny_model() -> torch.nn.Module:
    """A gate|up, a down projection and an LM head: the three kinds of layer that hold a GEMV choice."""
    from baton.engine.distributed.parallel_state import TpGroup
    from baton.engine.layers.linear import MergedColumnLinear, RowParallelLinear, even_parts
    from baton.engine.layers.vocab_parallel import VocabParallelEmbedding

    model = torch.nn.ModuleDict({"gate_up": MergedColumnLinear(64, even_parts([24, 24], TpGroup()), bias=False),
                                 "down": RowParallelLinear(24, 64, bias=False, tp=TpGroup()),
                                 "head": VocabParallelEmbedding(100, 64)}).to(torch.bfloat16)
    for p in model.parameters():
        torch.nn.init.normal_(p)  # made with torch.empty
    return model


def test_each_model_keeps_the_gemv_choice_it_was_bound_with(monkeypatch):
    """No process-wide switch: a layer is off until bound; a model bound for CUDA with the fused ops
    holds the choice, one bound for CPU (or with the reference ops) is off, whatever was asked, and
    binding one model leaves the other's alone. The CPU-bound model's calls keep F.linear."""
    if not triton_available():
        pytest.skip("triton is not installed")
    from baton.engine.layers.custom_op import bind_layer_ops
    from baton.engine.triton_ops import gemv as gemv_mod

    on_cuda, on_cpu, reference = _tiny_model(), _tiny_model(), _tiny_model()
    assert all(m.gemv is GEMV_OFF for m in on_cuda.values())
    counts = bind_layer_ops(on_cuda, "cuda", gemv=SmallBatchGemv(16, fuse_norms=False))
    assert counts == {"SmallBatchGemv/1..16 rows": 3}
    assert bind_layer_ops(on_cpu, "cpu", gemv=SmallBatchGemv(16)) == {}
    bind_layer_ops(reference, "cuda", fused=False, gemv=SmallBatchGemv(16))
    assert all(m.gemv == SmallBatchGemv(16, fuse_norms=False) for m in on_cuda.values())
    assert all(m.gemv is GEMV_OFF for model in (on_cpu, reference) for m in model.values())

    def refuse(*args, **kwargs):
        raise AssertionError("the GEMV ran for a model bound for CPU")

    monkeypatch.setattr(gemv_mod, "gemv", refuse)
    monkeypatch.setattr(gemv_mod, "gemv_silu_mul", refuse)
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert torch.equal(on_cpu["gate_up"](x), F.linear(x, on_cpu["gate_up"].weight))
    assert torch.equal(on_cpu["head"].logits(x), F.linear(x, on_cpu["head"].weight).float())
    with pytest.raises(ValueError, match="max_rows"):
        SmallBatchGemv(gemv_mod.MAX_ROWS + 1)


def test_small_batch_gemv_rows_flag(tiny_model_factory):
    """--small-batch-gemv-rows: SGLang-style flag parsing and bounds; a CPU runner's linears are off
    whatever the flag says (the GEMV serves CUDA only)."""
    import argparse

    from baton.engine.layers.linear import MergedColumnLinear
    from baton.engine.model_executor.model_runner import ModelRunner
    from baton.engine.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(["--model-path", "m", "--small-batch-gemv-rows", "16"]))
    assert args.small_batch_gemv_rows == 16 and ServerArgs(model_path="m").small_batch_gemv_rows == 0
    with pytest.raises(ValueError, match="small-batch-gemv-rows"):
        ServerArgs(model_path="m", small_batch_gemv_rows=65)
    runner = ModelRunner(ServerArgs(model_path=tiny_model_factory("llama"), small_batch_gemv_rows=16,
                                    max_total_tokens=256))
    linears = [m for m in runner.model.modules() if isinstance(m, MergedColumnLinear)]
    assert linears and all(m.gemv is GEMV_OFF for m in linears)


def test_gemv_is_taken_exactly_under_its_conditions(monkeypatch):
    if not triton_available():
        pytest.skip("triton is not installed")
    from baton.engine.distributed.parallel_state import TpGroup
    from baton.engine.layers.activation import GatedAct
    from baton.engine.layers.linear import MergedColumnLinear, even_parts
    from baton.engine.layers.vocab_parallel import VocabParallelEmbedding
    from baton.engine.triton_ops import gemv as gemv_mod

    calls: list[tuple] = []

    def fake_gemv(x, w, bias=None):
        calls.append(("gemv", x.shape[0], bias is not None))
        return F.linear(x, w, bias)

    def fake_silu_mul(x, w):
        calls.append(("silu_mul", x.shape[0]))
        gu = F.linear(x, w)
        return F.silu(gu[:, :w.shape[0] // 2]) * gu[:, w.shape[0] // 2:]

    monkeypatch.setattr(gemv_mod, "gemv", fake_gemv)
    monkeypatch.setattr(gemv_mod, "gemv_silu_mul", fake_silu_mul)
    bf = torch.bfloat16  # the layers' choices set by hand on CPU: the rule as on CUDA, the stand-ins as kernels
    layer = torch.nn.Linear(32, 12).to(bf)

    def took_gemv(x, rows_on=16, bias=True):
        layer.gemv = SmallBatchGemv(rows_on)
        calls.clear()
        b = layer.bias if bias else None
        assert torch.equal(gemm.linear_forward(layer, x, b), F.linear(x, layer.weight, b))
        return bool(calls)

    x16 = torch.randn(16, 32).to(bf)
    assert took_gemv(x16[:1]) and took_gemv(x16) and took_gemv(x16[:5], bias=False)
    assert calls == [("gemv", 5, False)]
    assert not took_gemv(torch.randn(17, 32).to(bf))  # more rows than switched on
    assert not took_gemv(x16[:0])
    assert not took_gemv(x16[:4], rows_on=0)  # off
    assert took_gemv(x16[:4], rows_on=4) and not took_gemv(x16[:5], rows_on=4)
    assert not took_gemv(torch.randn(2, 64).to(bf)[:, ::2])  # not contiguous
    assert not took_gemv(x16[:4].view(2, 2, 32))  # 3-D
    layer_fp16 = torch.nn.Linear(32, 12).to(torch.float16)
    layer.gemv = layer_fp16.gemv = SmallBatchGemv(16)
    assert gemm.gemv_applies(layer_fp16, x16[:2].half(), layer_fp16.bias)
    assert not gemm.gemv_applies(layer_fp16, x16[:2].float(), None)  # fp32 stays on torch's GEMM
    assert not gemm.gemv_applies(layer, x16[:2].half(), None)  # x's dtype is not the weight's
    layer.register_buffer("packed_weight", torch.zeros(1), persistent=False)  # a packed CPU layer keeps its kernel
    assert not gemm.gemv_applies(layer, x16[:2], None)
    del layer.packed_weight

    # MergedColumnLinear.gated: silu * up fused into the GEMV for SiLU without a bias
    gate_up = MergedColumnLinear(32, even_parts([24, 24], TpGroup()), bias=False).to(bf)
    gate_up.gemv = SmallBatchGemv(16)
    silu, gelu = GatedAct("silu"), GatedAct("gelu")
    calls.clear()
    want = silu.forward_native(F.linear(x16[:3], gate_up.weight))
    torch.testing.assert_close(gate_up.gated(x16[:3], silu), want)
    assert calls == [("silu_mul", 3)]
    calls.clear()
    gate_up.gated(x16[:3], gelu)  # another activation: the GEMV, then the activation
    assert calls == [("gemv", 3, False)]
    calls.clear()
    gate_up.gated(torch.randn(20, 32).to(bf), silu)  # past max_rows: torch's GEMM
    assert calls == []
    biased = MergedColumnLinear(32, even_parts([24, 24], TpGroup()), bias=True).to(bf)
    biased.gemv = SmallBatchGemv(16)
    calls.clear()
    biased.gated(x16[:3], silu)  # a bias: the GEMV with it, no fused epilogue
    assert calls == [("gemv", 3, True)]

    # the LM head: float32 logits of every vocabulary row through the GEMV
    head = VocabParallelEmbedding(100, 32).to(bf)
    torch.nn.init.normal_(head.weight)  # made with torch.empty
    head.gemv = SmallBatchGemv(16)
    calls.clear()
    logits = head.logits(x16[:2])
    assert calls == [("gemv", 2, False)] and logits.dtype == torch.float32 and logits.shape == (2, 100)
    assert torch.equal(logits, F.linear(x16[:2], head.weight).float())


# ---------------------------------------------------------------- the pre-norm folded in

DECODER_LAYER_FUSED = textwrap.dedent(
    """
    import torch
    from transformers import LlamaConfig
    from baton.engine.layers import custom_op, gemm
    from baton.engine.model_config import ModelConfig
    from baton.engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP
    from baton.engine.triton_ops import gemv as gemv_mod

    torch.manual_seed(0)
    bf = torch.bfloat16
    cfg = ModelConfig.from_hf(LlamaConfig(hidden_size=96, intermediate_size=160, num_attention_heads=4,
                                          num_key_value_heads=2, num_hidden_layers=1, rms_norm_eps=1e-5))
    layer = LlamaDecoderLayer(cfg, LlamaAttention(cfg, 0, False, False), LlamaMLP(96, 160, "silu")).to(bf)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        norm.weight.data = (1 + 0.3 * torch.randn(96)).to(bf)
    # attention's core stubbed: q's columns through o_proj (the layer's seams are what is under test)
    attn = layer.self_attn
    attn._attend = lambda positions, qkv, fb: attn.o_proj(qkv[:, :attn.q_size].contiguous())
    custom_op.bind_layer_ops(layer, "cpu")  # the norms on their fused path; the GEMV choice set below by hand
    calls = []
    real = gemv_mod.gemv_rmsnorm

    def counting(x, residual, norm_weight, eps, weight, bias=None, silu_mul=False):
        calls.append((x.shape[0], residual is not None, silu_mul, eps))
        return real(x, residual, norm_weight, eps, weight, bias, silu_mul)

    gemv_mod.gemv_rmsnorm = counting
    torch.set_grad_enabled(False)
    for rows in (1, 5):
        hidden, residual = torch.randn(rows, 96).to(bf), torch.randn(rows, 96).to(bf)
        for first in (True, False):  # the first layer has no residual yet
            r = None if first else residual
            gemm.bind_gemv(layer, gemm.GEMV_OFF)
            want, want_res = layer(None, hidden, None if first else r.clone(), None)
            gemm.bind_gemv(layer, gemm.SmallBatchGemv(16))  # the rule as on CUDA; the kernel Triton's, interpreted
            calls.clear()
            got, got_res = layer(None, hidden, r, None)
            assert calls == [(rows, not first, False, 1e-5), (rows, True, True, 1e-5)], calls
            err = ((got.float() - want.float()).abs() / want.float().abs().clamp_min(1)).max().item()
            assert err <= 8 * 2 ** -7, (rows, first, err)
            res_err = ((got_res.float() - want_res.float()).abs() / want_res.float().abs().clamp_min(1)).max()
            assert res_err <= 4 * 2 ** -7, (rows, first, res_err)  # the attention output it adds differs too
            if r is not None:
                assert torch.equal(r, residual), "the caller's residual is not written"
            print("layer", rows, first, err)
    gemm.bind_gemv(layer, gemm.SmallBatchGemv(16, fuse_norms=False))
    calls.clear()
    layer(None, hidden, residual.clone(), None)
    assert calls == [], "fuse_norms=False keeps the norms' own kernels"
    print("FUSED LAYER OK")
    """
)


def test_decoder_layer_folds_its_norms_into_the_gemv_under_the_interpreter():
    """A Llama decoder layer with the GEMV on: both norms go into their linears' kernels (qkv_proj;
    gate_up with silu * up), with and without an incoming residual, 1 and 5 rows; the real kernel
    (interpreted, bfloat16) against the same layer with the GEMV off within bfloat16 roundings (the
    interpreter truncates), the residual stream within four (it adds the attention output, which
    differs by the first kernel's roundings), the caller's residual untouched."""
    if not triton_available():
        pytest.skip("triton is not installed")
    out = run_python(DECODER_LAYER_FUSED, interpret=True)
    assert "FUSED LAYER OK" in out and out.count("layer ") == 4, out


def test_norm_linear_fuses_exactly_under_its_conditions():
    """layers/norm_linear.py's rule (the linears' GEMV choices set by hand on CPU): a plain RMSNorm bound to a fused
    path before a linear the GEMV takes; not the zero-centred norm, an Identity (EAGLE's first layer),
    the reference ops, a norm of another dtype, silu * up with a bias, more rows than the GEMV takes,
    or fuse_norms=False. Off the fused path it is the norm, then the linear, bit for bit."""
    if not triton_available():
        pytest.skip("triton is not installed")
    from baton.engine.distributed.parallel_state import TpGroup
    from baton.engine.layers import norm_linear as nl
    from baton.engine.layers.activation import GatedAct
    from baton.engine.layers.layernorm import RMSNorm, ZeroCenteredRMSNorm
    from baton.engine.layers.linear import MergedColumnLinear, even_parts

    bf = torch.bfloat16
    norm, zc = RMSNorm(32).to(bf), ZeroCenteredRMSNorm(32).to(bf)
    for n in (norm, zc):
        n.bind("cpu", True)
    linear = torch.nn.Linear(32, 12, bias=False).to(bf)
    gate_up = MergedColumnLinear(32, even_parts([24, 24], TpGroup()), bias=False).to(bf)
    biased = MergedColumnLinear(32, even_parts([24, 24], TpGroup()), bias=True).to(bf)
    silu = GatedAct("silu")
    x, r = torch.randn(4, 32).to(bf), torch.randn(4, 32).to(bf)

    def choose(gemv: SmallBatchGemv) -> None:  # what bind_layer_ops gives a model's linears on CUDA
        for layer in (linear, gate_up, biased):
            layer.gemv = gemv

    choose(SmallBatchGemv(16))
    assert nl.fusable(norm, linear, x, r) and nl.fusable(norm, linear, x, None)
    assert nl.fusable(norm, gate_up, x, r, silu)
    assert not nl.fusable(zc, linear, x, r)
    assert not nl.fusable(torch.nn.Identity(), linear, x, None)
    assert not nl.fusable(norm, biased, x, r, silu)
    assert not nl.fusable(norm, linear, torch.randn(17, 32).to(bf), None)
    assert not nl.fusable(norm, linear, x, r.float())
    assert not nl.fusable(RMSNorm(32), linear, x, r)  # a float32 norm weight: the norm's own op
    norm.bind("cpu", False)
    assert not nl.fusable(norm, linear, x, r)  # --disable-fused-ops
    norm.bind("cpu", True)
    choose(SmallBatchGemv(16, fuse_norms=False))
    assert not nl.fusable(norm, linear, x, r)
    choose(GEMV_OFF)
    assert not nl.fusable(norm, linear, x, r)
    y, res = nl.norm_linear(norm, gate_up, x, r.clone(), silu)  # unfused: the ops in order
    h, want_res = norm.forward_native(x, r.clone())
    assert torch.equal(res, want_res) and torch.equal(y, gate_up.gated(h, silu))
    y, res = nl.norm_linear(zc, linear, x, None)
    assert res is x and torch.equal(y, linear(zc.forward_native(x)))


# ---------------------------------------------------------------- CUDA

@pytest.mark.gpu
def test_gemv_on_cuda_matches_without_a_sync_and_in_a_graph():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if not triton_available():
        pytest.skip("needs triton")
    from baton.engine.triton_ops.activation import silu_and_mul
    from baton.engine.triton_ops.gemv import gemv, gemv_silu_mul

    g = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16

    def close(got, want, what, rel=2 ** -7):  # a rounding apart (bf16's ulp is at most 2^-7 of the value)
        got, want = got.float(), want.float()
        assert bool(((got - want).abs() <= rel * want.abs().clamp_min(1.0)).all()), (what, (got - want).abs().max())

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g, device="cuda")).to(bf)

    k, n, inter = 2048, 3000, 1408
    w, b, w13 = rand(n, k, scale=k ** -0.5), rand(n), rand(2 * inter, k, scale=k ** -0.5)
    xs = {m: rand(m, k) for m in (1, 5, 16)}

    def silu_ref(x):
        gu = F.linear(x.float(), w13.float()).to(bf).float()
        return (F.silu(gu[:, :inter]).to(bf).float() * gu[:, inter:]).to(bf)

    for m, x in xs.items():  # the first call of each shape tunes (and syncs)
        close(gemv(x, w, b), F.linear(x.float(), w.float(), b.float()), ("gemv", m))
        close(gemv_silu_mul(x, w13), silu_ref(x), ("gemv_silu_mul", m), rel=2 ** -6)
        close(gemv_silu_mul(x, w13), silu_and_mul(F.linear(x, w13)), ("against the unfused path", m), rel=2 ** -6)
    torch.cuda.set_sync_debug_mode("error")  # tuned: the calls launch without a device-to-host sync
    try:
        outs = {m: (gemv(x, w, b), gemv_silu_mul(x, w13)) for m, x in xs.items()}
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for m, (y, act) in outs.items():
        close(y, F.linear(xs[m].float(), w.float(), b.float()), ("gemv, no sync", m))
        close(act, silu_ref(xs[m]), ("gemv_silu_mul, no sync", m), rel=2 ** -6)

    # never called eagerly: the capture takes the fixed config, not the tuner. Same specialization as
    # n (not a multiple of 16) with a bias, so Triton finds it compiled (it compiles on a first launch,
    # which a capture may not allow: the graph runner's warm-ups are what make both happen before one).
    w_new, b_new = rand(n + 16, k, scale=k ** -0.5), rand(n + 16)
    graph = torch.cuda.CUDAGraph()
    x1, x16 = xs[1].clone(), xs[16].clone()
    with torch.cuda.graph(graph):
        y1, y16, a16, fresh = gemv(x1, w, b), gemv(x16, w), gemv_silu_mul(x16, w13), gemv(x1, w_new, b_new)
    x1.copy_(rand(1, k))
    x16.copy_(rand(16, k))
    graph.replay()
    close(y1, F.linear(x1.float(), w.float(), b.float()), "gemv replayed")
    close(y16, F.linear(x16.float(), w.float()), "gemv 16 rows replayed")
    close(a16, silu_ref(x16), "gemv_silu_mul replayed", rel=2 ** -6)
    close(fresh, F.linear(x1.float(), w_new.float(), b_new.float()), "a shape first met in the capture")

    # the pre-norm folded in (gemv_rmsnorm): against the fp32 norm and product, two roundings (x times
    # the norm weight is rounded for tl.dot), silu * up four; the residual stream exactly torch's add
    from baton.engine.triton_ops.gemv import gemv_rmsnorm

    nw, eps = (1 + 0.3 * torch.randn(k, generator=g, device="cuda")).to(bf), 1e-5

    def normed(x, r):
        h = (x + r).float()
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * nw.float()

    def check_normed(got, x, r, what):
        (y, h), (act, h2) = got
        assert torch.equal(h, x + r) and torch.equal(h2, x + r), what
        close(y, F.linear(normed(x, r), w.float(), b.float()), what, rel=2 * 2 ** -7)
        gu = F.linear(normed(x, r), w13.float()).to(bf).float()
        close(act, (F.silu(gu[:, :inter]).to(bf).float() * gu[:, inter:]).to(bf), what + " silu", rel=4 * 2 ** -7)

    rs = {m: rand(m, k) for m in xs}
    for m, x in xs.items():  # tunes
        check_normed((gemv_rmsnorm(x, rs[m], nw, eps, w, b), gemv_rmsnorm(x, rs[m], nw, eps, w13, silu_mul=True)),
                     x, rs[m], f"gemv_rmsnorm {m}")
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = {m: (gemv_rmsnorm(x, rs[m], nw, eps, w, b), gemv_rmsnorm(x, rs[m], nw, eps, w13, silu_mul=True))
                for m, x in xs.items()}
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for m, got in outs.items():
        check_normed(got, xs[m], rs[m], f"gemv_rmsnorm {m}, no sync")
    graph = torch.cuda.CUDAGraph()
    r16 = rs[16].clone()
    with torch.cuda.graph(graph):
        got16 = (gemv_rmsnorm(x16, r16, nw, eps, w, b), gemv_rmsnorm(x16, r16, nw, eps, w13, silu_mul=True))
    x16.copy_(rand(16, k))
    r16.copy_(rand(16, k))
    graph.replay()
    check_normed(got16, x16, r16, "gemv_rmsnorm replayed")


def test_bench_step_variants_bind_the_gemv(monkeypatch):
    """`baton bench step`: triton-gemv binds the model's linears to the GEMV for 1..64 rows before its
    graphs are captured, its norms folded in (triton-gemv-own-norms: not); every other variant binds
    them off again (the runner's GPU parts stubbed out)."""
    if not triton_available():
        pytest.skip("triton is not installed")
    import dataclasses
    import types

    from baton.engine.bench import step
    from baton.engine.layers import attention
    from baton.engine.model_executor import cuda_graph_runner

    seen: list[tuple[int, bool]] = []

    class Graphs:  # the capture: what the linears hold when the graphs (and their warm-ups) are made
        def __init__(self, runner, max_bs):
            choices = {m.gemv for m in runner.model.values()}
            assert len(choices) == 1, choices
            seen.append((choices.pop().max_rows, runner.model["gate_up"].gemv.fuse_norms))

    @dataclasses.dataclass
    class Args:
        disable_fused_ops: bool = False
        flashinfer_decode_tensor_cores: str = "auto"

    backend = types.SimpleNamespace(decode_tensor_cores=True, geometry=types.SimpleNamespace(num_qo_heads=8,
                                                                                             num_kv_heads=2))
    monkeypatch.setattr(attention, "create_attention_backend", lambda *a, **k: backend)
    monkeypatch.setattr(cuda_graph_runner, "CudaGraphRunner", Graphs)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    runner = types.SimpleNamespace(model=_tiny_model(), device="cuda", attn_backend=backend, config=Args())
    names = ["triton-gemv", "fused", "triton-gemv-own-norms", "reference-ops", "triton-gemv", "other-tensor-cores"]
    descriptions = [step._set_variant(runner, Args(), name, 64) for name in names]
    assert [rows for rows, _ in seen] == [64, 0, 64, 0, 64, 0]
    assert [fold for rows, fold in seen if rows] == [True, False, True]
    assert "GEMV for 1..64 rows, norms folded in" in descriptions[0] and "GEMV" not in descriptions[1]
    assert "norms own kernels" in descriptions[2]
    assert set(names) == set(step.VARIANTS)
