"""Layer ops by device (layers/custom_op.py) and their Triton kernels (triton_ops/norm.py, activation.py,
qkv_rope.py).

Criteria:
- CPU, under TRITON_INTERPRET=1 (a subprocess): each kernel, called through its op's CUDA path, against
  the op's torch reference. float32 within 1e-5; float16 within one rounding of the result for the
  norms and the activation, three for RoPE (the kernel rounds once where torch rounds each product
  and the sum); bfloat16 within four times that in bf16 ulps, since the interpreter's bfloat16 casts
  truncate where a GPU rounds to nearest.
- CPU: each kernel compiles for sm_90 (Triton's compiler is stricter than its interpreter).
- GPU (`gpu` marker): the same ops on CUDA in float16/bfloat16 within those tolerances, with no
  device-to-host sync and inside a captured CUDA graph; whole models (Llama, Qwen3 with q/k norms)
  with the Triton ops and with the torch reference ops, each against HF float32 prefill logprobs:
  the Triton path's largest error at most 1.25x the reference path's (+0.02), HF's top-1 token as
  often give or take one position. (A direct bound of 0.05 between the two paths failed on an H200
  at up to 0.74 in bfloat16 with top-1 agreement 0.98: rounding drift of a random tiny model.)
- CPU: paths are chosen at load and held per model: two models bound for CPU and CUDA in one process
  keep their own ops' paths and GEMV choices; the sampler and the Gated DeltaNet core bind the same way.
- The models never name a device kernel: no import of kernels/ or triton_ops/ (an AST check).
"""
from __future__ import annotations

import ast
import os
import pathlib
import textwrap

import pytest
import torch

from baton.engine.layers.custom_op import CustomOp, bind_layer_ops, triton_available
from fresh_python import run_python

ENGINE = pathlib.Path(__file__).resolve().parents[2] / "engine"

INTERPRETED = textwrap.dedent(
    """
    import types
    import torch
    import torch.nn.functional as F
    from baton.engine.layers.activation import GatedAct
    from baton.engine.layers.layernorm import RMSNorm
    from baton.engine.layers.qkv_rope import QKVRope
    from baton.engine.layers.rotary_embedding import RotaryEmbedding, _default_inv_freq

    g = torch.Generator().manual_seed(0)

    def close(got, want, dtype, what, ulps=1):
        got, want = got.float(), want.float()
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=what)
        else:  # `ulps` roundings (fp16); four times that in bf16 (the interpreter truncates bf16)
            rel = ulps * (2 ** -10 if dtype == torch.float16 else 2 ** -5)
            bound = rel * want.abs().clamp_min(1.0)
            assert bool(((got - want).abs() <= bound).all()), (what, (got - want).abs().max().item())

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for rows, cols in ((5, 96), (1, 4096), (3, 100), (0, 64)):
            norm = RMSNorm(cols, 1e-5).to(dtype)
            norm.weight.data = (1 + 0.3 * torch.randn(cols, generator=g)).to(dtype)
            norm.bind("cuda", fused=True)
            assert norm.path == "cuda"
            x = (2 * torch.randn(rows, cols, generator=g)).to(dtype)
            r = torch.randn(rows, cols, generator=g).to(dtype)
            close(norm(x), norm.forward_native(x), dtype, ("rmsnorm", dtype, rows, cols))
            want, want_res = norm.forward_native(x, r.clone())
            res = r.clone()
            got, got_res = norm(x, res)
            assert got_res.data_ptr() == res.data_ptr(), "the residual is updated in place"
            close(got, want, dtype, ("fused_add_rmsnorm", dtype, rows, cols))
            close(got_res, want_res, dtype, ("residual", dtype, rows, cols))
            if dtype != torch.bfloat16:
                assert torch.equal(got_res, want_res)  # the add is one rounding on both paths
        # a 3-D input (q/k norms reshape per head) and a row-strided one
        norm = RMSNorm(32, 1e-6).to(dtype)
        norm.bind("cuda", fused=True)
        x3 = torch.randn(4, 6, 32, generator=g).to(dtype)
        close(norm(x3), norm.forward_native(x3), dtype, ("rmsnorm 3-D", dtype))
        wide = torch.randn(4, 80, generator=g).to(dtype)
        close(norm(wide[:, 8:40]), norm.forward_native(wide[:, 8:40]), dtype, ("rmsnorm strided rows", dtype))

        act = GatedAct("silu")
        act.bind("cuda", fused=True)
        for rows, d in ((4, 70), (1, 3000), (0, 8)):
            gu = (3 * torch.randn(rows, 2 * d, generator=g)).to(dtype)
            close(act(gu), act.forward_native(gu), dtype, ("silu_and_mul", dtype, rows, d))
        gelu = GatedAct("gelu")  # no Triton kernel: the CUDA path falls back to the reference
        gelu.bind("cuda", fused=True)
        gu = torch.randn(3, 16, generator=g).to(dtype)
        assert torch.equal(gelu(gu), gelu.forward_native(gu))

        for head_dim, heads, kv_heads, qk_norm in ((64, 4, 2, False), (32, 6, 2, True), (128, 8, 8, True), (80, 2, 1, False)):
            rope = RotaryEmbedding(head_dim, _default_inv_freq(10000.0, head_dim), 1.0, 300)
            rope.reserve(300, "cpu")
            q_norm = k_norm = None
            if qk_norm:
                q_norm, k_norm = RMSNorm(head_dim, 1e-6).to(dtype), RMSNorm(head_dim, 1e-6).to(dtype)
                q_norm.weight.data = (1 + 0.3 * torch.randn(head_dim, generator=g)).to(dtype)
                k_norm.weight.data = (1 + 0.3 * torch.randn(head_dim, generator=g)).to(dtype)
            op = QKVRope(heads, kv_heads, head_dim, 1, rope, q_norm, k_norm)
            op.bind("cuda", fused=True)
            n, slots = 7, 40
            qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
            positions = torch.randint(0, 300, (n,), generator=g)
            loc = torch.randperm(slots, generator=g)[:n]
            bufs = [torch.zeros(slots, kv_heads, head_dim, dtype=dtype) for _ in range(4)]  # layer 1's k, v
            pool = types.SimpleNamespace(k_buffer=[bufs[0], bufs[1]], v_buffer=[bufs[2], bufs[3]])
            fb = types.SimpleNamespace(token_to_kv_pool=pool, out_cache_loc=loc,
                                       attn_backend=types.SimpleNamespace(reads_new_kv_from_pool=True))
            want = op.forward_native(positions, qkv, fb)
            got = op(positions, qkv, fb)
            assert got.kv_stored and not want.kv_stored
            what = ("qkv_rope", dtype, head_dim, heads, kv_heads, qk_norm)
            # the reference rounds each product and the sum: up to three roundings apart
            close(got.q, want.q, dtype, what, ulps=3)
            close(bufs[1][loc].reshape(n, -1), want.k, dtype, what, ulps=3)
            assert torch.equal(bufs[3][loc].reshape(n, -1), want.v), what  # v is copied as is
            untouched = torch.ones(slots, dtype=torch.bool)
            untouched[loc] = False
            assert not bufs[1][untouched].any() and not bufs[0].any(), "only this layer's slots at loc are written"
            # a backend that attends over the pass's own K/V (torch) keeps the reference path
            fb.attn_backend = types.SimpleNamespace()
            assert not op(positions, qkv, fb).kv_stored
    print("INTERPRETED OK")
    """
)


def test_fused_kernels_match_the_reference_under_the_interpreter():
    if not triton_available():
        pytest.skip("triton is not installed")
    assert "INTERPRETED OK" in run_python(INTERPRETED, interpret=True)


def test_kernels_compile_for_sm90():
    """Triton's compiler is stricter than its interpreter (a variable must keep one type across an
    if/else): each kernel compiles to PTX for an H100/H200 here, without a GPU."""
    if not triton_available():
        pytest.skip("triton is not installed")
    out = run_python(SM90_COMPILE)
    assert out.count("compiled") == 15, out


SM90_COMPILE = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from baton.engine.triton_ops import activation, norm, qkv_rope

    def compile_(fn, signature, constexprs):
        triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))
        print("compiled", fn.__name__)

    for dt in ("bf16", "fp16", "fp32"):
        norm_sig = {"x_ptr": f"*{dt}", "res_ptr": f"*{dt}", "w_ptr": f"*{dt}", "out_ptr": f"*{dt}", "x_stride": "i64",
                    "res_stride": "i64", "out_stride": "i64", "cols": "i32", "eps": "fp32",
                    "HAS_RESIDUAL": "constexpr", "BLOCK": "constexpr"}
        for residual in (True, False):
            compile_(norm._rmsnorm_kernel, norm_sig, {"HAS_RESIDUAL": residual, "BLOCK": 4096})
        compile_(activation._silu_and_mul_kernel, {"x_ptr": f"*{dt}", "out_ptr": f"*{dt}", "x_stride": "i64",
                                                  "out_stride": "i64", "d": "i32", "BLOCK": "constexpr"}, {"BLOCK": 1024})
        rope_sig = {"qkv_ptr": f"*{dt}", "pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "q_ptr": f"*{dt}",
                    "k_buf": f"*{dt}", "v_buf": f"*{dt}", "loc_ptr": "*i64", "qw_ptr": f"*{dt}", "kw_ptr": f"*{dt}",
                    "qkv_stride": "i64", "table_stride": "i64", "q_stride": "i64", "buf_stride": "i64", "eps": "fp32",
                    "NUM_Q": "constexpr", "NUM_KV": "constexpr", "HEAD_DIM": "constexpr", "HALF_BLOCK": "constexpr",
                    "HAS_NORM": "constexpr"}
        for qk_norm in (True, False):
            compile_(qkv_rope._qkv_rope_store_kernel, rope_sig,
                     {"NUM_Q": 32, "NUM_KV": 8, "HEAD_DIM": 128, "HALF_BLOCK": 64, "HAS_NORM": qk_norm})
    """
)


def test_kernels_refuse_shapes_they_do_not_take():
    if not triton_available():
        pytest.skip("triton is not installed")
    from baton.engine.triton_ops.activation import silu_and_mul
    from baton.engine.triton_ops.norm import fused_add_rmsnorm, rmsnorm
    from baton.engine.triton_ops.qkv_rope import qkv_rope_store

    with pytest.raises(ValueError, match="weight"):
        rmsnorm(torch.zeros(2, 8), torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rmsnorm(torch.zeros(2, 8), torch.zeros(3, 8), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match=r"\[n, 2d\]"):
        silu_and_mul(torch.zeros(2, 7))
    table = torch.zeros(16, 4)
    with pytest.raises(ValueError, match="qkv"):
        qkv_rope_store(torch.zeros(2, 8 * 5), torch.zeros(2, dtype=torch.long), table, table, 2, 2, 8,
                       torch.zeros(4, 2, 8), torch.zeros(4, 2, 8), torch.zeros(2, dtype=torch.long))


def test_bind_layer_ops_picks_one_path_per_device(tiny_model_factory):
    from baton.engine.model_executor.model_runner import ModelRunner
    from baton.engine.server_args import ServerArgs

    path = tiny_model_factory("qwen3")
    runner = ModelRunner(ServerArgs(model_path=path, device="cpu", max_total_tokens=256, max_running_requests=2))
    layers = runner.num_layers
    # RMSNorm: 2 per layer, the final norm, q/k norms; GatedAct and QKVRope: one per layer
    assert runner.layer_ops == {"RMSNorm/cpu": 4 * layers + 1, "GatedAct/cpu": layers, "QKVRope/cpu": layers}
    model = runner.model
    cuda = "cuda" if triton_available() else "native"
    assert bind_layer_ops(model, "cuda") == {f"RMSNorm/{cuda}": 4 * layers + 1, f"GatedAct/{cuda}": layers,
                                             f"QKVRope/{cuda}": layers}
    assert set(bind_layer_ops(model, "cuda", fused=False)) == {"RMSNorm/native", "GatedAct/native", "QKVRope/native"}
    ops = [m for m in model.modules() if isinstance(m, CustomOp)]
    assert all(op._forward == op.forward_native for op in ops)
    # the checkpoint's names are unchanged by the ops (QKVRope holds the norms without registering them)
    assert not any(".qkv_rope." in name for name, _ in model.named_parameters())


def test_op_paths_are_chosen_at_load_and_held_by_each_model(tiny_model_factory, monkeypatch):
    """No process-wide setting decides a path: two models of one process bound for different devices
    keep their own ops' paths and GEMV choices; a sampler built for CPU takes the native sampler (where
    its kernels build) and an unbound one torch's; the Gated DeltaNet core binds its CUDA path only
    where fla-core is installed."""
    from baton.engine.kernels import cpu_sampling
    from baton.engine.layers.gated_delta_net import GatedDeltaCore, fla_kernels
    from baton.engine.layers.gemm import GEMV_OFF, SmallBatchGemv
    from baton.engine.layers.linear import MergedColumnLinear
    from baton.engine.layers.sampler import Sampler
    from baton.engine.model_executor.model_loader import load_model
    from baton.engine.sampling.sampling_batch_info import ReqSamplingState, SamplingBatchInfo
    from baton.engine.sampling.sampling_params import SamplingParams

    path = tiny_model_factory("llama")
    on_cpu, on_cuda = load_model(path)[0], load_model(path)[0]  # the second only bound, never run
    gemv = SmallBatchGemv(16) if triton_available() else GEMV_OFF  # the GEMV needs triton to be bound
    bind_layer_ops(on_cpu, "cpu", gemv=gemv)
    bind_layer_ops(on_cuda, "cuda", gemv=gemv)
    cuda = "cuda" if triton_available() else "native"
    for model, want_path, want_gemv in ((on_cpu, "cpu", GEMV_OFF), (on_cuda, cuda, gemv)):
        ops = [m for m in model.modules() if isinstance(m, CustomOp)]
        assert ops and all(op.path == want_path and op._forward == getattr(op, f"forward_{want_path}")
                           for op in ops)
        linears = [m for m in model.modules() if isinstance(m, MergedColumnLinear)]
        assert linears and all(m.gemv == want_gemv for m in linears)

    calls: list[int] = []
    real_sample = cpu_sampling.sample
    monkeypatch.setattr(cpu_sampling, "sample", lambda *a: calls.append(1) or real_sample(*a))
    native_here = cpu_sampling.unavailable_reason() is None
    on_cpu_sampler, reference = Sampler("cpu"), Sampler()
    assert on_cpu_sampler.path == ("cpu" if native_here else "native") and reference.path == "native"
    assert Sampler("cuda").path == cuda  # torch's sampler (forward_cuda is the reference)
    for sampler, want_calls in ((reference, 0), (on_cpu_sampler, int(native_here)), (reference, 0)):
        calls.clear()
        states = [ReqSamplingState(SamplingParams(temperature=0.7, seed=i), [1], 8, set(), "cpu") for i in range(2)]
        ids = sampler(torch.randn(2, 8), SamplingBatchInfo.from_states(states, "cpu"), False, [0, 0]).next_token_ids
        assert len(calls) == want_calls and ids.shape == (2,)

    core = GatedDeltaCore(torch.nn.Conv1d(8, 8, 4, groups=8, bias=False), 2, 4, 2, 2, 0)
    assert core.bind("cpu", fused=True) == "cpu"
    assert core.bind("cuda", fused=True) == ("cuda" if cuda == "cuda" and fla_kernels() is not None else "native")


def test_models_never_name_a_device_kernel():
    for path in sorted((ENGINE / "models").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert not any(k in name for k in ("engine.kernels", "triton_ops", "flashinfer", "triton")), \
                    f"{path.name} imports {name}: models call layer ops, which pick the device's kernel"


def test_cuda_graph_default_by_gpu_memory():
    from baton.engine.model_executor.model_runner import cuda_graph_max_bs_for

    gib = 1 << 30
    assert [cuda_graph_max_bs_for(m * gib) for m in (16, 24, 48, 80, 141)] == [8, 24, 80, 160, 256]


def test_tensor_core_decode_rule():
    from baton.engine.layers.attention import use_tensor_core_decode

    assert [use_tensor_core_decode("auto", g) for g in (1, 2, 4, 8)] == [False, False, True, True]
    assert use_tensor_core_decode("on", 1) and not use_tensor_core_decode("off", 8)


# ---------------------------------------------------------------- the bench's checkpoints (CPU)

SMALL = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=160,
             max_position_embeddings=256)


@pytest.mark.parametrize("shape", ["llama-3-8b", "qwen3-8b", "qwen3-30b-a3b"])
def test_bench_step_checkpoint_loads_in_the_engine(tmp_path, monkeypatch, shape):
    """`baton bench step`'s checkpoint builder, on each named shape shrunk: every tensor it writes is
    one the engine's loader takes, and none is missing; the byte counts follow the parameters."""
    from baton.engine.bench import step
    from baton.engine.model_executor.model_loader import load_model

    small = {k: v for k, v in SMALL.items() if k in step.SHAPES[shape] or k in ("head_dim",)}
    monkeypatch.setitem(step.SHAPES, shape, dict(step.SHAPES[shape], **small))
    path, seconds = step.build_checkpoint(shape, str(tmp_path / shape), device="cpu")
    assert seconds > 0 and os.path.exists(os.path.join(path, ".complete"))
    assert step.build_checkpoint(shape, path, device="cpu") == (path, 0.0)  # reused
    model, _, dtype = load_model(path, "bfloat16", "cpu")  # raises on a missing or unknown tensor
    assert dtype == torch.bfloat16
    facts = step.model_facts(model, step.SHAPES[shape])
    params = sum(p.numel() * 2 for p in model.parameters())
    embed = model.model.embed_tokens.weight.numel() * 2
    if "num_experts" in small:
        experts = sum(p.numel() * 2 for n, p in model.named_parameters() if n.endswith((".w13", ".w2")))
        assert facts.weight_bytes_fn(1) == pytest.approx(params - embed - experts + experts * 2 / 4 + 64 * 2)
        assert facts.weight_bytes_fn(10_000) == pytest.approx(params - embed + 10_000 * 64 * 2)
    else:
        assert facts.weight_bytes_fn(3) == params - embed + 3 * 64 * 2
    assert facts.kv_bytes(2, 10) == 2 * 10 * 2 * 2 * 2 * 16 * 2


# ---------------------------------------------------------------- CUDA

def need_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if not triton_available():
        pytest.skip("needs triton")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_ops_on_cuda_match_the_reference_without_a_sync_and_in_a_graph(dtype):
    need_cuda()
    from baton.engine.layers.activation import GatedAct
    from baton.engine.layers.layernorm import RMSNorm

    g = torch.Generator(device="cuda").manual_seed(0)
    rel = 2 ** -10 if dtype == torch.float16 else 2 ** -8

    def close(got, want, what):
        got, want = got.float(), want.float()
        assert bool(((got - want).abs() <= rel * want.abs().clamp_min(1.0)).all()), (what, (got - want).abs().max())

    norm = RMSNorm(4096, 1e-5).to("cuda", dtype)
    norm.weight.data = (1 + 0.3 * torch.randn(4096, generator=g, device="cuda")).to(dtype)
    norm.bind("cuda", fused=True)
    act = GatedAct("silu")
    act.bind("cuda", fused=True)
    x = (2 * torch.randn(64, 4096, generator=g, device="cuda")).to(dtype)
    r = torch.randn(64, 4096, generator=g, device="cuda").to(dtype)
    gu = (3 * torch.randn(64, 2 * 1408, generator=g, device="cuda")).to(dtype)
    want, want_res = norm.forward_native(x, r.clone())
    res = r.clone()
    torch.cuda.set_sync_debug_mode("error")  # the kernels launch without a device-to-host sync
    try:
        normed, (got, got_res), activated = norm(x), norm(x, res), act(gu)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    close(normed, norm.forward_native(x), "rmsnorm")
    close(got, want, "fused_add_rmsnorm")
    assert torch.equal(got_res, want_res)
    close(activated, act.forward_native(gu), "silu_and_mul")
    graph, res = torch.cuda.CUDAGraph(), r.clone()
    with torch.cuda.graph(graph):
        out, _ = norm(x, res)
        out2 = act(gu)
    res.copy_(r)
    graph.replay()
    close(out, want, "fused_add_rmsnorm replayed")
    close(out2, act.forward_native(gu), "silu_and_mul replayed")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_qkv_rope_store_on_cuda_matches_the_reference(dtype):
    need_cuda()
    import types

    from baton.engine.layers.layernorm import RMSNorm
    from baton.engine.layers.qkv_rope import QKVRope
    from baton.engine.layers.rotary_embedding import RotaryEmbedding, _default_inv_freq

    g = torch.Generator(device="cuda").manual_seed(0)
    rel = 3 * (2 ** -10 if dtype == torch.float16 else 2 ** -7)  # three roundings apart at most
    for qk_norm in (False, True):
        rope = RotaryEmbedding(128, _default_inv_freq(500000.0, 128), 1.0, 4096)
        rope.reserve(4096, "cuda")
        norms = [RMSNorm(128, 1e-6).to("cuda", dtype) for _ in range(2)] if qk_norm else [None, None]
        op = QKVRope(32, 8, 128, 0, rope, *norms)
        op.bind("cuda", fused=True)
        n, slots = 64, 300
        qkv = torch.randn(n, 48 * 128, generator=g, device="cuda").to(dtype)
        positions = torch.randint(0, 4096, (n,), generator=g, device="cuda")
        loc = torch.randperm(slots, generator=g, device="cuda")[:n]
        k_buf, v_buf = (torch.zeros(slots, 8, 128, dtype=dtype, device="cuda") for _ in range(2))
        fb = types.SimpleNamespace(token_to_kv_pool=types.SimpleNamespace(k_buffer=[k_buf], v_buffer=[v_buf]),
                                   out_cache_loc=loc, attn_backend=types.SimpleNamespace(reads_new_kv_from_pool=True))
        want = op.forward_native(positions, qkv, fb)
        got = op(positions, qkv, fb)
        for a, b in ((got.q, want.q), (k_buf[loc].reshape(n, -1), want.k)):
            err = (a.float() - b.float()).abs()
            assert bool((err <= rel * b.float().abs().clamp_min(1.0)).all()), (qk_norm, err.max().item())
        assert torch.equal(v_buf[loc].reshape(n, -1), want.v)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_model_with_fused_ops_is_as_close_to_hf_as_the_reference_ops(tiny_model_factory, arch, dtype):
    """Prefill logprobs of three prompts with the Triton ops and with the torch reference ops (FlashInfer
    attention both), each against HF float32 on the same weights: the fused path's largest logprob
    error is at most 1.25x the reference path's (+0.02), and it picks HF's top-1 token as often, give
    or take one position. (Half-precision rounding alone moves a random tiny model's logprobs by up to
    ~0.7 in bfloat16; the two paths round in different places.)"""
    need_cuda()
    import importlib.util

    if importlib.util.find_spec("flashinfer") is None:
        pytest.skip("needs flashinfer-python (scripts/gpu_check.sh installs the carried wheel)")
    from test_gpu_paths import GPU_MODEL, make_runner, prefill
    from test_scheduler_vs_hf import _hf_model

    path = tiny_model_factory(arch, **GPU_MODEL)
    prompts = [[5 + (i * 7) % 300 for i in range(40)], [11, 12, 13], list(range(100, 160))]
    with torch.no_grad():
        hf = torch.cat([torch.log_softmax(_hf_model(path)(torch.tensor([p])).logits[0].float(), -1) for p in prompts])
    err, top1 = {}, {}
    for fused in (True, False):
        runner = make_runner(path, 16, "cuda", dtype=dtype, attention_backend="flashinfer", disable_cuda_graph=True,
                             disable_fused_ops=not fused)
        assert all(k.endswith("/cuda" if fused else "/native") for k in runner.layer_ops)
        captured = {}
        forward = runner.model.forward

        def spy(*a, **kw):
            captured["hidden"] = forward(*a, **kw)
            return captured["hidden"]

        runner.model.forward = spy
        with torch.inference_mode():
            prefill(runner, prompts)
            lp = torch.log_softmax(runner.model.compute_logits(captured["hidden"]).float(), -1).cpu()
        err[fused] = (lp - hf).abs().max().item()
        top1[fused] = int((lp.argmax(-1) == hf.argmax(-1)).sum())
    print(f"[{arch} {dtype}] max |logprob - HF fp32|: Triton ops {err[True]:.4f}, reference ops {err[False]:.4f}; "
          f"HF's top-1 at {top1[True]} / {top1[False]} of {hf.shape[0]} positions")
    assert err[True] <= max(1.25 * err[False], err[False] + 0.02)
    assert top1[True] >= top1[False] - 1


def test_bench_step_engine_holds_its_batches_in_whole_pages():
    """`baton bench step --page-size`: the engine it runs takes that page size, and its KV pool holds
    the largest batch's requests of --context tokens (plus the step's token) in whole pages, and the
    prefill chunk."""
    import argparse

    from baton.engine.bench import step

    parser = argparse.ArgumentParser()
    step.add_cli_args(parser)
    for page in (1, 16, 64):
        args = parser.parse_args(["--page-size", str(page), "--context", "1000", "--prefill-tokens", "8192"])
        engine = step.engine_args("m", args, 64)
        assert engine.page_size == page and engine.attention_backend == "flashinfer"
        assert engine.max_total_tokens >= 64 * (-(-1002 // page) * page) and engine.max_total_tokens >= 8192
        assert engine.context_length >= 8192
    assert parser.parse_args([]).page_size == 1
