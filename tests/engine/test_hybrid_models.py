"""Hybrid models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE: Gated DeltaNet + gated attention)
through the real scheduler: greedy tokens equal HF transformers' under concurrency, chunked prefill
(the recurrent state carried across chunks), retraction, mixed chunks, aborts, overlap on and off,
page sizes 1 and 16; the published Qwen3.5 layout (vision-language, served as text); the
recurrent-state pool on its own and its sizing (--max-mamba-cache-size, --mamba-full-memory-ratio)."""
from __future__ import annotations

import pytest
import torch

from baton.engine.io_struct import AbortReq
from baton.engine.mem_cache.state_pool import LinearStateShapes, RecurrentStatePool, split_state_memory
from test_scheduler_vs_hf import MAX_NEW, assert_greedy_equals_hf, harness_for, hf_greedy, run_workload, workload
from tiny_models import _BASE, ARCH_DEFAULTS, HYBRID_ARCHS, save_tiny_tokenizer


def _assert_hybrid_serving(h) -> None:
    """The radix cache is on, with one checkpoint slot per request slot; the pool sizes follow the
    layer kinds, and nothing is held at idle (KV, rows, checkpoint slots)."""
    s, runner = h.scheduler, h.scheduler.worker.model_runner
    layer_types = ARCH_DEFAULTS["qwen3_next"]["layer_types"]
    info = s.get_server_info()
    assert info["radix_cache"] is True and type(s.tree_cache).__name__ == "HybridRadixCache"
    assert runner.token_to_kv_pool.layer_num == layer_types.count("full_attention")
    assert runner.state_pool.shapes.num_layers == layer_types.count("linear_attention")
    assert runner.state_pool.rows == runner.req_to_token_pool.size  # one slot per request row
    assert runner.state_pool.checkpoints == info["recurrent_state_checkpoints_total"] == s.max_running_requests
    assert runner.native_forward is None
    assert s.check_memory_integrity() and info["integrity_ok"]


@pytest.mark.parametrize("arch,loop,page_size", [("qwen3_next", "overlap", 1), ("qwen3_next", "plain", 16),
                                                 ("qwen3_5", "inline", 16), ("qwen3_5_moe", "overlap", 1)])
def test_hybrid_matches_hf_concurrent_chunked(tiny_model_factory, arch, loop, page_size):
    """Requests of 3..50 tokens, arriving in two waves, prompts longer than the 32-token chunk."""
    path = tiny_model_factory(arch)
    h = harness_for(path, loop, page_size=page_size, chunked_prefill_size=32, max_total_tokens=4096)
    prompts = workload()
    assert_greedy_equals_hf(path, prompts, run_workload(h, prompts))
    _assert_hybrid_serving(h)


@pytest.mark.parametrize("arch,loop,page_size,mixed", [("qwen3_next", "overlap", 16, False),
                                                       ("qwen3_5", "plain", 1, False),
                                                       ("qwen3_5_moe", "overlap", 1, True)])
def test_hybrid_matches_hf_under_retraction(tiny_model_factory, arch, loop, page_size, mixed):
    """A KV pool too small for every request: decode retracts some, which restart from a zero state
    when readmitted; with --enable-mixed-chunk, decode steps ride in prefill batches instead (extends
    of one token, continuing the state; the mixed schedule need not retract here)."""
    path = tiny_model_factory(arch)
    prompts, max_new = workload(seed=1), 40
    pool = int(0.6 * (sum(map(len, prompts)) + max_new * len(prompts))) // page_size * page_size
    h = harness_for(path, loop, page_size=page_size, chunked_prefill_size=32, max_total_tokens=pool,
                    enable_mixed_chunk=mixed)
    results = run_workload(h, prompts, staggered=True, max_new=max_new, ignore_eos=True)
    stats = h.scheduler.stats
    assert (stats.mixed_decode_tokens > 0) == mixed
    assert mixed or stats.retractions > 0, "the pool is meant to be too small for all requests at once"
    for i, p in enumerate(prompts):
        assert results[str(i)].ids == hf_greedy(path, p, max_new, ignore_eos=True), f"request {i} differs from HF"
    _assert_hybrid_serving(h)


@pytest.mark.parametrize("loop", ["overlap", "plain"])
def test_aborts_free_state_rows_and_reused_rows_start_from_zero(tiny_model_factory, loop):
    """Requests aborted mid-prefill (between chunks) and mid-decode leave nothing held; requests that
    run next in the same rows (and state slots) still produce HF's tokens."""
    path = tiny_model_factory("qwen3_next")
    prompts = workload(seed=7)
    h = harness_for(path, loop, chunked_prefill_size=16, max_total_tokens=4096, max_running_requests=4)
    for i, p in enumerate(prompts[:4]):
        h.submit(f"gone{i}", p, max_new_tokens=30, ignore_eos=True)
    for _ in range(4):
        h.step()
    for i in range(4):
        h.scheduler.process_input_requests([AbortReq(rid=f"gone{i}")])
    h.run_until_idle()
    assert all(h.results[f"gone{i}"].finish.kind == "abort" for i in range(4))
    assert h.scheduler.check_memory_integrity()
    for i, p in enumerate(prompts[4:8]):
        h.submit(str(i), p, max_new_tokens=12)
    res = h.run_until_idle()
    for i, p in enumerate(prompts[4:8]):
        assert res[str(i)].ids == hf_greedy(path, p), f"request {i} in a reused row differs from HF"
    _assert_hybrid_serving(h)


def _pool() -> RecurrentStatePool:
    return RecurrentStatePool(LinearStateShapes(2, (6, 3), (2, 4, 4)), 5, torch.float32, torch.float32, "cpu")


def test_state_pool_read_zeroes_fresh_rows_only():
    pool = _pool()
    rows = torch.tensor([3, 1])
    conv, ssm = torch.randn(2, 6, 3), torch.randn(2, 2, 4, 4)
    pool.write(1, rows, conv, ssm)
    got_conv, got_ssm = pool.read(1, rows, [False, False])
    assert torch.equal(got_conv, conv) and torch.equal(got_ssm, ssm)
    got_conv, got_ssm = pool.read(1, torch.tensor([1, 3]), [True, False])  # row 1 starts anew
    assert not got_conv[0].any() and not got_ssm[0].any()
    assert torch.equal(got_conv[1], conv[0]) and torch.equal(got_ssm[1], ssm[0])
    assert torch.equal(pool.read(1, torch.tensor([1]), [False])[0][0], conv[1]), \
        "a read never changes the pool"
    assert not pool.conv[0].any() and not pool.ssm[0].any(), "layers are independent"


def test_state_pool_sizes_and_dtypes():
    shapes = LinearStateShapes(3, (10, 3), (4, 8, 8))
    pool = RecurrentStatePool(shapes, 7, torch.bfloat16, torch.float32, "cpu")
    assert pool.size_bytes() == 8 * shapes.bytes_per_row(torch.bfloat16, torch.float32), "7 rows and the padding slot"
    assert [t.shape for t in pool.ssm] == [torch.Size([8, 4, 8, 8])] * 3
    assert pool.conv[0].dtype == torch.bfloat16 and pool.ssm[0].dtype == torch.float32
    with pytest.raises(AssertionError):
        LinearStateShapes(0, (10, 3), (4, 8, 8))


def test_split_state_memory_follows_sglangs_rule():
    """state : KV = ratio : 1 of the budget; a fixed slot count overrides the ratio; the ratio's slots
    are capped at the most requests that may run; each count takes two rows more (the spare row and
    the padding slot of decode graphs)."""
    b = split_state_memory(1_900_000, 1000, 0.9, None, 10_000)
    assert b == (898, 900_000, 1_000_000)  # 900 rows: 898 slots, the spare row and the padding slot
    assert split_state_memory(1_000_000, 1000, 1.0, None, 10_000) == (498, 500_000, 500_000)
    assert split_state_memory(1_900_000, 1000, 0.9, None, 100) == (100, 102_000, 1_798_000), "capped: KV gets the rest"
    assert split_state_memory(1_900_000, 1000, 0.9, 7, 100) == (7, 9_000, 1_891_000), "fixed slots ignore the ratio"
    assert split_state_memory(1_900_000, 1000, 0.9, 500, 100).slots == 500, "a fixed count is not capped"
    assert split_state_memory(1_900_000, 1000, 0.9, None, 10_000, rows_per_slot=2) == (449, 900_000, 1_000_000), \
        "with the radix cache a request slot comes with a checkpoint slot"
    assert split_state_memory(1_900_000, 1000, 0.9, 7, 100, rows_per_slot=2) == (7, 16_000, 1_884_000)
    for budget, slots in ((1_500, None), (10_000, 10)):
        with pytest.raises(ValueError, match="not enough memory for the recurrent-state pool"):
            split_state_memory(budget, 1000, 0.9, slots, 100)


def _runner_sizes(h) -> tuple[int, int, int]:
    runner = h.scheduler.worker.model_runner
    cell = runner.token_to_kv_pool.layer_num * 2 * runner.num_kv_heads * runner.head_dim * runner.kv_dtype.itemsize
    return runner.state_pool.shapes.bytes_per_row(torch.float32, torch.float32), cell, runner.state_pool.size_bytes()


@pytest.mark.parametrize("flags", [{}, {"max_mamba_cache_size": 5}, {"max_running_requests": 9},
                                   {"mamba_full_memory_ratio": 0.3}, {"disable_radix_cache": True}])
def test_kv_pool_sized_from_memory_leaves_room_for_the_state_pool(tiny_model_factory, monkeypatch, flags):
    """With the KV pool sized from free memory, the state pool's bytes come out of the same budget:
    by the ratio (state : KV = 0.9 : 1 by default), or for the slots a flag fixes. With the radix
    cache each request slot has a checkpoint slot beside it, so the ratio's share buys half the slots."""
    from baton.engine.model_executor import model_runner

    memory = 20_000_000  # on CPU the pools get (1 - mem_fraction_static) of it: 3 MB, under the 256-slot cap
    monkeypatch.setattr(model_runner, "_total_memory_bytes", lambda device: memory)
    h = harness_for(tiny_model_factory("qwen3_5"), "plain", max_total_tokens=None, **flags)
    slot, cell, state_bytes = _runner_sizes(h)
    budget = int(memory * (1 - h.scheduler.server_args.mem_fraction_static))
    ratio = flags.get("mamba_full_memory_ratio", 0.9)
    per_slot = 1 if flags.get("disable_radix_cache") else 2
    slots = flags.get("max_mamba_cache_size") or flags.get("max_running_requests") \
        or (int(budget * ratio / (1 + ratio)) // slot - 2) // per_slot
    info = h.scheduler.get_server_info()
    assert info["max_running_requests"] == slots and state_bytes == (per_slot * slots + 2) * slot
    assert info["max_total_num_tokens"] == (budget - state_bytes) // cell
    assert info["recurrent_state_bytes"] == state_bytes
    assert (info["recurrent_state_slots_used"], info["recurrent_state_slots_total"]) == (0, slots + 1)
    assert info["recurrent_state_checkpoints_total"] == (per_slot - 1) * slots


def test_max_mamba_cache_size_caps_running_requests(tiny_model_factory):
    """Three state slots: the fourth request waits until one finishes, and HF's tokens still come out."""
    path = tiny_model_factory("qwen3_5")
    h = harness_for(path, "overlap", max_total_tokens=4096, max_mamba_cache_size=3)
    s = h.scheduler
    assert s.max_running_requests == 3 and s.worker.model_runner.state_pool.rows == 4
    prompts = workload(seed=5)[:8]
    for i, p in enumerate(prompts):
        h.submit(str(i), p, max_new_tokens=MAX_NEW)
    peak_running, waited = 0, False
    while not (not h.step() and s.is_idle()):
        info = s.get_server_info()
        peak_running = max(peak_running, info["num_running_reqs"])
        waited |= info["num_waiting_reqs"] > 0 and info["num_running_reqs"] == 3
        assert info["recurrent_state_slots_used"] <= info["recurrent_state_slots_total"] == 4
    assert peak_running == 3 and waited
    for i, p in enumerate(prompts):
        assert h.results[str(i)].ids == hf_greedy(path, p), f"request {i} differs from HF"
    assert s.get_server_info()["recurrent_state_slots_used"] == 0
    assert harness_for(path, "plain", max_total_tokens=4096, max_mamba_cache_size=3,
                       max_running_requests=2).scheduler.max_running_requests == 2


def test_hybrid_archs_cover_the_registry():
    from baton.engine.models import supported_architectures

    assert {"Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"} <= set(supported_architectures())
    assert set(HYBRID_ARCHS) <= set(ARCH_DEFAULTS)


def test_partial_rotary_equals_hf():
    """partial_rotary_factor 0.25: the first quarter of each head rotated, the rest passed through,
    exactly HF's Qwen3-Next rotary embedding and apply_rotary_pos_emb."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRotaryEmbedding, apply_rotary_pos_emb

    from baton.engine.layers.rotary_embedding import RotaryEmbedding, compute_inv_freq
    from baton.engine.model_config import ModelConfig

    config = Qwen3NextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    rope = RotaryEmbedding(32, *compute_inv_freq(ModelConfig.from_hf(config).text, 32))
    assert rope.rotary_dim == 8
    positions = torch.arange(5, 42)
    q, k = torch.randn(37, 4 * 32), torch.randn(37, 2 * 32)
    cos, sin = Qwen3NextRotaryEmbedding(config)(q, positions[None])
    want_q, want_k = apply_rotary_pos_emb(q.view(1, 37, 4, 32), k.view(1, 37, 2, 32), cos, sin, unsqueeze_dim=2)
    got_q, got_k = rope(positions, q, k)
    torch.testing.assert_close(got_q, want_q.reshape(37, -1), rtol=0, atol=1e-6)
    torch.testing.assert_close(got_k, want_k.reshape(37, -1), rtol=0, atol=1e-6)
    assert torch.equal(got_q.view(37, 4, 32)[..., 8:], q.view(37, 4, 32)[..., 8:])


# ---- the published checkpoints' layout: Qwen3_5(Moe)ForConditionalGeneration, served as text ----

_TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                    num_position_embeddings=16)


def _make_vl_checkpoint(path, arch: str, tie: bool) -> str:
    """A tiny Qwen3_5(Moe)ForConditionalGeneration saved as HF saves it (model.language_model.*,
    model.visual.*, lm_head.* unless tied)."""
    import transformers as tf

    from tiny_models import _randomize_zero_params

    config_cls, model_cls = {"qwen3_5": (tf.Qwen3_5Config, tf.Qwen3_5ForConditionalGeneration),
                             "qwen3_5_moe": (tf.Qwen3_5MoeConfig, tf.Qwen3_5MoeForConditionalGeneration)}[arch]
    config = config_cls(text_config={**_BASE, **ARCH_DEFAULTS[arch]}, vision_config=_TINY_VISION,
                        tie_word_embeddings=tie)
    torch.manual_seed(0)
    model = model_cls(config).to(torch.float32).eval()
    _randomize_zero_params(model, 0.15)
    model.save_pretrained(str(path))
    save_tiny_tokenizer(path)
    return str(path)


@pytest.mark.parametrize("arch,tie", [("qwen3_5", False), ("qwen3_5_moe", True)])
def test_conditional_generation_checkpoint_on_text(tmp_path, arch, tie):
    """The published layout (model.language_model.*, model.visual.*, lm_head.* unless tied): the text
    model's tensors load under its names, the vision tower's into `visual` (every one of them); on
    text-only input greedy tokens equal HF's vision-language model. Images: tests/engine/test_vl_models.py."""
    import transformers as tf
    from safetensors import safe_open

    path = _make_vl_checkpoint(tmp_path / arch, arch, tie)
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        names = list(f.keys())
        vision = {n.removeprefix("model.visual."): f.get_tensor(n) for n in names if n.startswith("model.visual.")}
    assert vision and all(n.startswith(("model.language_model.", "model.visual.", "lm_head.")) for n in names)
    assert any(n.startswith("lm_head.") for n in names) != tie

    h = harness_for(path, "plain", chunked_prefill_size=32, max_total_tokens=4096)
    tower = h.scheduler.worker.model_runner.model.visual
    params = dict(tower.named_parameters())
    assert len(params) == len(vision)
    assert torch.equal(params["pos_embed.weight"], vision["pos_embed.weight"])
    prompts = workload(seed=3)[:6]
    results = run_workload(h, prompts)
    hf_cls = tf.Qwen3_5ForConditionalGeneration if arch == "qwen3_5" else tf.Qwen3_5MoeForConditionalGeneration
    hf = hf_cls.from_pretrained(path, dtype=torch.float32).eval()
    for i, p in enumerate(prompts):
        want = hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)[0, len(p):]
        assert results[str(i)].ids == want.tolist(), f"request {i} (len {len(p)}) differs from HF"
    assert h.scheduler.check_memory_integrity()


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_pd_registers_hybrid_state_buffers(tiny_model_factory, mode):
    """PD serves hybrids (tests/engine/test_pd_hybrid.py): either side registers every
    linear layer's conv and delta-rule buffer for transfer, one slot per request row, and tells its
    peer the layer layout and state dtypes, which the handshake compares."""
    h = harness_for(tiny_model_factory("qwen3_5"), "plain", disaggregation_mode=mode,
                    disaggregation_transfer_backend="fake", disaggregation_bootstrap_port=42999, max_total_tokens=1024)
    try:
        pool, args = h.scheduler.worker.model_runner.state_pool, h.scheduler.pd.mgr.args
        bufs = [*pool.conv, *pool.ssm]
        assert args.state_data_ptrs == tuple(t.data_ptr() for t in bufs)
        assert args.state_item_lens == tuple(t[0].nbytes for t in bufs)
        assert args.state_slots() == pool.rows + pool.checkpoints + 1, "rows, checkpoints and the padding slot"
        geo = args.geometry
        assert (geo.layer_layout, geo.state_dtype) == ("LFLF", "conv float32, ssm float32")
        assert geo.model.startswith("Qwen3_5ForCausalLM") and geo.layer_num == 2
    finally:
        h.scheduler.close()
