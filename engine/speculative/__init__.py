"""Speculative decoding: draft tokens cheaply, verify them in one target forward, keep the
longest accepted run plus the target's own next token.

The scheduler's half (strategies) and the worker's half (the head's passes, acceptance), by file:

    base.py              the strategy interface as its no-op (NoSpeculation) and the SpecView it works through
    config.py            SpecConfig: the flags a strategy reads
    verify_strategy.py   what every drafting strategy shares: when a step verifies, its slots, its result
    ngram_strategy.py    NGRAM: drafts from ngram_index.py (prompt/output lookup in a request's own tokens)
    head_strategy.py     NEXTN / EAGLE / EAGLE3: a draft head drafts (the scheduler's half: placeholders)
    head_worker.py       their worker half: the head's passes beside the target's
    draft_graphs.py      the head's passes in CUDA graphs, over the target's graph runner
    accept_host.py       acceptance against the target's logits on the host: greedy (exact) and rejection sampling
    accept_device.py     the same rules on the device, read back with the step's result
    stats.py             accept length histogram and accept rate (/get_server_info, /metrics)

What a verify step carries to the worker and back (VerifyInput / VerifyOutput) is core/spec_info.py.

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
