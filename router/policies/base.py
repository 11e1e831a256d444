"""The routing-policy contract.

A policy picks one target among the routable ones of one side. It runs on the event loop for every
request, so it must be cheap and must not block or await. `select` is called with a non-empty list
whose identity changes only when the set of routable targets changes (a policy may cache per list).
"""
from __future__ import annotations

import abc
from typing import ClassVar, Iterable, NamedTuple, Sequence

from baton.router.worker import Target


class Pick(NamedTuple):
    target: Target
    reason: str  # why: "random", "round_robin", "power_of_two", "cache_hit", "cache_miss", "balance"


class Policy(abc.ABC):
    name: ClassVar[str]
    needs_text: ClassVar[bool] = False  # True: `select` wants the request text (costs extraction)

    @abc.abstractmethod
    def select(self, targets: Sequence[Target], text: str | None) -> Pick:
        """Pick one of `targets` (non-empty). `text` is the routing text, or None if not needed."""

    def forget(self, targets: Iterable[Target]) -> None:
        """These targets are gone for good (worker removed, DP layout changed): drop their state."""
