"""Tree drafts (speculative decoding with several candidate continuations per request): the
verify step's topology (a chain stays a chain), the tree attention mask, acceptance along the tree,
the accepted path's KV, NGRAM's tree drafter; greedy output equals the plain engine's."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import pytest
import torch
from transformers import AutoTokenizer

from baton.engine.core.forward_batch import ForwardBatch, ForwardMode
from baton.engine.core.spec_info import VerifyInput, first_chain, node_depths
from baton.engine.io_struct import AbortReq
from baton.engine.layers.attention.torch_backend import TorchAttnBackend
from baton.engine.layers.radix_attention import RadixAttention
from baton.engine.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from baton.engine.sampling.sampling_batch_info import ReqSamplingState
from baton.engine.sampling.sampling_params import SamplingParams
from baton.engine.server_args import ServerArgs
from baton.engine.speculative.accept_host import accept_greedy_tree, target_probs, verify_drafts
from baton.engine.speculative.ngram_index import NgramIndex, NgramTreeIndex
from baton.engine.speculative.ngram_strategy import NgramSpeculator
from scheduler_harness import SchedulerHarness
from test_scheduler_vs_hf import harness_for, hf_greedy, run_workload, workload
from test_speculative import assert_distributed_as, repetitive_prompts
from tiny_models import VOCAB_SIZE

if TYPE_CHECKING:
    from baton.engine.core.req import Req


# ---------------------------------------------------------------------------- a head's tree on the device

def test_head_tree_growth_breaks_ties_by_drafted_order():
    """head_worker._Growth, the best-first rule on the device, against the rule written out on lists:
    the next leaves are a request's width best children (ties: the one drafted first), the tree the n
    best candidates by (score, shallower, drafted first), packed by (depth, score, drafted first). Scores
    with many ties (quarter steps), three requests of different depths, one chain of width 1 beside them;
    the last tree smaller than the nodes the first one chooses (its columns past its count stay in it)."""
    from baton.engine.speculative.head_worker import _Growth

    gen = torch.Generator().manual_seed(3)
    w, depths = 3, [3, 2, 3, 1]
    widths = [w, w, 1, w]
    for trial in range(20):
        g = _Growth(widths, depths, torch.device("cpu"))
        ref = [dict(parent=[], token=[], score=[], depth=[]) for _ in widths]  # drafted order, per request

        def draft(n, parent_local, token, score):
            r = ref[n]
            r["parent"].append(parent_local)
            r["token"].append(token)
            r["score"].append(score)
            r["depth"].append(1 if parent_local < 0 else r["depth"][parent_local] + 1)

        lanes = [(n, b) for n in range(len(widths)) for b in range(widths[n])]
        first = (torch.randint(-4, 1, (len(lanes),), generator=gen) / 4.0).tolist()
        tok = torch.randint(0, 50, (len(lanes),), generator=gen).tolist()
        at = [g.base[n] + b for n, b in lanes]
        g.token[torch.tensor(at)], g.score[torch.tensor(at)] = torch.tensor(tok), torch.tensor(first)
        for (n, _), t, sc in zip(lanes, tok, first):
            draft(n, -1, t, sc)
        leaves, ref_leaves = torch.tensor(at), {n: list(range(widths[n])) for n in range(len(widths))}
        for j in range(1, max(depths)):
            keep = [k for k, (n, _) in enumerate(lanes) if depths[n] > j]
            lanes, leaves = [lanes[k] for k in keep], leaves[torch.tensor(keep)]
            top = w
            ids = torch.randint(0, 50, (len(lanes), top), generator=gen)
            lp = torch.randint(-3, 1, (len(lanes), top), generator=gen) / 4.0
            scores = g.score[leaves][:, None] + lp
            g.add_children(lanes, j, leaves, ids, scores)
            children = {}
            for k, (n, b) in enumerate(lanes):
                parent = ref_leaves[n][b]
                for c in range(widths[n]):
                    draft(n, parent, int(ids[k, c]), ref[n]["score"][parent] + float(lp[k, c]))
                    children.setdefault(n, []).append(len(ref[n]["token"]) - 1)
            lanes, leaves, parent_lane, ranks = g.next_leaves(lanes, j)
            ref_leaves = {n: sorted(kids, key=lambda c: -ref[n]["score"][c])[:widths[n]]  # sorted() is stable
                          for n, kids in children.items() if depths[n] > j + 1}
            assert [(n, b) for n in ref_leaves for b in range(widths[n])] == lanes
            if lanes:
                got = [int(x) - g.base[n] for x, (n, _) in zip(leaves, lanes)]
                assert got == [c for n in ref_leaves for c in ref_leaves[n]], (trial, j)
        nodes = [6, 4, depths[2], 3]
        chosen = g.choose(nodes).read()
        for n in range(len(widths)):
            r = ref[n]
            if widths[n] == 1:
                assert chosen[n] == (r["token"], None)
                continue
            best = sorted(range(len(r["token"])), key=lambda c: (-r["score"][c], r["depth"][c], c))[:nodes[n]]
            best.sort(key=lambda c: (r["depth"][c], -r["score"][c], c))
            index = {c: k + 1 for k, c in enumerate(best)}
            want = ([r["token"][c] for c in best], [-1] + [0 if r["parent"][c] < 0 else index[r["parent"][c]]
                                                             for c in best])
            assert chosen[n] == want, (trial, n, chosen[n], want)


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


def test_flashinfers_flat_mask_is_each_requests_mask_in_turn():
    """FlashInfer's custom_mask layout: request after request, each [n, p + n] row-major; a tree's rows
    see the prefix, the node and its ancestors, a chain's are causal."""
    from baton.engine.layers.attention.masks import flat_extend_mask, prefix_causal_mask, tree_mask

    cpu = torch.device("cpu")
    tree = [-1, 0, 0, 1, 2]
    flat = flat_extend_mask([3, 2], [5, 3], [tree, None], cpu)
    assert flat.shape == (5 * 8 + 3 * 5,) and flat.dtype == torch.bool
    first, second = flat[:40].view(5, 8), flat[40:].view(3, 5)
    assert torch.equal(first, tree_mask(3, tree, cpu)) and torch.equal(second, prefix_causal_mask(2, 3, cpu))
    # node 2 (a sibling of node 1) sees the prefix, the root and itself; node 4 its branch 0 -> 2 -> 4
    assert first[2].tolist() == [True] * 3 + [True, False, True, False, False]
    assert first[4].tolist() == [True] * 3 + [True, False, True, False, True]
    assert second.tolist()[0] == [True, True, True, False, False]


def test_a_trees_mask_from_its_ancestor_matrix_equals_the_mask_from_its_parents():
    """A draft head's trees reach the attention as ancestor matrices built on the device
    (masks.ancestors over a batch of parents, padded); each request's mask and FlashInfer's flat mask
    from them equal those from the parents' lists, random trees of 2..12 nodes up to 6 deep."""
    from baton.engine.layers.attention.masks import ancestors, flat_extend_mask, tree_mask

    cpu, gen = torch.device("cpu"), torch.Generator().manual_seed(5)
    for _ in range(30):
        trees = []
        for _ in range(3):
            n = int(torch.randint(2, 13, (1,), generator=gen))
            parents = [-1]
            for j in range(1, n):
                depth = [0] * j
                for c in range(1, j):
                    depth[c] = depth[parents[c]] + 1
                choices = [c for c in range(j) if depth[c] < 6]
                parents.append(choices[int(torch.randint(0, len(choices), (1,), generator=gen))])
            trees.append(parents)
        width = max(map(len, trees))
        padded = torch.tensor([t + [0] * (width - len(t)) for t in trees])
        matrices = ancestors(padded, 6)
        prefixes = [int(torch.randint(0, 5, (1,), generator=gen)) for _ in trees]
        given = [matrices[i, :len(t), :len(t)] for i, t in enumerate(trees)]
        for p, t, m in zip(prefixes, trees, given):
            assert torch.equal(tree_mask(p, m, cpu), tree_mask(p, t, cpu)), t
        lens = [len(t) for t in trees] + [3]
        assert torch.equal(flat_extend_mask(prefixes + [2], lens, given + [None], cpu),
                           flat_extend_mask(prefixes + [2], lens, trees + [None], cpu))
    # too few gathers for the depth: a deep node misses its far ancestors
    chain = torch.tensor([[-1, 0, 1, 2, 3]])
    assert not torch.equal(ancestors(chain, 2)[0], ancestors(chain, 4)[0])


# ---------------------------------------------------------------------------- acceptance
def _state(**params) -> ReqSamplingState:
    p = SamplingParams(**{"temperature": 0.0, **params})
    p.verify(VOCAB)
    return ReqSamplingState(p, [1, 2], vocab_size=VOCAB, stop_ids_for_min_tokens=set(), device="cpu")


VOCAB = 10
# the root's children: node 1 (token 3), node 2 (token 4); node 3 (5) under 1; nodes 4 (6), 5 (7) under 2
TREE, TREE_DRAFT = [-1, 0, 0, 1, 2, 2], [3, 4, 5, 6, 7]


def _logits(argmax: list[int]) -> torch.Tensor:
    """[len(argmax), VOCAB]: random rows whose argmax is the given token."""
    rows = torch.randn(len(argmax), VOCAB)
    rows[torch.arange(len(argmax)), torch.tensor(argmax)] = 10.0
    return rows


def test_greedy_follows_the_branch_the_target_chose_and_takes_its_token_after():
    """The target picks 4 at the root (the second child), 7 after it (node 5), then 9 (no child): the
    request emits 4 7 9, accepts nodes 2 and 5, and its logprobs are read at nodes 0, 2, 5. A chain
    request of the same step verifies as it always does."""
    torch.manual_seed(0)
    tree_logits = _logits([4, 0, 7, 0, 0, 9])
    chain_logits = _logits([8, 2, 1])  # draft [8, 5]: 8 accepted, 5 rejected (the target says 2)
    spec = VerifyInput([TREE_DRAFT, [8, 5]], parents=[TREE, None])
    out = verify_drafts(torch.cat([tree_logits, chain_logits]), spec, [_state(), _state()], None,
                        return_logprob=True, top_logprobs_nums=[0, 0])
    assert out.tokens == [[4, 7, 9], [8, 2]] and out.accepted_nodes == [[2, 5], [1]]
    lps = torch.log_softmax(tree_logits, dim=-1)
    assert out.logprobs[0] == pytest.approx([float(lps[0, 4]), float(lps[2, 7]), float(lps[5, 9])])
    assert accept_greedy_tree(TREE, TREE_DRAFT, [3, 5, 0, 1, 0, 0]) == [0, 1, 3]  # the first chain, whole
    assert accept_greedy_tree(TREE, TREE_DRAFT, [2, 0, 0, 0, 0, 0]) == [0]


def _random_tree(gen: torch.Generator, nodes: int) -> list[int]:
    """Parents of a random tree of `nodes` nodes (node 0 the root, a parent before its child)."""
    return [-1] + [int(torch.randint(0, j, (1,), generator=gen)) for j in range(1, nodes)]


def test_greedy_acceptance_on_the_device_is_the_host_rule():
    """accept_device.accept_on_device against verify_drafts (the rule on the host): batches of
    chains, trees given as parents (NGRAM's) and trees given as ancestor matrices (a head's), of different
    sizes, with empty drafts among them; tokens drawn from 3 values so drafts are often accepted and
    siblings often share a token (the first in node order wins). Same emitted tokens and accepted nodes,
    and logprobs with top logprobs where asked; the result crosses to the host in one read
    (PendingVerify), the moved KV columns are the host rule's moves, and the last tokens (the next
    step's inputs) agree."""
    from baton.engine.layers.attention.masks import ancestors
    from types import SimpleNamespace

    from baton.engine.speculative.accept_host import move_accepted_kv
    from baton.engine.speculative.accept_device import (PendingVerify, accept_on_device,
                                                        move_accepted_kv_on_device)

    gen = torch.Generator().manual_seed(11)
    for trial in range(60):
        bs = int(torch.randint(1, 5, (1,), generator=gen))
        drafts, parents, device_trees = [], [], []
        for b in range(bs):
            kind = int(torch.randint(0, 3, (1,), generator=gen))
            k = int(torch.randint(0, 6, (1,), generator=gen))
            drafts.append(torch.randint(0, 3, (k,), generator=gen).tolist())
            tree = _random_tree(gen, k + 1) if kind and k else None
            parents.append(tree)
            device_trees.append(kind == 2 and tree is not None)
        host_spec = VerifyInput([list(d) for d in drafts], parents=list(parents))
        device_spec = VerifyInput([list(d) for d in drafts], parents=list(parents))
        tree_parents = None
        if device_spec.parents is not None:  # what a ForwardBatch carries: host lists, or a head's matrices
            tree_parents = list(device_spec.parents)
            for b, tree in enumerate(tree_parents):
                if tree is not None and device_trees[b]:
                    tree_parents[b] = ancestors(torch.tensor([tree]), len(tree))[0]
        input_ids = torch.tensor([t for b in range(bs) for t in [9] + drafts[b]])
        logits = torch.randn(len(input_ids), VOCAB)
        logits[torch.arange(len(input_ids)), torch.randint(0, 3, (len(input_ids),), generator=gen)] = 10.0
        nums = torch.randint(0, 4, (bs,), generator=gen).tolist() if trial % 2 else None  # logprobs asked
        want = verify_drafts(logits, host_spec, [_state() for _ in range(bs)], None, nums is not None,
                             nums or [0] * bs)
        acc = accept_on_device(logits, input_ids, device_spec, tree_parents)
        got = PendingVerify(acc, device_spec, False, logits, nums).read()
        assert got.tokens == want.tokens, (trial, drafts, parents)
        assert got.accepted_nodes == want.accepted_nodes, (trial, drafts, parents)
        assert got.logprobs == want.logprobs and got.top_logprobs == want.top_logprobs, trial
        assert acc.last.tolist() == want.last_tokens
        if want.accepted_nodes is not None:  # the accepted nodes' KV into the columns after the last token
            moved = []
            for move, args in ((move_accepted_kv, (host_spec, want)), (move_accepted_kv_on_device, (acc,))):
                kv = torch.arange(len(input_ids)) * 10

                def copy(dst, src, kv=kv):
                    kv[dst] = kv[src].clone()

                runner = SimpleNamespace(token_to_kv_pool=SimpleNamespace(move_kv_cache=copy))
                loc = torch.arange(len(input_ids))
                if move is move_accepted_kv:
                    move(runner, SimpleNamespace(out_cache_loc=loc), *args)
                else:
                    move(runner, loc, *args)
                moved.append(kv.tolist())
            assert moved[0] == moved[1], trial


def _random_chains(gen: torch.Generator, longest: int, boost: float):
    """1-3 requests' chains of 0..`longest` drafts from tokens 0-3, the pass's token ids ([9] + draft
    each) and random logits whose argmax is one of tokens 0-3 by `boost` at most rows: (bs, drafts, ids,
    logits)."""
    bs = int(torch.randint(1, 4, (1,), generator=gen))
    drafts = [torch.randint(0, 4, (int(torch.randint(0, longest + 1, (1,), generator=gen)),), generator=gen).tolist()
              for _ in range(bs)]
    ids = torch.tensor([t for d in drafts for t in [9] + d])
    logits = torch.randn(len(ids), VOCAB, generator=gen)
    logits[torch.arange(len(ids)), torch.randint(0, 4, (len(ids),), generator=gen)] += boost
    return bs, drafts, ids, logits


def _assert_tree_rows_processed_as_on_the_host(gen: torch.Generator, base: torch.Tensor, state: ReqSamplingState,
                                               host_state: ReqSamplingState) -> None:
    """A random 6-node tree's rows (`base` [1, VOCAB] plus noise) processed on the device for `state`:
    each node's row is the last row of its root -> node chain as the host processes it for `host_state`
    (the drafts on its path counted, min_new_tokens by its depth)."""
    from baton.engine.speculative.accept_device import _Nodes, processed_logits
    from baton.engine.speculative.accept_host import processed_rows

    tree = _random_tree(gen, 6)
    tree_ids = torch.tensor([9] + torch.randint(0, 4, (5,), generator=gen).tolist())
    tree_spec = VerifyInput([tree_ids[1:].tolist()], parents=[tree])
    tree_logits = base.repeat(6, 1) + torch.randn(6, VOCAB, generator=gen)
    got = processed_logits(tree_logits, _Nodes(tree_logits, tree_ids, tree_spec, [tree]), tree_spec, [state], [0])
    for node in range(6):
        path = [node]
        while path[-1] > 0:
            path.append(tree[path[-1]])
        path.reverse()
        want = processed_rows(tree_logits[path], tree_ids[path[1:]].tolist(), host_state)[-1]
        torch.testing.assert_close(got[node], want)


@pytest.mark.parametrize("params", [dict(frequency_penalty=0.7, presence_penalty=0.4),
                                    dict(repetition_penalty=1.8, logit_bias={1: 3.0, 2: -2.0}),
                                    dict(temperature=0.8, top_k=5, frequency_penalty=1.5, seed=3)],
                         ids=["frequency-presence", "repetition-bias", "sampled-frequency"])
def test_penalised_requests_are_processed_and_counted_on_the_device(params):
    """Penalties and a logit bias on the device (accept_device.processed_logits): each row as the host
    processes it (verify.processed_rows: the drafts before it counted), a tree node's as the host
    processes its root -> node chain; greedy requests emit the host rule's tokens; the penalty counts
    after the step are what the host's per-token updates leave."""
    from baton.engine.speculative.accept_device import PendingVerify, _Nodes, accept_on_device, processed_logits
    from baton.engine.speculative.accept_host import processed_rows

    gen = torch.Generator().manual_seed(5)
    for trial in range(20):
        bs, drafts, ids, logits = _random_chains(gen, longest=4, boost=3.0)
        states, host_states = ([_state(**params) for _ in range(bs)] for _ in range(2))
        for a, b in zip(states, host_states):  # some output so far
            for t in torch.randint(0, VOCAB, (3,), generator=gen).tolist():
                a.on_sampled(t)
                b.on_sampled(t)
        spec = VerifyInput([list(d) for d in drafts])
        got = processed_logits(logits, _Nodes(logits, ids, spec, None), spec, states, list(range(bs)))
        for i, d in enumerate(drafts):
            off, n = spec.offsets[i], 1 + len(d)
            torch.testing.assert_close(got[off:off + n], processed_rows(logits[off:off + n], d, host_states[i]))
        # a tree: each node's row as the host processes the last row of its root -> node chain
        _assert_tree_rows_processed_as_on_the_host(gen, logits[:1], states[0], host_states[0])
        if "temperature" in params:
            continue  # sampled: the device's draws are its own (the walk's distribution: the tests above)
        acc = accept_on_device(logits, ids, spec, None, states, list(range(bs)))
        out = PendingVerify(acc, spec, async_copy=False).read()
        want = verify_drafts(logits, VerifyInput([list(d) for d in drafts]), host_states, None, False, [0] * bs)
        assert out.tokens == want.tokens, trial
        for a, b in zip(states, host_states):
            if a.has_penalties:
                assert torch.equal(a.output_counts, b.output_counts) and torch.equal(a.seen_mask, b.seen_mask)


def _min_tokens_state(min_new: int, done: int, unread: int, device: str = "cpu") -> ReqSamplingState:
    """A greedy request with stop ids 0 and 1 blocked below `min_new`: `done` tokens read by the host,
    `unread` more emitted by a verify step checked on the device and not read yet."""
    p = SamplingParams(temperature=0.0, min_new_tokens=min_new, stop_token_ids=[0, 1])
    p.verify(VOCAB)
    s = ReqSamplingState(p, [1, 2], vocab_size=VOCAB, stop_ids_for_min_tokens={0, 1}, device=device)
    s.num_sampled = done
    if unread:
        s.sampled(torch.device(device))
        s.sampled_on_device += unread
    return s


def test_min_new_tokens_blocks_stop_ids_on_the_device_by_the_count_there():
    """min_new_tokens on the device (accept_device.processed_logits): each row's stop ids blocked as the
    host blocks them (verify.processed_rows: while num_sampled + the row's index < min_new_tokens), where
    the tokens sampled so far include a step the host has not read yet (sampled_on_device: a lagged
    step's); a tree node's by its own depth; greedy requests emit the host rule's tokens; and once the
    host reads the steps, its count is the host rule's (ReqSamplingState.on_read)."""
    from baton.engine.speculative.accept_device import PendingVerify, _Nodes, accept_on_device, processed_logits
    from baton.engine.speculative.accept_host import processed_rows

    gen = torch.Generator().manual_seed(7)
    blocked_rows = unblocked_stop_rows = 0
    for trial in range(40):
        bs, drafts, ids, logits = _random_chains(gen, longest=5, boost=4.0)  # stop ids 0, 1 often win
        counts = [(int(torch.randint(1, 9, (1,), generator=gen)), int(torch.randint(0, 5, (1,), generator=gen)),
                   int(torch.randint(0, 4, (1,), generator=gen))) for _ in range(bs)]
        states = [_min_tokens_state(m, done, unread) for m, done, unread in counts]
        host_states = [_min_tokens_state(m, done + unread, 0) for m, done, unread in counts]  # the exact count
        spec = VerifyInput([list(d) for d in drafts])
        got = processed_logits(logits, _Nodes(logits, ids, spec, None), spec, states,
                               [i for i, s in enumerate(states) if s.min_tokens_active])
        for i, d in enumerate(drafts):
            off, n = spec.offsets[i], 1 + len(d)
            want = processed_rows(logits[off:off + n], d, host_states[i])
            torch.testing.assert_close(got[off:off + n], want)
            blocked_rows += int(torch.isinf(want[:, 0]).sum())
            unblocked_stop_rows += int((~torch.isinf(want[:, 0]) & (logits[off:off + n].argmax(1) <= 1)).sum())
        # a tree: each node's row by its depth (its root -> node chain's last row on the host)
        _assert_tree_rows_processed_as_on_the_host(gen, torch.zeros(1, VOCAB), _min_tokens_state(4, 1, 1),
                                                   _min_tokens_state(4, 2, 0))
        # the walk: the host rule's tokens; the counts, once both steps are read, the host rule's
        acc = accept_on_device(logits, ids, spec, None, states, list(range(bs)))
        out = PendingVerify(acc, spec, async_copy=False).read()
        want = verify_drafts(logits, VerifyInput([list(d) for d in drafts]), host_states, None, False, [0] * bs)
        assert out.tokens == want.tokens, trial
        for s, h, (_, _, unread) in zip(states, host_states, counts):
            if unread:
                s.on_read(unread, True)  # the earlier step, read after this one was launched
            assert s.num_sampled == h.num_sampled, trial
            assert s.sampled_on_device is None or int(s.sampled_on_device) == 0, trial
    assert blocked_rows > 20 and unblocked_stop_rows > 20, (blocked_rows, unblocked_stop_rows)


class _SampledBatch:
    """Verify rows for the rejection walk: TREE's (temperature 1, top-p 0.8; half given as host parents,
    half as a head's ancestor matrices), chains [d1, d2] of two other parameter sets (top-k; top-p with
    min-p), and every 97th row greedy (its chain [2, 7] is the argmax's); each row its own draw number."""

    def __init__(self, rows: int) -> None:
        from baton.engine.layers.attention.masks import ancestors

        torch.manual_seed(0)
        self.tree_logits = torch.randn(6, VOCAB)
        tree_params = dict(temperature=1.0, top_p=0.8, seed=11)
        self.p_tree = target_probs(self.tree_logits, _state(**tree_params).params)
        order = self.p_tree[0].argsort(descending=True).tolist()
        self.tree_draft = list(TREE_DRAFT)
        self.tree_draft[0], self.tree_draft[1] = order[1], order[2]  # both children of the root live
        for node, rank in ((3, 0), (4, 1), (5, 0)):
            self.tree_draft[node - 1] = self.p_tree[TREE[node]].argsort(descending=True).tolist()[rank]
        chain_logits = torch.randn(3, VOCAB)
        chain_params = [dict(temperature=0.7, top_k=3, seed=5), dict(temperature=1.3, top_p=0.9, min_p=0.05)]
        self.p_chain = [target_probs(chain_logits, _state(**c).params) for c in chain_params]
        self.chain_draft = [int(self.p_chain[0][0].argsort(descending=True)[1]), int(self.p_chain[0][1].argmax())]
        self.greedy_logits = torch.randn(3, VOCAB)
        self.greedy_logits[0, 2] = self.greedy_logits[1, 7] = 9.0
        self.params = [_state(**c).params for c in (tree_params, *chain_params)]
        self.kinds, self.states, self.drafts, self.parents, self.logits = [], [], [], [], []
        for r in range(rows):
            kind = ("tree", "chain0", "chain1")[r % 3] if r % 97 else "greedy"
            self.kinds.append(kind)
            if kind == "tree":
                self.states.append(_state(**tree_params))
                self.drafts.append(self.tree_draft)
                self.parents.append(TREE if r % 2 else ancestors(torch.tensor([TREE]), len(TREE))[0])
                self.logits.append(self.tree_logits)
            else:
                self.states.append(_state(**chain_params[int(kind[-1])]) if kind != "greedy" else _state())
                self.drafts.append(self.chain_draft if kind != "greedy" else [2, 7])
                self.parents.append(None)
                self.logits.append(chain_logits if kind != "greedy" else self.greedy_logits)

    def run(self, rows: list[int], device: str = "cpu", no_waits: bool = False):
        """accept_on_device over these rows, read back as the scheduler reads it. `no_waits` (CUDA): in
        torch's sync debug mode, which raises where a call waits for the device."""
        from baton.engine.speculative.accept_device import PendingVerify, accept_on_device

        spec = VerifyInput([self.drafts[r] for r in rows],
                           parents=[TREE if self.parents[r] is not None else None for r in rows])
        ids = torch.tensor([t for r in rows for t in [1] + self.drafts[r]], device=device)
        logits = torch.cat([self.logits[r] for r in rows]).to(device)
        parents = [p.to(device) if isinstance(p, torch.Tensor) else p for p in (self.parents[r] for r in rows)]
        if no_waits:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            acc = accept_on_device(logits, ids, spec, parents, [self.states[r] for r in rows], rows)
            pending = PendingVerify(acc, spec, async_copy=device != "cpu")
        finally:
            if no_waits:
                torch.cuda.set_sync_debug_mode("default")
        return acc, pending


def test_sampled_acceptance_on_the_device_keeps_the_target_distribution():
    """accept_device.accept_on_device with sampled requests (the rejection walk), 12,000 verified rows in
    one call (_SampledBatch): each token is distributed as the target's p at the node it was predicted
    at (chi-square), for the tree and for chains of other parameters in the same batch; greedy rows take
    the host's greedy rule; a request's tokens do not depend on the rest of the batch (the same rows
    alone give the same tokens); and the walk's probabilities are verify.target_probs row by row."""
    from baton.engine.speculative.accept_device import _Nodes, target_probs_rows

    sb = _SampledBatch(12000)
    out = sb.run(list(range(len(sb.states))))[1].read()
    by = {k: [t for t, kk in zip(out.tokens, sb.kinds) if kk == k] for k in ("tree", "chain0", "chain1", "greedy")}
    check = dict(least=200, limit=35.0)  # p < 1e-4
    draft = sb.tree_draft
    assert_distributed_as(sb.p_tree[0], [t[0] for t in by["tree"]], "tree root", **check)
    for first, node in ((draft[0], 1), (draft[1], 2)):
        assert_distributed_as(sb.p_tree[node], [t[1] for t in by["tree"] if t[0] == first], f"node {node}", **check)
    for path, node in (((draft[0], draft[2]), 3), ((draft[1], draft[3]), 4), ((draft[1], draft[4]), 5)):
        assert_distributed_as(sb.p_tree[node], [t[2] for t in by["tree"] if tuple(t[:2]) == path], f"node {node}",
                              **check)
    for k, p in enumerate(sb.p_chain):
        tokens, chain = by[f"chain{k}"], sb.chain_draft
        assert_distributed_as(p[0], [t[0] for t in tokens], f"chain {k} position 0", **check)
        assert_distributed_as(p[1], [t[1] for t in tokens if t[0] == chain[0]], f"chain {k} position 1", **check)
        assert all(t[-1] != chain[len(t) - 1] for t in tokens if len(t) < 3), "a rejection never emits the draft"
    for t, accepted in zip(out.tokens, out.accepted_nodes):
        assert len(accepted) == len(t) - 1
    assert by["greedy"] and all(t == [2, 7, int(sb.greedy_logits[2].argmax())] for t in by["greedy"])
    some = [0, 1, 2, 97, 5000]
    assert sb.run(some)[1].read().tokens == [out.tokens[r] for r in some], "the same draws give the same tokens"

    # the walk's distribution, row by row, is the host's (rows of different parameters in one call)
    lg = torch.randn(8, VOCAB)
    params = [*sb.params, _state(temperature=0.5).params]
    spec = VerifyInput([[0, 0], [0], [], [0]])
    got = target_probs_rows(lg, params, _Nodes(lg, torch.zeros(8, dtype=torch.int64), spec, None))
    for j, r in enumerate([0, 0, 0, 1, 1, 2, 3, 3]):
        torch.testing.assert_close(got[j], target_probs(lg[j:j + 1], params[r])[0])


@pytest.mark.gpu
def test_the_rejection_walk_on_cuda_is_the_cpus_and_never_waits():
    """The rejection walk on CUDA (_SampledBatch, 3,000 rows): no call in it waits for the device
    (torch's sync debug mode raises on one), and it draws the CPU's tokens (the same hashed numbers;
    float rounding may flip a trial that falls on a threshold: at most 1% of the rows)."""
    from test_gpu_paths import need_gpu

    need_gpu()
    sb = _SampledBatch(3000)
    rows = list(range(3000))
    want = sb.run(rows)[1].read().tokens
    sb.run(rows[:10], "cuda")  # warm-up: first CUDA calls may load modules
    got = sb.run(rows, "cuda", no_waits=True)[1].read().tokens
    differ = sum(a != b for a, b in zip(got, want))
    print(f"rejection walk on CUDA: {differ} of {len(rows)} rows differ from the CPU's")
    assert differ <= len(rows) // 100, differ


@pytest.mark.gpu
def test_min_new_tokens_on_cuda_blocks_as_on_the_cpu_and_never_waits():
    """min_new_tokens on the device, on CUDA (states, logits and counts there): no call waits for the
    device (torch's sync debug mode), the tokens are the host rule's, the counts once read the host's."""
    from test_gpu_paths import need_gpu

    from baton.engine.speculative.accept_device import PendingVerify, accept_on_device

    need_gpu()
    gen = torch.Generator().manual_seed(3)
    drafts = [[0, 2, 1], [3, 0], [], [1, 1, 1, 0]]
    counts = [(3, 0, 1), (6, 2, 0), (1, 0, 0), (5, 1, 2)]
    ids = torch.tensor([t for d in drafts for t in [9] + d])
    logits = torch.randn(len(ids), VOCAB, generator=gen)
    logits[torch.arange(len(ids)), torch.randint(0, 2, (len(ids),), generator=gen)] += 4.0  # stop ids win
    host_states = [_min_tokens_state(m, done + unread, 0) for m, done, unread in counts]
    want = verify_drafts(logits, VerifyInput([list(d) for d in drafts]), host_states, None, False, [0] * len(drafts))
    for warm in (True, False):  # the first CUDA calls may load modules
        states = [_min_tokens_state(m, done, unread, "cuda") for m, done, unread in counts]
        spec = VerifyInput([list(d) for d in drafts])
        torch.cuda.synchronize()
        if not warm:
            torch.cuda.set_sync_debug_mode("error")
        try:
            acc = accept_on_device(logits.cuda(), ids.cuda(), spec, None, states, [0] * len(drafts))
            pending = PendingVerify(acc, spec, async_copy=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert pending.read().tokens == want.tokens
    for s, h, (_, _, unread) in zip(states, host_states, counts):
        if unread:
            s.on_read(unread, True)
        assert s.num_sampled == h.num_sampled and int(s.sampled_on_device or 0) == 0


@pytest.mark.parametrize("params", [dict(logit_bias={4: -1.0}), dict(frequency_penalty=0.5),
                                    dict(temperature=0.8, seed=3, frequency_penalty=0.5)],
                         ids=["bias", "penalty", "sampled-penalty"])
def test_processed_requests_verify_the_first_chain_as_a_chain(params):
    """Their rules hold for one chain: the tree's first chain (nodes 0, 1, 3) verifies exactly as that
    chain would alone (same tokens, same logprobs), whatever the other branches hold."""
    torch.manual_seed(1)
    logits = torch.randn(6, VOCAB)
    logits[0, 3] = logits[1, 5] = 4.0  # the first chain is likely to pass
    tree = verify_drafts(logits, VerifyInput([TREE_DRAFT], parents=[TREE]), [_state(**params)], [5],
                         return_logprob=True, top_logprobs_nums=[2])
    chain = verify_drafts(logits[[0, 1, 3]], VerifyInput([[3, 5]]), [_state(**params)], [5],
                          return_logprob=True, top_logprobs_nums=[2])
    assert tree.tokens == chain.tokens and tree.logprobs == chain.logprobs
    assert tree.top_logprobs == chain.top_logprobs
    assert tree.accepted_nodes == [[1, 3][:len(chain.tokens[0]) - 1]]


def test_tree_rejection_sampling_keeps_the_target_distribution():
    """A sampled request walks the whole tree (TREE: two children of the root, one under the first,
    two under the second): the first token is distributed as the target's p at the root, the second as
    p at the node of the accepted first (or, after a root token no child holds, it is absent), the third
    likewise; siblings other than the first are accepted too; logprobs and accepted nodes follow the
    walked path. A chi-square test over 10,000 verified rows."""
    torch.manual_seed(0)
    logits = torch.randn(6, VOCAB)
    params = dict(temperature=1.0, top_p=0.8)
    p = target_probs(logits, _state(**params).params)
    # the root's children: its 2nd and 3rd likeliest tokens, so both are accepted and rejected often
    order = p[0].argsort(descending=True).tolist()
    draft = list(TREE_DRAFT)
    draft[0], draft[1] = order[1], order[2]
    for node, rank in ((3, 0), (4, 1), (5, 0)):  # deeper children: likely tokens at their parent
        draft[node - 1] = p[TREE[node]].argsort(descending=True).tolist()[rank]
    assert float(p[0, draft[0]]) > 0.05 and float(p[0, draft[1]]) > 0.05, "the test needs both children live"
    rows = 10000
    states = [_state(**params, seed=11) for _ in range(rows)]  # top-p leaves some tokens no mass
    out = verify_drafts(logits.repeat(rows, 1), VerifyInput([draft] * rows, parents=[TREE] * rows), states,
                        list(range(rows)), return_logprob=True, top_logprobs_nums=[0] * rows)

    def check(node: int, samples: list[int]) -> None:
        assert_distributed_as(p[node], samples, f"node {node}", least=200, limit=35.0)  # p < 1e-4

    check(0, [t[0] for t in out.tokens])
    for first, node in ((draft[0], 1), (draft[1], 2)):
        check(node, [t[1] for t in out.tokens if t[0] == first])
    for path, node in (((draft[0], draft[2]), 3), ((draft[1], draft[3]), 4), ((draft[1], draft[4]), 5)):
        check(node, [t[2] for t in out.tokens if tuple(t[:2]) == path])
    nodes = {(1,): 0, (2,): 0}
    for t, accepted, lps in zip(out.tokens, out.accepted_nodes, out.logprobs):
        assert len(accepted) == len(t) - 1 and [draft[n - 1] for n in accepted] == t[:-1]
        assert all(TREE[n] == (accepted[k - 1] if k else 0) for k, n in enumerate(accepted))
        at = [0, *accepted]
        assert lps == pytest.approx([float(torch.log_softmax(logits[n], -1)[x]) for n, x in zip(at, t)])
        if accepted:
            nodes[(accepted[0],)] += 1
    assert nodes[(1,)] > 500 and nodes[(2,)] > 500, f"both children of the root accepted often: {nodes}"


# ---------------------------------------------------------------------------- the accepted path's KV
SPEC = dict(speculative_algorithm="NGRAM", speculative_disable_by_batch_size=64)
MAX_NEW = 40


def _oracle(refs: dict[str, list[int]]) -> Callable:
    """A tree drafter that knows each request's greedy continuation (`refs`, HF's): the first chain is
    wrong from its first token on, and the continuation is a later branch of the root, each of its
    tokens behind a wrong sibling. Everything a verify step accepts is off the first chain, so the
    accepted KV always moves."""
    def draft_tree(self, req: "Req") -> tuple[list[int], Optional[list[int]]]:
        depth = min(3, self.room(req))
        if depth <= 0:
            return [], None
        right = refs[req.rid][len(req.output_ids):][:depth]
        tokens, parents = [], [-1]

        def add(token: int, parent: int) -> int:
            tokens.append(token)
            parents.append(parent)
            return len(tokens)

        first = add((right[0] + 1) % VOCAB_SIZE, 0)
        if depth > 1:
            add((right[1] + 1) % VOCAB_SIZE, first)
        node = 0
        for k, token in enumerate(right):
            if k:
                add((token + 2) % VOCAB_SIZE, node)
            node = add(token, node)
        return tokens, parents

    return draft_tree


def _oracle_harness(monkeypatch, path: str, refs: dict[str, list[int]], loop: str = "plain",
                    **overrides) -> SchedulerHarness:
    """A scheduler whose NGRAM speculator drafts _oracle's trees from `refs` (rid -> greedy tokens; the
    test may add rids later)."""
    monkeypatch.setattr(NgramSpeculator, "draft_tree", _oracle(refs))
    monkeypatch.setattr(NgramSpeculator, "on_verified", lambda self, req, drafted, accepted: None)  # no index
    return harness_for(path, loop, max_total_tokens=4096, **{**SPEC, **overrides})


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_sampled_requests_walk_the_whole_tree(tiny_model_factory, monkeypatch, arch):
    """Sampled requests whose target distribution is its argmax alone (temperature 1, min_p 0.999: no
    greedy request, the rejection rule decides) verify the whole tree: every run they accept comes off
    the first chain (the oracle's trees), its KV moves (a hybrid's state rolls back to the walk's last
    node), their tokens are HF's greedy ones, nothing leaks."""
    path = tiny_model_factory(arch)  # (with initializer_range 0.02 a hybrid's near-ties pass min_p 0.999)
    prompts = {str(i): p for i, p in enumerate(workload()[:3])}
    refs = {rid: hf_greedy(path, p, MAX_NEW, ignore_eos=True) for rid, p in prompts.items()}
    h = _oracle_harness(monkeypatch, path, refs, "plain", page_size=16)
    for rid, p in prompts.items():
        h.submit(rid, p, max_new_tokens=MAX_NEW, ignore_eos=True, temperature=1.0, min_p=0.999, seed=int(rid))
    results = h.run_until_idle()
    for rid in prompts:
        assert results[rid].ids == refs[rid], f"request {rid}"
    info = h.scheduler.get_server_info()
    assert info["spec_tree_branch_accepts"] > 10 and info["spec_accept_length"] > 2.5, info
    assert info["integrity_ok"] is True


@pytest.mark.parametrize("loop,page_size", [("plain", 1), ("overlap", 16)])
def test_accepted_branches_keep_their_kv(tiny_model_factory, monkeypatch, loop, page_size):
    """Every accepted token of these runs comes from a branch other than the first chain: greedy tokens
    still equal HF's (so the next steps read the moved KV as their own), the radix cache holds what the
    plain engine would, and nothing leaks."""
    path = tiny_model_factory("llama")
    prompts = {str(i): p for i, p in enumerate(workload()[:4])}
    refs = {rid: hf_greedy(path, p, MAX_NEW, ignore_eos=True) for rid, p in prompts.items()}
    h = _oracle_harness(monkeypatch, path, refs, loop, page_size=page_size)
    results = run_workload(h, list(prompts.values()), max_new=MAX_NEW, ignore_eos=True)
    for rid in prompts:
        assert results[rid].ids == refs[rid], f"request {rid}"
    info = h.scheduler.get_server_info()
    assert info["spec_tree_branch_accepts"] > 10 and info["spec_accept_length"] > 2.5, info
    assert info["integrity_ok"] is True
    # a follow-up turn reuses a finished request's cached KV, accepted-branch tokens included
    turn2 = prompts["0"] + results["0"].ids + [7, 8]
    refs["turn2"] = hf_greedy(path, turn2, 8, ignore_eos=True)
    h.submit("turn2", turn2, max_new_tokens=8, ignore_eos=True)
    res = h.run_until_idle()
    assert res["turn2"].cached_tokens >= (len(prompts["0"]) + MAX_NEW - 1) // page_size * page_size
    assert res["turn2"].ids == refs["turn2"]


def test_stops_and_logprobs_inside_accepted_branches(tiny_model_factory, monkeypatch):
    """A stop string, a stop id and max_tokens that fall inside runs accepted off the first chain end
    the request exactly where the plain engine ends it, with its logprobs."""
    path = tiny_model_factory("llama")
    prompt = workload()[3]
    ref = hf_greedy(path, prompt, 60, ignore_eos=True)
    late = next(t for t in ref[20:] if ref.index(t) >= 12)  # first seen well into the output
    stop_text = AutoTokenizer.from_pretrained(path).decode(ref[29:31])
    base = dict(ignore_eos=True, return_logprob=True, top_logprobs_num=2, max_new_tokens=60)
    requests = {"len17": dict(base, max_new_tokens=17), "stop_id": dict(base, stop_token_ids=[late]),
                "stop_str": dict(base, stop=[stop_text])}
    plain = SchedulerHarness(path, max_total_tokens=4096, disable_overlap_schedule=True)
    spec = _oracle_harness(monkeypatch, path, {rid: ref for rid in requests})
    for h in (plain, spec):
        for rid, params in requests.items():
            h.submit(rid, prompt, **params)
        h.run_until_idle()
    assert spec.scheduler.get_server_info()["spec_tree_branch_accepts"] > 0
    assert plain.results["stop_str"].finish.matched == stop_text and len(plain.results["stop_str"].ids) < 40
    for rid, want in plain.results.items():
        got = spec.results[rid]
        assert got.ids == want.ids and (got.finish.kind, got.finish.matched) == (want.finish.kind, want.finish.matched), rid
        torch.testing.assert_close([lp for lp, _ in got.output_logprobs], [lp for lp, _ in want.output_logprobs],
                                   rtol=1e-4, atol=1e-4)
        assert [[t for _, t in top] for top in got.output_top_logprobs] == \
            [[t for _, t in top] for top in want.output_top_logprobs], rid
    assert spec.scheduler.check_memory_integrity()


def test_abort_while_drafting_trees_leaks_nothing(tiny_model_factory, monkeypatch):
    path = tiny_model_factory("llama")
    prompts = {str(i): p for i, p in enumerate(workload()[1:4])}
    refs = {rid: hf_greedy(path, p, 120, ignore_eos=True) for rid, p in prompts.items()}
    h = _oracle_harness(monkeypatch, path, refs, page_size=4)
    for rid, p in prompts.items():
        h.submit(rid, p, max_new_tokens=120, ignore_eos=True)
    output_len = lambda: next((len(r.output_ids) for r in h.scheduler.running_batch.reqs if r.rid == "1"), 0)
    for _ in range(100):
        h.step()
        if output_len() > 8:
            break
    assert 8 < output_len() < 100
    h.scheduler.process_input_requests([AbortReq(rid="1")])
    res = h.run_until_idle()
    assert res["1"].finish.kind == "abort" and res["1"].after_finish == 0
    assert res["0"].ids == refs["0"] and res["2"].ids == refs["2"]
    assert h.scheduler.check_memory_integrity()


# ---------------------------------------------------------------------------- NGRAM's trees
def test_ngram_tree_merges_the_continuations_of_earlier_occurrences_latest_first():
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 7, 9, 1, 2, 3, 6, 8, 9, 1, 2, 3]
    chain = NgramIndex(min_window=2, max_window=3, max_draft=4)
    tree = NgramTreeIndex(min_window=2, max_window=3, max_draft=4, breadth=3)
    chain.extend(tokens)
    tree.extend(tokens)
    # "1 2 3" was followed by 6 8 (latest), 7 7, 4 5: the first chain is the chain index's draft
    assert chain.propose(2) == tree.propose(2) == [6, 8]
    assert tree.propose_tree(max_nodes=6, max_depth=2) == ([6, 8, 7, 7, 4, 5], [-1, 0, 1, 0, 3, 0, 5])
    assert tree.propose_tree(max_nodes=3, max_depth=2) == ([6, 8, 7], [-1, 0, 1, 0])  # the node budget
    assert tree.propose_tree(max_nodes=6, max_depth=1) == ([6, 7, 4], [-1, 0, 0, 0])
    narrow = NgramTreeIndex(min_window=2, max_window=3, max_draft=4, breadth=2)
    narrow.extend(tokens)
    assert narrow.propose_tree(max_nodes=6, max_depth=2) == ([6, 8, 7, 7], [-1, 0, 1, 0, 3])
    # an older occurrence followed by the same token gives way to the newer; a shorter window's other
    # occurrences come after the longest's
    again = NgramTreeIndex(min_window=2, max_window=3, max_draft=4, breadth=3)
    again.extend([5, 2, 3, 4, 1, 2, 3, 6, 7, 1, 2, 3, 6, 8, 1, 2, 3])
    assert again.propose_tree(max_nodes=6, max_depth=2) == ([6, 8, 4, 1], [-1, 0, 1, 0, 3])
    # the latest continuation runs into the end: the chain is only that one, the tree takes the next
    short = [7, 1, 2, 3, 4, 5, 6, 9, 2, 3, 2, 3]
    for index in (NgramIndex(min_window=2, max_window=3, max_draft=4),
                  NgramTreeIndex(min_window=2, max_window=3, max_draft=4, breadth=3)):
        index.extend(short)
        assert index.propose(4) == [2, 3]
    assert index.propose_tree(max_nodes=6, max_depth=4) == ([2, 3, 4, 5, 6, 9], [-1, 0, 1, 0, 3, 4, 5])
    # one continuation: a chain, returned as one (no parents)
    lone = NgramTreeIndex(min_window=2, max_window=3, max_draft=4, breadth=3)
    lone.extend([1, 2, 3, 4, 5, 1, 2, 3])
    assert lone.propose_tree(max_nodes=6, max_depth=3) == ([4, 5, 1], None)


def test_an_ngram_tree_takes_no_more_nodes_than_its_row_has_columns():
    """Near a request's end (max_tokens: capped to the context for a request that fills it) a tree's
    nodes, a KV column each, stay within what the request may still emit; the same lookup with room
    takes more."""
    from types import SimpleNamespace

    from baton.engine.speculative.base import SpecView
    from baton.engine.speculative.config import SpecConfig

    args = ServerArgs(model_path="m", speculative_algorithm="NGRAM", speculative_ngram_max_bfs_breadth=3,
                      speculative_ngram_min_match_window_size=2, speculative_ngram_max_match_window_size=3,
                      speculative_num_draft_tokens=8)
    spec = NgramSpeculator(SpecView(args.view(SpecConfig), None, None, None, None, None, None))
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 7, 9, 1, 2, 3, 6, 8, 9, 1, 2, 3]  # "1 2 3" went on 3 ways

    def draft(max_new: int) -> list[int]:
        req = SimpleNamespace(spec_index=None, origin_input_ids=tokens[:-1], output_ids=tokens[-1:], spec_flight=0,
                              spec_reach=0, sampling_params=SimpleNamespace(max_new_tokens=max_new))
        return spec.draft_tree(req)[0]

    assert len(draft(40)) > 2
    assert len(draft(4)) == 2  # room for 2 more tokens after the target's own


LOOPING = dict(initializer_range=0.08)  # test_speculative.py: greedy text that falls into loops


@pytest.mark.parametrize("loop,page_size", [("plain", 1), ("overlap", 16)])
def test_ngram_trees_greedy_equals_hf(tiny_model_factory, loop, page_size):
    """NGRAM with trees of up to 3 continuations on the looping model: HF's tokens, some runs accepted
    off the first chain, nothing leaked."""
    path = tiny_model_factory("llama", **LOOPING)
    prompts = repetitive_prompts() + repetitive_prompts(seed=4) + workload()[:4]
    h = harness_for(path, loop, page_size=page_size, max_total_tokens=4096, **SPEC,
                    speculative_ngram_min_match_window_size=1, speculative_ngram_max_bfs_breadth=3)
    results = run_workload(h, prompts, max_new=MAX_NEW, ignore_eos=True)
    for i, p in enumerate(prompts):
        assert results[str(i)].ids == hf_greedy(path, p, MAX_NEW, ignore_eos=True), f"request {i} differs from HF"
    info = h.scheduler.get_server_info()
    assert info["speculative_ngram_max_bfs_breadth"] == 3 and info["spec_accept_length"] > 1.2, info
    assert info["spec_tree_branch_accepts"] > 0 and info["integrity_ok"] is True, info


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_hybrid_verifies_trees_node_by_node(tiny_model_factory, monkeypatch, page_size):
    """A Qwen3.5-shaped hybrid verifies the oracle's trees, every accepted run off the first chain:
    its Gated DeltaNet layers run each node from its parent's state, and the row rolls back to the
    last accepted node's (GatedDeltaCore._tree_waves, state_node), so the next steps and a follow-up
    turn from the cached end state give HF's tokens; nothing leaks."""
    path = tiny_model_factory("qwen3_5", initializer_range=0.02)
    prompts = {str(i): p for i, p in enumerate(workload()[:3])}
    refs = {rid: hf_greedy(path, p, MAX_NEW, ignore_eos=True) for rid, p in prompts.items()}
    h = _oracle_harness(monkeypatch, path, refs, page_size=page_size)
    results = run_workload(h, list(prompts.values()), max_new=MAX_NEW, ignore_eos=True)
    for rid in prompts:
        assert results[rid].ids == refs[rid], f"request {rid}"
    info = h.scheduler.get_server_info()
    assert info["spec_tree_branch_accepts"] > 10 and info["spec_accept_length"] > 2.5, info
    first = prompts["1"]
    turn2 = first + results["1"].ids + [7, 8]
    refs["turn2"] = hf_greedy(path, turn2, 8, ignore_eos=True)
    h.submit("turn2", turn2, max_new_tokens=8, ignore_eos=True)
    res = h.run_until_idle()
    # from the first turn's end state (page 1), else from the checkpoint at its prompt's last whole page
    cached = len(first) + MAX_NEW - 1 if page_size == 1 else (len(first) - 1) // page_size * page_size
    assert res["turn2"].ids == refs["turn2"] and res["turn2"].cached_tokens >= cached > 0, res["turn2"]
    assert h.scheduler.check_memory_integrity()


def test_tree_flags_are_sglangs_and_refused_where_trees_cannot_run():
    import argparse

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(
        ["--model-path", "m", "--speculative-algorithm", "NGRAM", "--speculative-ngram-max-bfs-breadth", "3"]))
    assert args.speculative_ngram_max_bfs_breadth == 3
    assert ServerArgs(model_path="m", speculative_algorithm="NGRAM").speculative_ngram_max_bfs_breadth == 1
    with pytest.raises(ValueError, match=">= 1"):
        ServerArgs(model_path="m", speculative_algorithm="NGRAM", speculative_ngram_max_bfs_breadth=0)
    # FlashInfer plans a custom mask for tree verify steps (layers/attention/masks.py)
    assert ServerArgs(model_path="m", device="cuda", attention_backend="flashinfer", speculative_algorithm="NGRAM",
                      speculative_ngram_max_bfs_breadth=2).speculative_ngram_max_bfs_breadth == 2
    # TP ranks get the trees and the accepted nodes (worker/tp_step.py)
    assert ServerArgs(model_path="m", tp_size=2, speculative_algorithm="NGRAM",
                      speculative_ngram_max_bfs_breadth=2).tp_size == 2
    # a prefill engine never decodes: it takes the decode's flags and ignores them
    ServerArgs(model_path="m", device="cuda", attention_backend="flashinfer", speculative_algorithm="NGRAM",
               speculative_ngram_max_bfs_breadth=2, disaggregation_mode="prefill")


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_tree_drafts_on_flashinfer(tiny_model_factory, monkeypatch, graphs):
    """On CUDA with FlashInfer (fp16): verify steps of trees whose accepted tokens all lie off the first
    chain plan FlashInfer's custom mask, eagerly, or (`graphs`: an engine that drafts trees of 8 tokens)
    replaying the verify graphs captured over the custom mask; the tokens are HF's greedy ones
    (teacher-forced, fp16 criterion of test_gpu_paths), runs are accepted off the first chain, nothing
    leaks."""
    from test_gpu_paths import GPU_MODEL, hf_consistency, need_gpu

    need_gpu()
    path = tiny_model_factory("llama", **GPU_MODEL)
    prompts = {str(i): p for i, p in enumerate(workload()[:4])}
    refs = {rid: hf_greedy(path, p, MAX_NEW, ignore_eos=True) for rid, p in prompts.items()}
    trees = dict(speculative_ngram_max_bfs_breadth=2, speculative_num_draft_tokens=8,  # the oracle's 7 nodes
                 speculative_disable_by_batch_size=5) if graphs else {}
    h = _oracle_harness(monkeypatch, path, refs, "overlap", page_size=16, device="cuda", dtype="float16",
                        attention_backend="flashinfer", **trees)
    runner = h.scheduler.worker.model_runner
    replayed, replay = [], runner.cuda_graph_runner.replay
    runner.cuda_graph_runner.replay = lambda fb: replayed.append(fb.tree_parents is not None) or replay(fb)
    results = run_workload(h, list(prompts.values()), max_new=MAX_NEW, ignore_eos=True)
    assert any(replayed) == graphs, "tree steps replayed the verify graphs exactly where the engine drafts trees"
    exact = sum(hf_consistency(path, prompts[rid], results[rid].ids, tol=0.1) for rid in prompts)
    assert exact >= 0.9 * MAX_NEW * len(prompts)
    info = h.scheduler.get_server_info()
    assert info["spec_tree_branch_accepts"] > 10 and info["integrity_ok"] is True, info
