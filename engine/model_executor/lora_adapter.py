"""LoRA adapters in PEFT's format, read and cut for this rank's layers.

    adapter_config.json            r, lora_alpha, use_rslora (scaling alpha / r, or alpha / sqrt(r))
    adapter_model.safetensors      base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight  [r, in]
      (or adapter_model.bin)       base_model.model.model.layers.N.self_attn.q_proj.lora_B.weight  [out, r]

The checkpoint names its projections as HF does (q_proj, k_proj, ...); ours fuse q|k|v and gate|up
(models/llama.py STACKED_SHARDS), so each adapter matrix lands in one part of one of our layers. Which
projections an adapter targets is read from its tensors (adapter_config's target_modules may be a
regex or "all-linear"). What PEFT can save and LoRA serving here does not compute (DoRA, per-module
ranks or alphas, trained biases, embedding or LM head adapters, modules_to_save) is refused with a
message that says so.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Optional

import torch

from baton.engine.models.llama import STACKED_SHARDS
from baton.engine.server_args import LORA_TARGET_MODULES

# our layers that fuse several of them, by their name's last component
FUSED_TARGETS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_TENSOR = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")


class AdapterError(ValueError):
    """An adapter this server cannot serve: the message says why (a 400 at /load_lora_adapter)."""


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    alpha: float
    use_rslora: bool = False

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


@dataclass(frozen=True)
class AdapterMatrices:
    """One HF projection's A [r, in] and B [out, r], whole."""

    a: torch.Tensor
    b: torch.Tensor


def read_adapter_config(path: str) -> AdapterConfig:
    file = os.path.join(path, "adapter_config.json")
    try:
        with open(file) as f:
            raw = json.load(f)
    except OSError as e:
        raise AdapterError(f"LoRA adapter {path}: cannot read adapter_config.json ({e.strerror or e})") from None
    except ValueError as e:
        raise AdapterError(f"LoRA adapter {path}: adapter_config.json is not JSON ({e})") from None
    if raw.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"LoRA adapter {path}: peft_type {raw['peft_type']!r}; only LORA adapters are served")
    for key, what in (("use_dora", "DoRA"), ("rank_pattern", "per-module ranks"),
                      ("alpha_pattern", "per-module alphas"), ("modules_to_save", "modules_to_save")):
        if raw.get(key):
            raise AdapterError(f"LoRA adapter {path}: {what} ({key}) is not supported")
    if raw.get("bias", "none") != "none":
        raise AdapterError(f"LoRA adapter {path}: trained biases (bias={raw['bias']!r}) are not supported")
    rank, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise AdapterError(f"LoRA adapter {path}: adapter_config.json needs an integer r >= 1 and a lora_alpha")
    return AdapterConfig(rank, float(alpha), bool(raw.get("use_rslora", False)))


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    file = os.path.join(path, "adapter_model.safetensors")
    if os.path.exists(file):
        from safetensors.torch import load_file

        return load_file(file)
    file = os.path.join(path, "adapter_model.bin")
    if os.path.exists(file):
        return torch.load(file, map_location="cpu", weights_only=True)
    raise AdapterError(f"LoRA adapter {path}: no adapter_model.safetensors or adapter_model.bin")


def read_adapter(path: str) -> tuple[AdapterConfig, dict[str, AdapterMatrices]]:
    """The adapter's config and its matrices by HF module name ("model.layers.0.self_attn.q_proj")."""
    config = read_adapter_config(path)
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in _read_tensors(path).items():
        m = _TENSOR.match(name)
        if m is None:
            raise AdapterError(f"LoRA adapter {path}: tensor {name!r} is not a LoRA A or B matrix of a linear layer "
                               "(embedding and LM head adapters, DoRA magnitudes and biases are not supported)")
        halves.setdefault(m["module"], {})[m["which"]] = tensor
    matrices = {}
    for module, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"LoRA adapter {path}: {module} has lora_{''.join(pair)} without its other half")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != config.rank or b.shape[1] != config.rank:
            raise AdapterError(f"LoRA adapter {path}: {module}'s A {tuple(a.shape)} and B {tuple(b.shape)} are not "
                               f"of rank r = {config.rank}")
        matrices[module] = AdapterMatrices(a, b)
    if not matrices:
        raise AdapterError(f"LoRA adapter {path}: no LoRA matrices")
    return config, matrices


def target_name(module: str) -> str:
    """The projection an HF module name is (its last component: q_proj, down_proj, ...)."""
    return module.rsplit(".", 1)[-1]


def our_module(module: str) -> tuple[str, int]:
    """Our layer that holds an HF projection, and the projection's part in it."""
    head, _, last = module.rpartition(".")
    if last in STACKED_SHARDS:
        fused, part = STACKED_SHARDS[last]
        return f"{head}.{fused}" if head else fused, part
    return module, 0


def adapter_targets(path: str) -> tuple[int, frozenset[str]]:
    """(rank, projections) of an adapter on disk: what --lora-paths imply for the pool."""
    config, matrices = read_adapter(path)
    return config.rank, frozenset(target_name(m) for m in matrices)


@dataclass(frozen=True)
class LoraSettings:
    """The adapter pool's shape: slots (one per adapter a batch may use), rank and projections."""

    max_loras_per_batch: int
    max_rank: int
    target_modules: frozenset[str]

    @staticmethod
    def resolve(paths: list[str], max_loras_per_batch: int, max_lora_rank: Optional[int],
                target_modules: Optional[tuple[str, ...]]) -> "LoraSettings":
        """From the flags; what they leave out, from the adapters of --lora-paths (SGLang's rule: their
        largest rank, the union of their projections)."""
        found = [adapter_targets(p) for p in paths]
        if max_lora_rank is None:
            max_lora_rank = max((r for r, _ in found), default=0)
        if target_modules is None:
            targets = frozenset().union(*(t for _, t in found))
        elif "all" in target_modules:
            targets = frozenset(LORA_TARGET_MODULES)
        else:
            targets = frozenset(target_modules)
        if max_lora_rank < 1 or not targets:
            raise ValueError("LoRA: give --max-lora-rank and --lora-target-modules, or adapters in --lora-paths "
                             "to take them from")
        return LoraSettings(max_loras_per_batch, max_lora_rank, targets)

    def check(self, path: str, config: AdapterConfig, matrices: dict[str, AdapterMatrices]) -> None:
        """An adapter fits the pool: rank and projections (SGLang's can_support)."""
        if config.rank > self.max_rank:
            raise AdapterError(f"LoRA adapter {path}: rank {config.rank} is above --max-lora-rank {self.max_rank}")
        extra = sorted({target_name(m) for m in matrices} - self.target_modules)
        if extra:
            raise AdapterError(f"LoRA adapter {path}: targets {', '.join(extra)}, which are not among "
                               f"--lora-target-modules ({', '.join(sorted(self.target_modules))})")
