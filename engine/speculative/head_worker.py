"""The worker half of speculation with a draft head (NEXTN, EAGLE, EAGLE3; head_strategy.py): the
head's passes beside the target's. The head: NEXTN's MTP head (models/qwen3_next.py MtpHead) or an
EAGLE draft checkpoint's (models/eagle.py), each

    forward(embeds, positions, features, forward_batch) -> out    one pass over a batch's positions
    own_lm_head                                                   False: the target's LM head reads out;
    draft_logits(out), draft_to_target                            True: the head's (EAGLE3, its own vocabulary)
    aux_layers                                                    EAGLE3: its features are the target's
                                                                  states entering these layers, else the
                                                                  target's final hidden states

The head at position p reads the embedding of token t[p+1] and the target's features at p, and
predicts t[p+2]; its attention has KV-pool layers of its own (after the target's), in the same slots
as the target's KV, so prefix sharing, retraction, PD transfer and freeing treat them as any layer.
Its KV at p needs t[p+1], so it lags the target by one position, filled after each target pass once
the next token is known:

    after a plain pass (extend, decode, mixed)   the head over the pass's positions, ids shifted by one;
                                                 a row's last input is the token sampled there, or for a
                                                 chunk that is not the prompt's last, the next prompt
                                                 token (ModelWorkerBatch.next_prompt_ids). Same batch
                                                 geometry, so the pass's attention metadata serves.
    after a verify pass                          the same over [last, d1 .. dk]: the row after the last
                                                 accepted draft takes the target's token; rows past it
                                                 are rejected positions (their KV is freed or rewritten)

Either leaves, per request row, the head's predictions at the row's last kept position (the first
draft of the next step: its argmax, then with --speculative-eagle-topk k its next k - 1 candidates) and
its output (`tokens`, `hidden`). A verify step of a request with k drafts (position L = its last
token's) then runs k - 1 decode passes of the head: step j at position L + j - 1 over (d[j], its
previous output in place of the target's features), into the verify step's own slots; the verify pass
runs [last, d1 .. dk]. The head's KV those steps wrote is rewritten by the after-verify pass.

A tree (--speculative-eagle-topk k > 1) grows best-first, as SGLang's EAGLE trees do: the row's k
candidates (with their log-probabilities under the head) are the depth-1 leaves; each step runs the
head over every leaf, each leaf's k best next tokens join the candidates, scored by the sum of the
head's log-probabilities along their path, and the k best of those are the next leaves; after the
steps the tree is the n best candidates (n: the nodes the scheduler reserved, spec_info.tree_size),
which holds every chosen node's parent, packed by depth then score (_Growth.choose). The drafter gives
the pass the tree's shape (its ancestor matrix as fb.tree_parents: the tree mask) and its nodes'
positions (L + depth); spec.parents gets it with the verify result. A chain is the same with k = 1.
The leaves of a step sit at the same position in different slots, so a step reads the head's KV
through a table of its own, one row per leaf (the request's prefix, then the slots its path's nodes
were expanded in: scratch slots, k per step, among the verify step's own, which the verify pass then
overwrites), all leaves of all requests in one decode pass per step:

    step 2, k = 2     leaf a row   prefix .. | s(a1)  s(a)       a1: a's parent, expanded at step 1
                      leaf b row   prefix .. | s(b1)  s(b)       column L + j - 1: the leaf's own slot

A batch of chains reads through the requests' own rows (column L + j - 1 holds node j - 1's slot). Both
keep their drafts on the device until the verify pass is queued: a tree's candidates, scores, next
leaves and the slots of each leaf's path are chosen there (_Growth: stable sorts, so ties go to the
candidate drafted first); the drafts go into the pass there (_into_pass), and VerifyInput.settle reads
them (one read) once the pass is queued.

After the verify pass the head runs over its nodes with the pass's tree mask, each node reading the
token of its accepted child (nodes off the accepted path: any valid id), before the worker moves the
accepted nodes' KV, the head's layers with the target's (TpModelWorker._verify); the row keeps the
head's output at the last accepted node.

Drafts are a deterministic function of the head's outputs (a chain: its argmax; a tree: its best
candidates), so accept_host.py's acceptance rules hold as for NGRAM. A request whose row holds no
prediction of its own yet (a PD decode's transferred request: the prefill computed the head's KV over
the prompt, not this row's buffers) drafts nothing in its first step (head_strategy.py), whose pass
after it fills the row; unless the prefill sent its head's first drafts (`prime_from`).

The target runs its plain forward, its CUDA graphs (decode steps, and verify steps of full chains or trees;
EAGLE-3's layer states are graph outputs too), or on CPU its native forward where the head needs only
final hidden states; after a graph or the native forward the head's passes plan the batch's own
attention metadata. The draft steps (a chain's, a tree's leaves: decode-shaped) replay graphs of their
own where the target has CUDA graphs (one rank; draft_graphs.py), and so does its pass
after a replayed decode or verify step (reading that graph's output); after an extend it runs
eagerly. torch.compile stays off with a head. With tensor parallelism every rank runs these passes in
the driver's order (the head's layers and LM head are collectives); worker/tp_step.py says what
the followers are sent.
"""
from __future__ import annotations

from itertools import accumulate
from typing import TYPE_CHECKING, Optional

import torch

from baton.engine.core.forward_batch import ForwardMode
from baton.engine.mem_cache.memory_pool import ReqToTokenPool
from baton.engine.speculative.draft_graphs import DraftGraphs
from baton.engine.utils.device_lists import to_device

if TYPE_CHECKING:
    from baton.engine.core.forward_batch import ForwardBatch
    from baton.engine.core.spec_info import VerifyInput, VerifyOutput
    from baton.engine.model_executor.cuda_graph_runner import CudaGraphRunner
    from baton.engine.model_executor.model_runner import ModelRunner
    from baton.engine.speculative.accept_device import DeviceAcceptance


class HeadDrafter:
    def __init__(self, runner: "ModelRunner", num_steps: int, topk: int = 1) -> None:
        model = runner.model
        assert runner.draft_head is not None, "the model was loaded without a draft head"
        assert runner.compiled_model is None, "a draft head runs beside the model's uncompiled forward"
        self.runner, self.head, self.embed = runner, runner.draft_head, model.model.embed_tokens
        self.num_steps, self.topk = num_steps, topk
        rows, dev = runner.req_to_token_pool.size, runner.device
        # each row's first draft candidates, the greedy one first [rows, topk]
        self.tokens = torch.zeros(rows, topk, dtype=torch.int64, device=dev)
        # and their log-probabilities under the head (a tree ranks its nodes by their sums)
        self.logp = torch.zeros(rows, topk, dtype=torch.float32, device=dev)
        # each row's head output at that draft's position (the next step's input, for chains past 1;
        # a PD prefill sends it whatever its own chain length)
        self.hidden = torch.zeros(rows, runner.model_config.text.hidden_size, dtype=runner.dtype, device=dev)
        # CUDA: the last head pass's end, which a PD prefill waits for before reading a row (row_draft)
        self.done: Optional[torch.cuda.Event] = None
        self.graphs: Optional[DraftGraphs] = None  # the draft steps' graphs (use_graphs)
        if runner.cuda_graph_runner is not None and runner.tp.size == 1:
            self.use_graphs(runner.cuda_graph_runner)

    def use_graphs(self, target: "CudaGraphRunner") -> None:
        """Run the draft steps through graphs over the target's (draft_graphs.py, captured here): as many
        rows as a step of the batches that speculate has (their requests, times topk for a tree's leaves)."""
        args = self.runner.config
        most = max(1, args.speculative_disable_by_batch_size - 1) * self.topk
        self.graphs = DraftGraphs(target, self._draft_pass, self.hidden.shape[1], self.hidden.dtype, most,
                                  aux_states=bool(self.head.aux_layers))

    # ------------------------------------------------------------------ the head's passes
    def _head(self, fb: "ForwardBatch", ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        # a fresh view of the positions per pass: the rotary embedding memoizes cos/sin by the positions
        # tensor's identity, and a graph's static batch keeps one object (its capture would skip them)
        return self.head(self.embed(ids), fb.positions.view(-1), features, fb)

    def _draft_pass(self, step: "ForwardBatch", states: torch.Tensor) -> torch.Tensor:
        """A draft step's pass, its attention metadata planned (what the draft-step graphs capture)."""
        return self._head(step, step.input_ids, states)

    def _draft_step(self, step: "ForwardBatch", states: torch.Tensor) -> torch.Tensor:
        """A draft step (one token per row of its table): through the draft-step graphs where they serve."""
        if self.graphs is not None and self.graphs.can_run_draft(step):
            return self.graphs.replay_draft(step, states)
        self.runner.attn_backend.init_forward_metadata(step)
        return self._draft_pass(step, states)

    def _pass_after(self, fb: "ForwardBatch", hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The head over a target pass's positions reading `ids`: through its graph after a replayed
        decode or verify step, where that graph left the head's input states and planned the attention."""
        states = fb.aux_hidden if self.head.aux_layers else hidden
        if self.graphs is not None and self.graphs.can_run_head_after(fb, states):
            return self.graphs.replay_head_after(fb, ids, states)
        return self._head(fb, ids, self._features(fb, hidden))

    def _features(self, fb: "ForwardBatch", hidden: torch.Tensor) -> torch.Tensor:
        """What the head reads of a target pass: its captured states (EAGLE3) or final hidden states.
        A pass the native forward or a decode graph ran planned no attention metadata for fb: the head's
        pass plans it."""
        if self.runner.planned_no_metadata(fb):
            self.runner.attn_backend.init_forward_metadata(fb)
        return fb.aux_hidden if self.head.aux_layers else hidden

    def _predict(self, out: torch.Tensor, k: int = 1,
                 scores: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The head's outputs [m, hidden] -> its k best tokens [m, k] (target vocabulary ids), its argmax
        first (whatever order topk gives tied scores, a chain is the argmax's), and with `scores` their
        log-probabilities under the head [m, k] (float32; over its own vocabulary where it has one)."""
        logits = self.head.draft_logits(out) if self.head.own_lm_head else self.runner.compute_logits(out)
        ids = torch.argmax(logits, dim=-1, keepdim=True)
        if k > 1:
            ids = torch.cat([ids, logits.scatter(1, ids, float("-inf")).topk(k - 1, dim=-1).indices], dim=1)
        logp = torch.log_softmax(logits.float(), dim=-1).gather(1, ids) if scores else None
        return (self.head.draft_to_target[ids] if self.head.own_lm_head else ids), logp

    def _keep(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        """Each row's candidates (with a tree's topk, their log-probabilities) and hidden output at its
        last kept position."""
        ids, logp = self._predict(out, self.topk, scores=self.topk > 1)
        self.tokens[rows] = ids
        if logp is not None:
            self.logp[rows] = logp
        self.hidden[rows] = out
        if out.is_cuda:
            self.done = torch.cuda.Event()
            self.done.record()

    # ------------------------------------------------------------------ PD: the row travels with the KV
    def metadata_bytes(self) -> int:
        """The draft part of a PD metadata slot (disaggregation/base.py MetadataBuffers)."""
        from baton.engine.disaggregation.base import MetadataBuffers

        return MetadataBuffers.draft_bytes_for(self.hidden.shape[1], self.hidden.dtype)

    def row_draft(self, row: int) -> tuple[tuple[int, ...], torch.Tensor, tuple[float, ...]]:
        """A prefill's request row once its last chunk ran: its first-draft candidates (argmax first),
        the head's output and the candidates' log-probabilities (MetadataBuffers.set_draft's order)."""
        if self.done is not None:
            self.done.synchronize()
        return tuple(self.tokens[row].tolist()), self.hidden[row].cpu(), tuple(self.logp[row].tolist())

    def prime_from(self, metadata, slot: int) -> Optional[tuple[tuple[int, ...], torch.Tensor,
                                                              tuple[float, ...]]]:
        """A decode's transferred request: what its prefill's row_draft sent, if anything."""
        return metadata.get_draft(slot, self.hidden.shape[1], self.hidden.dtype)

    def _prime(self, rows: torch.Tensor, primes: dict[int, tuple]) -> None:
        """Put primes (batch index -> first-draft candidates, head output, the candidates'
        log-probabilities) into the batch's rows: as many candidates as this engine keeps (a chain's prime
        may carry one)."""
        for i, (candidates, _, logps) in primes.items():
            n = min(len(candidates), self.topk)
            self.tokens[rows[i], :n] = to_device(candidates[:n], rows.device)
            self.logp[rows[i], :n] = to_device(logps[:n], rows.device, torch.float32)
        idx = to_device(list(primes), rows.device)
        self.hidden[rows[idx]] = torch.stack([p[1] for p in primes.values()]).to(self.hidden.device, self.hidden.dtype)

    @torch.inference_mode()
    def after_pass(self, fb: "ForwardBatch", hidden: torch.Tensor, next_ids: torch.Tensor,
                   next_prompt_ids: Optional[list[int]]) -> None:
        """After a plain target pass: `hidden` its final hidden states [num_tokens, hidden], `next_ids`
        the tokens it sampled [bs] (0 where a row samples nothing), `next_prompt_ids` per row the prompt
        token after an extend row's chunk, or -1 where the sampled one follows."""
        if fb.forward_mode == ForwardMode.DECODE:
            self._keep(fb.req_pool_indices, self._pass_after(fb, hidden, next_ids))
            return
        features = self._features(fb, hidden)
        following = next_ids
        if next_prompt_ids is not None and any(t >= 0 for t in next_prompt_ids):
            prompt = to_device(next_prompt_ids, next_ids.device)
            following = torch.where(prompt >= 0, prompt, next_ids)
        ends = to_device(list(accumulate(fb.extend_seq_lens_cpu)), fb.input_ids.device).sub_(1)
        ids = fb.input_ids.roll(-1)  # each row's next token, but at each request's last row
        ids[ends] = following
        self._keep(fb.req_pool_indices, self._head(fb, ids, features)[ends])

    @torch.inference_mode()
    def draft(self, fb: "ForwardBatch", spec: "VerifyInput") -> None:
        """Before a verify pass (`fb`, its input ids holding placeholder drafts): each request's chain or
        best-first tree (module docstring), into spec.drafts and the pass's input ids; a tree's shape into
        spec.parents (which fb.tree_parents shares) and its nodes' positions into fb.positions."""
        rows, dev = fb.req_pool_indices, fb.req_pool_indices.device
        if spec.primes:
            self._prime(rows, spec.primes)
        reqs = [i for i, d in enumerate(spec.drafts) if d]
        if not reqs:
            return
        if spec.parents is None:  # the drafts go into the pass on the device; the host reads them later
            at = [spec.offsets[i] + 1 + t for i, d in enumerate(spec.drafts) for t in range(len(d))]
            drafts = self._draft_chains(fb, spec, reqs)
            fb.input_ids[to_device(at, dev)] = drafts[to_device([n for n, i in enumerate(reqs) for _ in spec.drafts[i]], dev),
                                                  to_device([t for i in reqs for t in range(len(spec.drafts[i]))], dev)]

            def fill() -> None:
                for i, tokens in zip(reqs, drafts.tolist()):
                    spec.drafts[i][:] = tokens[:len(spec.drafts[i])]

            spec.pending = fill
            return
        self._draft_trees(fb, spec, reqs)

    def _draft_chains(self, fb: "ForwardBatch", spec: "VerifyInput", reqs: list[int]) -> torch.Tensor:
        """A batch of chains: step j drafts d[j + 1] from (d[j], the head's previous output) at position
        L + j - 1 through the requests' own rows (column L + j - 1 holds node j - 1's slot). Returns the
        drafts [len(reqs), deepest] on the device: nothing is read back before the verify pass is queued
        (VerifyInput.settle reads them with its result)."""
        rows, prefix, pool = fb.req_pool_indices, fb.extend_prefix_lens_cpu, self.runner.req_to_token_pool
        dev = rows.device
        depth = [len(spec.drafts[i]) for i in reqs]
        req_rows = rows[to_device(reqs, dev)]
        drafts = torch.zeros(len(reqs), max(depth), dtype=torch.int64, device=dev)
        drafts[:, 0] = self.tokens[req_rows, 0]
        out = self.hidden[req_rows]
        for j in range(1, max(depth)):
            sel = [n for n, d in enumerate(depth) if d > j]
            idx = to_device(sel, dev)
            seq_lens = [prefix[reqs[n]] + j for n in sel]
            lens = to_device(seq_lens, dev)
            step = self.runner.make_forward_batch(
                ForwardMode.DECODE, input_ids=drafts[idx, j - 1], positions=lens - 1, req_pool_indices=req_rows[idx],
                seq_lens=lens, out_cache_loc=pool.req_to_token[req_rows[idx], lens - 1], seq_lens_cpu=seq_lens,
                req_to_token_pool=pool)
            step_out = self._draft_step(step, out[idx])
            drafts[idx, j] = self._predict(step_out)[0][:, 0]
            out[idx] = step_out
        return drafts

    def _draft_trees(self, fb: "ForwardBatch", spec: "VerifyInput", reqs: list[int]) -> None:
        """A batch with trees, grown best-first (module docstring; a chain request of the batch: width 1)
        on the device: each step's leaves, their scores and the slots of their paths stay there (_Growth),
        and so do the chosen trees, which go into the verify pass there (_into_pass)."""
        rows, prefix = fb.req_pool_indices, fb.extend_prefix_lens_cpu
        dev = rows.device
        g = _Growth([self.topk if spec.tree(i) is not None else 1 for i in reqs], [spec.depth(i) for i in reqs], dev)
        lanes = [(n, b) for n in range(len(reqs)) for b in range(g.width[n])]  # (request, rank): host-known
        first = rows[to_device([reqs[n] for n, _ in lanes], dev)]
        ranks = to_device([b for _, b in lanes], dev)
        at = to_device([g.base[n] + b for n, b in lanes], dev)
        g.token[at], g.score[at] = self.tokens[first, ranks], self.logp[first, ranks]
        leaves, path, features = at, ranks[:, None], self.hidden[first]
        for j in range(1, max(g.depth)):  # expand the leaves at depth j, at position L + j - 1
            keep = [k for k, (n, _) in enumerate(lanes) if g.depth[n] > j]
            if len(keep) < len(lanes):
                kept = to_device(keep, dev)
                lanes, leaves, path, features = [lanes[k] for k in keep], leaves[kept], path[kept], features[kept]
            table = self._lane_table(fb, spec, reqs, g, lanes, path, j)
            lane_rows = torch.arange(len(lanes), device=dev)
            seq_lens = [prefix[reqs[n]] + j for n, _ in lanes]
            lens = to_device(seq_lens, dev)
            ids = g.token[leaves]
            step = self.runner.make_forward_batch(
                ForwardMode.DECODE, input_ids=ids, positions=lens - 1, req_pool_indices=lane_rows, seq_lens=lens,
                out_cache_loc=table.req_to_token[lane_rows, lens - 1], seq_lens_cpu=seq_lens, req_to_token_pool=table)
            out = self._draft_step(step, features)
            top = max(g.width[n] for n, _ in lanes)
            child_ids, child_lp = self._predict(out, top, scores=top > 1)
            child_scores = g.score[leaves][:, None] + (child_lp if child_lp is not None else 0.0)
            g.add_children(lanes, j, leaves, child_ids, child_scores)
            lanes, leaves, parent_lane, ranks = g.next_leaves(lanes, j)
            if not lanes:
                break
            path = torch.cat([path[parent_lane], ranks[:, None]], dim=1)
            features = out[parent_lane]
        self._into_pass(fb, spec, reqs, g, g.choose([len(spec.drafts[i]) for i in reqs]))

    def _into_pass(self, fb: "ForwardBatch", spec: "VerifyInput", reqs: list[int], g: "_Growth",
                   chosen: "_Chosen") -> None:
        """The chosen trees into the verify pass, on the device: their tokens into the input ids, their
        nodes' positions (L + depth), their shapes as ancestor matrices (fb.tree_parents: the attention
        masks are built from them there). The host reads them with the verify result (spec.settle)."""
        prefix, offsets, dev = fb.extend_prefix_lens_cpu, spec.offsets, fb.input_ids.device
        at, src, pos_at, pos_src, pos_base = [], [], [], [], []
        for n, i in enumerate(reqs):
            start, count = chosen.flat_start[n], chosen.count[n]
            at += [offsets[i] + 1 + t for t in range(count)]
            src += [start + t for t in range(count)]
            if g.width[n] > 1:
                pos_at += [offsets[i] + 1 + t for t in range(count)]
                pos_src += [start + t for t in range(count)]
                pos_base += [prefix[i]] * count
        fb.input_ids[to_device(at, dev)] = chosen.flat_tokens[to_device(src, dev)]
        if pos_at:
            depth = chosen.flat_depth[to_device(pos_src, dev)]
            fb.positions[to_device(pos_at, dev)] = (to_device(pos_base, dev) + depth).to(fb.positions.dtype)
            matrices = chosen.ancestors(max(spec.depth(reqs[n]) for n in chosen.trees))
            masks = list(fb.tree_parents)
            for t, n in enumerate(chosen.trees):
                size = chosen.count[n] + 1
                masks[reqs[n]] = matrices[t, :size, :size]
            fb.tree_parents = masks

        def fill() -> None:
            for n, (tokens, parents) in enumerate(chosen.read()):
                i = reqs[n]
                spec.drafts[i][:] = tokens
                if parents is not None:
                    assert all(0 <= p < k for k, p in enumerate(parents[1:], 1)), \
                        "a chosen node's parent was not chosen"
                    spec.parents[i] = parents

        spec.pending = fill

    def _lane_table(self, fb: "ForwardBatch", spec: "VerifyInput", reqs: list[int], g: "_Growth",
                    lanes: list[tuple[int, int]], path: torch.Tensor, j: int) -> ReqToTokenPool:
        """The req_to_token table tree draft step j reads and writes through, one row per lane: the
        request's prefix, then in columns L .. L + j - 1 the slots its node's ancestors (depth 1 ..) and the
        node itself (column L + j - 1, position L + j - 1) wrote the head's KV to: the node at depth d of
        rank r among its step's lanes wrote to the request's verify slot (d - 1) * width + r (`path`
        holds those ranks, [lanes, j], on the device)."""
        pool, rows, prefix = self.runner.req_to_token_pool, fb.req_pool_indices, fb.extend_prefix_lens_cpu
        dev = rows.device
        req = to_device([reqs[n] for n, _ in lanes], dev)
        width = max(prefix[reqs[n]] + j for n, _ in lanes)
        table = ReqToTokenPool(len(lanes), width, pool.device)
        table.req_to_token.copy_(pool.req_to_token[rows[req], :width])
        cols = to_device([[prefix[reqs[n]] + d for d in range(j)] for n, _ in lanes], dev)
        first_slot = to_device([[spec.offsets[reqs[n]] + d * g.width[n] for d in range(j)] for n, _ in lanes], dev)
        lane = torch.arange(len(lanes), device=dev)[:, None].expand(-1, j)
        table.req_to_token[lane, cols] = fb.out_cache_loc[first_slot + path]
        return table

    @torch.inference_mode()
    def after_verify(self, fb: "ForwardBatch", hidden: torch.Tensor, spec: "VerifyInput", out: "VerifyOutput") -> None:
        """After a verify pass and its acceptance (`out`), before the accepted nodes' KV moves: the head
        over the pass's positions, each node on a request's accepted path reading the next one's token,
        the last accepted node the target's token after it."""
        spec.settle()
        ids = fb.input_ids.roll(-1)  # a chain's next token; rows off the accepted path: any valid id
        at, following, kept = [], [], []
        for i, (off, tokens) in enumerate(zip(spec.offsets, out.tokens)):
            path = [0, *(range(1, len(tokens)) if out.accepted_nodes is None else out.accepted_nodes[i])]
            for node, child in zip(path, path[1:]):
                if child != node + 1:  # a tree's branch: its child is not the next row
                    at.append(off + node)
                    following.append(spec.drafts[i][child - 1])
            kept.append(off + path[-1])
        ids[to_device(at + kept, ids.device)] = to_device(following + out.last_tokens, ids.device)
        self._keep(fb.req_pool_indices, self._pass_after(fb, hidden, ids)[to_device(kept, ids.device)])


    @torch.inference_mode()
    def after_verify_on_device(self, fb: "ForwardBatch", hidden: torch.Tensor, acc: "DeviceAcceptance") -> None:
        """after_verify for a step accepted on the device (accept_device.py), from the walk's tensors: each
        node on the accepted path reads the next one's token (a chain's next row already holds it), the
        last one the target's token. Steps past a request's count repeat its last node, which reads its
        own token there until the last write puts the target's in its place."""
        ids = fb.input_ids.roll(-1)
        if acc.path.shape[1] > 1:
            at = (acc.offsets[:, None] + acc.path[:, :-1]).reshape(-1)
            ids[at] = fb.input_ids[(acc.offsets[:, None] + acc.path[:, 1:]).reshape(-1)]
        kept = acc.offsets + acc.path.gather(1, acc.count[:, None])[:, 0]
        ids[kept] = acc.last
        self._keep(fb.req_pool_indices, self._pass_after(fb, hidden, ids)[kept])


class _Growth:
    """The batch's trees while they grow, on the device. Request n's candidates sit at base[n] + a
    local index: its width first drafts, then each step's children, lane after lane (its leaves in rank
    order), each lane's children in the head's order, so the local order is the order drafted and
    deepens monotonically. Per candidate: token, score (the sum of the head's log-probabilities along
    its path; -inf where nothing was drafted) and parent (a global index; -1: the root).

    What a tree is: the best-first rule of the module docstring. Ties go to the earlier candidate
    (stable sorts over the drafted order): the next leaves among a step's children, and the n chosen
    nodes among all candidates (the shallower first, since the local order deepens), packed by depth,
    then score, then drafted order."""

    def __init__(self, width: list[int], depth: list[int], device: torch.device) -> None:
        self.width, self.depth, self.device = width, depth, device
        self.size = [w + (d - 1) * w * w for w, d in zip(width, depth)]
        self.base = [sum(self.size[:n]) for n in range(len(width))]
        total = sum(self.size)
        self.token = torch.zeros(total, dtype=torch.int64, device=device)
        self.score = torch.full((total,), float("-inf"), dtype=torch.float32, device=device)
        self.parent = torch.full((total,), -1, dtype=torch.int64, device=device)

    def block(self, n: int, j: int) -> int:
        """Where request n's children of draft step j begin (global)."""
        w = self.width[n]
        return self.base[n] + w + (j - 1) * w * w

    def add_children(self, lanes: list[tuple[int, int]], j: int, leaves: torch.Tensor, ids: torch.Tensor,
                     scores: torch.Tensor) -> None:
        """Step j's children: lane k's c-th best next token (c < its request's width) with its score."""
        top = ids.shape[1]
        at, src, lane = [], [], []
        for k, (n, b) in enumerate(lanes):
            w = self.width[n]
            for c in range(w):
                at.append(self.block(n, j) + b * w + c)
                src.append(k * top + c)
                lane.append(k)
        at, src, lane = (to_device(x, self.device) for x in (at, src, lane))
        self.token[at] = ids.reshape(-1)[src]
        self.score[at] = scores.reshape(-1)[src]
        self.parent[at] = leaves[lane]

    def next_leaves(self, lanes: list[tuple[int, int]],
                    j: int) -> tuple[list[tuple[int, int]], torch.Tensor, torch.Tensor, torch.Tensor]:
        """The leaves step j + 1 expands: each request still that deep keeps its width best children of
        step j (ties: the one drafted first), in that order as ranks 0 ... Returns (their lanes, their
        global indices, the lane of step j each came from, their ranks)."""
        lane_of = {}  # request -> its first lane at step j
        for k, (n, _) in enumerate(lanes):
            lane_of.setdefault(n, k)
        going = [n for n in lane_of if self.depth[n] > j + 1]
        new_lanes = [(n, b) for n in going for b in range(self.width[n])]
        if not going:
            return [], None, None, None
        leaves = torch.empty(len(new_lanes), dtype=torch.int64, device=self.device)
        parent_lane = torch.empty(len(new_lanes), dtype=torch.int64, device=self.device)
        starts, pos = {}, 0
        for n in going:
            starts[n] = pos
            pos += self.width[n]
        for w in sorted({self.width[n] for n in going}):  # one sort per width: [requests, w * w]
            group = [n for n in going if self.width[n] == w]
            idx = to_device([self.block(n, j) for n in group], self.device)[:, None] + torch.arange(w * w,
                                                                                            device=self.device)
            order = torch.sort(self.score[idx], dim=1, descending=True, stable=True).indices[:, :w]
            dest = to_device([[starts[n] + b for b in range(w)] for n in group], self.device)
            leaves[dest] = idx.gather(1, order)
            parent_lane[dest] = to_device([lane_of[n] for n in group], self.device)[:, None] + order // w
        ranks = to_device([b for _, b in new_lanes], self.device)
        return new_lanes, leaves, parent_lane, ranks

    def choose(self, nodes: list[int]) -> "_Chosen":
        """The batch's drafts, on the device: a request of width 1 its chain; a tree its nodes[n] best
        candidates, packed by depth, then score, then drafted order."""
        dev = self.device
        chains = {n: self.token[self.base[n]:self.base[n] + self.size[n]]
                  for n in range(len(self.width)) if self.width[n] == 1}
        trees = [n for n in range(len(self.width)) if self.width[n] > 1]
        packed_tokens = packed_parents = packed_depth = None
        if trees:
            w = self.width[trees[0]]
            assert all(self.width[n] == w for n in trees), "a batch's trees share the engine's topk"
            most, chosen_n = max(self.size[n] for n in trees), max(nodes[n] for n in trees)
            local = torch.arange(most, device=dev)
            base = to_device([self.base[n] for n in trees], dev)[:, None]
            valid = local[None, :] < to_device([self.size[n] for n in trees], dev)[:, None]
            idx = torch.where(valid, base + local, base)
            scores = torch.where(valid, self.score[idx], float("-inf"))
            best = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :chosen_n]  # local
            depth = torch.where(best < w, 1, 2 + (best - w) // (w * w))
            wanted = torch.arange(chosen_n, device=dev)[None, :] < to_device([nodes[n] for n in trees], dev)[:, None]
            depth = torch.where(wanted, depth, most + 1)  # past a request's count: to the end
            packed_depth, order = torch.sort(depth, dim=1, stable=True)
            packed = best.gather(1, order)
            # a column past a request's count may hold a local index past its candidates (a smaller tree
            # beside a bigger one): read candidate 0 there, which every request has (the column is unused)
            at = base + torch.where(packed_depth <= most, packed, 0)
            parent = self.parent[at]  # global; -1 for the root
            index = torch.zeros_like(idx).scatter_(1, packed,
                                                   torch.arange(1, chosen_n + 1, device=dev).expand_as(packed))
            packed_parents = torch.where(parent < 0, 0, index.gather(1, (parent - base).clamp(min=0)))
            packed_tokens = self.token[at]
        return _Chosen(chains, trees, nodes, packed_tokens, packed_parents, packed_depth)


class _Chosen:
    """A batch's chosen drafts on the device (_Growth.choose), request n in the growth's order: chains
    (tokens), trees (tokens, each node's parent as its packed index, 0 the root, and depth, [trees,
    most nodes]). `flat_tokens` / `flat_depth`: all of them in one vector each, request n's from
    flat_start[n], count[n] of them (a chain's depths are not used)."""

    def __init__(self, chains: dict[int, torch.Tensor], trees: list[int], nodes: list[int],
                 tokens: Optional[torch.Tensor], parents: Optional[torch.Tensor],
                 depth: Optional[torch.Tensor]) -> None:
        self.chains, self.trees, self.parents = chains, trees, parents
        self.count = [len(chains[n]) if n in chains else nodes[n] for n in range(len(nodes))]
        width = 0 if tokens is None else tokens.shape[1]
        self.tree_at = {n: t for t, n in enumerate(trees)}  # request -> its row of the tree tensors
        self.flat_start, at, chain_at = [], 0, sum(len(c) for c in chains.values())
        for n in range(len(nodes)):
            if n in chains:
                self.flat_start.append(at)
                at += len(chains[n])
            else:
                self.flat_start.append(chain_at + self.tree_at[n] * width)
        parts = list(chains.values()) + ([tokens.reshape(-1)] if tokens is not None else [])
        depths = [torch.zeros_like(c) for c in chains.values()] + ([depth.reshape(-1)] if depth is not None else [])
        self.flat_tokens, self.flat_depth = torch.cat(parts), torch.cat(depths)

    def ancestors(self, depth: int) -> torch.Tensor:
        """The trees' ancestor matrices [trees, 1 + most nodes, same] (node 0 the root), on the device."""
        from baton.engine.layers.attention.masks import ancestors

        root = torch.full((self.parents.shape[0], 1), -1, dtype=self.parents.dtype, device=self.parents.device)
        return ancestors(torch.cat([root, self.parents], dim=1), depth)

    def read(self) -> list[tuple[list[int], Optional[list[int]]]]:
        """Per request: (its drafts, parents [-1, ..] or None for a chain); one read from the device."""
        reads = [self.flat_tokens] + ([self.parents.reshape(-1)] if self.parents is not None else [])
        flat = torch.cat(reads).tolist()
        tokens, parents = flat[:len(self.flat_tokens)], flat[len(self.flat_tokens):]
        width = 0 if self.parents is None else self.parents.shape[1]
        out = []
        for n, (start, count) in enumerate(zip(self.flat_start, self.count)):
            if n in self.chains:
                out.append((tokens[start:start + count], None))
            else:
                t = self.tree_at[n]
                out.append((tokens[start:start + count], [-1] + parents[t * width:t * width + count]))
        return out
