"""`random`: uniform choice among routable targets."""
from __future__ import annotations

import random as _random
from typing import Sequence

from baton.router.policies.base import Pick, Policy
from baton.router.worker import Target


class RandomPolicy(Policy):
    name = "random"

    def __init__(self, rng: _random.Random | None = None) -> None:
        self._rng = rng or _random.Random()

    def select(self, targets: Sequence[Target], text: str | None) -> Pick:
        return Pick(targets[self._rng.randrange(len(targets))], "random")
