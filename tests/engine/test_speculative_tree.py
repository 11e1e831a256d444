"""Tree drafts (issue 35, speculative decoding with several candidate continuations per request): the
verify step's topology (a chain stays a chain), the tree attention mask, acceptance along the tree,
the accepted path's KV, NGRAM's tree drafter; greedy output equals the plain engine's."""
from __future__ import annotations

from baton.engine.speculative.spec_info import VerifyInput, first_chain, node_depths


# ---------------------------------------------------------------------------- topology
def test_a_chain_given_as_parents_is_a_chain_and_a_tree_keeps_its_parents():
    chains = VerifyInput([[5, 6], [7]], parents=[[-1, 0, 1], None])
    assert chains.parents is None and chains.positions(0, 10) == [10, 11, 12]
    tree = VerifyInput([[5, 6, 7, 8], [9]], parents=[[-1, 0, 0, 1, 2], [-1, 0]])
    assert tree.parents == [[-1, 0, 0, 1, 2], None] and tree.offsets == [0, 5]
    assert tree.positions(0, 10) == [10, 11, 11, 12, 12] and tree.positions(1, 3) == [3, 4]
    assert tree.depth(0) == 2 and tree.depth(1) == 1
    assert node_depths([-1, 0, 1, 0, 3, 3]) == [0, 1, 2, 1, 2, 2]
    assert first_chain([-1, 0, 1, 0, 3, 2]) == [0, 1, 2, 5]
