"""`power_of_two`: sample two targets, send to the one with fewer requests in flight.

Two random choices get exponentially closer to the least-loaded target than one, without the herd
that "always the least loaded" causes when many routers (or a burst) see the same counts.
"""
from __future__ import annotations

import random as _random
from typing import Sequence

from baton.router.policies.base import Pick, Policy
from baton.router.worker import Target


class PowerOfTwoPolicy(Policy):
    name = "power_of_two"

    def __init__(self, rng: _random.Random | None = None) -> None:
        self._rng = rng or _random.Random()

    def select(self, targets: Sequence[Target], text: str | None) -> Pick:
        n = len(targets)
        if n == 1:
            return Pick(targets[0], "power_of_two")
        i = self._rng.randrange(n)
        j = self._rng.randrange(n - 1)
        a, b = targets[i], targets[j + 1 if j >= i else j]  # two distinct indices
        return Pick(b if b.in_flight < a.in_flight else a, "power_of_two")
