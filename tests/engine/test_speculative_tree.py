"""Tree drafts (issue 35, speculative decoding with several candidate continuations per request): the
verify step's topology (a chain stays a chain), the tree attention mask, acceptance along the tree,
the accepted path's KV, NGRAM's tree drafter; greedy output equals the plain engine's."""
from __future__ import annotations

import pytest
import torch

from baton.engine.layers.attention.torch_backend import TorchAttnBackend
from baton.engine.layers.radix_attention import RadixAttention
from baton.engine.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from baton.engine.model_executor.forward_batch import ForwardBatch, ForwardMode
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


# ---------------------------------------------------------------------------- tree attention
def _attend(backend, r2t, pool, layer, q, k, v, rows, prefixes, extends, slots, trees=None):
    """One EXTEND pass of the torch backend over the given rows (slots: the new tokens' KV slots)."""
    fb = ForwardBatch(ForwardMode.EXTEND, len(rows), torch.zeros(q.shape[0], dtype=torch.int64),
                      torch.zeros(q.shape[0], dtype=torch.int64), torch.tensor(rows),
                      torch.tensor([p + e for p, e in zip(prefixes, extends)]), slots,
                      [p + e for p, e in zip(prefixes, extends)], prefixes, extends, r2t, pool, backend,
                      tree_parents=trees)
    backend.init_forward_metadata(fb)
    return backend.forward(q, k, v, layer, fb)


@pytest.mark.parametrize("native", [False, True], ids=["sdpa", "native"])
def test_tree_attention_equals_each_nodes_chain_alone(native):
    """A tree request beside a chain request in one pass: each node's output is what the chain root ->
    node gives run on its own over the same prefix; the chain request's is unchanged by the tree."""
    from baton.engine.kernels import cpu_attention

    if native and cpu_attention.unavailable_reason(torch.float32, "cpu", torch.float32) is not None:
        pytest.skip("the native CPU kernels do not build here")
    torch.manual_seed(0)
    heads, kv_heads, dim, prefix = 4, 2, 16, 7
    pool = MHATokenToKVPool(256, 1, torch.float32, kv_heads, dim, 1, "cpu")
    r2t = ReqToTokenPool(4, 64, "cpu")
    layer = RadixAttention(heads, dim, dim ** -0.5, kv_heads, 0)
    backend = TorchAttnBackend(native_decode=native)
    parents, chain = [-1, 0, 0, 1, 1, 2, 4], 3
    n = len(parents)
    pool.k_buffer[0].normal_()
    pool.v_buffer[0].normal_()
    r2t.req_to_token[0, :prefix + n] = torch.arange(1, 1 + prefix + n)  # the tree's row, then the chain's
    r2t.req_to_token[1, :prefix + chain] = torch.arange(40, 40 + prefix + chain)
    q, k, v = torch.randn(n + chain, heads * dim), torch.randn(n + chain, kv_heads * dim), torch.randn(n + chain, kv_heads * dim)
    slots = torch.cat([r2t.req_to_token[0, prefix:prefix + n], r2t.req_to_token[1, prefix:prefix + chain]])
    out = _attend(backend, r2t, pool, layer, q, k, v, [0, 1], [prefix, prefix], [n, chain], slots, [parents, None])
    chain_alone = _attend(backend, r2t, pool, layer, q[n:], k[n:], v[n:], [1], [prefix], [chain], slots[n:])
    torch.testing.assert_close(out[n:], chain_alone)
    for j in range(n):
        path = [j]
        while parents[path[0]] >= 0:
            path.insert(0, parents[path[0]])
        r2t.req_to_token[2, :prefix] = r2t.req_to_token[0, :prefix]
        r2t.req_to_token[2, prefix:prefix + len(path)] = torch.arange(100, 100 + len(path))
        alone = _attend(backend, r2t, pool, layer, q[path], k[path], v[path], [2], [prefix], [len(path)],
                        torch.arange(100, 100 + len(path)))
        torch.testing.assert_close(out[j], alone[-1], msg=f"node {j} (path {path})")
