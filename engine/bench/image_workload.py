"""The image workload: random RGB pictures, made from a seed, sent as `data:` URLs in chat completions.

Each picture is uniform noise (a PNG barely compresses it, so every request moves the bytes a photo of
that size would). Its seed is the workload's seed plus what the reuse mode asks for:

    shared    (seed, image k)              every request sends the same picture(s): the vision
                                           embeddings' cache hits from the second request on
    distinct  (seed, request i, image k)   a picture no other request sends: the cache cannot help

A round of `compare --repeats` runs on seed + round, so no round meets another's pictures either.
The pictures are made and encoded before the timed run: the client stays cheap while it measures.
"""
from __future__ import annotations

import base64
import io
import re

import numpy as np

IMAGE_REUSE = ("shared", "distinct")
_SHARED, _DISTINCT, _WARMUP = 0, 1, 2  # the seed spaces of the modes, apart from each other


def parse_image_size(text: str) -> tuple[int, int]:
    """"448x448" -> (448, 448): width, height."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not m or int(m[1]) < 1 or int(m[2]) < 1:
        raise ValueError(f"an image size is WIDTHxHEIGHT, e.g. 448x448; got {text!r}")
    return int(m[1]), int(m[2])


def random_png(width: int, height: int, entropy: list[int]) -> bytes:
    """A PNG of random RGB pixels; the same entropy gives the same bytes."""
    from PIL import Image

    rng = np.random.default_rng(entropy)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB").save(buf, format="PNG")
    return buf.getvalue()


def png_data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def image_urls(num_prompts: int, per_request: int, size: tuple[int, int], reuse: str, seed: int) -> list[tuple[str, ...]]:
    """Each prompt's pictures as data URLs; shared mode encodes its picture(s) once."""
    assert reuse in IMAGE_REUSE, f"--image-reuse is one of {IMAGE_REUSE}, got {reuse!r}"
    assert seed >= 0, "image seeds are non-negative"
    if per_request == 0:
        return [()] * num_prompts
    if reuse == "shared":
        shared = tuple(png_data_url(random_png(*size, [seed, _SHARED, k])) for k in range(per_request))
        return [shared] * num_prompts
    return [tuple(png_data_url(random_png(*size, [seed, _DISTINCT, i, k])) for k in range(per_request))
            for i in range(num_prompts)]


def warmup_image_urls(per_request: int, size: tuple[int, int]) -> tuple[str, ...]:
    """Pictures for the warm-up requests: the vision path is warmed at the workload's size, with
    pictures no measured request sends (so warming up fills no cache entry the workload could hit)."""
    return tuple(png_data_url(random_png(*size, [0, _WARMUP, k])) for k in range(per_request))


def warmup_like(images: tuple[str, ...]) -> tuple[str, ...]:
    """Warm-up pictures as many and as large as `images` (data URLs made here)."""
    if not images:
        return ()
    from PIL import Image

    png = base64.b64decode(images[0].split(",", 1)[1])
    return warmup_image_urls(len(images), Image.open(io.BytesIO(png)).size)
