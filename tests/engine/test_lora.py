"""Multi-LoRA serving through the real scheduler: batches that mix requests under two adapters and the base
model give, per request, HF's greedy tokens on the checkpoint with its adapter merged in (W + scaling B A);
the radix cache never shares a prefix across adapters; a batch holds at most --max-loras-per-batch
adapters while more are loaded (the pool's slots are reloaded); loads and unloads through the control
messages; TP 2; the segmented LoRA GEMM's Triton kernel equals the torch path under the interpreter."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Optional

import pytest

from baton.engine.io_struct import (LoadLoRAAdapterReqInput, LoRAUpdateOutput, TokenizedGenerateReqInput,
                                    UnloadLoRAAdapterReqInput)
from baton.engine.model_executor.lora_adapter import AdapterError, LoraSettings, read_adapter
from baton.engine.sampling.sampling_params import SamplingParams
from baton.engine.server_args import ServerArgs, parse_lora_paths
from lora_adapters import make_adapter
from scheduler_harness import SchedulerHarness
from test_scheduler_vs_hf import hf_greedy

MAX_NEW = 8


@pytest.fixture(scope="module")
def adapters(tiny_model_factory, tmp_path_factory):
    """arch -> (base path, {name: (adapter dir, merged dir)}): `a` on every projection (rank 8), `b` on
    q, v, gate, down with rsLoRA scaling (rank 4), `c` on o and up (rank 2)."""
    built = {}

    def get(arch: str):
        if arch not in built:
            base = tiny_model_factory(arch)
            root = tmp_path_factory.mktemp(f"lora-{arch}")
            built[arch] = base, {
                "a": make_adapter(base, root / "a", rank=8, seed=1),
                "b": make_adapter(base, root / "b", targets=("q_proj", "v_proj", "gate_proj", "down_proj"), rank=4,
                                  alpha=8, seed=2, use_rslora=True),
                "c": make_adapter(base, root / "c", targets=("o_proj", "up_proj"), rank=2, alpha=4, seed=3),
            }
        return built[arch]

    return get


class LoraHarness(SchedulerHarness):
    def submit_as(self, rid: str, ids: list[int], lora: Optional[str], max_new: int = MAX_NEW) -> None:
        params = SamplingParams(max_new_tokens=max_new, temperature=0.0)
        self.scheduler.process_input_requests([TokenizedGenerateReqInput(
            rid=rid, input_text=None, input_ids=list(ids), sampling_params=params, lora_name=lora)])
        self._collect()

    def control(self, msg) -> LoRAUpdateOutput:
        self.scheduler.process_input_requests([msg])
        replies = [m for m in self.scheduler.outbox if isinstance(m, LoRAUpdateOutput)]
        self.scheduler.outbox[:] = [m for m in self.scheduler.outbox if not isinstance(m, LoRAUpdateOutput)]
        assert len(replies) == 1
        return replies[0]


def _lora_paths(paths: dict, names: str) -> tuple[str, ...]:
    return tuple(f"{n}={paths[n][0]}" for n in names)


def _reference(base: str, paths: dict, lora: Optional[str], prompt: list[int], max_new: int = MAX_NEW) -> list[int]:
    return hf_greedy(base if lora is None else paths[lora][1], prompt, max_new)


PROMPTS = [[11, 42, 7, 99, 5, 17, 300, 23], [200, 201, 202, 203, 204], [77] * 3 + list(range(30, 60))]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_5"])
@pytest.mark.parametrize("loop", ["plain", "overlap", "mixed-chunk"])
def test_mixed_batches_equal_hf_on_each_merged_checkpoint(adapters, arch, loop):
    """`mixed-chunk`: the running requests' decode rows ride in the prefill batches, under their adapters."""
    base, paths = adapters(arch)
    h = LoraHarness(base, lora_paths=_lora_paths(paths, "ab"), chunked_prefill_size=16, max_total_tokens=2048,
                    enable_overlap_schedule=loop == "overlap", disable_overlap_schedule=loop != "overlap",
                    enable_mixed_chunk=loop == "mixed-chunk")
    jobs = [(f"{i}-{lora}", p, lora) for i, p in enumerate(PROMPTS) for lora in (None, "a", "b")]
    for rid, p, lora in jobs:
        h.submit_as(rid, p, lora)
    results = h.run_until_idle()
    for rid, p, lora in jobs:
        assert results[rid].ids == _reference(base, paths, lora, p), f"{rid} differs from HF on its merged checkpoint"
    for i in range(len(PROMPTS)):  # the adapters matter: an equality above is no accident of a tiny delta
        assert results[f"{i}-a"].ids != results[f"{i}-None"].ids or results[f"{i}-b"].ids != results[f"{i}-None"].ids
    assert loop != "mixed-chunk" or h.scheduler.stats.mixed_decode_tokens > 0
    assert h.scheduler.check_memory_integrity()


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_the_radix_cache_never_shares_a_prefix_across_adapters(adapters, arch):
    """A hybrid model's recurrent-state checkpoints are keyed alike: a hit restores its own adapter's state."""
    base, paths = adapters(arch)
    h = LoraHarness(base, lora_paths=_lora_paths(paths, "ab"), max_total_tokens=2048, mamba_track_interval=8)
    prompt = list(range(100, 140))
    order = [None, "a", "b", None, "a", "b"]
    for k, lora in enumerate(order):  # one after the other: each finds what the ones before cached
        h.submit_as(str(k), prompt, lora)
        h.run_until_idle()
    cached = [h.results[str(k)].cached_tokens for k in range(len(order))]
    assert cached[:3] == [0, 0, 0], f"a request hit another adapter's cached prefix: {cached}"
    assert all(c >= len(prompt) - 1 for c in cached[3:]), f"each adapter's own repeat should hit: {cached}"
    for k, lora in enumerate(order):
        assert h.results[str(k)].ids == _reference(base, paths, lora, prompt)
    assert h.scheduler.check_memory_integrity()


@pytest.mark.parametrize("loop", ["plain", "overlap"])
def test_a_batch_holds_at_most_max_loras_per_batch_adapters(adapters, monkeypatch, loop):
    """Three adapters and the base over two slots: every batch holds at most two of them (the base counting),
    the pool's slots are reloaded as batches change adapters (in the overlap loop while the batch before
    runs), and every output equals HF's."""
    base, paths = adapters("qwen3")
    h = LoraHarness(base, lora_paths=_lora_paths(paths, "abc"), max_loras_per_batch=2, max_total_tokens=2048,
                    enable_overlap_schedule=loop == "overlap", disable_overlap_schedule=loop == "plain")
    lora = h.scheduler.lora
    seen, loads = [], []
    prepare = lora.prepare

    def recording(mwb, reqs):
        prepare(mwb, reqs)
        seen.append({r.lora_uid for r in reqs})
        loads.extend(mwb.lora.loads)

    monkeypatch.setattr(lora, "prepare", recording)
    jobs = [(f"{i}-{name}", p, name) for i, p in enumerate(PROMPTS[:2]) for name in ("a", None, "b", "c")]
    for rid, p, name in jobs:
        h.submit_as(rid, p, name)
    results = h.run_until_idle()
    assert seen and max(map(len, seen)) <= 2, seen
    assert len({uid for _, uid, _ in loads}) == 3 and len(loads) > 2, "adapters should take turns in the 2 slots"
    for rid, p, name in jobs:
        assert results[rid].ids == _reference(base, paths, name, p), rid
    assert h.scheduler.check_memory_integrity()


def test_load_and_unload_through_the_scheduler(adapters):
    base, paths = adapters("llama")
    h = LoraHarness(base, enable_lora=True, max_lora_rank=8, lora_target_modules=("all",), max_total_tokens=2048)
    out = h.control(LoadLoRAAdapterReqInput("a", paths["a"][0]))
    assert out.success and out.loaded_adapters == {"a": paths["a"][0]}
    again = h.control(LoadLoRAAdapterReqInput("a", paths["b"][0]))
    assert not again.success and "loaded already" in again.error_message
    h.submit_as("r1", PROMPTS[0], "a", max_new=12)
    h.step()  # running now: the unload waits for it
    pending = h.control(UnloadLoRAAdapterReqInput("a"))
    assert not pending.success and pending.in_use == 1 and pending.loaded_adapters == {}
    h.submit_as("late", PROMPTS[1], "a")  # the name is gone for new requests at once
    assert h.results["late"].finish.status_code == 400 and "'a' is not loaded" in h.results["late"].finish.message
    h.run_until_idle()
    assert h.results["r1"].ids == _reference(base, paths, "a", PROMPTS[0], 12)
    done = h.control(UnloadLoRAAdapterReqInput("a"))
    assert done.success and done.loaded_adapters == {}
    assert not h.control(UnloadLoRAAdapterReqInput("a")).success  # unknown now
    # the name again, for another adapter: a new uid, so neither the pool nor the radix cache mixes them up
    assert h.control(LoadLoRAAdapterReqInput("a", paths["b"][0])).success
    h.submit_as("r2", PROMPTS[0], "a")
    h.run_until_idle()
    assert h.results["r2"].ids == _reference(base, paths, "b", PROMPTS[0])
    assert h.results["r2"].cached_tokens == 0
    assert h.scheduler.check_memory_integrity()


def test_adapters_the_pool_cannot_serve_are_refused(adapters):
    base, paths = adapters("llama")
    h = LoraHarness(base, enable_lora=True, max_lora_rank=4, lora_target_modules=("q_proj", "v_proj"),
                    max_loaded_loras=8, max_total_tokens=2048)
    rank = h.control(LoadLoRAAdapterReqInput("a", paths["a"][0]))
    assert not rank.success and "rank 8 is above --max-lora-rank 4" in rank.error_message
    targets = h.control(LoadLoRAAdapterReqInput("b", paths["b"][0]))
    assert not targets.success and "down_proj, gate_proj" in targets.error_message
    missing = h.control(LoadLoRAAdapterReqInput("x", "/nonexistent"))
    assert not missing.success and "adapter_config.json" in missing.error_message
    h.submit_as("r", PROMPTS[0], "nope")
    assert h.results["r"].finish.status_code == 400 and "'nope' is not loaded" in h.results["r"].finish.message


def test_without_enable_lora_an_adapter_is_a_400(tiny_model_factory):
    h = LoraHarness(tiny_model_factory("llama"), max_total_tokens=1024)
    h.submit_as("r", PROMPTS[0], "a")
    assert h.results["r"].finish.status_code == 400 and "not enabled" in h.results["r"].finish.message
    assert not h.control(LoadLoRAAdapterReqInput("a", "/x")).success


def test_lora_flags(tmp_path):
    assert parse_lora_paths(("a=/p", "/q", '{"lora_name": "c", "lora_path": "/r", "pinned": true}')) == [
        ("a", "/p", False), ("/q", "/q", False), ("c", "/r", True)]
    with pytest.raises(ValueError, match="name of its own"):
        parse_lora_paths(("a=/p", "a=/q"))
    args = ServerArgs(model_path=str(tmp_path), lora_paths=("a=/p",))
    assert args.enable_lora  # --lora-paths turn LoRA on, as in SGLang
    for bad, match in (({"max_lora_rank": 8}, "means nothing without --enable-lora"),
                       ({"enable_lora": True}, "needs --max-lora-rank and --lora-target-modules"),
                       ({"enable_lora": True, "max_lora_rank": 8, "lora_target_modules": ("qkv",)}, "unknown qkv"),
                       ({"lora_paths": ("a=/p",), "max_loras_per_batch": 4, "max_loaded_loras": 2},
                        "--max-loaded-loras"),
                       ({"lora_paths": ("a=/p",), "speculative_algorithm": "NGRAM"}, "not supported")):
        with pytest.raises(ValueError, match=match):
            ServerArgs(model_path=str(tmp_path), **bad)


def test_peft_adapter_reading(adapters, tmp_path):
    base, paths = adapters("llama")
    config, matrices = read_adapter(paths["b"][0])
    assert config.rank == 4 and config.scaling == pytest.approx(8 / 2)  # rsLoRA: alpha / sqrt(r)
    assert sorted({m.rsplit(".", 1)[-1] for m in matrices}) == ["down_proj", "gate_proj", "q_proj", "v_proj"]
    settings = LoraSettings.resolve([paths["b"][0], paths["c"][0]], 4, None, None)
    assert settings.max_rank == 4 and settings.target_modules == {"q_proj", "v_proj", "gate_proj", "down_proj",
                                                                   "o_proj", "up_proj"}
    (tmp_path / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8, "use_dora": true}')
    with pytest.raises(AdapterError, match="DoRA"):
        read_adapter(str(tmp_path))


def test_tp2_mixed_adapters_equal_hf(adapters):
    from tp_group import tp_followers

    base, paths = adapters("llama")
    args = dict(lora_paths=_lora_paths(paths, "ab"), max_loras_per_batch=2, tp_size=2, max_total_tokens=2048,
                disable_overlap_schedule=True)
    with tp_followers(ServerArgs(model_path=base, **args)) as tp:
        h = LoraHarness(base, tp=tp, **args)
        try:
            jobs = [(f"{i}-{lora}", p, lora) for i, p in enumerate(PROMPTS[:2]) for lora in ("a", None, "b")]
            for rid, p, lora in jobs:
                h.submit_as(rid, p, lora)
            results = h.run_until_idle()
        finally:
            h.scheduler.close()
    for rid, p, lora in jobs:
        assert results[rid].ids == _reference(base, paths, lora, p), rid


INTERPRETED = textwrap.dedent(
    """
    import torch
    from baton.engine.triton_ops.lora_sgemm import (Segments, lora_expand_add_torch, lora_expand_add_triton,
                                                    lora_shrink_torch, lora_shrink_triton)

    g = torch.Generator().manual_seed(0)

    def check(rows, slots, k, rank, parts, dtype, tol):
        segs = Segments.from_rows(rows, slots, "cpu")
        t = sum(rows)
        x = torch.randn(t, k, generator=g).to(dtype)
        a = torch.randn(3, parts * rank, k, generator=g).to(dtype)
        out_w = 24 * parts + 5  # the parts' columns inside a wider output (strided views)
        b = torch.randn(3, out_w, rank, generator=g).to(dtype)
        scaling = torch.tensor([0.5, 2.0, 1.25])
        xa_t, xa_r = lora_shrink_triton(x, a, segs), lora_shrink_torch(x, a, segs)
        covered = torch.zeros(t, dtype=torch.bool)
        for s, n in zip(segs.starts, segs.lens):
            covered[s:s + n] = True
        torch.testing.assert_close(xa_t[covered].float(), xa_r[covered].float(), atol=tol, rtol=tol)
        base = torch.randn(t, out_w, generator=g).to(dtype)
        got, want = base.clone(), base.clone()
        for p in range(parts):
            cols = slice(5 + 24 * p, 5 + 24 * p + 20)
            lora_expand_add_triton(got[:, cols], xa_r[:, p * rank:(p + 1) * rank], b[:, cols], scaling, segs)
            lora_expand_add_torch(want[:, cols], xa_r[:, p * rank:(p + 1) * rank], b[:, cols], scaling, segs)
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
        assert torch.equal(got[~covered], base[~covered]), "rows of the base model changed"

    check([5, 1, 20, 3, 11], [0, 0, -1, 2, 1], 48, 8, 3, torch.float32, 1e-5)  # runs merged, a base run skipped
    check([1] * 9, [2, -1, 0, 0, 1, -1, 2, 2, 1], 64, 4, 2, torch.float32, 1e-5)  # a decode batch
    check([70, 2], [1, 0], 40, 16, 1, torch.float32, 1e-5)  # a run over several row blocks
    check([7, 9], [0, 1], 32, 8, 3, torch.float16, 2e-2)
    check([4, 4], [-1, -1], 16, 8, 1, torch.float32, 1e-5)  # the base model only: nothing to do
    print("INTERPRETED OK")
    """
)


def test_segmented_lora_kernel_equals_the_torch_path_under_the_interpreter():
    proc = subprocess.run([sys.executable, "-c", INTERPRETED], env=dict(os.environ, TRITON_INTERPRET="1"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "INTERPRETED OK" in proc.stdout, proc.stdout + proc.stderr


def test_segments_merge_runs_of_one_adapter_and_skip_the_base_model():
    from baton.engine.triton_ops.lora_sgemm import Segments

    segs = Segments.from_rows([3, 2, 0, 4, 1, 1], [1, 1, 0, -1, 1, 1], "cpu")
    assert (segs.starts, segs.lens, segs.slots, segs.max_len) == ([0, 9], [5, 2], [1, 1], 5)
    apart = Segments.from_rows([2, 3, 1], [0, 1, 0], "cpu")  # one slot, but not consecutive rows
    assert (apart.starts, apart.lens, apart.slots) == ([0, 2, 5], [2, 3, 1], [0, 1, 0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_segmented_lora_kernel_on_cuda(dtype):
    import torch

    from baton.engine.triton_ops.lora_sgemm import (Segments, lora_expand_add_torch, lora_expand_add_triton,
                                                    lora_shrink_torch, lora_shrink_triton)

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    dt, tol = getattr(torch, dtype), (1e-4 if dtype == "float32" else 3e-2)
    g = torch.Generator(device="cuda").manual_seed(0)
    for rows, slots in (([1] * 64, [i % 5 - 1 for i in range(64)]), ([300, 7, 129], [2, -1, 0])):
        segs = Segments.from_rows(rows, slots, "cuda")
        x = torch.randn(sum(rows), 512, generator=g, device="cuda").to(dt)
        a = (torch.randn(4, 3 * 16, 512, generator=g, device="cuda") / 512 ** 0.5).to(dt)
        b = torch.randn(4, 768, 16, generator=g, device="cuda").to(dt)
        scaling = torch.tensor([0.5, 2.0, 1.0, 4.0], device="cuda")
        xa = lora_shrink_torch(x, a, segs)
        got, want = torch.zeros(sum(rows), 768, device="cuda", dtype=dt), torch.zeros(sum(rows), 768, device="cuda",
                                                                                    dtype=dt)
        for p in range(3):
            lora_expand_add_triton(got[:, 256 * p:256 * (p + 1)], xa[:, 16 * p:16 * (p + 1)], b[:, 256 * p:256 * (p + 1)],
                                   scaling, segs)
            lora_expand_add_torch(want[:, 256 * p:256 * (p + 1)], xa[:, 16 * p:16 * (p + 1)], b[:, 256 * p:256 * (p + 1)],
                                  scaling, segs)
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
        covered = want.abs().sum(1) > 0
        torch.testing.assert_close(lora_shrink_triton(x, a, segs)[covered].float(), xa[covered].float(), atol=tol,
                                   rtol=tol)


@pytest.mark.gpu
def test_lora_on_cuda_equals_its_torch_path_and_hf(adapters):
    """The scheduler on CUDA (float32): the Triton LoRA path gives the torch path's tokens, and HF's."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    base, paths = adapters("llama")
    jobs = [(f"{i}-{lora}", p, lora) for i, p in enumerate(PROMPTS) for lora in (None, "a", "b")]
    runs = []
    for reference in (False, True):
        h = LoraHarness(base, device="cuda", dtype="float32", lora_paths=_lora_paths(paths, "ab"),
                        chunked_prefill_size=16, max_total_tokens=2048)
        h.scheduler.worker.model_runner.lora.batch.reference = reference
        try:
            for rid, p, lora in jobs:
                h.submit_as(rid, p, lora)
            runs.append({rid: r.ids for rid, r in h.run_until_idle().items()})
            assert h.scheduler.check_memory_integrity()
        finally:
            h.scheduler.close()
    assert runs[0] == runs[1]
    exact = sum(runs[0][rid] == _reference(base, paths, lora, p) for rid, p, lora in jobs)
    assert exact >= 0.8 * len(jobs), f"{exact} of {len(jobs)} requests give HF's tokens"
