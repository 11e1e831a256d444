"""Weight updates through the real scheduler, in-process: after an update from disk or from tensors
greedy tokens equal HF on the new checkpoint (prefix cache flushed, a hybrid's state checkpoints with
it), a refused update (missing path, tensor, wrong shape, another architecture) leaves the old weights
serving and says why, requests running at the update are retracted and finish under the new weights
(or are aborted with abort_all_requests), get_weights_by_name gives the checkpoint's tensor whatever
the sharding (TP 2 too), a packed bfloat16 model updates like a fresh load, and in PD a decode refuses
KV prefilled under another weight version."""
from __future__ import annotations

import base64
import json
import os
import pickle
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from baton.engine.core.weight_version import WeightVersion, version_hash
from baton.engine.disaggregation.base import KVMetadata, MetadataBuffers
from baton.engine.io_struct import (BatchTokenIDOut, GetWeightsByNameReqInput, UpdateWeightFromDiskReqInput,
                                    UpdateWeightsFromTensorReqInput)
from baton.engine.server_args import ServerArgs
from baton.engine.utils.named_tensors import NamedTensorsError, deserialize_named_tensors, serialize_named_tensors
from scheduler_harness import SchedulerHarness
from test_scheduler_vs_hf import hf_greedy, workload
from tp_group import tp_followers

MAX_NEW = 8
PROMPTS = workload()[:6]


def control(h: SchedulerHarness, req: object) -> object:
    """A control message's reply (the outputs it streamed are collected as usual)."""
    h.scheduler.process_input_requests([req])
    replies = [m for m in h.scheduler.outbox if not isinstance(m, BatchTokenIDOut)]
    h._collect()
    assert len(replies) == 1, replies
    return replies[0]


def greedy(h: SchedulerHarness, tag: str, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    for i, p in enumerate(prompts):
        h.submit(f"{tag}-{i}", p, max_new_tokens=MAX_NEW)
    results = h.run_until_idle()
    return [results[f"{tag}-{i}"].ids for i in range(len(prompts))]


def hf(path: str, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return [hf_greedy(path, p, MAX_NEW) for p in prompts]


def checkpoint(path: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(path, "model.safetensors"))


def variant(src: str, dst: str, edit) -> str:
    """A copy of checkpoint `src` whose tensors `edit` changed (a dict, edited in place)."""
    shutil.copytree(src, dst)
    tensors = checkpoint(src)
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def file_system_sharing():
    """CPU tensors leave this process by shared-memory file name (utils/named_tensors.py)."""
    import torch.multiprocessing as tmp

    saved = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    return saved


# ---------------------------------------------------------------------------- units

def test_weight_version_counts_names_and_refuses_a_mismatch():
    v = WeightVersion("default")
    first = v.hash
    assert version_hash("default") == first != 0 and first < 1 << 63
    assert v.advance() == "1" and v.advance("step-7") == "step-7" and v.advance() == "3"
    assert v.mismatch(v.hash) is None
    message = v.mismatch(first)
    assert "'default'" in message and "'3'" in message
    assert "hash 0x" in v.mismatch(version_hash("elsewhere")) and "none" in v.mismatch(0)


def test_metadata_buffers_carry_the_version_hash_in_column_4():
    buffers = MetadataBuffers(2)
    slot = buffers.alloc()
    meta = KVMetadata(7, -0.5, 1 << 62, 3, version_hash("v2"))
    buffers.set(slot, meta)
    assert buffers.get(slot) == meta and int(buffers.buffer[slot, 4]) == version_hash("v2")
    buffers.free(slot)
    assert buffers.get(slot).weight_version_hash == 0


def test_named_tensors_travel_by_shared_memory_and_nothing_else_unpickles():
    saved = file_system_sharing()
    try:
        sent = [("a.weight", torch.randn(4, 3)), ("b", torch.ones(5, dtype=torch.bfloat16))]
        got = deserialize_named_tensors(serialize_named_tensors(sent))  # base64 text, as over HTTP
        assert [n for n, _ in got] == ["a.weight", "b"] and all(torch.equal(x, y) for (_, x), (_, y) in zip(sent, got))
    finally:
        import torch.multiprocessing as tmp

        tmp.set_sharing_strategy(saved)
    with pytest.raises(NamedTensorsError, match="file_system"):  # a descriptor only this process's children reach
        deserialize_named_tensors(serialize_named_tensors([("x", torch.zeros(2))], as_base64=False))
    with pytest.raises(NamedTensorsError, match="may not reference posix.system|may not reference os.system"):
        deserialize_named_tensors(pickle.dumps(os.system))
    with pytest.raises(NamedTensorsError, match="list of \\(name, tensor\\)"):
        deserialize_named_tensors(base64.b64encode(pickle.dumps([1, 2])).decode())


# ---------------------------------------------------------------------------- updates from disk

@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "qwen3_5"])
def test_update_from_disk_equals_hf_on_the_new_checkpoint(tiny_model_factory, arch):
    """The prompts run first (their KV, and a hybrid's state checkpoints, fill the cache): after the
    update the same prompts must equal HF on the new weights, so nothing of the old KV is reused."""
    old, new = tiny_model_factory(arch), tiny_model_factory(arch, seed=1)
    h = SchedulerHarness(old, max_total_tokens=4096, page_size=1)
    assert greedy(h, "old") == hf(old)
    out = control(h, UpdateWeightFromDiskReqInput(new))
    assert out.success and out.weight_version == "1", out.message
    assert greedy(h, "new") == hf(new)
    assert control(h, UpdateWeightFromDiskReqInput(old, weight_version="back")).weight_version == "back"
    assert greedy(h, "back") == hf(old)
    assert h.scheduler.check_memory_integrity()
    h.scheduler.close()


def test_refused_updates_leave_the_old_weights_and_say_why(tiny_model_factory, tmp_path):
    old = tiny_model_factory("qwen3")
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    missing = variant(old, str(tmp_path / "missing"), lambda t: t.pop(q_proj))
    wrong = variant(old, str(tmp_path / "wrong"), lambda t: t.update({q_proj: t[q_proj][:, :-2].contiguous()}))
    extra = variant(old, str(tmp_path / "extra"), lambda t: t.update({"model.layers.9.mlp.x.weight": torch.ones(2)}))
    cases = [(str(tmp_path / "nowhere"), None, ["not a checkpoint directory"]),
             (missing, None, ["unfilled", "qkv_proj"]),
             (wrong, None, [q_proj, "(64, 62)"]),
             (extra, None, ["model.layers.9.mlp.x.weight"]),
             (tiny_model_factory("llama"), None, ["LlamaForCausalLM checkpoint; this engine serves Qwen3ForCausalLM"]),
             (old, "pt", ["load_format 'pt' is not supported"])]
    h = SchedulerHarness(old, max_total_tokens=4096)
    before = greedy(h, "before")
    for i, (path, load_format, why) in enumerate(cases):
        out = control(h, UpdateWeightFromDiskReqInput(path, load_format=load_format, weight_version="bad"))
        assert not out.success and all(w in out.message for w in why), out.message
        assert out.weight_version == "default"
        assert greedy(h, f"after-{i}") == before
    assert h.scheduler.check_memory_integrity()
    h.scheduler.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_requests_running_at_an_update_are_retracted_and_go_on_under_the_new_weights(tiny_model_factory, overlap):
    """Each request's tokens after the update are HF's on the new weights continuing its prompt and
    the tokens it had: its KV was recomputed, none of the old weights' was kept."""
    old, new = tiny_model_factory("qwen3"), tiny_model_factory("qwen3", seed=1)
    h = SchedulerHarness(old, max_total_tokens=4096, enable_overlap_schedule=overlap, disable_overlap_schedule=not overlap)
    prompts = PROMPTS[:4]
    for i, p in enumerate(prompts):
        h.submit(str(i), p, max_new_tokens=12)
    for _ in range(6):
        h.step()
    out = control(h, UpdateWeightFromDiskReqInput(new))
    assert out.success and out.num_paused_requests > 0, out
    had = {str(i): list(h.scheduler.table.get(str(i)).output_ids) for i in range(len(prompts))}  # old weights'
    assert any(had.values())
    results = h.run_until_idle()
    for i, p in enumerate(prompts):
        r, k = results[str(i)], len(had[str(i)])
        assert r.finish.kind == "length" and r.ids[:k] == had[str(i)]
        assert r.ids[k:] == hf_greedy(new, p + r.ids[:k], 12 - k), f"request {i} after {k} tokens"
    assert h.scheduler.check_memory_integrity()
    h.scheduler.close()


def test_abort_all_requests_ends_every_request_first(tiny_model_factory):
    old, new = tiny_model_factory("qwen3"), tiny_model_factory("qwen3", seed=1)
    h = SchedulerHarness(old, max_total_tokens=4096, max_running_requests=2)
    for i, p in enumerate(PROMPTS):  # two run, the rest wait
        h.submit(str(i), p, max_new_tokens=30)
    for _ in range(4):
        h.step()
    out = control(h, UpdateWeightFromDiskReqInput(new, abort_all_requests=True))
    assert out.success and out.num_paused_requests == 0
    results = h.run_until_idle()
    assert all(results[str(i)].finish.kind == "abort" and results[str(i)].finish.status_code == 503
               for i in range(len(PROMPTS)))
    assert h.scheduler.check_memory_integrity()
    assert greedy(h, "new") == hf(new)
    h.scheduler.close()


# ---------------------------------------------------------------------------- tensors and reads

def test_update_from_tensors_whole_and_in_part(tiny_model_factory):
    old, new = tiny_model_factory("qwen3"), tiny_model_factory("qwen3", seed=1)
    h = SchedulerHarness(old, max_total_tokens=4096)
    saved = file_system_sharing()
    try:
        tensors = list(checkpoint(new).items())
        out = control(h, UpdateWeightsFromTensorReqInput([serialize_named_tensors(tensors, as_base64=False)]))
        assert out.success, out.message
        assert greedy(h, "new") == hf(new)
        name = "model.layers.1.mlp.down_proj.weight"  # one tensor back: only it changes
        part = [(name, checkpoint(old)[name])]
        assert control(h, UpdateWeightsFromTensorReqInput([serialize_named_tensors(part, as_base64=False)],
                                                          weight_version="mixed")).success
        got = control(h, GetWeightsByNameReqInput(name, 1000)).parameter
        assert torch.equal(torch.tensor(got), checkpoint(old)[name])
        other = "model.layers.1.mlp.up_proj.weight"
        assert torch.equal(torch.tensor(control(h, GetWeightsByNameReqInput(other, 1000)).parameter),
                           checkpoint(new)[other])
        bad = [("model.layers.1.mlp.down_proj.weight", torch.zeros(3, 3))]
        out = control(h, UpdateWeightsFromTensorReqInput([serialize_named_tensors(bad, as_base64=False)]))
        assert not out.success and "down_proj.weight: (3, 3)" in out.message and out.weight_version == "mixed"
    finally:
        import torch.multiprocessing as tmp

        tmp.set_sharing_strategy(saved)
    h.scheduler.close()


READ_NAMES = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
              "model.layers.0.self_attn.k_proj.weight", "model.layers.1.self_attn.v_proj.weight",
              "model.layers.1.self_attn.o_proj.weight", "model.layers.0.mlp.gate_proj.weight",
              "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight",
              "model.layers.0.input_layernorm.weight", "model.norm.weight", "lm_head.weight"]


def assert_reads_equal_the_checkpoint(h: SchedulerHarness, path: str, names: list[str], dtype=torch.float32) -> None:
    tensors = checkpoint(path)
    for name in names:
        for rows in (3, 100000):
            got = control(h, GetWeightsByNameReqInput(name, rows))
            assert got.parameter is not None, got.message
            want = tensors.get(name, tensors["model.embed_tokens.weight"])[:rows]  # a tied head is the embedding
            assert torch.equal(torch.tensor(got.parameter), want.to(dtype).float()), name


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "qwen3_5"])
def test_get_weights_by_name_gives_the_checkpoint_tensor(tiny_model_factory, arch):
    path = tiny_model_factory(arch)
    h = SchedulerHarness(path, max_total_tokens=1024)
    names = [n for n in checkpoint(path) if n.endswith("weight")][::3] + ["lm_head.weight"]
    assert_reads_equal_the_checkpoint(h, path, names)
    out = control(h, GetWeightsByNameReqInput("model.nothing.weight"))
    assert out.parameter is None and "no tensor 'model.nothing.weight'" in out.message
    h.scheduler.close()


def test_a_tied_lm_head_reads_as_the_embedding(tiny_model_factory):
    path = tiny_model_factory("qwen3", tie_word_embeddings=True)
    h = SchedulerHarness(path, max_total_tokens=1024)
    assert_reads_equal_the_checkpoint(h, path, ["lm_head.weight", "model.embed_tokens.weight"])
    h.scheduler.close()


def test_a_packed_bfloat16_model_updates_like_a_fresh_load(tiny_model_factory):
    """CPU bfloat16: the packed linears (and the native forward reading them) take the new weights."""
    old, new = tiny_model_factory("qwen3"), tiny_model_factory("qwen3", seed=1)
    fresh = SchedulerHarness(new, dtype="bfloat16", max_total_tokens=1024)
    want = greedy(fresh, "fresh")
    fresh.scheduler.close()
    h = SchedulerHarness(old, dtype="bfloat16", max_total_tokens=1024)
    assert control(h, UpdateWeightFromDiskReqInput(new)).success
    assert greedy(h, "new") == want
    assert_reads_equal_the_checkpoint(h, new, READ_NAMES, torch.bfloat16)
    h.scheduler.close()


# ---------------------------------------------------------------------------- tensor parallelism

def test_tp2_updates_from_disk_and_reads_the_unsharded_tensors(tiny_model_factory, tmp_path):
    """Each rank loads its shard of the new checkpoint; a read gathers the shards (KV heads split);
    a shape no rank can take is refused on every rank, and the old weights serve on."""
    old, new = tiny_model_factory("qwen3"), tiny_model_factory("qwen3", seed=1)
    wrong = variant(new, str(tmp_path / "wrong"), lambda t: t.update(
        {"model.layers.1.mlp.down_proj.weight": t["model.layers.1.mlp.down_proj.weight"][:, :64].contiguous()}))
    args = dict(tp_size=2, max_total_tokens=4096)
    with tp_followers(ServerArgs(model_path=old, **args)) as tp:
        h = SchedulerHarness(old, tp=tp, **args)
        try:
            assert greedy(h, "old") == hf(old)
            out = control(h, UpdateWeightFromDiskReqInput(new, weight_version="v2"))
            assert out.success and out.weight_version == "v2", out.message
            assert greedy(h, "new") == hf(new)
            assert_reads_equal_the_checkpoint(h, new, READ_NAMES)
            out = control(h, UpdateWeightFromDiskReqInput(wrong))
            assert not out.success and "down_proj.weight: (64, 64)" in out.message, out.message
            assert greedy(h, "still") == hf(new) and h.scheduler.check_memory_integrity()
        finally:
            h.scheduler.close()


# ---------------------------------------------------------------------------- PD

def test_pd_decode_refuses_kv_prefilled_under_another_weight_version(tiny_model_factory):
    from test_pd_scheduler import PDPair

    old, new = tiny_model_factory("qwen3"), tiny_model_factory("qwen3", seed=1)
    pair = PDPair(old, max_total_tokens=4096)
    try:
        pair.submit("same", PROMPTS[0])
        pair.run_until_idle()
        assert pair.decode.results["same"].ids == hf_greedy(old, PROMPTS[0], 12)
        assert control(pair.decode, UpdateWeightFromDiskReqInput(new, weight_version="v2")).success
        pair.submit("mixed", PROMPTS[1])
        pair.run_until_idle()
        finish = pair.decode.results["mixed"].finish
        assert finish.kind == "abort" and finish.status_code == 409, finish
        assert "'default'" in finish.message and "'v2'" in finish.message, finish.message
        assert control(pair.prefill, UpdateWeightFromDiskReqInput(new, weight_version="v2")).success
        pair.submit("both", PROMPTS[1])
        pair.run_until_idle()
        assert pair.decode.results["both"].ids == hf_greedy(new, PROMPTS[1], 12)
        pair.assert_settled()
    finally:
        pair.close()


def test_checkpoint_fixtures_differ(tiny_model_factory):
    """The two seeds give two models (else every test above would pass without an update)."""
    a, b = checkpoint(tiny_model_factory("qwen3")), checkpoint(tiny_model_factory("qwen3", seed=1))
    assert json.dumps(sorted(a)) == json.dumps(sorted(b)) and not torch.equal(a["lm_head.weight"], b["lm_head.weight"])
    assert hf(tiny_model_factory("qwen3")) != hf(tiny_model_factory("qwen3", seed=1))
