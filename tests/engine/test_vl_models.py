"""Images through the real scheduler: greedy tokens equal HF's vision-language models (Qwen3.5 dense
and MoE, Qwen3-VL with deepstack) on the same pixels, token for token, in float32 on CPU: one and
several images of different sizes, an image in a later turn, chunked prefill cutting images, the
overlap loop, retraction; the radix cache keyed by image content and the vision embeddings' cache."""
from __future__ import annotations

import pytest

from scheduler_harness import SchedulerHarness
from test_scheduler_vs_hf import harness_for
from tiny_vl import hf_vl_greedy, make_tiny_vl_model, random_image

MAX_NEW = 8


@pytest.fixture(scope="module")
def vl_models(tmp_path_factory):
    built: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in built:
            built[arch] = make_tiny_vl_model(arch, tmp_path_factory.mktemp(arch))
        return built[arch]

    return get


class Prompts:
    """Chat prompts with images, expanded by the engine's processor (multimodal/processor.py)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        from baton.engine.model_config import ModelConfig
        from baton.engine.multimodal.processor import ImageProcessor

        self.tok = AutoTokenizer.from_pretrained(path)
        mc = ModelConfig.from_pretrained(path)
        self.proc = ImageProcessor(path, mc.vision, mc.text.vocab_size)

    def chat(self, turns: list[list]) -> list[int]:
        """turns: per user turn its parts, strings or ("image", ...) markers; assistant turns between."""
        messages = []
        for i, parts in enumerate(turns):
            if i:
                messages.append({"role": "assistant", "content": "ok."})
            messages.append({"role": "user", "content": [{"type": "text", "text": p} if p is not IMG
                                                         else {"type": "image"} for p in parts]})
        return list(self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False))

    def expand(self, ids: list[int], images: list[tuple[int, int, int]]):
        """images: (width, height, seed) each; -> (expanded ids, MultimodalInputs or None)."""
        if not images:
            return ids, None
        loaded = []
        for w, h, seed in images:
            pixels, grid = self.proc.pixels(random_image(w, h, seed))
            loaded.append((f"img-{w}x{h}-{seed}", grid, pixels))
        return self.proc.expand(ids, loaded)


IMG = object()  # an image part
# (turns, images): one image; two of different sizes; none; an image in the second turn only
WORKLOAD = [
    ([["describe", IMG]], [(30, 50, 1)]),
    ([["compare", IMG, "and", IMG, "please"]], [(64, 20, 2), (17, 17, 3)]),
    ([["no picture here, just text to extend the prompt a little"]], []),
    ([["hello"], ["and now this:", IMG]], [(40, 40, 4)]),
    ([[IMG, "first then text"]], [(48, 24, 5)]),
]


def _expanded(prompts: Prompts, copies: int = 1) -> list:
    """WORKLOAD's prompts; further copies with other pictures of the same sizes."""
    return [prompts.expand(prompts.chat(turns), [(w, h, seed + 10 * k) for w, h, seed in images])
            for k in range(copies) for turns, images in WORKLOAD]


def _submit_all(h: SchedulerHarness, prompts: Prompts, max_new: int = MAX_NEW, copies: int = 1,
                **sampling) -> list:
    """Every WORKLOAD request (`copies` times); with copies, the later half after a few steps of the first."""
    cases = _expanded(prompts, copies)
    for i, (ids, mm) in enumerate(cases):
        if copies > 1 and i == len(cases) // 2:
            for _ in range(3):
                h.step()
        h.submit(str(i), ids, max_new_tokens=max_new, mm_inputs=mm, **sampling)
    return cases


def _assert_equal_hf(h: SchedulerHarness, path: str, cases: list, max_new: int = MAX_NEW, **hf) -> None:
    """Every request's greedy tokens are HF's on the same pixels; the pools whole after."""
    results = h.run_until_idle()
    for i, (ids, mm) in enumerate(cases):
        assert results[str(i)].ids == hf_vl_greedy(path, ids, mm, max_new, **hf), f"request {i} differs from HF"
    assert h.scheduler.check_memory_integrity()


@pytest.mark.parametrize("arch,loop,mixed", [("qwen3_5", "plain", False), ("qwen3_5", "overlap", False),
                                             ("qwen3_5", "plain", True), ("qwen3_5_moe", "plain", False),
                                             ("qwen3_vl", "overlap", False), ("qwen3_vl", "plain", True)])
def test_images_equal_hf(vl_models, arch, loop, mixed):
    """Chunks of 16 tokens cut every image (each is 9..36 tokens); images of five sizes; one prompt
    without any. `mixed`: --enable-mixed-chunk, running requests' decode steps (1-D positions plus
    their deltas) ride in the prefill batches with images."""
    path = vl_models(arch)
    prompts = Prompts(path)
    h = harness_for(path, loop, chunked_prefill_size=16, max_total_tokens=4096, enable_mixed_chunk=mixed)
    _assert_equal_hf(h, path, _submit_all(h, prompts))
    embedder = h.scheduler.worker.model_runner.mm_embedder
    assert embedder.images_encoded == sum(len(images) for _, images in WORKLOAD)  # once each, though cut
    assert (h.scheduler.stats.mixed_decode_tokens > 0) == mixed


def test_images_equal_hf_under_retraction(vl_models):
    """A pool too small for every request's 40 tokens: decode retracts requests with images, which
    run their prompts (and images) again; M-RoPE positions past the prompt continue from the delta."""
    path = vl_models("qwen3_5")
    prompts = Prompts(path)
    max_new = 40
    pool = int(0.6 * sum(len(ids) + max_new for ids, _ in _expanded(prompts, 2)))
    h = harness_for(path, "overlap", chunked_prefill_size=32, max_total_tokens=pool)
    cases = _submit_all(h, prompts, max_new=max_new, copies=2, ignore_eos=True)
    _assert_equal_hf(h, path, cases, max_new, ignore_eos=True)
    assert h.scheduler.stats.retractions > 0, "the pool is meant to be too small for all requests at once"


def test_radix_cache_keys_are_the_images_content(vl_models):
    """Same text, a different image: a different answer, and no KV shared past the image's first
    token; the same image again: its KV reused whole. The same image after other text: the radix cache
    cannot help, the embeddings' cache skips the encoder, and the answer equals HF's."""
    path = vl_models("qwen3_5")
    prompts = Prompts(path)
    h = harness_for(path, "plain", chunked_prefill_size=64, max_total_tokens=4096)
    ids = prompts.chat([["what is in", IMG, "? answer briefly"]])
    runs = {}
    embedder = h.scheduler.worker.model_runner.mm_embedder
    for name, image, text in [("a", (30, 50, 1), ids), ("b", (30, 50, 2), ids), ("a again", (30, 50, 1), ids),
                              ("a elsewhere", (30, 50, 1), prompts.chat([["other words first", IMG]]))]:
        full, mm = prompts.expand(text, [image])
        encoded = embedder.images_encoded
        h.submit(name, full, max_new_tokens=MAX_NEW, mm_inputs=mm)
        result = h.run_until_idle()[name]
        runs[name] = (full, mm, result, embedder.images_encoded - encoded)
        assert result.ids == hf_vl_greedy(path, full, mm, MAX_NEW), name
    (_, mm_a, a, enc_a), (_, _, b, enc_b) = runs["a"], runs["b"]
    offset = mm_a.items[0].offset
    assert a.ids != b.ids, "a different image must change the answer"
    assert b.cached_tokens <= offset, (b.cached_tokens, offset)
    assert (enc_a, enc_b) == (1, 1)
    again = runs["a again"]
    assert again[2].ids == a.ids and again[2].cached_tokens >= mm_a.items[0].end
    elsewhere = runs["a elsewhere"]
    assert elsewhere[3] == 0 and embedder.cache.hits >= 1, "the embeddings' cache serves a known image"
    assert elsewhere[2].cached_tokens < elsewhere[1].items[0].offset + 1
    assert h.scheduler.check_memory_integrity()


@pytest.mark.parametrize("dp_encoder", [False, True], ids=["driver-encodes", "vit-dp"])
def test_tp2_with_and_without_vit_dp_equals_hf(vl_models, dp_encoder):
    """TP 2: the text model sharded, the tower replicated. Without ViT DP the driver encodes and sends
    the embeddings; with it each rank encodes its share (a batch of one image leaves a rank with
    none, which must not hang). The embeddings' cache is off, so every step with images encodes."""
    from baton.engine.server_args import ServerArgs
    from tp_group import tp_followers

    path = vl_models("qwen3_vl")
    prompts = Prompts(path)
    args = dict(tp_size=2, chunked_prefill_size=16, max_total_tokens=4096, mm_embedding_cache_mb=0,
                mm_enable_dp_encoder=dp_encoder, enable_overlap_schedule=True, disable_overlap_schedule=False)
    with tp_followers(ServerArgs(model_path=path, **args)) as tp:
        h = SchedulerHarness(path, tp=tp, **args)
        try:
            _assert_equal_hf(h, path, _submit_all(h, prompts))
            embedder = h.scheduler.worker.model_runner.mm_embedder
            assert embedder.dp_encoder == dp_encoder and embedder.cache.hits == 0
        finally:
            h.scheduler.close()


def test_a_prefill_batch_brings_the_encoder_at_most_its_patch_budget(vl_models):
    """--mm-encoder-max-patches 100: of requests with 96, 64 and 72 patches and a text one, each prefill
    batch takes what fits (the first always): 96 | 64 | 72 + text. All equal HF."""
    path = vl_models("qwen3_5")
    prompts = Prompts(path)
    h = harness_for(path, "plain", chunked_prefill_size=512, max_total_tokens=4096, mm_encoder_max_patches=100)
    cases = [prompts.expand(prompts.chat([["look", IMG]]), [size]) for size in [(30, 50, 1), (64, 20, 2), (48, 24, 5)]]
    cases.append(prompts.expand(prompts.chat([["text only"]]), []))
    assert [sum(t * gh * gw for t, gh, gw in (it.grid_thw for it in mm.items)) for _, mm in cases[:3]] == [96, 64, 72]
    for i, (ids, mm) in enumerate(cases):
        h.submit(str(i), ids, max_new_tokens=MAX_NEW, mm_inputs=mm)
    waiting = []
    while h.scheduler.waiting_queue:
        h.step()
        waiting.append(len(h.scheduler.waiting_queue))
    assert waiting == [3, 2, 0]
    _assert_equal_hf(h, path, cases)


@pytest.mark.gpu
def test_images_on_cuda_stay_with_hf(tmp_path):
    """CUDA, float16, FlashInfer, decode graphs, the overlap loop: a Qwen3.5-shaped VL model at
    FlashInfer's head size, images cut by chunks. Criterion (GPU): teacher-forced against HF float32 on
    CPU, every engine token's HF logit within 0.1 of HF's best, and >= 90% of them HF's exact argmax."""
    import torch

    from test_gpu_paths import GPU_HYBRID, need_gpu
    from tiny_vl import hf_vl_model

    need_gpu()
    path = make_tiny_vl_model("qwen3_5", tmp_path / "vl", vision_overrides={"out_hidden_size": GPU_HYBRID["hidden_size"]},
                              **GPU_HYBRID)
    prompts = Prompts(path)
    h = SchedulerHarness(path, device="cuda", dtype="float16", attention_backend="flashinfer", cuda_graph_max_bs=16,
                         enable_overlap_schedule=True, disable_overlap_schedule=False, chunked_prefill_size=16,
                         max_total_tokens=4096)
    cases = _submit_all(h, prompts)
    results = h.run_until_idle()
    model, exact, total = hf_vl_model(path), 0, 0
    for i, (ids, mm) in enumerate(cases):
        out = results[str(i)].ids
        hf_ids, types = list(ids), [0] * len(ids)
        for item in (mm.items if mm is not None else []):
            for p in range(item.offset, item.end):
                hf_ids[p], types[p] = model.config.image_token_id, 1
        kwargs = {} if mm is None else dict(pixel_values=torch.cat([it.pixel_values for it in mm.items]),
                                            image_grid_thw=torch.tensor([it.grid_thw for it in mm.items]),
                                            mm_token_type_ids=torch.tensor([types + [0] * len(out)]))
        with torch.no_grad():
            logits = model(torch.tensor([hf_ids + out]), **kwargs).logits[0, len(ids) - 1:-1].float()
        gap = logits.max(-1).values - logits.gather(1, torch.tensor(out)[:, None])[:, 0]
        assert bool((gap <= 0.1).all()), f"request {i}: engine tokens far from HF's greedy choice: {gap.tolist()}"
        exact += int((logits.argmax(-1) == torch.tensor(out)).sum())
        total += len(out)
    print(f"[qwen3_5 VL on cuda] {exact}/{total} tokens are HF's exact argmax")
    assert exact >= 0.9 * total
    assert h.scheduler.check_memory_integrity()
