"""The vision tower (engine/models/qwen_vision.py) against transformers' Qwen3_5VisionModel and
Qwen3VLVisionModel (attn_implementation="sdpa", the per-segment path HF takes without flash-attn): tiny
random towers fed the same patches, CPU float32, merged embeddings and deepstack features equal to 1e-5.
Also: images encoded together equal images encoded one by one (no attention across images), loading by
HF's names with clear errors for a missing or unknown tensor, and on CUDA (`gpu`) the same tower against
the CPU reference."""
from __future__ import annotations

import pytest
import torch

from baton.engine.model_config import ModelConfig, VisionConfig
from baton.engine.models.qwen_vision import QwenVisionTower, VisionOutput, interpolation_taps

TINY_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48, patch_size=4,
                   spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
ARCHS = {"qwen3_5": {}, "qwen3_vl": {"deepstack_visual_indexes": [0]},
         "qwen3_vl-deepstack-unsorted": {"deepstack_visual_indexes": [1, 0]}}
ONE_IMAGE = [(1, 4, 6)]
THREE_IMAGES = [(1, 4, 6), (1, 2, 2), (1, 8, 4)]
WITH_FRAMES = [(2, 2, 4), (1, 6, 2)]  # a two-frame entry: each frame attends within itself, as in HF


def hf_vision(arch: str, seed: int = 0):
    """(transformers' vision model with random weights, our VisionConfig read from the same config)."""
    import transformers as tf

    config_cls, model_cls = {"qwen3_5": (tf.Qwen3_5Config, tf.Qwen3_5VisionModel),
                             "qwen3_vl": (tf.Qwen3VLConfig, tf.Qwen3VLVisionModel)}[arch.split("-")[0]]
    outer = config_cls(vision_config={**TINY_VISION, **ARCHS[arch]})
    outer.vision_config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = model_cls(outer.vision_config).to(torch.float32).eval()
    with torch.no_grad():  # std 0.15 so that every tensor moves the output; norms near 1
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.15)
            if "norm" in name and name.endswith("weight"):
                p.add_(1.0)
    return model, ModelConfig.from_hf(outer).vision


def our_tower(vision: VisionConfig, hf_model) -> QwenVisionTower:
    tower = QwenVisionTower(vision).eval()
    tower.load_weights(hf_model.state_dict().items())
    return tower


def pixels(vision: VisionConfig, grids, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(t * h * w for t, h, w in grids), vision.patch_dim, generator=g)


def run_hf(model, pixel_values: torch.Tensor, grids) -> tuple[torch.Tensor, list[torch.Tensor]]:
    with torch.no_grad():
        out = model(hidden_states=pixel_values, grid_thw=torch.tensor(grids))
    return out.pooler_output, list(getattr(out, "deepstack_features", None) or [])


def assert_equal_to_hf(ours: VisionOutput, hf: tuple[torch.Tensor, list[torch.Tensor]]) -> None:
    embeds, deepstack = hf
    assert ours.embeds.shape == embeds.shape and ours.embeds.dtype == embeds.dtype
    torch.testing.assert_close(ours.embeds, embeds, rtol=0, atol=1e-5)
    assert len(ours.deepstack) == len(deepstack)
    for a, b in zip(ours.deepstack, deepstack):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("grids", [ONE_IMAGE, THREE_IMAGES, WITH_FRAMES], ids=["one", "three", "frames"])
def test_tower_equals_hf(arch, grids):
    model, vision = hf_vision(arch)
    tower = our_tower(vision, model)
    x = pixels(vision, grids)
    with torch.no_grad():
        ours = tower(x, grids)
    hf = run_hf(model, x, grids)
    assert ours.embeds.shape == (sum(tower.tokens_per_image(g) for g in grids), vision.out_hidden_size)
    assert len(ours.deepstack) == len(vision.deepstack_visual_indexes)
    assert hf[0].abs().mean() > 0.1  # the tower is not inert: a wrong weight or position would show
    assert_equal_to_hf(ours, hf)


def test_images_do_not_attend_to_each_other():
    """Three images in one call give what each gives alone: the split ViT DP relies on."""
    model, vision = hf_vision("qwen3_vl")
    tower = our_tower(vision, model)
    x = pixels(vision, THREE_IMAGES)
    with torch.no_grad():
        together = tower(x, THREE_IMAGES)
        alone = [tower(part, [g]) for part, g in zip(x.split([t * h * w for t, h, w in THREE_IMAGES]), THREE_IMAGES)]
    torch.testing.assert_close(together.embeds, torch.cat([a.embeds for a in alone]), rtol=0, atol=1e-5)
    torch.testing.assert_close(together.deepstack[0], torch.cat([a.deepstack[0] for a in alone]), rtol=0, atol=1e-5)
    # (1e-5: a GEMM rounds by its row count) and the images do differ: a swapped image would show
    assert not torch.allclose(alone[0].embeds[:1], alone[2].embeds[:1], atol=1e-3)


def test_position_interpolation_equals_hf_helper():
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights

    grids = [(1, 4, 6), (2, 2, 2), (1, 8, 4), (1, 6, 10)]
    ref_idx, ref_w = get_vision_interpolation_indices_and_weights(torch.tensor(grids), num_grid_per_side=4,
                                                                  mode="bilinear", align_corners=True,
                                                                  spatial_merge_size=2)
    idx, w = interpolation_taps(grids, side=4, merge=2, device=torch.device("cpu"))
    assert torch.equal(idx, ref_idx) and torch.equal(w, ref_w)


def test_vision_config_and_tokens_per_image():
    _, vision = hf_vision("qwen3_vl")
    assert (vision.head_dim, vision.patch_dim, vision.tokens_merged) == (16, 3 * 2 * 4 * 4, 4)
    tower = QwenVisionTower(vision)
    assert [tower.tokens_per_image(g) for g in THREE_IMAGES] == [6, 1, 8]
    assert tower.tokens_per_image((2, 2, 4)) == 4
    with pytest.raises(AssertionError, match="merge size"):
        tower.tokens_per_image((1, 3, 4))


def test_bad_pixel_values_are_refused():
    _, vision = hf_vision("qwen3_5")
    tower = QwenVisionTower(vision)
    with pytest.raises(AssertionError, match="need"):
        tower(torch.zeros(20, vision.patch_dim), [(1, 4, 6)])  # 24 patches expected
    with pytest.raises(AssertionError, match="merge size"):
        tower(torch.zeros(15, vision.patch_dim), [(1, 3, 5)])


def test_load_weights_errors_name_the_tensor():
    model, vision = hf_vision("qwen3_vl")
    state = model.state_dict()
    tower = QwenVisionTower(vision)
    partial = [(k, v) for k, v in state.items() if k != "blocks.1.attn.qkv.bias"]
    with pytest.raises(ValueError, match=r"missing 1 vision tower tensors.*blocks\.1\.attn\.qkv\.bias"):
        tower.load_weights(partial)
    with pytest.raises(ValueError, match=r"deepstack_merger_list\.0\.norm\.weight"):
        tower.load_weights([(k, v) for k, v in state.items() if not k.startswith("deepstack_merger_list.0.norm.w")])
    with pytest.raises(KeyError, match=r"visual\.blocks\.9\.attn\.qkv\.weight"):
        tower.load_weights([*state.items(), ("blocks.9.attn.qkv.weight", state["blocks.0.attn.qkv.weight"])])
    with pytest.raises(AssertionError, match=r"merger\.linear_fc2\.weight"):
        tower.load_weights([(k, v.T if k == "merger.linear_fc2.weight" else v) for k, v in state.items()])


def test_bfloat16_tower_keeps_its_dtype():
    """Activations in the tower's dtype (rotary in float32 inside); close to the float32 tower."""
    model, vision = hf_vision("qwen3_vl")
    tower = our_tower(vision, model)
    x = pixels(vision, THREE_IMAGES)
    with torch.no_grad():
        ref = tower(x, THREE_IMAGES)
        out = tower.to(torch.bfloat16)(x, THREE_IMAGES)
    assert out.embeds.dtype == torch.bfloat16 and out.deepstack[0].dtype == torch.bfloat16
    torch.testing.assert_close(out.embeds.float(), ref.embeds, rtol=0.05, atol=0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_tower_on_cuda_matches_hf_on_cpu(dtype, atol):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model, vision = hf_vision("qwen3_vl")
    tower = our_tower(vision, model).to("cuda", dtype)
    x = pixels(vision, THREE_IMAGES)
    with torch.no_grad():
        out = tower(x.cuda(), THREE_IMAGES)
    embeds, deepstack = run_hf(model, x, THREE_IMAGES)
    assert out.embeds.is_cuda and out.embeds.dtype == dtype
    torch.testing.assert_close(out.embeds.float().cpu(), embeds, rtol=0.02 if dtype != torch.float32 else 0,
                               atol=atol)
    torch.testing.assert_close(out.deepstack[0].float().cpu(), deepstack[0], rtol=0.02 if dtype != torch.float32
                               else 0, atol=atol)
