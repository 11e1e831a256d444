"""Routing policies: `base.Policy` is the contract; one file per policy; `create_policy` imports lazily."""
from __future__ import annotations

import importlib
import random as _random

from baton.router.config import CacheAwareConfig, PolicyName
from baton.router.policies.base import Pick, Policy

_IMPLEMENTATIONS: dict[PolicyName, tuple[str, str]] = {
    PolicyName.RANDOM: ("baton.router.policies.random", "RandomPolicy"),
    PolicyName.ROUND_ROBIN: ("baton.router.policies.round_robin", "RoundRobinPolicy"),
    PolicyName.POWER_OF_TWO: ("baton.router.policies.power_of_two", "PowerOfTwoPolicy"),
    PolicyName.CACHE_AWARE: ("baton.router.policies.cache_aware", "CacheAwarePolicy"),
}


def create_policy(name: PolicyName, cache_aware: CacheAwareConfig | None = None,
                  rng: _random.Random | None = None) -> Policy:
    module_name, class_name = _IMPLEMENTATIONS[PolicyName(name)]
    cls = getattr(importlib.import_module(module_name), class_name)
    if name is PolicyName.CACHE_AWARE:
        return cls(cache_aware or CacheAwareConfig())
    if name in (PolicyName.RANDOM, PolicyName.POWER_OF_TWO):
        return cls(rng)
    return cls()


__all__ = ["Pick", "Policy", "create_policy"]
