"""The worker's side of multi-LoRA serving: the adapter pool on the device, adapters kept in host memory, and
each pass's rows-to-adapters map (layers/lora.py computes the deltas).

    pool          per served layer A [slots, parts * R, in] and B [slots, out, R] (this rank's shard, the
                  model's dtype), and each slot's scaling; --max-loras-per-batch slots, rank R = --max-lora-rank
    host copies   uid -> an adapter's matrices cut for this rank (the scheduler's load validates and
                  stores the driver's; a follower reads its own from disk the first time a pass loads it)

The scheduler decides which adapter goes to which slot (scheduler/lora.py); a pass carries that
(core/lora.py LoraStep) and `prepare` does it before the layers run: drops first, then each load
copies an adapter into its slot (every layer of the slot rewritten, zeros where the adapter has no
matrix), then the pass's runs of rows under each slot. The scheduler's decisions thus take effect in
pass order, whatever the loop: a pass in flight keeps the slots it was planned with.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from baton.engine.layers.linear import MergedColumnLinear, RowParallelLinear
from baton.engine.layers.lora import LoraBatchInfo, LoraLinear
from baton.engine.model_executor.lora_adapter import (FUSED_TARGETS, AdapterError, AdapterMatrices, LoraSettings,
                                                      our_module, read_adapter, target_name)
from baton.engine.triton_ops.lora_sgemm import Segments

if TYPE_CHECKING:
    from baton.engine.core.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)


@dataclass
class LoadedAdapter:
    """An adapter cut for this rank: per served layer, each part's (A [r, in_local], B [out_local, r])."""

    rank: int
    scaling: float
    layers: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]


@dataclass
class _Served:
    layer: nn.Module  # MergedColumnLinear or RowParallelLinear
    lora: LoraLinear


def _targets_of(name: str, layer: nn.Module) -> tuple[str, ...]:
    """The HF projections a layer of ours computes, by its name."""
    last = name.rsplit(".", 1)[-1]
    if isinstance(layer, MergedColumnLinear):
        return FUSED_TARGETS.get(last, ())
    return (last,) if last in ("o_proj", "down_proj") else ()


class LoraManager:
    def __init__(self, model: nn.Module, settings: LoraSettings, dtype: torch.dtype, device: str,
                 reference: bool = False) -> None:
        """`reference`: the torch path of the LoRA GEMMs on every device (--disable-fused-ops)."""
        self.settings, self.dtype, self.device = settings, dtype, device
        self.batch = LoraBatchInfo(reference=reference)
        slots, rank = settings.max_loras_per_batch, settings.max_rank
        self.scaling = torch.zeros(slots, dtype=torch.float32, device=device)
        self.served: dict[str, _Served] = {}
        for name, layer in model.named_modules():
            targets = _targets_of(name, layer)
            if not set(targets) & settings.target_modules:
                continue
            parts = self._parts(layer)
            a = torch.zeros(slots, len(parts) * rank, self._in_local(layer), dtype=dtype, device=device)
            b = torch.zeros(slots, layer.weight.shape[0], rank, dtype=dtype, device=device)
            layer.lora = LoraLinear(a, b, self.scaling, parts, rank, self.batch)
            self.served[name] = _Served(layer, layer.lora)
        if not self.served:
            raise ValueError(f"LoRA: no layer of {type(model).__name__} computes any of --lora-target-modules "
                             f"({', '.join(sorted(settings.target_modules))})")
        self.host: dict[int, LoadedAdapter] = {}  # uid -> this rank's cut of an adapter
        size = sum(s.lora.a.numel() + s.lora.b.numel() for s in self.served.values()) * self.dtype.itemsize
        logger.info("LoRA: %d layers served, %d slots of rank %d (%.1f MB)", len(self.served), slots, rank, size / 1e6)

    @staticmethod
    def _parts(layer: nn.Module) -> list[tuple[int, int]]:
        """(first output column, columns) of each part of the layer's output on this rank."""
        if isinstance(layer, MergedColumnLinear):
            sizes = layer.output_sizes
            return [(sum(sizes[:i]), n) for i, n in enumerate(sizes)]
        return [(0, layer.out_features)]

    @staticmethod
    def _in_local(layer: nn.Module) -> int:
        return layer.in_local if isinstance(layer, RowParallelLinear) else layer.in_features

    # ---- adapters in host memory ----

    def read(self, path: str) -> LoadedAdapter:
        """An adapter read from disk, checked against the pool and this model, cut for this rank."""
        config, matrices = read_adapter(path)
        self.settings.check(path, config, matrices)
        layers: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for module, m in matrices.items():
            name, part = our_module(module)
            served = self.served.get(name)
            if served is None:
                raise AdapterError(f"LoRA adapter {path}: {module} is not a layer of this model that LoRA serves")
            layers.setdefault(name, {})[part] = self._cut(path, module, served.layer, part, m)
        return LoadedAdapter(config.rank, config.scaling, layers)

    def _cut(self, path: str, module: str, layer: nn.Module, part: int,
             m: AdapterMatrices) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's A and B of one projection (column-parallel: B's rows of the part; row-parallel: A's
        columns), in the model's dtype."""
        if isinstance(layer, MergedColumnLinear):
            p = layer.parts[part]
            want_in, want_out = layer.in_features, p.full
            cut = (m.a, m.b[p.start:p.start + p.size]) if m.a.shape[1] == want_in and m.b.shape[0] == want_out else None
        else:
            want_in, want_out = layer.in_features, layer.out_features
            first = layer.tp.rank * layer.in_local
            cut = ((m.a[:, first:first + layer.in_local], m.b)
                   if m.a.shape[1] == want_in and m.b.shape[0] == want_out else None)
        if cut is None:
            raise AdapterError(f"LoRA adapter {path}: {module}'s A {tuple(m.a.shape)} and B {tuple(m.b.shape)} do "
                               f"not fit the model's {target_name(module)} ({want_in} -> {want_out})")
        return tuple(t.to(self.dtype).contiguous() for t in cut)

    def keep(self, uid: int, adapter: LoadedAdapter) -> None:
        """Hold an adapter the scheduler has read (the driver's rank) until its uid is dropped."""
        self.host[uid] = adapter

    # ---- a pass ----

    def prepare(self, fb: "ForwardBatch") -> None:
        """The pass's LoRA work, before its layers: drops, loads into slots, the rows' runs."""
        step = fb.lora
        if step is None:
            self.batch.segments = None
            return
        for uid in step.drops:
            self.host.pop(uid, None)
        for slot, uid, path in step.loads:
            self._load_slot(slot, uid, path)
        if all(s < 0 for s in step.slots):
            self.batch.segments = None
            return
        tokens = fb.extend_seq_lens_cpu if fb.forward_mode.is_extend() else [1] * fb.batch_size
        self.batch.segments = Segments.from_rows(tokens, step.slots, self.device)

    @torch.no_grad()
    def _load_slot(self, slot: int, uid: int, path: str) -> None:
        adapter = self.host.get(uid)
        if adapter is None:  # a follower's first pass with it (the driver's scheduler read it at load)
            adapter = self.host[uid] = self.read(path)
        for name, served in self.served.items():
            lora = served.lora
            lora.a[slot].zero_()
            lora.b[slot].zero_()
            for part, (a, b) in adapter.layers.get(name, {}).items():
                first, n = lora.parts[part]
                lora.a[slot, part * lora.rank:part * lora.rank + adapter.rank].copy_(a, non_blocking=True)
                lora.b[slot, first:first + n, :adapter.rank].copy_(b, non_blocking=True)
        self.scaling[slot] = adapter.scaling

