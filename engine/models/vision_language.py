"""The published vision-language checkpoints' layout (Qwen3.5, Qwen3-VL): the text model's weights under
`model.language_model.*` beside `lm_head.*`, the vision tower's under `model.visual.*`."""
from __future__ import annotations

from typing import Iterable

import torch

from baton.engine.model_config import ModelConfig

_TEXT_PREFIX, _VISION_PREFIX = "model.language_model.", "model.visual."


def split_vision_weights(weights: Iterable[tuple[str, torch.Tensor]], vision: list[tuple[str, torch.Tensor]]
                         ) -> Iterable[tuple[str, torch.Tensor]]:
    """The text model's tensors under the names Qwen3_5ForCausalLM has; the vision tower's go to
    `vision`, under the names the tower has (what follows `model.visual.`)."""
    for name, tensor in weights:
        if name.startswith(_VISION_PREFIX):
            vision.append((name[len(_VISION_PREFIX):], tensor))
        elif name.startswith(_TEXT_PREFIX):
            yield "model." + name[len(_TEXT_PREFIX):], tensor
        else:  # lm_head.*, mtp.*
            yield name, tensor


class VisionLanguageMixin:
    """A vision-language checkpoint: the text model (the class this mixes into) and `visual`, the
    vision tower (models/qwen_vision.py), replicated on every TP rank; the model runner runs it
    (model_executor/mm_embedder.py) and the text model splices its output over the image tokens."""

    separately_loaded = ("visual.",)

    def _add_vision_tower(self, config: ModelConfig) -> None:
        from baton.engine.models.qwen_vision import QwenVisionTower

        self.visual = QwenVisionTower(config.vision)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> None:
        vision: list[tuple[str, torch.Tensor]] = []
        super().load_weights(split_vision_weights(weights, vision), strict)
        self.visual.load_weights(vision, strict)


