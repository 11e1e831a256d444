"""Speculation counters the scheduler reports (/get_server_info, then /metrics: engine/metrics.py)."""
from __future__ import annotations


class SpecStats:
    """Accept length = tokens one request emitted in one verify step: its accepted draft tokens plus the
    target's own (1 .. num_draft_tokens). Kept as running totals, so no sample is lost between scrapes."""

    def __init__(self, num_draft_tokens: int) -> None:
        self.verify_steps = 0  # verify forwards run
        self.lagged_steps = 0  # of those, built while the verify step before them ran (verify_strategy.py)
        self.draft_tokens = 0  # draft tokens proposed (and verified)
        self.accepted_tokens = 0  # of those, accepted
        # tree drafts: request-steps whose accepted run left the tree's first chain (what a chain of the
        # same first candidates would have missed)
        self.branch_accepts = 0
        # accept_length_counts[n]: request-steps that emitted n tokens (index 0 unused)
        self.accept_length_counts = [0] * (num_draft_tokens + 1)

    def on_verify_step(self, lagged: bool = False) -> None:
        self.verify_steps += 1
        self.lagged_steps += lagged

    def on_request(self, drafted: int, accepted: int, branched: bool = False) -> None:
        """One request of a verify step (with or without a draft): `accepted` of its `drafted` tokens
        passed, so the step gave it accepted + 1 tokens (before a stop or max_tokens cut the run);
        `branched`: along a branch of its tree other than the first chain."""
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        self.branch_accepts += branched
        n = min(accepted + 1, len(self.accept_length_counts) - 1)
        self.accept_length_counts[n] += 1

    def accept_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def mean_accept_length(self) -> float:
        steps = sum(self.accept_length_counts)
        return sum(n * c for n, c in enumerate(self.accept_length_counts)) / steps if steps else 0.0

    def server_info(self) -> dict:
        return {"spec_verify_steps": self.verify_steps, "spec_lagged_verify_steps": self.lagged_steps,
                "spec_draft_tokens": self.draft_tokens,
                "spec_accepted_tokens": self.accepted_tokens, "spec_tree_branch_accepts": self.branch_accepts,
                "spec_accept_rate": self.accept_rate(),
                "spec_accept_length": self.mean_accept_length(),
                "spec_accept_length_counts": list(self.accept_length_counts)}
