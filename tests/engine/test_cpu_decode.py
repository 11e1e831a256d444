"""The native decode step (engine/kernels/cpu_decode.py) against the eager bfloat16 model it replaces:
same logits within bfloat16 rounding, the same greedy tokens, the same K/V in the pool; where it
cannot serve a model it says why; bad indices raise before anything is written; and a bfloat16
engine decodes through it."""
from __future__ import annotations

import pytest
import torch

from baton.engine.kernels import cpu_decode, cpu_linear
from baton.engine.layers.linear import pack_linear_weights
from baton.engine.model_executor.forward_batch import ForwardMode
from baton.engine.model_executor.model_loader import load_model

from test_models import PROMPTS, LLAMA3_ROPE, PagedRunner

pytestmark = pytest.mark.skipif(cpu_linear.unavailable_reason() is not None,
                                reason=f"no packed bfloat16 kernel here: {cpu_linear.unavailable_reason()}")

CASES = {
    "llama": ("llama", {"hidden_size": 128}),  # head_dim 32
    "llama-tied-llama3rope": ("llama", {"tie_word_embeddings": True, "rope_parameters": LLAMA3_ROPE}),
    "qwen2": ("qwen2", {}),  # q/k/v bias
    "qwen3": ("qwen3", {}),  # per-head q/k norms
}
STEPS = 6


def _load(factory, arch, **overrides):
    model, config, dtype = load_model(factory(arch, **overrides), dtype="bfloat16")
    assert dtype == torch.bfloat16 and pack_linear_weights(model, "cpu") > 0
    return model, config


class NativeRunner(PagedRunner):
    """PagedRunner whose decode steps go through the native step (extends stay eager)."""

    def __init__(self, model, config, **kw) -> None:
        super().__init__(model, config, native_decode=True, dtype=torch.bfloat16, **kw)
        self.step = cpu_decode.NativeDecodeStep.create(model, self.req_pool, self.kv_pool)
        assert self.step is not None, cpu_decode.unavailable_reason(model, self.kv_pool)

    def run(self, mode, rows, tokens, prefix_lens):
        if mode != ForwardMode.DECODE:
            return super().run(mode, rows, tokens, prefix_lens)
        r2t = self.req_pool.req_to_token
        seq_lens = torch.tensor([p + 1 for p in prefix_lens])
        hidden = self.step(torch.tensor([t[0] for t in tokens]), torch.tensor(prefix_lens), torch.tensor(rows),
                           seq_lens, torch.stack([r2t[r, p] for r, p in zip(rows, prefix_lens)]))
        with torch.no_grad():
            return self.model.compute_logits(hidden)


@pytest.mark.parametrize("case", list(CASES))
def test_native_step_matches_eager_model(tiny_model_factory, case):
    arch, overrides = CASES[case]
    model, config = _load(tiny_model_factory, arch, **overrides)
    rows, prompts = [2, 0, 1], [PROMPTS[1], PROMPTS[0], PROMPTS[2]]
    lens = [len(p) for p in prompts]
    results, pools = [], []
    for runner in (PagedRunner(model, config, page_size=4, native_decode=True, dtype=torch.bfloat16),
                   NativeRunner(model, config, page_size=4)):
        logits = runner.run(ForwardMode.EXTEND, rows, prompts, [0, 0, 0])
        last = logits[torch.tensor(lens).cumsum(0) - 1]
        results.append(runner.decode_greedy(rows, last, lens, STEPS))
        pools.append(runner.kv_pool)
    (eager_tokens, eager_logits), (native_tokens, native_logits) = results
    assert native_tokens == eager_tokens
    # eager rounds the same ops the same way (identical here); only the RMSNorm's sum of squares is
    # added in another order, which may move a rounding by one unit
    torch.testing.assert_close(native_logits, eager_logits, atol=0.05, rtol=0)
    for layer in range(config.num_hidden_layers):
        for eager_buf, native_buf in zip(pools[0].get_kv_buffer(layer), pools[1].get_kv_buffer(layer)):
            torch.testing.assert_close(native_buf.float(), eager_buf.float(), atol=0.05, rtol=0.02)


def test_unavailable_reasons(tiny_model_factory):
    from baton.engine.mem_cache.memory_pool import MHATokenToKVPool

    def pool(config, dtype=torch.bfloat16):
        head_dim = config.hidden_size // config.num_attention_heads
        return MHATokenToKVPool(64, 1, dtype, config.num_key_value_heads, head_dim, config.num_hidden_layers, "cpu")

    model, config = _load(tiny_model_factory, "llama")
    assert cpu_decode.unavailable_reason(model, pool(config)) is None
    assert "KV cache" in cpu_decode.unavailable_reason(model, pool(config, torch.float8_e5m2))
    assert "tensor parallelism" in cpu_decode.unavailable_reason(model, pool(config), tp_size=2)
    moe, moe_config = _load(tiny_model_factory, "qwen3_moe")
    assert "MoE" in cpu_decode.unavailable_reason(moe, pool(moe_config))
    fp32, fp32_config, _ = load_model(tiny_model_factory("llama"))
    assert "not bfloat16" in cpu_decode.unavailable_reason(fp32, pool(fp32_config, torch.float32))
    unpacked, _, _ = load_model(tiny_model_factory("llama"), dtype="bfloat16")  # --disable-packed-linear
    assert "packed" in cpu_decode.unavailable_reason(unpacked, pool(config))


def test_bad_indices_raise_before_writing(tiny_model_factory):
    model, config = _load(tiny_model_factory, "llama")
    runner = NativeRunner(model, config, page_size=1)
    runner.run(ForwardMode.EXTEND, [0], [PROMPTS[0]], [0])
    before = [t.clone() for layer in range(config.num_hidden_layers) for t in runner.kv_pool.get_kv_buffer(layer)]
    n, slots = len(PROMPTS[0]), runner.kv_pool.get_kv_buffer(0)[0].shape[0]
    loc = runner.req_pool.req_to_token[0, n:n + 1]
    good = dict(input_ids=torch.tensor([5]), positions=torch.tensor([n]), req_pool_indices=torch.tensor([0]),
                seq_lens=torch.tensor([n + 1]), out_cache_loc=loc)
    for name, value in [("input_ids", [config.vocab_size]), ("positions", [-1]), ("req_pool_indices", [99]),
                        ("seq_lens", [10_000]), ("out_cache_loc", [slots])]:
        with pytest.raises(RuntimeError, match="out of range"):
            runner.step(**{**good, name: torch.tensor(value)})
    with pytest.raises(ValueError, match="must be"):
        runner.step(**{**good, "positions": torch.tensor([n, n])})
    after = [t for layer in range(config.num_hidden_layers) for t in runner.kv_pool.get_kv_buffer(layer)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert runner.step(**good).shape == (1, config.hidden_size)  # and it still serves


@pytest.mark.parametrize("disable", [False, True], ids=["native", "disabled"])
def test_engine_decodes_through_the_native_step(tiny_model_factory, disable):
    from scheduler_harness import SchedulerHarness

    path = tiny_model_factory("qwen3")
    h = SchedulerHarness(path, dtype="bfloat16", disable_native_decode_step=disable, max_total_tokens=2048)
    runner = h.scheduler.worker.model_runner
    assert (runner.native_decode_step is None) == disable
    calls = []
    if not disable:
        step = runner.native_decode_step
        runner.native_decode_step = lambda *a: calls.append(len(a[0])) or step(*a)
    for i, p in enumerate(PROMPTS):
        h.submit(str(i), p, max_new_tokens=5, ignore_eos=True)
    h.run_until_idle()
    assert all(len(h.results[str(i)].ids) == 5 for i in range(len(PROMPTS)))
    assert (sum(calls) > 0) != disable  # every decode step took it
    assert h.scheduler.check_memory_integrity()
