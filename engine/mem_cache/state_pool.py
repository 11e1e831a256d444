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
is a request row, so those bytes go to the KV pool.

Checkpoint slots (the radix cache's, mem_cache/hybrid_radix_cache.py): with the radix cache on, the
pool holds `checkpoints` more slots after the request rows, one per request slot by default. A
checkpoint is a copy of a request's state at a page-aligned position, kept on the radix node that
ends there, so a later request matching that prefix starts from it instead of from zero.

The last slot (`pad_slot`) belongs to no request: the padded rows of a captured decode graph
(model_executor/cuda_graph_runner.py) read and write their states there.

Every state operation runs inside a forward pass, in launch order (StateOps): the copies first
(a hit's checkpoint into its row; a finished request's row into a checkpoint), then the layers,
which also write the tracked positions (a checkpoint of the state part-way through an extend or
after a decode step). The scheduler only decides which slot goes where, so nothing it does can race
a pass still in flight (the overlap loop), exactly as with KV slots.
"""
from __future__ import annotations

from dataclasses import dataclass, field
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


@dataclass
class StateOps:
    """The state work of one forward pass, decided by the scheduler (module docstring).

    copies: (source slot, destination slot), run in order before the layers.
    tracks: per batch row, (offset, destination slot): after the row's first `offset` new tokens,
            its state also goes to that checkpoint slot (offset == the row's token count: the end)."""

    copies: list[tuple[int, int]] = field(default_factory=list)
    tracks: dict[int, list[tuple[int, int]]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.copies or self.tracks)

    def merged(self, other: Optional["StateOps"], row_offset: int) -> "StateOps":
        """This batch's ops followed by `other`'s, whose rows come `row_offset` rows later."""
        if not other:
            return self
        tracks = dict(self.tracks)
        tracks.update({row + row_offset: t for row, t in other.tracks.items()})
        return StateOps(self.copies + other.copies, tracks)


class StateBudget(NamedTuple):
    slots: int  # the most requests that may run: each holds a state slot
    state_bytes: int  # the state pool's: slots + 2 rows (ReqToTokenPool's spare row, see ModelRunner; the padding slot)
    kv_bytes: int  # what is left for the KV pool


def split_state_memory(budget_bytes: int, slot_bytes: int, ratio: float, slots: Optional[int],
                       max_slots: int, rows_per_slot: int = 1) -> StateBudget:
    """Splits `budget_bytes` between the state pool and the KV pool (module docstring). `slots`: fixed
    by a flag, or None for the ratio's share, capped at `max_slots`. `rows_per_slot`: 2 with the
    radix cache (each request slot has a checkpoint slot beside it), else 1."""
    assert slot_bytes > 0 and ratio > 0 and max_slots > 0 and rows_per_slot >= 1
    if slots is None:
        share = int(budget_bytes * ratio / (1 + ratio)) // slot_bytes - 2
        slots = min(max_slots, share // rows_per_slot)
    state_bytes = (slots * rows_per_slot + 2) * slot_bytes
    if slots < 1 or state_bytes >= budget_bytes:
        raise ValueError(f"not enough memory for the recurrent-state pool: {budget_bytes / 2**20:.1f} MiB to share, "
                         f"{slot_bytes / 2**20:.2f} MiB per slot, {slots} slot(s); raise --mem-fraction-static or "
                         "--mamba-full-memory-ratio, or set --max-mamba-cache-size / --max-total-tokens")
    return StateBudget(slots, state_bytes, budget_bytes - state_bytes)


class RecurrentStatePool:
    def __init__(self, shapes: LinearStateShapes, rows: int, conv_dtype: torch.dtype, ssm_dtype: torch.dtype,
                 device: str, checkpoints: int = 0, scratch: tuple[int, int] = (0, 0), scratch_sets: int = 1) -> None:
        """`rows`: as many as ReqToTokenPool has (slot index = request row); `checkpoints`: the radix
        cache's slots, indices rows .. rows + checkpoints - 1; `scratch`: (batch rows, slots per row)
        for speculative decoding's verify steps (`scratch_slot`), after the checkpoints, `scratch_sets`
        times (2: consecutive verify steps alternate, so a step built behind another keeps the other's
        states readable; speculative/verify_strategy.py); then the padding slot of decode graphs (`pad_slot`)."""
        assert rows > 0 and checkpoints >= 0 and min(scratch) >= 0 and scratch_sets in (1, 2)
        self.shapes, self.rows, self.checkpoints, self.device = shapes, rows, checkpoints, device
        self.scratch_rows, self.scratch_per_row = scratch
        self.scratch_sets = scratch_sets
        self.pad_slot = rows + checkpoints + scratch_sets * self.scratch_rows * self.scratch_per_row
        total = self.pad_slot + 1
        self.conv = [torch.zeros((total, *shapes.conv), dtype=conv_dtype, device=device)
                     for _ in range(shapes.num_layers)]
        self.ssm = [torch.zeros((total, *shapes.ssm), dtype=ssm_dtype, device=device)
                    for _ in range(shapes.num_layers)]

    def checkpoint_slots(self) -> list[int]:
        return list(range(self.rows, self.rows + self.checkpoints))

    def scratch_slot(self, batch_index: int, offset: int, which: int = 0) -> int:
        """Where a verify step keeps the state of its `batch_index`-th request after `offset` of its
        tokens (1 .. slots per row; a tree: after node offset - 1), in scratch set `which`: the state to
        roll back to when the drafts after it are rejected. A rollback copy runs at the start of the next pass that reads the state
        (the next pass, or the worker's at the start of a verify step built behind this one), before
        the next verify step using the same set writes these slots."""
        assert 0 <= batch_index < self.scratch_rows and 1 <= offset <= self.scratch_per_row, (batch_index, offset)
        assert 0 <= which < self.scratch_sets, which
        row = which * self.scratch_rows + batch_index
        return self.rows + self.checkpoints + row * self.scratch_per_row + offset - 1

    def copy_slots(self, copies: list[tuple[int, int]]) -> None:
        """(source, destination) slot pairs, in order, every layer (a pass's StateOps.copies)."""
        if not copies:
            return
        if len({d for _, d in copies}) == len(copies) and not {s for s, _ in copies} & {d for _, d in copies}:
            src = torch.tensor([s for s, _ in copies], device=self.device)
            dst = torch.tensor([d for _, d in copies], device=self.device)
            for t in (*self.conv, *self.ssm):
                t[dst] = t[src]
            return
        for s, d in copies:  # a chain (a slot copied out, then over): one at a time
            for t in (*self.conv, *self.ssm):
                t[d] = t[s]

    def copy_slot_tensors(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Slots `src` [n] into slots `dst` [n] (on the device: no host read), every layer; `dst`
        distinct and none of them a source."""
        for t in (*self.conv, *self.ssm):
            t[dst] = t[src]

    def copy_tracked_ends(self, slots: torch.Tensor, tracks: dict[int, list[tuple[int, int]]]) -> None:
        """After a decode pass whose layers wrote no checkpoints (a graph replay): batch row i's state
        (its slot `slots[i]`) into each checkpoint slot `tracks` names for it, every layer."""
        pairs = [(i, slot) for i, t in tracks.items() for _, slot in t]
        if not pairs:
            return
        src = slots[torch.tensor([i for i, _ in pairs], device=slots.device)]
        dst = torch.tensor([slot for _, slot in pairs], device=self.device)
        for t in (*self.conv, *self.ssm):
            t[dst] = t[src]

    def read(self, layer: int, rows: torch.Tensor, fresh: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the conv and delta-rule states of `rows` [bs] in `layer`, zeros where `fresh`
        (a host list: a request whose extend starts at position 0; deciding on the host keeps a
        decode step free of device-to-host syncs)."""
        conv, ssm = self.conv[layer][rows], self.ssm[layer][rows]
        if any(fresh):
            which = torch.tensor(fresh, device=rows.device)
            conv[which] = 0
            ssm[which] = 0
        return conv, ssm

    def write(self, layer: int, rows: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """The states of `rows` [bs] (distinct) after this pass."""
        self.conv[layer][rows] = conv.to(self.conv[layer].dtype)
        self.ssm[layer][rows] = ssm.to(self.ssm[layer].dtype)

    def read_ssm(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """A copy of the delta-rule states of `rows` (a decode step whose conv states alone are updated
        in place, triton_ops/causal_conv1d.py; the CUDA path updates both, triton_ops/gated_delta_decode.py)."""
        return self.ssm[layer][rows]

    def write_ssm(self, layer: int, rows: torch.Tensor, ssm: torch.Tensor) -> None:
        self.ssm[layer][rows] = ssm.to(self.ssm[layer].dtype)

    def size_bytes(self) -> int:
        return sum(t.nbytes for t in self.conv) + sum(t.nbytes for t in self.ssm)

    def __repr__(self) -> str:
        return (f"RecurrentStatePool(rows={self.rows}, checkpoints={self.checkpoints}, layers={self.shapes.num_layers}, conv={self.shapes.conv} "
                f"{self.conv[0].dtype}, ssm={self.shapes.ssm} {self.ssm[0].dtype})")
