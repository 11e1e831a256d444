"""Model registry: HF `config.architectures[0]` -> model class, imported lazily (one file per family)."""
from __future__ import annotations

import importlib

from torch import nn

# architecture -> (module under baton.engine.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "Qwen3NextForCausalLM": ("qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5ForCausalLM": ("qwen3_next", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("qwen3_next", "Qwen3_5MoeForCausalLM"),
    # the published vision-language checkpoints: the text model and its vision tower
    "Qwen3_5ForConditionalGeneration": ("qwen3_next", "Qwen3_5ForConditionalGeneration"),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_next", "Qwen3_5MoeForConditionalGeneration"),
    "Qwen3VLForConditionalGeneration": ("qwen3", "Qwen3VLForConditionalGeneration"),
    # --is-embedding: bare decoders (no LM head; their weights without the `model.` prefix) and classifiers
    "LlamaModel": ("llama", "LlamaForCausalLM"),
    "Qwen2Model": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3Model": ("qwen3", "Qwen3ForCausalLM"),
    "LlamaForSequenceClassification": ("sequence_classification", "LlamaForSequenceClassification"),
    "Qwen2ForSequenceClassification": ("sequence_classification", "Qwen2ForSequenceClassification"),
    "Qwen3ForSequenceClassification": ("sequence_classification", "Qwen3ForSequenceClassification"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(f"unsupported model architecture {architecture!r}; supported: {supported_architectures()}")
    module_name, class_name = _MODELS[architecture]
    return getattr(importlib.import_module(f"{__name__}.{module_name}"), class_name)
