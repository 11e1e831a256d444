import random

from baton.router.prefix_tree import PrefixTree, common_prefix_len


def test_common_prefix_len():
    assert common_prefix_len("hello", "say hello", 4) == 5
    assert common_prefix_len("hello", "say help", 4) == 3
    assert common_prefix_len("hello", "say ", 4) == 0
    assert common_prefix_len("hello", "say hel", 4) == 3
    assert common_prefix_len("", "abc", 0) == 0


def test_match_finds_longest_prefix_and_its_tenants():
    tree = PrefixTree()
    tree.insert("hello world", "a")
    tree.insert("hello there", "b")
    assert tree.match("hello world!", {"a", "b"}) == (11, ["a"])
    length, tenants = tree.match("hello xyz", {"a", "b"})
    assert length == 6 and sorted(tenants) == ["a", "b"]
    assert tree.match("goodbye", {"a", "b"}) == (0, [])


def test_match_only_counts_allowed_tenants():
    tree = PrefixTree()
    tree.insert("hello world", "a")
    tree.insert("hello", "b")
    assert tree.match("hello world", {"b"}) == (5, ["b"])
    assert tree.match("hello world", set()) == (0, [])


def test_partial_edge_match_counts_matched_characters():
    tree = PrefixTree()
    tree.insert("abcdef", "a")
    assert tree.match("abcxyz", {"a"}) == (3, ["a"])
    assert tree.match("ab", {"a"}) == (2, ["a"])


def test_sizes_count_characters_per_tenant_across_splits():
    tree = PrefixTree()
    tree.insert("abcdef", "a")
    tree.insert("abcxyz", "a")
    assert tree.size("a") == 9  # "abc" + "def" + "xyz"
    tree.insert("abcdef", "b")
    assert tree.size("b") == 6
    tree.insert("abcdef", "b")  # again: no growth
    assert tree.size("b") == 6


def test_evict_drops_least_recently_used_leaves_first():
    tree = PrefixTree()
    tree.insert("old prompt one", "a")
    tree.insert("new prompt two", "a")
    tree.insert("new prompt two, longer", "a")  # touch the new branch again
    freed = tree.evict("a", max_size=tree.size("a") - 1)
    assert freed > 0
    assert tree.match("old prompt one", {"a"}).length == 0
    assert tree.match("new prompt two, longer", {"a"}).length == len("new prompt two, longer")


def test_evict_one_tenant_keeps_the_others_nodes():
    tree = PrefixTree()
    tree.insert("shared prefix A", "a")
    tree.insert("shared prefix A", "b")
    tree.evict("a", 0)
    assert tree.size("a") == 0
    assert tree.match("shared prefix A", {"b"}) == (15, ["b"])
    assert tree.match("shared prefix A", {"a"}) == (0, [])


def test_remove_tenant():
    tree = PrefixTree()
    tree.insert("abc", "a")
    tree.insert("abd", "b")
    tree.remove_tenant("a")
    assert "a" not in tree.tenants()
    assert tree.match("abc", {"a", "b"}) == (2, ["b"])
    assert not any("a" in n.tenants for n in _nodes(tree))


def test_random_operations_agree_with_a_naive_model():
    """Against the obvious model: a tenant holds the prefixes of the strings inserted for it."""
    rng = random.Random(7)
    tree, model = PrefixTree(), {"a": set(), "b": set(), "c": set()}
    words = ["".join(rng.choice("xyz") for _ in range(rng.randint(1, 8))) for _ in range(60)]
    for word in words:
        tenant = rng.choice(sorted(model))
        tree.insert(word, tenant)
        model[tenant].add(word)
    for probe in words + ["xyzxyz", "q"]:
        for tenant, held in model.items():
            expected = max((_lcp(probe, w) for w in held), default=0)
            length, tenants = tree.match(probe, {tenant})
            assert length == expected, (probe, tenant)
            assert (tenant in tenants) == (expected > 0)
    _check_invariants(tree)


def test_eviction_keeps_invariants_and_bound():
    rng = random.Random(3)
    tree = PrefixTree()
    for _ in range(300):
        tree.insert("".join(rng.choice("ab") for _ in range(rng.randint(5, 30))), rng.choice("pq"))
        for tenant in "pq":
            tree.evict(tenant, 100)
            assert tree.size(tenant) <= 100
        _check_invariants(tree)


def _lcp(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _nodes(tree):
    stack = [tree.root]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def _check_invariants(tree: PrefixTree) -> None:
    sizes: dict[str, int] = {}
    for node in _nodes(tree):
        for key, child in node.children.items():
            assert child.parent is node and child.text[0] == key and child.text
            assert set(child.tenants) <= set(node.tenants)
            assert child.tenants, "a node without tenants must be removed"
        if node is not tree.root:
            for tenant in node.tenants:
                sizes[tenant] = sizes.get(tenant, 0) + len(node.text)
    for tenant in tree.tenants():
        assert tree.size(tenant) == sizes.get(tenant, 0)
