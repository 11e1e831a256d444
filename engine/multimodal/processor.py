"""The image processor of a vision-language model, in the tokenizer process (SGLang's design).

For each image of a request: the Qwen2-VL image processing (resize to a multiple of patch x merge
within the checkpoint's pixel bounds, rescale, normalize, cut into patches: `pixel_values` and the
patch grid `image_grid_thw`), by transformers' PIL image processor configured from the checkpoint's
preprocessor_config.json, as SGLang and vLLM take the model's own HF processor. Then the prompt: each
image's single placeholder token (`image_token_id`, which the chat template writes between
vision_start and vision_end) becomes the image's t * h * w / merge^2 tokens, whose ids are pad
values drawn from the image's hash (inputs.py says why), and the M-RoPE positions of the whole prompt
follow (mrope.py).

A PD decode engine processes the images the same way: its prompt must be the prefill's token for
token. It does not encode them (their KV arrives from the prefill, the M-RoPE delta with the transfer
metadata) unless it retracts the request and runs its prompt again itself.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from baton.engine.model_config import VisionConfig
from baton.engine.multimodal.inputs import MmItem, MultimodalInputs
from baton.engine.multimodal.mrope import mrope_positions


class ProcessorError(ValueError):
    """An image or prompt this model cannot take (a 400)."""


@dataclass(frozen=True)
class ImageGeometry:
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


def _preprocessor_config(model_path: str) -> dict[str, Any]:
    path = os.path.join(model_path, "preprocessor_config.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


class ImageProcessor:
    """One per tokenizer process; `process` is thread-safe (the tokenizer manager runs it off the
    event loop, at most --mm-max-concurrent-calls at a time)."""

    def __init__(self, model_path: str, vision: VisionConfig, vocab_size: int) -> None:
        from transformers import Qwen2VLImageProcessorPil

        cfg = _preprocessor_config(model_path)
        size = cfg.get("size") or {}
        kwargs = {k: cfg[k] for k in ("image_mean", "image_std", "rescale_factor", "do_rescale", "do_normalize",
                                      "do_convert_rgb", "resample") if k in cfg}
        self.geometry = ImageGeometry(
            patch_size=cfg.get("patch_size", vision.patch_size),
            temporal_patch_size=cfg.get("temporal_patch_size", vision.temporal_patch_size),
            merge_size=cfg.get("merge_size", vision.spatial_merge_size),
            min_pixels=size.get("shortest_edge", cfg.get("min_pixels", 56 * 56)),
            max_pixels=size.get("longest_edge", cfg.get("max_pixels", 28 * 28 * 1280)))
        g = self.geometry
        if (g.patch_size, g.temporal_patch_size, g.merge_size) != (
                vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size):
            raise ValueError(f"{model_path}: preprocessor_config.json's patches ({g}) differ from the vision config's")
        self.hf = Qwen2VLImageProcessorPil(patch_size=g.patch_size, temporal_patch_size=g.temporal_patch_size,
                                           merge_size=g.merge_size, min_pixels=g.min_pixels,
                                           max_pixels=g.max_pixels, **kwargs)
        self.vision, self.vocab_size = vision, vocab_size

    # ---- one image ----

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """The patch grid (t, h, w) an image of this size becomes."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        g = self.geometry
        try:
            h, w = smart_resize(height, width, g.factor, min_pixels=g.min_pixels, max_pixels=g.max_pixels)
        except ValueError as e:  # an aspect ratio over 200
            raise ProcessorError(f"image of {width}x{height}: {e}") from e
        return 1, h // g.patch_size, w // g.patch_size

    def pixels(self, image: Any) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """(pixel_values [patches, C * T * p^2] float32, grid) of one RGB PIL image."""
        self.grid(image.width, image.height)  # the aspect-ratio check, as a ProcessorError
        out = self.hf(images=[image], return_tensors="pt")
        t, h, w = (int(x) for x in out["image_grid_thw"][0].tolist())
        return out["pixel_values"].to(torch.float32).contiguous(), (t, h, w)

    def tokens_of(self, grid: tuple[int, int, int]) -> int:
        t, h, w = grid
        return t * h * w // self.geometry.merge_size ** 2

    def pad_values(self, image_hash: str, n: int) -> list[int]:
        """n token ids drawn from the hash: a different picture gives a different run of ids (two
        pictures collide with probability vocab^-n), and every id is a valid row of the embedding."""
        seed = int.from_bytes(hashlib.sha256(image_hash.encode()).digest()[:8], "little") & (2 ** 63 - 1)
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, self.vocab_size, (n,), generator=gen).tolist()

    # ---- a prompt ----

    def expand(self, input_ids: Sequence[int], images: Sequence[tuple[str, tuple[int, int, int],
                                                                      Optional[torch.Tensor]]]
               ) -> tuple[list[int], MultimodalInputs]:
        """The prompt with each image placeholder expanded, and its MultimodalInputs. `images`: per
        image in order (hash, grid, pixel_values or None)."""
        image_token = self.vision.image_token_id
        slots = [i for i, t in enumerate(input_ids) if t == image_token]
        if len(slots) != len(images):
            raise ProcessorError(f"the prompt has {len(slots)} image placeholder(s) and the request {len(images)} "
                                 "image(s): each image needs one (the chat template writes them for image parts; "
                                 "with /generate, put one <|vision_start|><|image_pad|><|vision_end|> per image)")
        ids: list[int] = []
        items: list[MmItem] = []
        last = 0
        for slot, (image_hash, grid, pixels) in zip(slots, images):
            ids.extend(input_ids[last:slot])
            n = self.tokens_of(grid)
            items.append(MmItem(image_hash, len(ids), n, grid, pixels))
            ids.extend(self.pad_values(image_hash, n))
            last = slot + 1
        ids.extend(input_ids[last:])
        positions, delta = mrope_positions(len(ids), [(it.offset, it.grid_thw) for it in items],
                                           self.geometry.merge_size)
        return ids, MultimodalInputs(items, positions, delta)
