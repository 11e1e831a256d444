"""Speculative decoding: draft tokens cheaply, verify them in one target forward, keep the
longest accepted run plus the target's own next token.

    base.py              the strategy interface as its no-op (NoSpeculation) and the SpecView it works through
    ngram_index.py             NgramIndex: prompt/output lookup in one request's own tokens
    verify_strategy.py         what every drafting strategy shares: when a step verifies, its slots, its result
    ngram_strategy.py  NGRAM: drafts from the index
    head_strategy.py   NEXTN / EAGLE / EAGLE3: a draft head drafts (the scheduler's half: placeholders)
    head_worker.py      their worker half: the head's passes beside the target's
    spec_info.py         VerifyInput / VerifyOutput: what a verify step carries to the worker and back
    accept_host.py            acceptance against the target's logits: greedy (exact) and rejection sampling
    stats.py             accept length histogram and accept rate (/get_server_info, /metrics)

create_speculator picks the strategy once, from --speculative-algorithm (SGLang's flag names).
"""
from __future__ import annotations

from baton.engine.speculative.base import NoSpeculation, SpecView

# the algorithms whose drafts come from a head beside the target (head_worker.py)
HEAD_ALGORITHMS = ("NEXTN", "EAGLE", "EAGLE3")


def create_speculator(view: SpecView) -> NoSpeculation:
    algorithm = view.config.speculative_algorithm
    if algorithm is None:
        return NoSpeculation()
    if algorithm == "NGRAM":
        from baton.engine.speculative.ngram_strategy import NgramSpeculator

        return NgramSpeculator(view)
    if algorithm in HEAD_ALGORITHMS:
        from baton.engine.speculative.head_strategy import HeadSpeculator

        return HeadSpeculator(view)
    raise ValueError(f"--speculative-algorithm {algorithm} is not supported")


__all__ = ["HEAD_ALGORITHMS", "NoSpeculation", "SpecView", "create_speculator"]
