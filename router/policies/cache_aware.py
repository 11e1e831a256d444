"""`cache_aware`: send a prompt where its prefix was sent before, unless the load is too uneven.

Per request (sglang-router's algorithm):
1. Imbalanced (max-min in-flight > abs threshold AND max > min * rel threshold): least loaded.
2. Else match the text in the prefix tree. Match rate > cache_threshold: the least loaded of the
   targets holding that prefix ("cache_hit"); otherwise the target with the smallest tree, i.e. the
   one with the most free room for new prefixes ("cache_miss").
3. Insert the text under the chosen target, evicting its LRU leaves beyond `max_tree_size`.
"""
from __future__ import annotations

from typing import Iterable, Sequence

from baton.router.config import CacheAwareConfig
from baton.router.policies.base import Pick, Policy
from baton.router.prefix_tree import PrefixTree
from baton.router.worker import Target

# Evict down to this fraction of the bound, so eviction (a walk over the tenant's nodes) is amortized
# over many inserts instead of running on every insert once the bound is reached.
_EVICT_LOW_WATERMARK = 0.9


class CacheAwarePolicy(Policy):
    name = "cache_aware"
    needs_text = True

    def __init__(self, config: CacheAwareConfig) -> None:
        self.config = config
        self.tree = PrefixTree()
        self._keys_of: tuple[int, dict[str, Target]] = (0, {})  # (id of the targets list, key -> target)

    def select(self, targets: Sequence[Target], text: str | None) -> Pick:
        text = text or ""
        if len(targets) == 1:
            pick = Pick(targets[0], "cache_hit")
        else:
            pick = self._balance(targets) or self._by_prefix(targets, text)
        self._insert(text, pick.target.key)
        return pick

    def forget(self, targets: Iterable[Target]) -> None:
        for target in targets:
            self.tree.remove_tenant(target.key)

    def _balance(self, targets: Sequence[Target]) -> Pick | None:
        least = min(targets, key=_load)
        most = max(targets, key=_load)
        lo, hi = least.in_flight, most.in_flight
        if hi - lo > self.config.balance_abs_threshold and hi > lo * self.config.balance_rel_threshold:
            return Pick(least, "balance")
        return None

    def _by_prefix(self, targets: Sequence[Target], text: str) -> Pick:
        by_key = self._targets_by_key(targets)
        matched, holders = self.tree.match(text, by_key)
        if text and holders and matched / len(text) > self.config.cache_threshold:
            return Pick(min((by_key[k] for k in holders), key=_load), "cache_hit")
        emptiest = min(targets, key=lambda t: (self.tree.size(t.key), t.in_flight))
        return Pick(emptiest, "cache_miss")

    def _targets_by_key(self, targets: Sequence[Target]) -> dict[str, Target]:
        list_id, by_key = self._keys_of
        if list_id != id(targets) or len(by_key) != len(targets):
            by_key = {t.key: t for t in targets}
            self._keys_of = (id(targets), by_key)
        return by_key

    def _insert(self, text: str, key: str) -> None:
        self.tree.insert(text, key)
        if self.tree.size(key) > self.config.max_tree_size:
            self.tree.evict(key, int(self.config.max_tree_size * _EVICT_LOW_WATERMARK))


def _load(target: Target) -> int:
    return target.in_flight
