"""The packed bfloat16 linear kernel (engine/kernels/cpu_linear.py) against torch's GEMM, its
fallbacks, its place in the model's linear layers, and inside torch.compile."""
import pytest
import torch
import torch.nn.functional as F

from baton.engine.kernels import cpu_attention, cpu_linear
from baton.engine.layers.linear import MergedColumnLinear, RowParallelLinear, even_parts, pack_linear_weights
from baton.engine.distributed.parallel_state import TpGroup

REASON = cpu_linear.unavailable_reason()
needs_kernel = pytest.mark.skipif(REASON is not None, reason=f"packed bf16 linear unavailable: {REASON}")


def _ulps_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Within one bfloat16 rounding of a float64 reference: both sides round once, so two ulps."""
    ref = ref.double()
    ulp = torch.finfo(torch.bfloat16).eps * ref.abs().clamp_min(1e-3)
    assert ((out.double() - ref).abs() <= 2 * ulp + 1e-6).all(), (out.double() - ref).abs().max()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 31, 32, 64, 300])
@pytest.mark.parametrize("k,n", [(256, 512), (64, 16), (96, 48), (768, 256), (2, 32)])
def test_matches_float64_reference_like_torch(rows, k, n):
    g = torch.Generator().manual_seed(rows * 1000 + k + n)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    out = cpu_linear.packed_linear(x, w, cpu_linear.pack_weight(w))
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    ref = x.double() @ w.double().T
    _ulps_close(out, ref)
    _ulps_close(F.linear(x, w), ref)  # the same bound holds for torch's own GEMM


@needs_kernel
def test_bias_leading_dims_and_empty_batch():
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(64, 32, generator=g).bfloat16(), torch.randn(64, generator=g).bfloat16()
    packed = cpu_linear.pack_weight(w)
    x = torch.randn(2, 3, 32, generator=g).bfloat16()
    out = cpu_linear.packed_linear(x, w, packed, b)
    assert out.shape == (2, 3, 64)
    torch.testing.assert_close(out, F.linear(x, w, b), atol=0.1, rtol=0.02)
    empty = cpu_linear.packed_linear(torch.empty(0, 32, dtype=torch.bfloat16), w, packed)
    assert empty.shape == (0, 64)
    strided = torch.randn(32, 8, generator=g).bfloat16().T  # [8, 32], not contiguous
    torch.testing.assert_close(cpu_linear.packed_linear(strided, w, packed), F.linear(strided, w), atol=0.1, rtol=0.02)


@needs_kernel
def test_other_dtypes_take_torch_gemm(monkeypatch):
    """A float32 input (not what a packed layer is given, but possible) is F.linear exactly, and
    never reaches the kernel."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(32, 16, generator=g).bfloat16()
    packed = cpu_linear.pack_weight(w)
    calls = []
    monkeypatch.setattr(cpu_linear, "_library", lambda: calls.append(1))  # the kernel must not be reached
    x32 = torch.randn(4, 16, generator=g)
    assert torch.equal(cpu_linear.packed_linear(x32, w.float(), packed), F.linear(x32, w.float()))
    assert not calls


@needs_kernel
def test_a_packed_copy_of_another_weight_is_refused():
    w = torch.randn(32, 16).bfloat16()
    with pytest.raises(ValueError, match="does not match"):
        cpu_linear.packed_linear(torch.randn(2, 16).bfloat16(), w, cpu_linear.pack_weight(torch.randn(16, 16).bfloat16()))


def test_pack_rejects_unsupported_weights():
    with pytest.raises(ValueError, match="N % 16"):
        cpu_linear.pack_weight(torch.zeros(24, 16, dtype=torch.bfloat16))  # N not a multiple of 16
    with pytest.raises(ValueError, match="even K"):
        cpu_linear.pack_weight(torch.zeros(16, 15, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_linear.pack_weight(torch.zeros(16, 16))
    assert not cpu_linear.packable(torch.zeros(16, 16, 2, dtype=torch.bfloat16))


def test_other_devices_have_a_reason():
    assert "not the CPU" in cpu_linear.unavailable_reason("cuda:0")


def test_disable_switch_has_a_reason(monkeypatch):
    monkeypatch.setenv(cpu_attention.DISABLE_ENV, "1")
    assert "BATON_DISABLE_CPU_KERNELS" in cpu_linear.unavailable_reason()
    layer = MergedColumnLinear(32, even_parts([16, 16], TpGroup()), bias=False).bfloat16()
    assert pack_linear_weights(layer, "cpu") == 0 and not hasattr(layer, "packed_weight")


@needs_kernel
def test_model_layers_pack_and_compute_what_they_did():
    """Column and row layers of a bf16 model get packed copies (unsupported shapes keep none) and
    give torch's results within rounding, eager and under torch.compile (one opaque op), with their
    original weights released."""
    torch.manual_seed(3)
    tp = TpGroup()
    model = torch.nn.Sequential(MergedColumnLinear(64, even_parts([48, 48], tp), bias=True),
                                RowParallelLinear(96, 64, bias=False, tp=tp),
                                MergedColumnLinear(64, even_parts([20], tp), bias=False))  # N = 20: not packable
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    model = model.bfloat16()
    x = torch.randn(8, 64).bfloat16()
    with torch.no_grad():
        before = model(x)
        assert pack_linear_weights(model, "cpu") == 2
        assert model[0].packed_weight.shape == (6, 32, 16, 2) and not hasattr(model[2], "packed_weight")
        assert "packed_weight" not in model.state_dict()  # not a checkpoint tensor
        for layer in model[:2]:  # released: the shape stays, the data is gone
            assert cpu_linear.is_released(layer.weight) and layer.weight.untyped_storage().nbytes() == 2
        assert model[2].weight.untyped_storage().nbytes() == 20 * 64 * 2  # unpacked: kept
        after = model(x)
        torch.testing.assert_close(after, before, atol=0.05, rtol=0.02)
        compiled = torch.compile(model, dynamic=True)
        torch.testing.assert_close(compiled(x), after, atol=0, rtol=0)
        big = torch.randn(300, 64).bfloat16()  # a prefill-sized call: the same graph, no recompile
        torch.testing.assert_close(compiled(big), model(big), atol=0, rtol=0)
        with pytest.raises(TypeError, match="bfloat16 CPU inputs"):  # no silent product with a placeholder
            model[0](torch.randn(2, 64))


@needs_kernel
def test_lm_heads_pack_and_a_tied_table_is_kept():
    """An untied LM head is packed and released; a tied one (the embedding table) is packed and
    kept, since the embedding lookup still reads it."""
    from baton.engine.layers.vocab_parallel import VocabParallelEmbedding

    class Model(torch.nn.Module):
        def __init__(self, tied: bool) -> None:
            super().__init__()
            self.model = torch.nn.Module()
            self.model.embed_tokens = VocabParallelEmbedding(64, 32)
            self.lm_head = None if tied else VocabParallelEmbedding(64, 32)

    for tied in (False, True):
        m = Model(tied).bfloat16()
        for p in m.parameters():
            torch.nn.init.normal_(p)
        head = m.model.embed_tokens if tied else m.lm_head
        hidden, ids = torch.randn(3, 32).bfloat16(), torch.tensor([1, 5, 63])
        with torch.no_grad():
            want_logits, want_rows = head.logits(hidden), m.model.embed_tokens(ids)
            assert pack_linear_weights(m, "cpu") == 1 and hasattr(head, "packed_weight")
            torch.testing.assert_close(head.logits(hidden), want_logits, atol=0.05, rtol=0.02)
            assert torch.equal(m.model.embed_tokens(ids), want_rows)  # the lookup table is intact
        assert cpu_linear.is_released(head.weight) == (not tied)
        assert not hasattr(m.model.embed_tokens, "packed_weight") or tied


@needs_kernel
@pytest.mark.parametrize("disable", [False, True], ids=["packed", "torch-gemm"])
def test_bf16_engine_serves_with_and_without_packed_linears(tiny_model_factory, disable):
    """Through the scheduler: a bfloat16 engine packs its linears and LM head unless --disable-packed-linear,
    and either way serves a batch to the end with its memory accounted for."""
    from scheduler_harness import SchedulerHarness

    path = tiny_model_factory("llama", hidden_size=64)
    h = SchedulerHarness(path, dtype="bfloat16", disable_packed_linear=disable, max_total_tokens=2048)
    model = h.scheduler.worker.model_runner.model
    packed = [m for m in model.modules() if hasattr(m, "packed_weight")]
    from baton.engine.layers.vocab_parallel import VocabParallelEmbedding

    assert (len(packed) == 0) if disable else any(isinstance(m, VocabParallelEmbedding) for m in packed)
    for i in range(5):
        h.submit(f"r{i}", [5 + i, 9, 13, 21 + i], max_new_tokens=6, ignore_eos=True)
    out = h.run_until_idle()
    assert all(len(out[f"r{i}"].ids) == 6 and out[f"r{i}"].finish.kind == "length" for i in range(5))
    assert h.scheduler.check_memory_integrity()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 32, 300])
@pytest.mark.parametrize("k,n", [(256, 1536), (64, 32), (96, 96), (2, 64)])
def test_silu_mul_fused_is_the_unfused_layer_under_compile_exactly(rows, k, n):
    """silu(gate) * up out of the packed GEMM equals, bit for bit, what torch.compile makes of the
    unfused layer's bfloat16 gate|up: silu and the product in float32, rounded once."""
    g = torch.Generator().manual_seed(rows * 7 + k + n)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.2).bfloat16()
    packed = cpu_linear.pack_weight(w)
    out = cpu_linear.packed_linear_silu_mul(x, w, packed)
    gate_up = cpu_linear.packed_linear(x, w, packed).float()
    want = (F.silu(gate_up[:, :n // 2]) * gate_up[:, n // 2:]).bfloat16()
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n // 2)
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    eager = F.silu(F.linear(x, w)[:, :n // 2]) * F.linear(x, w)[:, n // 2:]  # rounds twice more
    torch.testing.assert_close(out, eager, atol=0.05, rtol=0.03)


@needs_kernel
def test_silu_mul_fused_shapes_compile_and_refusals():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 32, generator=g).bfloat16()
    packed = cpu_linear.pack_weight(w)
    x = torch.randn(2, 3, 32, generator=g).bfloat16()
    assert cpu_linear.packed_linear_silu_mul(x, w, packed).shape == (2, 3, 32)
    assert cpu_linear.packed_linear_silu_mul(torch.empty(0, 32, dtype=torch.bfloat16), w, packed).shape == (0, 32)
    flat = torch.randn(7, 32, generator=g).bfloat16()
    compiled = torch.compile(lambda t: cpu_linear.packed_linear_silu_mul(t, w, packed), dynamic=True, fullgraph=True)
    torch.testing.assert_close(compiled(flat), cpu_linear.packed_linear_silu_mul(flat, w, packed), atol=0, rtol=0)
    with pytest.raises(TypeError, match="bfloat16 CPU inputs"):
        cpu_linear.packed_linear_silu_mul(torch.randn(2, 32), w, packed)
    w48 = torch.randn(48, 32, generator=g).bfloat16()  # halves of 24 rows: not whole blocks of 16
    assert not cpu_linear.silu_mul_fusable(w48, cpu_linear.pack_weight(w48), None)
    with pytest.raises(TypeError, match="16-row blocks"):
        cpu_linear.packed_linear_silu_mul(flat, w48, cpu_linear.pack_weight(w48))
    assert not cpu_linear.silu_mul_fusable(w, packed, torch.zeros(64, dtype=torch.bfloat16))  # a bias: unfused
    assert not cpu_linear.silu_mul_fusable(w, None, None)


@needs_kernel
def test_a_packed_bf16_llama_mlp_takes_the_fused_path_and_keeps_its_result(monkeypatch):
    from baton.engine.models.llama import LlamaMLP

    torch.manual_seed(6)
    mlp = LlamaMLP(64, 96, "silu").bfloat16()
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(9, 64).bfloat16()
    with torch.no_grad():
        unfused = torch.compile(mlp, dynamic=True)(x)  # before packing: torch's GEMMs, Inductor's silu * up
        assert pack_linear_weights(mlp, "cpu") == 2
        calls = []
        real = cpu_linear._packed_linear_silu_mul
        monkeypatch.setattr(cpu_linear, "_packed_linear_silu_mul", lambda *a: calls.append(1) or real(*a))
        fused = mlp(x)
        assert calls, "the packed bf16 MLP did not take the fused kernel"
        torch.testing.assert_close(fused, unfused, atol=0.05, rtol=0.03)
        gelu = LlamaMLP(64, 96, "gelu").bfloat16()
        pack_linear_weights(gelu, "cpu")
        calls.clear()
        gelu(x)
        assert not calls  # only silu is fused
