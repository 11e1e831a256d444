"""An approximate radix tree over request text, shared by all workers ("tenants") of one side.

It remembers which worker saw which prefixes, to guess where the engine's own radix cache already
holds a prompt's KV. Approximate: the router never learns what the engine evicted, so the tree
bounds itself with its own LRU eviction per tenant.

Invariants: a child's tenants are a subset of its parent's (insert marks the whole path; eviction
only removes a tenant from nodes where no child holds it); `size(t)` is the number of characters on
nodes that hold t. Token-id prompts are mapped to characters by the caller (`chr(id)`).
"""
from __future__ import annotations

import heapq
from typing import Collection, NamedTuple


class _Node:
    __slots__ = ("text", "parent", "children", "tenants")

    def __init__(self, text: str, parent: "_Node | None") -> None:
        self.text = text  # the edge label from the parent
        self.parent = parent
        self.children: dict[str, _Node] = {}  # first character -> child
        self.tenants: dict[str, int] = {}  # tenant -> tick of its last access


class Match(NamedTuple):
    length: int  # characters of the text matched
    tenants: list[str]  # tenants (among the allowed) holding the whole matched prefix


def common_prefix_len(edge: str, text: str, start: int) -> int:
    """Length of the common prefix of `edge` and `text[start:]`, by binary search on C compares."""
    if text.startswith(edge, start):
        return len(edge)
    lo, hi = 0, min(len(edge), len(text) - start)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if text.startswith(edge[:mid], start):
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixTree:
    def __init__(self) -> None:
        self.root = _Node("", None)
        self._sizes: dict[str, int] = {}
        self._tick = 0

    def size(self, tenant: str) -> int:
        return self._sizes.get(tenant, 0)

    def tenants(self) -> list[str]:
        return list(self._sizes)

    def insert(self, text: str, tenant: str) -> None:
        self._tick += 1
        tick, node, i = self._tick, self.root, 0
        node.tenants[tenant] = tick
        self._sizes.setdefault(tenant, 0)
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                leaf = _Node(text[i:], node)
                leaf.tenants[tenant] = tick
                node.children[text[i]] = leaf
                self._sizes[tenant] += len(leaf.text)
                return
            n = common_prefix_len(child.text, text, i)
            if n < len(child.text):
                child = self._split(child, n)
            if tenant not in child.tenants:
                self._sizes[tenant] += len(child.text)
            child.tenants[tenant] = tick
            node, i = child, i + n

    def match(self, text: str, allowed: Collection[str]) -> Match:
        """Longest prefix of `text` held by some allowed tenant, and the allowed tenants holding it."""
        node, i, tenants = self.root, 0, []
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                break
            holders = [t for t in child.tenants if t in allowed]
            if not holders:
                break
            n = common_prefix_len(child.text, text, i)
            node, i, tenants = child, i + n, holders
            if n < len(child.text):
                break
        return Match(i, tenants)

    def remove_tenant(self, tenant: str) -> None:
        if self._sizes.pop(tenant, None) is None:
            return
        stack = [self.root]
        while stack:
            node = stack.pop()
            node.tenants.pop(tenant, None)
            stack.extend(c for c in node.children.values() if tenant in c.tenants)
            if not node.tenants and node.parent is not None:
                del node.parent.children[node.text[0]]

    def evict(self, tenant: str, max_size: int) -> int:
        """Drop the tenant's least recently used leaves until its size <= max_size. Returns chars freed."""
        size = self._sizes.get(tenant, 0)
        if size <= max_size:
            return 0
        heap = [(n.tenants[tenant], id(n), n) for n in self._tenant_leaves(tenant)]
        heapq.heapify(heap)
        freed = 0
        while heap and size - freed > max_size:
            _, _, node = heapq.heappop(heap)
            del node.tenants[tenant]
            freed += len(node.text)
            parent = node.parent
            if not node.tenants:
                del parent.children[node.text[0]]
            if parent is not self.root and not any(tenant in c.tenants for c in parent.children.values()):
                heapq.heappush(heap, (parent.tenants[tenant], id(parent), parent))
        self._sizes[tenant] = size - freed
        return freed

    def _tenant_leaves(self, tenant: str) -> list[_Node]:
        leaves, stack = [], [self.root]
        while stack:
            node = stack.pop()
            held = [c for c in node.children.values() if tenant in c.tenants]
            if held:
                stack.extend(held)
            elif node is not self.root:
                leaves.append(node)
        return leaves

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut `child`'s edge after n characters; returns the new middle node."""
        parent = child.parent
        assert parent is not None and 0 < n < len(child.text)
        mid = _Node(child.text[:n], parent)
        mid.tenants = dict(child.tenants)
        parent.children[child.text[0]] = mid
        child.text, child.parent = child.text[n:], mid
        mid.children[child.text[0]] = child
        return mid
