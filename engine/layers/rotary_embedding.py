"""Rotary position embedding (NeoX "rotate half" layout, as HF Llama/Qwen), with rope scaling.

RoPE parameters: the model config's `text.rope` (model_config.RopeConfig: transformers 5.x's
`rope_parameters`, or a 4.x config's `rope_theta` and `rope_scaling`, as one mapping).

Supported rope_type: default, linear, llama3, dynamic, yarn. A `partial_rotary_factor` below 1 (Qwen3-Next,
Qwen3.5: 0.25) rotates only the first head_dim * factor dims of each head and passes the rest through,
as HF's apply_rotary_pos_emb does; the frequencies are those of a head of that width.
- dynamic (NTK): HF recomputes frequencies only once a sequence grows past max_position_embeddings
  (and then per batch, which makes results batch-dependent); inside that length it equals default,
  which is what we implement. Requests longer than max_position_embeddings are refused upstream.
- yarn: frequencies and the attention factor come from transformers' own init function (static).
cos/sin come from tables built once in float32 from the positions 0..max_positions-1, exactly as HF
computes them (position x inv_freq, then cos/sin, times the attention scaling), and are gathered by
position, as SGLang's cos_sin_cache. The tables hold head_dim // 2 columns, as the two halves of
HF's cos/sin repeat; the rotation is applied half by half, which is HF's `q * cos + rotate_half(q)
* sin` element for element without building the rotated copy. The model runner sizes the tables to
the context length (`reserve`) before any compile or CUDA graph capture; they take positions x
head_dim x 4 bytes (64 MiB at 131,072 positions and head_dim 128). Computing cos/sin from the
positions inside the forward instead cost a compiled CPU prefill ~9% of its time: Inductor fused
the cos/sin into each layer's rotation kernel, so every head of every layer recomputed them.
Layers with the same RoPE share one instance (get_rope), which keeps the cos/sin of the last
positions tensor it saw.

M-RoPE (Qwen3.5, Qwen3-VL; the config's `mrope_section`): positions may come as [3, n], a temporal,
a height and a width row (multimodal/mrope.py computes them). Each cos/sin column j takes its position
from one row, interleaved as HF's text rotary embedding recomposes them (section = (t, h, w)):

    column j       j % 3 == 1 and j < 3 * h   j % 3 == 2 and j < 3 * w   otherwise
    position row   height (1)                 width (2)                  temporal (0)

and is gathered from the same tables, so three equal rows give exactly the 1-D result. 1-D positions
(text-only batches) take the plain path whatever the config.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from baton.engine.model_config import TextConfig


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (base ** exponents)  # [dim // 2] float32


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict, max_position: int) -> torch.Tensor:
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_context = params.get("original_max_position_embeddings", max_position)
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def compute_inv_freq(text: TextConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [head_dim // 2] float32, attention_scaling applied to cos/sin)."""
    rope = text.rope
    params, rope_type = rope.params, rope.rope_type
    rotary_dim = int(head_dim * rope.partial_rotary_factor)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise NotImplementedError(f"partial_rotary_factor {rope.partial_rotary_factor} of head_dim {head_dim}")
    inv_freq = _default_inv_freq(rope.theta, rotary_dim)
    if rope_type in ("default", "dynamic"):
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / params["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params, text.context_length), 1.0
    if rope_type == "yarn":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS["yarn"](rope.hf_config, torch.device("cpu"))
        return inv_freq.to(torch.float32), float(scaling)
    raise NotImplementedError(f"rope_type {rope_type!r} is not supported (default, linear, llama3, dynamic, yarn)")


def mrope_rows(section: tuple[int, int, int], interleaved: bool, columns: int) -> torch.Tensor:
    """For each of the `columns` cos/sin columns, the position row it reads (0 t, 1 h, 2 w) [columns] int64."""
    if not interleaved:
        raise NotImplementedError("M-RoPE with the sections in three runs (Qwen2-VL's layout) is not supported")
    j = torch.arange(columns, dtype=torch.int64)
    rows = torch.zeros(columns, dtype=torch.int64)
    rows[(j % 3 == 1) & (j < 3 * section[1])] = 1
    rows[(j % 3 == 2) & (j < 3 * section[2])] = 2
    return rows


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's x * cat(cos, cos) + rotate_half(x) * cat(sin, sin), by halves: x [n, heads, head_dim],
    cos/sin [n, 1, head_dim // 2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, inv_freq: torch.Tensor, attention_scaling: float = 1.0,
                 max_positions: int = 4096, mrope_rows: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = 2 * inv_freq.shape[0]  # < head_dim with a partial_rotary_factor
        assert self.rotary_dim <= head_dim
        # A plain attribute, not a buffer: model.to(bfloat16) must not round the frequencies.
        self.inv_freq = inv_freq.to(torch.float32)  # [head_dim // 2]
        self.attention_scaling = attention_scaling
        self.max_positions = max_positions
        self.cos_table: Optional[torch.Tensor] = None  # [max_positions, rotary_dim // 2] float32
        self.sin_table: Optional[torch.Tensor] = None
        self._memo: tuple = (None, None, None, None)  # (positions, dtype, cos, sin) of the last call
        # M-RoPE: the position row of each cos/sin column [rotary_dim // 2] and the column indices; None: 1-D only
        self.mrope_rows = mrope_rows
        self._mrope_cols = None if mrope_rows is None else torch.arange(mrope_rows.shape[0])
        assert mrope_rows is None or mrope_rows.shape == self.inv_freq.shape, (mrope_rows.shape, self.inv_freq.shape)

    def reserve(self, max_positions: int, device: torch.device | str) -> None:
        """Build the tables for positions 0..max(max_positions, the config's)-1 on `device`."""
        self.max_positions = max(self.max_positions, max_positions)
        self.inv_freq = self.inv_freq.to(device)
        positions = torch.arange(self.max_positions, dtype=torch.int64, device=device)
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        self.cos_table = freqs.cos() * self.attention_scaling
        self.sin_table = freqs.sin() * self.attention_scaling
        if self.mrope_rows is not None:
            self.mrope_rows, self._mrope_cols = self.mrope_rows.to(device), self._mrope_cols.to(device)
        self._memo = (None, None, None, None)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [n, rotary_dim // 2] in `dtype` for positions [n] or M-RoPE's [3, n] (< max_positions)."""
        if torch.compiler.is_compiling():  # keep state out of the graph's guards; reserve() ran at load
            return self._gather(positions, dtype)
        table = self.cos_table
        if table is None or table.device != positions.device or table.shape[0] < self.max_positions:
            self.reserve(self.max_positions, positions.device)
        # Every layer of one pass gets the same positions tensor; holding it keeps its id from reuse.
        last_positions, last_dtype, cos, sin = self._memo
        if positions is last_positions and dtype == last_dtype:
            return cos, sin
        cos, sin = self._gather(positions, dtype)
        self._memo = (positions, dtype, cos, sin)
        return cos, sin

    def _gather(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return self.cos_table[positions].to(dtype), self.sin_table[positions].to(dtype)
        assert self.mrope_rows is not None, "[3, n] positions need a RoPE with an mrope_section"
        index = (positions[self.mrope_rows].t(), self._mrope_cols)  # [n, columns] positions, [columns]
        return self.cos_table[index].to(dtype), self.sin_table[index].to(dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [n] or M-RoPE's [3, n]; q [n, num_heads * head_dim]; k [n, num_kv_heads * head_dim];
        returns the same shapes."""
        n = positions.shape[-1]
        cos, sin = self.cos_sin(positions, q.dtype)
        cos, sin = cos[:, None, :], sin[:, None, :]  # [n, 1, rotary_dim // 2]
        q_out = self._rotate_head(q.reshape(n, -1, self.head_dim), cos, sin)
        k_out = self._rotate_head(k.reshape(n, -1, self.head_dim), cos, sin)
        return q_out.reshape(n, -1), k_out.reshape(n, -1)

    def _rotate_head(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rotary_dim == self.head_dim:
            return _rotate(x, cos, sin)
        d = self.rotary_dim  # partial: rotate the first d dims of each head, pass the rest
        return torch.cat((_rotate(x[..., :d], cos, sin), x[..., d:]), dim=-1)


_SHARED: dict[tuple, RotaryEmbedding] = {}


def get_rope(text: TextConfig, head_dim: int) -> RotaryEmbedding:
    """One instance per distinct RoPE (as SGLang's get_rope), so a pass computes cos/sin once."""
    inv_freq, scaling = compute_inv_freq(text, head_dim)
    section, interleaved = text.rope.mrope_section, text.rope.mrope_interleaved
    mrope = None if section is None else (section, interleaved)
    key = (head_dim, tuple(inv_freq.tolist()), scaling, mrope)
    max_positions = text.context_length
    if key not in _SHARED:
        rows = None if mrope is None else mrope_rows(*mrope, inv_freq.shape[0])
        _SHARED[key] = RotaryEmbedding(head_dim, inv_freq, scaling, max_positions, rows)
    rope = _SHARED[key]
    rope.max_positions = max(rope.max_positions, max_positions)
    return rope
