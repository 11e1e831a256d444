"""Sequence classifiers (HF's `*ForSequenceClassification`): the decoder without an LM head, and a
`score` linear (hidden -> num_labels, no bias) that the pooler applies to the final-normed hidden state
of the prompt's last token (layers/pooler.py), as HF reads it at the last token of an unpadded prompt.
Served with --is-embedding; the head's logits are the request's vector (/classify, /encode).

The head is small and replicated on every TP rank (HF's `score.weight` loads whole)."""
from __future__ import annotations

from torch import nn

from baton.engine.distributed.parallel_state import TpGroup
from baton.engine.model_config import ModelConfig
from baton.engine.models.llama import LlamaForCausalLM
from baton.engine.models.qwen2 import Qwen2ForCausalLM
from baton.engine.models.qwen3 import Qwen3ForCausalLM


def _swap_head(model: nn.Module, config: ModelConfig) -> None:
    """The LM head out, the classifier's score head in."""
    assert config.num_labels > 0, f"{config.architecture}: the config names no labels (num_labels / id2label)"
    model.lm_head = None
    model.score = nn.Linear(config.text.hidden_size, config.num_labels, bias=False)


class LlamaForSequenceClassification(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, tp: TpGroup = TpGroup()) -> None:
        super().__init__(config, tp)
        _swap_head(self, config)


class Qwen2ForSequenceClassification(Qwen2ForCausalLM):
    def __init__(self, config: ModelConfig, tp: TpGroup = TpGroup()) -> None:
        super().__init__(config, tp)
        _swap_head(self, config)


class Qwen3ForSequenceClassification(Qwen3ForCausalLM):
    def __init__(self, config: ModelConfig, tp: TpGroup = TpGroup()) -> None:
        super().__init__(config, tp)
        _swap_head(self, config)
