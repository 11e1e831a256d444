"""LoRA adapters in PEFT's format for the tiny models (tests/engine/tiny_models.py), and the reference a
served adapter must match: the base checkpoint with the adapter merged in (W + scaling * B A), saved as
an ordinary checkpoint HF transformers loads.

    adapter, merged = make_adapter(base_path, tmp_path / "a", targets=("q_proj", "v_proj"), rank=4, seed=1)
"""
from __future__ import annotations

import json
import math
import os
import shutil
from typing import Sequence, Union

import torch
from safetensors.torch import load_file, save_file

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def _module_name(layer: int, target: str) -> str:
    return f"model.layers.{layer}.{'self_attn' if target in _ATTENTION else 'mlp'}.{target}"


def make_adapter(base_path: str, path: Union[str, os.PathLike], targets: Sequence[str] = ALL_TARGETS,
                 rank: int = 8, alpha: float = 16.0, seed: int = 0, std: float = 0.1,
                 use_rslora: bool = False) -> tuple[str, str]:
    """Write a random adapter (A and B both nonzero) at `path`/adapter and the merged checkpoint at
    `path`/merged; returns both directories."""
    path = os.fspath(path)
    adapter_dir, merged_dir = os.path.join(path, "adapter"), os.path.join(path, "merged")
    os.makedirs(adapter_dir, exist_ok=True)
    weights = load_file(os.path.join(base_path, "model.safetensors"))
    with open(os.path.join(base_path, "config.json")) as f:
        layers = json.load(f)["num_hidden_layers"]
    scaling = alpha / (math.sqrt(rank) if use_rslora else rank)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for target in targets:
            name = _module_name(layer, target)
            if f"{name}.weight" not in weights:  # a hybrid's linear-attention layer has no q_proj ...
                continue
            w = weights[f"{name}.weight"]
            a = torch.randn(rank, w.shape[1], generator=gen) * std
            b = torch.randn(w.shape[0], rank, generator=gen) * std
            tensors[f"base_model.model.{name}.lora_A.weight"] = a
            tensors[f"base_model.model.{name}.lora_B.weight"] = b
            weights[f"{name}.weight"] = w + scaling * (b @ a)
    save_file(tensors, os.path.join(adapter_dir, "adapter_model.safetensors"))
    with open(os.path.join(adapter_dir, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
                   "use_rslora": use_rslora, "bias": "none", "lora_dropout": 0.0, "task_type": "CAUSAL_LM",
                   "base_model_name_or_path": base_path}, f)
    shutil.copytree(base_path, merged_dir, dirs_exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(merged_dir, "model.safetensors"),
              metadata={"format": "pt"})
    return adapter_dir, merged_dir
