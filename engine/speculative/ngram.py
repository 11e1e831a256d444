"""The NGRAM drafter's index: prompt/output lookup in one request's own tokens.

The draft for the next step is what followed, the last time, the longest recent n-gram that ends the
request's tokens now (n between --speculative-ngram-min-match-window-size and ...-max-...): text a
model repeats (code it edits, a document it quotes, a list it continues) is often already in its
prompt or output, word for word.

    tokens:   ... a b c d e ... x y | a b c        (n = 3 matches "a b c", which ended at position p)
    draft:    d e ...                              (tokens[p:p + num_draft], a chain)

Per window size w a dict maps each w-gram to where its latest continuation starts. Indexing is lazy
(`extend` is called with what arrived since the last draft), so a request that never drafts (the batch
is too large, its sampling needs the plain sampler) pays nothing.
"""
from __future__ import annotations


class NgramIndex:
    def __init__(self, min_window: int, max_window: int) -> None:
        assert 1 <= min_window <= max_window, "ngram match window: 1 <= min <= max"
        self.min_window, self.max_window = min_window, max_window
        self.tokens: list[int] = []
        # tables[w]: w-gram -> position of the token that followed its latest occurrence
        self.tables: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_window + 1)]

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new_tokens: list[int]) -> None:
        tokens, tables = self.tokens, self.tables
        for t in new_tokens:
            p = len(tokens)  # t's position: the w-grams ending just before it now have a continuation
            for w in range(self.min_window, min(self.max_window, p) + 1):
                tables[w][tuple(tokens[p - w:p])] = p
            tokens.append(t)

    def propose(self, num_tokens: int) -> list[int]:
        """Up to `num_tokens` draft tokens continuing the longest matching suffix ([] without a match)."""
        tokens, n = self.tokens, len(self.tokens)
        if num_tokens <= 0:
            return []
        for w in range(min(self.max_window, n), self.min_window - 1, -1):
            start = self.tables[w].get(tuple(tokens[n - w:]))
            if start is not None:
                return tokens[start:start + num_tokens]
        return []
