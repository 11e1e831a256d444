"""`round_robin`: the next target in turn (the turn survives changes of the target list)."""
from __future__ import annotations

from typing import Sequence

from baton.router.policies.base import Pick, Policy
from baton.router.worker import Target


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def select(self, targets: Sequence[Target], text: str | None) -> Pick:
        index = self._next % len(targets)
        self._next = index + 1
        return Pick(targets[index], "round_robin")
