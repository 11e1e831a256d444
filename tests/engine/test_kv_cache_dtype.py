"""--kv-cache-dtype: a KV cache in its own dtype (bfloat16, float16 or float8 e5m2 under a float32
model): sizing, storing, both decode paths, prefix hits, PD geometry, and accuracy against HF."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from baton.engine.core.forward_batch import ForwardMode
from baton.engine.disaggregation.base import KVGeometry
from baton.engine.mem_cache.memory_pool import MHATokenToKVPool
from baton.engine.model_executor import model_runner as mr
from baton.engine.model_executor.model_loader import load_model
from baton.engine.server_args import ServerArgs

sys.path.insert(0, str(Path(__file__).parent))
from scheduler_harness import SchedulerHarness  # noqa: E402
from test_models import PROMPTS, PagedRunner, hf_logits  # noqa: E402


@pytest.fixture(scope="module")
def llama(tiny_model_factory) -> str:
    return tiny_model_factory("llama", hidden_size=128)  # head_dim 32: the AVX-512 kernel path where there is one


def test_resolve_kv_dtype():
    assert mr.resolve_kv_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert mr.resolve_kv_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2
    assert mr.resolve_kv_dtype("bfloat16", torch.float32) == torch.bfloat16
    with pytest.raises(ValueError, match="unknown --kv-cache-dtype"):
        mr.resolve_kv_dtype("fp8_e4m3", torch.float32)


def test_same_memory_holds_two_and_four_times_the_tokens(llama, monkeypatch):
    monkeypatch.setattr(mr, "_total_memory_bytes", lambda device: 512 << 20)
    monkeypatch.setattr(mr, "_CPU_DEFAULT_MAX_TOKENS", 1 << 30)
    sizes = {kv: mr.ModelRunner(ServerArgs(model_path=llama, kv_cache_dtype=kv, max_running_requests=4))
             .pool_config.max_total_tokens for kv in ("auto", "bfloat16", "fp8_e5m2")}
    assert abs(sizes["bfloat16"] / sizes["auto"] - 2) < 0.01 and abs(sizes["fp8_e5m2"] / sizes["auto"] - 4) < 0.01


def test_server_args_check_the_kv_cache_dtype():
    with pytest.raises(ValueError, match="needs --attention-backend torch"):
        ServerArgs(model_path="m", kv_cache_dtype="fp8_e5m2", attention_backend="flashinfer", device="cuda")
    with pytest.raises(ValueError, match="must be one of"):
        ServerArgs(model_path="m", kv_cache_dtype="fp8_e4m3")
    assert ServerArgs(model_path="m", kv_cache_dtype="auto", attention_backend="flashinfer", device="cuda")


def test_float8_store_writes_the_rounded_values():
    pool = MHATokenToKVPool(16, 1, torch.float8_e5m2, head_num=2, head_dim=4, layer_num=1, device="cpu")
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    loc = torch.tensor([2, 9, 5])
    pool.set_kv_buffer(0, loc, k, v)
    k_buf, v_buf = pool.get_kv_buffer(0)
    assert k_buf.dtype == torch.float8_e5m2
    assert torch.equal(k_buf[loc].float(), k.to(torch.float8_e5m2).float())
    assert torch.equal(v_buf[loc].float(), v.to(torch.float8_e5m2).float())
    assert not k_buf[torch.tensor([0, 1, 3])].float().any()  # nothing else written


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e5m2], ids=["bf16", "e5m2"])
def test_native_and_gather_decode_agree_and_stay_near_hf(llama, kv_dtype):
    """Both decode paths read the same rounded cache, so they agree tightly with each other; against
    HF in float32 the logits move by what the cache's rounding allows (measured bounds, with margin),
    and for float8 they do move: the cache really is float8."""
    from transformers import AutoModelForCausalLM

    ours, config, _ = load_model(llama)
    hf = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    rows, prompts = [1, 0], [PROMPTS[1], PROMPTS[2]]
    steps = []
    for native in (False, True):
        runner = PagedRunner(ours, config, page_size=4, native_decode=native, dtype=kv_dtype)
        logits = runner.run(ForwardMode.EXTEND, rows, prompts, [0, 0])
        last = logits[[len(prompts[0]) - 1, len(logits) - 1]]
        first = last.argmax(-1).tolist()
        steps.append(runner.run(ForwardMode.DECODE, rows, [[t] for t in first], [len(p) for p in prompts]))
    torch.testing.assert_close(steps[1], steps[0], atol=1e-4, rtol=0)
    expected = torch.stack([hf_logits(hf, p + [t])[-1] for p, t in zip(prompts, first)])
    error = (steps[1] - expected).abs().max().item()
    if kv_dtype == torch.bfloat16:
        assert error < 0.08
    else:
        assert 1e-3 < error < 1.5


@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e5m2"])
@pytest.mark.parametrize("native", [True, False], ids=["native", "gather"])
def test_served_with_prefix_hits_and_nothing_leaks(llama, kv, native, monkeypatch):
    """Requests sharing a prefix read the cached part back from the rounded cache (the extend's
    gather path); every request finishes and the pool is whole afterwards."""
    if not native:
        monkeypatch.setenv("BATON_DISABLE_CPU_KERNELS", "1")
    h = SchedulerHarness(llama, device="cpu", max_total_tokens=512, page_size=4, disable_overlap_schedule=True,
                         kv_cache_dtype=kv)
    runner = h.scheduler.worker.model_runner
    assert runner.token_to_kv_pool.k_buffer[0].dtype == mr.resolve_kv_dtype(kv, torch.float32)
    assert runner.attn_backend.native_decode == native
    assert h.scheduler.get_server_info()["kv_cache_dtype"] == str(runner.kv_dtype).removeprefix("torch.")
    shared = [7, 8, 9, 10, 11, 12, 13, 14]
    h.submit("a", shared + [20, 21], max_new_tokens=6)
    h.run_until_idle()
    for i in range(3):
        h.submit(f"b{i}", shared + [30 + i] * (i + 1), max_new_tokens=6)
    out = h.run_until_idle()
    assert all(len(out[r].ids) == 6 for r in ["a", "b0", "b1", "b2"])
    assert out["b2"].cached_tokens >= 8  # the shared prefix came from the cache
    assert h.scheduler.check_memory_integrity()


def test_pd_peers_with_different_kv_cache_dtypes_do_not_pair():
    a, b = KVGeometry(1, "float32", 2, 2, 32), KVGeometry(1, "float8_e5m2", 2, 2, 32)
    assert "dtype float32 != float8_e5m2" in a.mismatch(b)


def test_torch_compile_with_a_float8_cache_has_no_graph_break_and_compiles_only_at_start(llama):
    """The float8 store (a byte view) and the kernel's second dtype stay inside the compiled graphs."""
    import torch._dynamo.utils

    torch._dynamo.utils.counters.clear()
    h = SchedulerHarness(llama, device="cpu", max_total_tokens=1024, page_size=4, disable_overlap_schedule=True,
                         kv_cache_dtype="fp8_e5m2", enable_torch_compile=True, chunked_prefill_size=16)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    torch._dynamo.utils.counters.clear()
    shared = list(range(7, 27))
    for i in range(4):  # chunked extends, prefix hits, decode batches that shrink
        h.submit(f"r{i}", shared + [40 + i] * (i + 1), max_new_tokens=3 + 2 * i)
        h.step()
    out = h.run_until_idle()
    assert [len(out[f"r{i}"].ids) for i in range(4)] == [3, 5, 7, 9]
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert not torch._dynamo.utils.counters["stats"]["unique_graphs"], "compiled while serving, not at start-up"
    assert h.scheduler.check_memory_integrity()
