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

Tree drafts (NgramTreeIndex, --speculative-ngram-max-bfs-breadth b > 1): text that repeats with
variations (a list whose items differ, code edited in several places) was followed, at different
earlier occurrences of the same suffix, by different tokens. Per w-gram the index keeps the latest
b occurrences followed by different tokens; a draft merges up to b continuations into a prefix tree
(spec_info.py), longest match first, most recent first within a window, so the tree's first chain is
the chain drafted above:

    tokens:   ... a b c d e ... a b c x y ... a b c | (suffix "a b c": continuations "x y", "d e")
    tree:     last -> x -> y
                   -> d -> e                         (4 nodes; the verify step accepts along either)
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterator, Optional


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
        tokens, tables, record = self.tokens, self.tables, self._record
        for t in new_tokens:
            p = len(tokens)  # t's position: the w-grams ending just before it now have a continuation
            for w in range(self.min_window, min(self.max_window, p) + 1):
                record(tables[w], tuple(tokens[p - w:p]), p, t)
            tokens.append(t)

    def _record(self, table: dict, gram: tuple[int, ...], start: int, token: int) -> None:
        """`gram` was just followed by `token`, at position `start`."""
        table[gram] = start

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
        if num_tokens <= 0:
            return []
        start = next(self._starts(), None)
        return [] if start is None else self.tokens[start:start + num_tokens]

    def start_of(self, gram: tuple[int, ...]) -> Optional[int]:
        """Where the latest continuation of `gram` (min_window .. max_window tokens) starts, if any."""
        return self.tables[len(gram)].get(gram)

    def _starts(self) -> Iterator[int]:
        """Where the continuations worth drafting start, best first: the latest of the longest match."""
        tokens, n = self.tokens, len(self.tokens)
        for w in range(min(self.max_window, n), self.min_window - 1, -1):
            start = self.tables[w].get(tuple(tokens[n - w:]))
            if start is not None:
                yield start
                return


class NgramTreeIndex(NgramIndex):
    """Several continuations per lookup, as a tree (module docstring). tables[w] maps each w-gram to
    the positions after its latest occurrences that were followed by different tokens, latest first
    (at most `breadth`)."""

    def __init__(self, min_window: int, max_window: int, max_draft: int, breadth: int) -> None:
        assert breadth > 1, "breadth 1 drafts chains: NgramIndex"
        super().__init__(min_window, max_window, max_draft)
        self.breadth = breadth

    def _record(self, table: dict, gram: tuple[int, ...], start: int, token: int) -> None:
        starts = table.get(gram)
        if starts is None:
            table[gram] = [start]
        else:  # the same next token as an older occurrence: the newer one stands for both
            tokens = self.tokens
            table[gram] = [start] + [q for q in starts if tokens[q] != token][:self.breadth - 1]

    def start_of(self, gram: tuple[int, ...]) -> Optional[int]:
        starts = self.tables[len(gram)].get(gram)
        return starts[0] if starts else None

    def _starts(self) -> Iterator[int]:
        """The longest matching window's occurrences, latest first, then each shorter window's others
        (an occurrence of a longer match is one of every shorter one)."""
        tokens, n, seen = self.tokens, len(self.tokens), set()
        for w in range(min(self.max_window, n), self.min_window - 1, -1):
            for start in self.tables[w].get(tuple(tokens[n - w:]), ()):
                if start not in seen:
                    seen.add(start)
                    yield start

    def propose_tree(self, max_nodes: int, max_depth: int) -> tuple[list[int], Optional[list[int]]]:
        """Up to `breadth` continuations of at most `max_depth` tokens, best first (_starts), merged into
        a prefix tree of at most `max_nodes` nodes: its tokens in packed order and their parents
        ([-1, ...], spec_info.py; None when it is a chain). A continuation that adds no node does not
        count."""
        tokens = self.tokens
        draft, parents = [], [-1]
        children: dict[tuple[int, int], int] = {}  # (node, token) -> child node
        merged, branched = 0, False
        for start in self._starts():
            node, grew = 0, False
            for t in tokens[start:start + max_depth]:
                child = children.get((node, t))
                if child is None:
                    if len(draft) == max_nodes:
                        break
                    draft.append(t)
                    parents.append(node)
                    child = children[(node, t)] = len(draft)
                    branched |= child - 1 != node
                    grew = True
                node = child
            merged += grew
            if merged == self.breadth or len(draft) == max_nodes:
                break
        return draft, parents if branched else None


class SharedNgrams:
    """The indexes of recently finished requests (their prompts and outputs), newest first, up to
    `capacity` tokens in all (the oldest go first): where a request's own tokens hold no match, its
    draft is what followed the longest match in another request's text, the newest such (SGLang's NGRAM
    drafts from a cache of recent requests' tokens; --speculative-ngram-capacity). The same question
    asked again, a template or a JSON shape other requests filled in: the answer is often in
    another request's text. Only requests that drafted join (their index is built already); the newest
    request's match wins within a window size, the longest window first."""

    def __init__(self, capacity: int) -> None:
        assert capacity > 0
        self.capacity = capacity
        self.indexes: OrderedDict[int, NgramIndex] = OrderedDict()  # oldest first
        self.tokens = 0
        self.hits = 0  # drafts taken from here

    def add(self, index: NgramIndex) -> None:
        """A finished request's index, with every token of its prompt and output."""
        if not 0 < len(index) <= self.capacity:
            return
        self.indexes[id(index)] = index
        self.tokens += len(index)
        while self.tokens > self.capacity:
            _, old = self.indexes.popitem(last=False)
            self.tokens -= len(old)

    def propose(self, tokens: list[int], num_tokens: int, min_window: int, max_window: int) -> list[int]:
        """Up to `num_tokens` tokens that followed the longest suffix of `tokens` (min_window ..
        max_window long) in a stored request's text, the newest request's first ([] without a match)."""
        if num_tokens <= 0:
            return []
        newest_first = list(reversed(self.indexes.values()))
        for w in range(min(max_window, len(tokens)), min_window - 1, -1):
            gram = tuple(tokens[len(tokens) - w:])
            for index in newest_first:
                if w < index.min_window or w > index.max_window:
                    continue
                start = index.start_of(gram)
                if start is not None:
                    self.hits += 1
                    return index.tokens[start:start + num_tokens]
        return []

