"""The token embedding and the LM head, split over the TP ranks by vocabulary rows (Megatron's
vocab-parallel split, as SGLang's VocabParallelEmbedding and ParallelLMHead).

    rank r holds rows [r * s, (r + 1) * s) of the [vocab, hidden] table, s = ceil(vocab / size);
    rows past the vocabulary (the last rank's, when size does not divide it) are zeros

    embedding  each rank looks up the ids in its range and zeros the rest; an all-reduce sums the
               ranks' rows. Each element is one rank's value plus zeros, so the sum is exact.
    LM head    each rank scores the hidden states against its rows; an all-gather puts the ranks'
               logits side by side, and the padding columns are cut off.

A model of vocabulary V and hidden size H thus holds V * H / size of each table per rank instead of
all of it (for a 150k vocabulary at H = 8192 in bfloat16: 2.5 GB per table), and the LM head's
matmul, the largest of a small model's step, is split like the others. With one rank both are
exactly nn.Embedding and F.linear over the whole table.

Every rank must make the same LM head calls in the same order (each is a collective): the TP step
tells the followers which rows the driver scores (worker/tp_step.py).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from baton.engine.distributed.parallel_state import TpGroup, all_gather_last_dim, all_reduce
from baton.engine.layers.gemm import GEMV_OFF, SmallBatchGemv, linear_forward


class VocabShard(NamedTuple):
    start: int  # this rank's first row
    size: int  # rows this rank holds, padding included (the same on every rank)
    vocab: int  # rows of the whole table


def vocab_shard(vocab: int, tp: TpGroup) -> VocabShard:
    per_rank = -(-vocab // tp.size)
    return VocabShard(tp.rank * per_rank, per_rank, vocab)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of a [vocab, dim] table; `forward` is the embedding lookup, `logits` the
    LM head (the same table when the checkpoint ties them)."""

    gemv: SmallBatchGemv = GEMV_OFF  # which LM head calls take the Triton GEMV: set at load (layers/gemm.py)

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TpGroup = TpGroup()) -> None:
        super().__init__()
        self.tp, self.embedding_dim = tp, embedding_dim
        self.shard = vocab_shard(num_embeddings, tp)
        self.weight = nn.Parameter(torch.empty(self.shard.size, embedding_dim))
        self.weight.weight_loader = self._load_weight

    @torch.no_grad()
    def _load_weight(self, param: nn.Parameter, tensor: torch.Tensor) -> None:
        assert tensor.shape == (self.shard.vocab, self.embedding_dim), f"{tuple(tensor.shape)} in checkpoint"
        rows = tensor[self.shard.start:self.shard.start + self.shard.size]
        param[:rows.shape[0]].copy_(rows)
        param[rows.shape[0]:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[n] token ids -> [n, dim]."""
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.shard.start
        elsewhere = (local < 0) | (local >= self.shard.size)
        rows = F.embedding(local.masked_fill(elsewhere, 0), self.weight)
        return all_reduce(rows.masked_fill(elsewhere.unsqueeze(-1), 0), self.tp)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[m, dim] -> [m, vocab] float32 scores against every row of the table."""
        scores = linear_forward(self, hidden, None)  # through a packed copy where there is one
        if self.tp.size > 1:
            scores = all_gather_last_dim(scores, self.tp)[:, :self.shard.vocab]
        return scores.float()

    def extra_repr(self) -> str:
        return (f"{self.shard.vocab}, {self.embedding_dim} (this rank: rows {self.shard.start}.."
                f"{self.shard.start + self.shard.size - 1})")
