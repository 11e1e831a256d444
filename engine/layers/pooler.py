"""An embedding engine's pooling (--is-embedding): each request's vector from the final-normed hidden
state of its prompt's last token, as SGLang's LAST pooling does.

    embedding model (Qwen3-Embedding, a bare Qwen3Model / LlamaModel)   L2-normalised hidden state
    sequence classifier (a `score` head: *ForSequenceClassification)     the head's logits, as they are

Only the last token is read, so a chunked prompt pools from its last chunk and a prompt whose prefix
came from the radix cache pools the same vector as one computed whole.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn


class LastTokenPooler:
    """[bs, hidden] last-token hidden states -> [bs, dim] float32 vectors."""

    def __init__(self, score: Optional[nn.Module] = None) -> None:
        """`score`: a classifier's head (hidden -> num_labels); None: normalise the hidden state."""
        self.score = score

    @property
    def normalizes(self) -> bool:
        """Whether the vectors are unit length (embeddings), not a classifier's raw logits."""
        return self.score is None

    def __call__(self, last_hidden: torch.Tensor) -> torch.Tensor:
        if self.score is not None:
            return self.score(last_hidden).float()
        return nn.functional.normalize(last_hidden.float(), p=2, dim=-1)

    @classmethod
    def for_model(cls, model: nn.Module) -> "LastTokenPooler":
        """A classifier's head where the model has one (`score`), else plain normalisation."""
        return cls(getattr(model, "score", None))
