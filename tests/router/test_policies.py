import random
from collections import Counter

import pytest

from baton.router.circuit_breaker import CircuitBreaker
from baton.router.config import CacheAwareConfig, CircuitBreakerConfig, PolicyName, WorkerSpec
from baton.router.policies import create_policy
from baton.router.policies.cache_aware import CacheAwarePolicy
from baton.router.worker import Target, Worker


def make_targets(n: int) -> list[Target]:
    workers = [Worker(WorkerSpec(f"http://w{i}:1"), CircuitBreaker(CircuitBreakerConfig())) for i in range(n)]
    return [w.targets[0] for w in workers]


@pytest.mark.parametrize("name", list(PolicyName))
def test_registry_creates_every_policy_and_picks_a_given_target(name):
    policy = create_policy(name, CacheAwareConfig(), random.Random(0))
    assert policy.name == name.value
    targets = make_targets(3)
    for _ in range(20):
        assert policy.select(targets, "some text").target in targets


def test_random_reaches_every_target_about_evenly():
    policy = create_policy(PolicyName.RANDOM, rng=random.Random(1))
    targets = make_targets(4)
    counts = Counter(policy.select(targets, None).target.key for _ in range(4000))
    assert set(counts) == {t.key for t in targets}
    assert min(counts.values()) > 800


def test_round_robin_cycles_in_order_and_survives_list_changes():
    policy = create_policy(PolicyName.ROUND_ROBIN)
    targets = make_targets(3)
    picks = [policy.select(targets, None).target for _ in range(6)]
    assert picks == targets + targets
    assert policy.select(targets[:2], None).target in targets[:2]


def test_power_of_two_prefers_the_less_loaded_of_two():
    policy = create_policy(PolicyName.POWER_OF_TWO, rng=random.Random(2))
    targets = make_targets(2)
    targets[0].in_flight, targets[1].in_flight = 10, 3
    assert all(policy.select(targets, None).target is targets[1] for _ in range(50))


def test_power_of_two_never_picks_the_most_loaded_of_many():
    policy = create_policy(PolicyName.POWER_OF_TWO, rng=random.Random(3))
    targets = make_targets(5)
    for i, t in enumerate(targets):
        t.in_flight = i
    picks = Counter(policy.select(targets, None).target.in_flight for _ in range(2000))
    assert 4 not in picks and picks[0] > picks[3]


def test_single_target_is_always_picked():
    for name in PolicyName:
        policy = create_policy(name, CacheAwareConfig())
        (only,) = make_targets(1)
        assert policy.select([only], "x").target is only


def cache_aware(**kw) -> CacheAwarePolicy:
    return CacheAwarePolicy(CacheAwareConfig(**{"balance_abs_threshold": 4, **kw}))


def test_cache_aware_sends_a_shared_prefix_to_the_same_target():
    policy, targets = cache_aware(), make_targets(3)
    first = policy.select(targets, "You are a helpful assistant. Question one?")
    assert first.reason == "cache_miss"
    second = policy.select(targets, "You are a helpful assistant. Question two?")
    assert second.reason == "cache_hit" and second.target is first.target


def test_cache_aware_spreads_unrelated_prompts_to_the_emptiest_tree():
    policy, targets = cache_aware(), make_targets(3)
    picks = {policy.select(targets, prompt).target.key for prompt in ("alpha " * 5, "bravo " * 5, "charlie " * 5)}
    assert len(picks) == 3


def test_cache_aware_falls_back_to_least_loaded_when_imbalanced():
    policy, targets = cache_aware(balance_abs_threshold=4, balance_rel_threshold=1.5), make_targets(2)
    hot = policy.select(targets, "shared system prompt, then a").target
    hot.in_flight = 20
    other = targets[1] if hot is targets[0] else targets[0]
    pick = policy.select(targets, "shared system prompt, then b")
    assert pick.reason == "balance" and pick.target is other
    hot.in_flight, other.in_flight = 0, 1  # balanced again; both hold the prefix now: least loaded
    pick = policy.select(targets, "shared system prompt, then c")
    assert pick.reason == "cache_hit" and pick.target is hot


def test_cache_aware_ignores_targets_not_offered():
    policy, targets = cache_aware(), make_targets(2)
    hot = policy.select(targets, "prefix prefix prefix 1").target
    rest = [t for t in targets if t is not hot]
    assert policy.select(rest, "prefix prefix prefix 2").target is rest[0]


def test_cache_aware_bounds_tree_size_per_target():
    policy, targets = cache_aware(max_tree_size=200), make_targets(1)
    for i in range(100):
        policy.select(targets, f"prompt number {i} " * 3)
    assert policy.tree.size(targets[0].key) <= 200


def test_cache_aware_forgets_removed_targets():
    policy, targets = cache_aware(), make_targets(2)
    policy.select(targets, "hello hello hello")
    policy.forget(targets)
    assert policy.tree.tenants() == []
