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

How far to draft adapts per request (`draft_len`, `on_verified`): a request copying its prompt has its
drafts accepted whole and drafts twice as far next time (up to the cap); a request writing new text
has its drafts cut short and drafts only one token past what was last accepted. On a CPU every draft
token costs the verify step about what it would cost to decode it in a batch, so drafts that are
mostly rejected would eat what the accepted ones gain (measured: a fixed 11-token draft halved the
throughput of 4 concurrent code-edit requests, docs/benchmarks.md).
"""
from __future__ import annotations


class NgramIndex:
    def __init__(self, min_window: int, max_window: int, max_draft: int) -> None:
        assert 1 <= min_window <= max_window, "ngram match window: 1 <= min <= max"
        self.min_window, self.max_window = min_window, max_window
        self.max_draft = max_draft
        self.draft_len = max_draft  # how far the next draft may go (on_verified adapts it)
        # decode steps to let pass before looking for a draft again, after lookups that found none
        # (on_lookup; the speculator counts them down)
        self.backoff = 0
        self._misses = 0
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

    def on_verified(self, drafted: int, accepted: int) -> None:
        """A verify step of this request's draft: grow the next draft after a whole acceptance, else
        draft one token past the accepted run."""
        if drafted == 0:
            return
        if accepted == drafted:
            self.draft_len = min(self.max_draft, 2 * self.draft_len)
        else:
            self.draft_len = accepted + 1

    def on_lookup(self, found: bool) -> None:
        """After a lookup: one that found nothing makes the request wait 1, 3, 7, 15 steps before the
        next (in the overlap loop every look costs the step its overlap: a request writing new text
        should not pay that every step); a hit looks again at once."""
        self._misses = 0 if found else min(self._misses + 1, 4)
        self.backoff = (1 << self._misses) - 1

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
