"""RecurrentStatePool: the linear-attention layers' state of every request row, beside the KV pool.

A hybrid model (Qwen3-Next, Qwen3.5) keeps no KV for its Gated DeltaNet layers; each of them carries,
per request, a conv state (the last conv_kernel - 1 inputs of its short causal conv1d) and the gated
delta rule's state matrix. The pool holds one slot per row of ReqToTokenPool, and the slot index IS
the row index (req_pool_idx): a request owns its slot exactly as long as its row, so whatever frees
the row (finish, abort, retraction, preemption) frees the slot, and nothing can leak.

    conv[layer]  [rows, conv_dim, conv_kernel - 1]           model dtype (as HF keeps it)
    ssm[layer]   [rows, num_v_heads, head_k_dim, head_v_dim]  float32 by default (--mamba-ssm-dtype)

A slot's content is meaningful only while a request runs in it: an extend that starts at position 0
starts from zeros (`read(..., fresh)`), whatever the row held before; a later chunk or decode step
of the same request continues from what the last pass wrote.

Sizing (split_state_memory), with SGLang's flags: where the KV pool is sized from free memory, the
state pool's bytes come out of the same budget first. Its slots (the max running requests it allows)
are --max-mamba-cache-size, else --max-running-requests, else what --mamba-full-memory-ratio gives it:
state bytes : KV bytes = ratio : 1, i.e. ratio / (1 + ratio) of the budget (SGLang's
_handle_max_mamba_cache). Slots beyond the most requests that may ever run would sit idle while a slot
is a request row (until the radix cache keeps states on its nodes), so those bytes go to the KV pool.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch


@dataclass(frozen=True)
class LinearStateShapes:
    """What a hybrid model needs per request row: `num_layers` linear-attention layers, each with a
    conv state and a delta-rule state of these shapes (without the row dimension)."""

    num_layers: int
    conv: tuple[int, int]  # (conv_dim, conv_kernel - 1)
    ssm: tuple[int, int, int]  # (num_v_heads, head_k_dim, head_v_dim)

    def __post_init__(self) -> None:
        assert self.num_layers > 0 and min(self.conv) > 0 and min(self.ssm) > 0, self

    def bytes_per_row(self, conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> int:
        conv = self.conv[0] * self.conv[1] * conv_dtype.itemsize
        ssm = self.ssm[0] * self.ssm[1] * self.ssm[2] * ssm_dtype.itemsize
        return self.num_layers * (conv + ssm)


class StateBudget(NamedTuple):
    slots: int  # the most requests that may run: each holds a state slot
    state_bytes: int  # the state pool's: slots + 1 rows (ReqToTokenPool's spare row, see ModelRunner)
    kv_bytes: int  # what is left for the KV pool


def split_state_memory(budget_bytes: int, slot_bytes: int, ratio: float, slots: Optional[int],
                       max_slots: int) -> StateBudget:
    """Splits `budget_bytes` between the state pool and the KV pool (module docstring). `slots`: fixed
    by a flag, or None for the ratio's share, capped at `max_slots`."""
    assert slot_bytes > 0 and ratio > 0 and max_slots > 0
    if slots is None:
        slots = min(max_slots, int(budget_bytes * ratio / (1 + ratio)) // slot_bytes - 1)
    state_bytes = (slots + 1) * slot_bytes
    if slots < 1 or state_bytes >= budget_bytes:
        raise ValueError(f"not enough memory for the recurrent-state pool: {budget_bytes / 2**20:.1f} MiB to share, "
                         f"{slot_bytes / 2**20:.2f} MiB per slot, {slots} slot(s); raise --mem-fraction-static or "
                         "--mamba-full-memory-ratio, or set --max-mamba-cache-size / --max-total-tokens")
    return StateBudget(slots, state_bytes, budget_bytes - state_bytes)


class RecurrentStatePool:
    def __init__(self, shapes: LinearStateShapes, rows: int, conv_dtype: torch.dtype, ssm_dtype: torch.dtype,
                 device: str) -> None:
        """`rows`: as many as ReqToTokenPool has (slot index = request row)."""
        assert rows > 0
        self.shapes, self.rows, self.device = shapes, rows, device
        self.conv = [torch.zeros((rows, *shapes.conv), dtype=conv_dtype, device=device)
                     for _ in range(shapes.num_layers)]
        self.ssm = [torch.zeros((rows, *shapes.ssm), dtype=ssm_dtype, device=device)
                    for _ in range(shapes.num_layers)]

    def read(self, layer: int, rows: torch.Tensor, fresh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the conv and delta-rule states of `rows` [bs] in `layer`, zeros where `fresh`
        [bs] bool (a request whose extend starts at position 0)."""
        conv, ssm = self.conv[layer][rows], self.ssm[layer][rows]
        if bool(fresh.any()):
            conv[fresh] = 0
            ssm[fresh] = 0
        return conv, ssm

    def write(self, layer: int, rows: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """The states of `rows` [bs] (distinct) after this pass."""
        self.conv[layer][rows] = conv.to(self.conv[layer].dtype)
        self.ssm[layer][rows] = ssm.to(self.ssm[layer].dtype)

    def size_bytes(self) -> int:
        return sum(t.nbytes for t in self.conv) + sum(t.nbytes for t in self.ssm)

    def __repr__(self) -> str:
        return (f"RecurrentStatePool(rows={self.rows}, layers={self.shapes.num_layers}, conv={self.shapes.conv} "
                f"{self.conv[0].dtype}, ssm={self.shapes.ssm} {self.ssm[0].dtype})")
