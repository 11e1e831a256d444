"""The vision tower of Qwen3.5 and Qwen3-VL: pixel patches in, one embedding per merged text token out.

Patch embedding, the learned position grid resampled to each image, 2-D rotary, full-attention blocks
confined to each image, the patch merger, and Qwen3-VL's deepstack mergers. Replicated: every rank that
encodes images holds all of its weights.

Patches arrive as the Qwen2-VL image processor emits them: one row per patch of C*T*p*p pixel values, each
image's rows in merge-block order (the m*m patches that become one text token are consecutive):

    image of h x w patches, m = 2        rows of pixel_values
      (0,0) (0,1) | (0,2) (0,3)            (0,0) (0,1) (1,0) (1,1)   -> text token 0
      (1,0) (1,1) | (1,2) (1,3)            (0,2) (0,3) (1,2) (1,3)   -> text token 1
      ------------+------------            (2,0) (2,1) (3,0) (3,1)   -> text token 2
      (2,0) ...                            ...
"""
from __future__ import annotations

from typing import Iterable, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from baton.engine.layers.activation import get_act_fn
from baton.engine.model_config import VisionConfig

Grid = tuple[int, int, int]  # (frames, rows, cols) of patches: the processor's image_grid_thw


class VisionOutput(NamedTuple):
    embeds: torch.Tensor  # [sum of tokens_per_image, out_hidden_size], images in order
    deepstack: list[torch.Tensor]  # per deepstack block, like embeds; [] without deepstack (Qwen3.5)


class PatchEmbed(nn.Module):
    """HF's Conv3d whose kernel equals its stride is a Linear over the flattened patch."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(config.patch_dim, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_values.to(self.proj.weight.dtype))

    def load_conv_weight(self, tensor: torch.Tensor) -> None:
        # [hidden, C, T, p, p]: flattened in the order the processor flattens each patch
        with torch.no_grad():
            self.proj.weight.copy_(tensor.reshape(self.proj.weight.shape))


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], seqlens: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)  # each [n, heads, head_dim]
        q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        out = segment_attention(q, k, v, seqlens)
        return self.proj(out.reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act_fn = get_act_fn(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], seqlens: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, seqlens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """m*m consecutive patches -> one text token. The final merger norms each patch before joining them;
    a deepstack merger (postshuffle) norms the joined vector."""

    def __init__(self, config: VisionConfig, postshuffle_norm: bool) -> None:
        super().__init__()
        self.merged_size = config.hidden_size * config.tokens_merged
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.merged_size if postshuffle_norm else config.hidden_size,
                                 eps=config.layer_norm_eps)
        self.linear_fc1 = nn.Linear(self.merged_size, self.merged_size)
        self.linear_fc2 = nn.Linear(self.merged_size, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.postshuffle_norm:
            x = self.norm(x.view(-1, self.merged_size))
        else:
            x = self.norm(x).view(-1, self.merged_size)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class QwenVisionTower(nn.Module):
    """Qwen3.5's and Qwen3-VL's vision model (HF: Qwen3_5VisionModel, Qwen3VLVisionModel); the
    checkpoint's `model.visual.*` tensors, by the same names less that prefix."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.grid_side = int(config.num_position_embeddings ** 0.5)
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        spatial_dim = config.head_dim // 2  # half the rotated dims for rows, half for columns
        inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, spatial_dim, 2, dtype=torch.float) / spatial_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config, postshuffle_norm=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(config, postshuffle_norm=True) for _ in config.deepstack_visual_indexes)

    def tokens_per_image(self, grid_thw: Grid) -> int:
        return self.config.tokens_per_image(grid_thw)

    def forward(self, pixel_values: torch.Tensor, grid_thw: Sequence[Grid]) -> VisionOutput:
        """pixel_values [sum of t*h*w, C*T*p*p], the images' patches in order (module docstring)."""
        grids = [tuple(int(d) for d in g) for g in grid_thw]
        self._check_input(pixel_values, grids)
        device = pixel_values.device
        x = self.patch_embed(pixel_values)  # [patches, hidden]
        x = x + self._position_embeddings(grids, device).to(x.dtype)
        rope = self._rotary(grids, device)
        seqlens = [h * w for t, h, w in grids for _ in range(t)]  # each frame attends within itself, as HF's
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, rope, seqlens)
            if i in self.config.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[self.config.deepstack_visual_indexes.index(i)](x))
        return VisionOutput(self.merger(x), deepstack)

    def _check_input(self, pixel_values: torch.Tensor, grids: list[Grid]) -> None:
        for grid in grids:
            self.config.tokens_per_image(grid)  # asserts the merge-size multiple
        patches = sum(t * h * w for t, h, w in grids)
        expected = (patches, self.config.patch_dim)
        assert tuple(pixel_values.shape) == expected, \
            f"pixel_values {tuple(pixel_values.shape)}, grids {grids} need {expected}"

    def _position_embeddings(self, grids: list[Grid], device: torch.device) -> torch.Tensor:
        """The learned side x side grid, bilinearly resampled (align_corners) to each image's grid."""
        indices, weights = interpolation_taps(grids, self.grid_side, self.config.spatial_merge_size, device)
        # weights are float32: the sum runs in float32 whatever the tower's dtype, as HF's does
        return (self.pos_embed(indices) * weights[:, :, None]).sum(1)  # [patches, hidden]

    def _rotary(self, grids: list[Grid], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [patches, head_dim] in float32: the first half of each head rotates by the patch's row
        and column (a quarter each), the second half repeats the first (rotate_half's pairing)."""
        rows, cols = patch_rows_cols(grids, self.config.spatial_merge_size, device)
        freqs = torch.stack([rows, cols], dim=-1)[..., None].float() * self.inv_freq.to(device)  # [n, 2, hd/4]
        freqs = freqs.flatten(1)  # [n, hd/2]: rows' then columns'
        angles = torch.cat([freqs, freqs], dim=-1)
        return angles.cos(), angles.sin()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> None:
        """(name, tensor) pairs named as under the checkpoint's `model.visual.`; raises on a tensor the
        tower has no place for and (if `strict`) on a parameter the checkpoint does not fill."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name == "patch_embed.proj.weight":
                self.patch_embed.load_conv_weight(tensor)
            elif name in params:
                param = params[name]
                assert param.shape == tensor.shape, \
                    f"vision tensor {name}: {tuple(tensor.shape)} in checkpoint, {tuple(param.shape)} in the tower"
                with torch.no_grad():
                    param.copy_(tensor)
            else:
                raise KeyError(f"checkpoint tensor visual.{name} has no matching parameter in the vision tower")
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing and strict:
            raise ValueError(f"checkpoint is missing {len(missing)} vision tower tensors, e.g. {missing[:5]}")


def patch_rows_cols(grids: list[Grid], merge: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each patch's (row, col) in its image, in the rows' merge-block order; frames repeat the grid."""
    rows, cols = [], []
    for t, h, w in grids:
        r = torch.arange(h, device=device)[:, None].expand(h, w)
        c = torch.arange(w, device=device)[None, :].expand(h, w)
        for grid, out in ((r, rows), (c, cols)):
            blocks = grid.reshape(h // merge, merge, w // merge, merge).transpose(1, 2).flatten()
            out.append(blocks.repeat(t))
    return torch.cat(rows), torch.cat(cols)


def interpolation_taps(grids: list[Grid], side: int, merge: int,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear (align_corners=True) resampling of a side x side table to each image's grid, as 4 taps per
    patch: indices [patches, 4] into the flattened table and their float32 weights [patches, 4]."""
    rows, cols = patch_rows_cols(grids, merge, device)
    heights = torch.cat([torch.full((t * h * w,), h, device=device) for t, h, w in grids])
    widths = torch.cat([torch.full((t * h * w,), w, device=device) for t, h, w in grids])
    row_taps, row_weights = _axis_taps(rows, heights, side)
    col_taps, col_weights = _axis_taps(cols, widths, side)
    indices = (row_taps[:, :, None] * side + col_taps[:, None, :]).flatten(1)
    weights = (row_weights[:, :, None] * col_weights[:, None, :]).flatten(1)
    return indices, weights


def _axis_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two source cells around each target position on one axis and their linear weights; written as
    transformers.vision_utils computes them, so the weights agree to the bit."""
    src = index.float() * (side - 1) / torch.clamp(size - 1, min=1)  # ends map to ends (align_corners)
    floor = torch.floor(src)
    offsets = torch.arange(2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def apply_rotary(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [n, heads, head_dim] rotated in float32 (rotate_half pairing), back in x's dtype."""
    cos, sin = (r[:, None, :] for r in rope)
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
    """Full (non-causal) attention within each segment of `seqlens` rows, none across: [n, heads, head_dim]."""
    outs = []
    for qs, ks, vs in zip(q.split(seqlens), k.split(seqlens), v.split(seqlens)):
        # [1, heads, len, head_dim]
        o = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (qs, ks, vs)),
                                           scale=q.shape[-1] ** -0.5)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)
