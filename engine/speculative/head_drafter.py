"""The worker half of speculation with a draft head (NEXTN, EAGLE, EAGLE3; head_speculator.py): the
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

A tree (head_speculator.py: spec_info.branch_tree) is a chain per candidate: branch b starts with the
row's b-th candidate and goes on greedily, branch 0 the chain topk 1 drafts. The branches' nodes sit at
the same positions L + 1 .. in different slots, so their steps read their KV through a table of their
own, one row per branch (the request's prefix, then the slots of the branch's nodes; step j writes its
j-th node's), all branches of all requests in one decode pass per step:

    request row     prefix .. | n0  n1  n2  n3  n4        parents [-1, 0, 1, 0, 3]
    branch 0 row    prefix .. | n1  n2                    step j at position L + j - 1: column L + j - 1
    branch 1 row    prefix .. | n3  n4

After the verify pass the head runs over its nodes with the pass's tree mask, each node reading the
token of its accepted child (nodes off the accepted path: any valid id), before the worker moves the
accepted nodes' KV, the head's layers with the target's (TpModelWorker._verify); the row keeps the
head's output at the last accepted node.

Drafts are greedy (the head's argmax; a tree's other branches start with its next candidates): a
deterministic proposal, so verify.py's acceptance rules hold as for NGRAM (sampled requests verify
branch 0). A request whose row holds no prediction of its own yet (a PD decode's transferred request:
the prefill computed the head's KV over the prompt, not this row's buffers) drafts nothing in its first
step (head_speculator.py), whose pass after it fills the row.

The target runs its plain forward, its CUDA graphs (decode steps, and verify steps of full chains;
EAGLE-3's layer states are graph outputs too), or on CPU its native forward where the head needs only
final hidden states; after a graph or the native forward the head's passes plan the batch's own
attention metadata. The head's passes run eagerly; torch.compile stays off with a head. With tensor parallelism every rank runs these passes in the driver's order (the
head's layers and LM head are collectives); scheduler/tp_step.py says what the followers are sent.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from baton.engine.mem_cache.memory_pool import ReqToTokenPool
from baton.engine.model_executor.forward_batch import ForwardMode
from baton.engine.speculative.spec_info import branches

if TYPE_CHECKING:
    from baton.engine.model_executor.forward_batch import ForwardBatch
    from baton.engine.model_executor.model_runner import ModelRunner
    from baton.engine.speculative.spec_info import VerifyInput, VerifyOutput

# a branch of a request's draft: (its batch index, its rank among the row's candidates, its nodes)
Lane = tuple[int, int, list[int]]


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
        # each row's head output at that draft's position (the next step's input, for chains past 1;
        # a PD prefill sends it whatever its own chain length)
        self.hidden = torch.zeros(rows, model.config.hidden_size, dtype=runner.dtype, device=dev)
        # CUDA: the last head pass's end, which a PD prefill waits for before reading a row (row_draft)
        self.done: Optional[torch.cuda.Event] = None

    # ------------------------------------------------------------------ the head's passes
    def _head(self, fb: "ForwardBatch", ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids), fb.positions, features, fb)

    def _features(self, fb: "ForwardBatch", hidden: torch.Tensor) -> torch.Tensor:
        """What the head reads of a target pass: its captured states (EAGLE3) or final hidden states.
        A pass the native forward or a decode graph ran planned no attention metadata for fb: the head's
        pass plans it."""
        if self.runner.planned_no_metadata(fb):
            self.runner.attn_backend.init_forward_metadata(fb)
        return fb.aux_hidden if self.head.aux_layers else hidden

    def _predict(self, out: torch.Tensor, k: int = 1) -> torch.Tensor:
        """The head's outputs [m, hidden] -> its k best tokens [m, k] (target vocabulary ids), its argmax
        first (whatever order topk gives tied scores, branch 0 is the chain topk 1 drafts)."""
        logits = self.head.draft_logits(out) if self.head.own_lm_head else self.runner.compute_logits(out)
        ids = torch.argmax(logits, dim=-1, keepdim=True)
        if k > 1:
            ids = torch.cat([ids, logits.scatter(1, ids, float("-inf")).topk(k - 1, dim=-1).indices], dim=1)
        return self.head.draft_to_target[ids] if self.head.own_lm_head else ids

    def _keep(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        """Each row's candidates and hidden output at its last kept position."""
        self.tokens[rows] = self._predict(out, self.topk)
        self.hidden[rows] = out
        if out.is_cuda:
            self.done = torch.cuda.Event()
            self.done.record()

    # ------------------------------------------------------------------ PD: the row travels with the KV
    def metadata_bytes(self) -> int:
        """The draft part of a PD metadata slot (disaggregation/base.py MetadataBuffers)."""
        from baton.engine.disaggregation.base import MetadataBuffers

        return MetadataBuffers.draft_bytes_for(self.hidden.shape[1], self.hidden.dtype)

    def row_draft(self, row: int) -> tuple[tuple[int, ...], torch.Tensor]:
        """A prefill's request row once its last chunk ran: its first-draft candidates (argmax first)
        and the head's output."""
        if self.done is not None:
            self.done.synchronize()
        return tuple(self.tokens[row].tolist()), self.hidden[row].cpu()

    def prime_from(self, metadata, slot: int) -> Optional[tuple[tuple[int, ...], torch.Tensor]]:
        """A decode's transferred request: what its prefill's row_draft sent, if anything."""
        return metadata.get_draft(slot, self.hidden.shape[1], self.hidden.dtype)

    def _prime(self, rows: torch.Tensor, primes: dict[int, tuple[tuple[int, ...], torch.Tensor]]) -> None:
        """Put primes (batch index -> first-draft candidates, head output) into the batch's rows: as many
        candidates as this engine keeps (a chain's prime may carry one)."""
        for i, (candidates, _) in primes.items():
            n = min(len(candidates), self.topk)
            self.tokens[rows[i], :n] = torch.tensor(candidates[:n], dtype=torch.int64, device=rows.device)
        idx = torch.tensor(list(primes), dtype=torch.int64, device=rows.device)
        self.hidden[rows[idx]] = torch.stack([h for _, h in primes.values()]).to(self.hidden.device, self.hidden.dtype)

    @torch.inference_mode()
    def after_pass(self, fb: "ForwardBatch", hidden: torch.Tensor, next_ids: torch.Tensor,
                   next_prompt_ids: Optional[list[int]]) -> None:
        """After a plain target pass: `hidden` its final hidden states [num_tokens, hidden], `next_ids`
        the tokens it sampled [bs] (0 where a row samples nothing), `next_prompt_ids` per row the prompt
        token after an extend row's chunk, or -1 where the sampled one follows."""
        features = self._features(fb, hidden)
        if fb.forward_mode == ForwardMode.DECODE:
            self._keep(fb.req_pool_indices, self._head(fb, next_ids, features))
            return
        following = next_ids
        if next_prompt_ids is not None and any(t >= 0 for t in next_prompt_ids):
            prompt = torch.tensor(next_prompt_ids, dtype=torch.int64, device=next_ids.device)
            following = torch.where(prompt >= 0, prompt, next_ids)
        ends = torch.tensor(fb.extend_seq_lens_cpu, dtype=torch.int64).cumsum(0).sub_(1).to(fb.input_ids.device)
        ids = fb.input_ids.roll(-1)  # each row's next token, but at each request's last row
        ids[ends] = following
        self._keep(fb.req_pool_indices, self._head(fb, ids, features)[ends])

    @torch.inference_mode()
    def draft(self, fb: "ForwardBatch", spec: "VerifyInput") -> None:
        """Before a verify pass (`fb`, its input ids holding placeholder drafts): each request's chain or
        tree (spec.parents), into spec.drafts and the pass's input ids."""
        rows, prefix = fb.req_pool_indices, fb.extend_prefix_lens_cpu
        dev = rows.device
        if spec.primes:
            self._prime(rows, spec.primes)
        lanes: list[Lane] = [(i, b, nodes) for i, d in enumerate(spec.drafts) if d
                             for b, nodes in enumerate(branches(spec.tree(i) or list(range(-1, len(d)))))]
        depth = [len(nodes) for _, _, nodes in lanes]
        req = torch.tensor([i for i, _, _ in lanes], dtype=torch.int64, device=dev)
        drafts = torch.zeros(len(lanes), max(depth), dtype=torch.int64, device=dev)
        drafts[:, 0] = self.tokens[rows[req], torch.tensor([b for _, b, _ in lanes], device=dev)]
        if max(depth) > 1:
            table, lane_rows = self._lane_table(fb, spec, lanes)
            out = self.hidden[rows[req]]
        for j in range(1, max(depth)):  # draft j + 1 from (draft j, the head's output before it) at position L + j - 1
            sel = [n for n, d in enumerate(depth) if d > j]
            idx = torch.tensor(sel, dtype=torch.int64, device=dev)
            seq_lens = [prefix[lanes[n][0]] + j for n in sel]
            lens = torch.tensor(seq_lens, device=dev)
            step = self.runner.make_forward_batch(
                ForwardMode.DECODE, input_ids=drafts[idx, j - 1], positions=lens - 1, req_pool_indices=lane_rows[idx],
                seq_lens=lens, out_cache_loc=table.req_to_token[lane_rows[idx], lens - 1], seq_lens_cpu=seq_lens,
                req_to_token_pool=table)
            self.runner.attn_backend.init_forward_metadata(step)
            step_out = self._head(step, step.input_ids, out[idx])
            drafts[idx, j] = self._predict(step_out)[:, 0]
            out[idx] = step_out
        for (i, _, nodes), tokens in zip(lanes, drafts.tolist()):
            for node, token in zip(nodes, tokens):
                spec.drafts[i][node - 1] = token
        at = [spec.offsets[i] + 1 + t for i, d in enumerate(spec.drafts) for t in range(len(d))]
        fb.input_ids[torch.tensor(at, dtype=torch.int64, device=dev)] = torch.tensor(
            [t for d in spec.drafts for t in d], dtype=torch.int64, device=dev)

    def _lane_table(self, fb: "ForwardBatch", spec: "VerifyInput",
                    lanes: list[Lane]) -> tuple[ReqToTokenPool, torch.Tensor]:
        """The req_to_token table the draft steps read and write through, and each lane's row in it: column
        L + j - 1 of a lane's row holds the slot step j writes (position L + j - 1). Chains: the requests'
        own rows, whose columns L, L + 1 .. hold the verify step's slots (nodes 0, 1 ..). Trees: a table of
        one row per branch (module docstring)."""
        pool, rows = self.runner.req_to_token_pool, fb.req_pool_indices
        req = torch.tensor([i for i, _, _ in lanes], dtype=torch.int64, device=rows.device)
        if spec.parents is None:
            return pool, rows[req]
        prefix = fb.extend_prefix_lens_cpu
        width = max(prefix[i] + len(nodes) for i, _, nodes in lanes)
        table = ReqToTokenPool(len(lanes), width, pool.device)
        table.req_to_token.copy_(pool.req_to_token[rows[req], :width])
        at = [(n, prefix[i] + j, spec.offsets[i] + node) for n, (i, _, nodes) in enumerate(lanes)
              for j, node in enumerate(nodes)]
        lane, col, src = (torch.tensor(x, dtype=torch.int64, device=rows.device) for x in zip(*at))
        table.req_to_token[lane, col] = fb.out_cache_loc[src]
        return table, torch.arange(len(lanes), device=rows.device)

    @torch.inference_mode()
    def after_verify(self, fb: "ForwardBatch", hidden: torch.Tensor, spec: "VerifyInput", out: "VerifyOutput") -> None:
        """After a verify pass and its acceptance (`out`), before the accepted nodes' KV moves: the head
        over the pass's positions, each node on a request's accepted path reading the next one's token,
        the last accepted node the target's token after it."""
        features = self._features(fb, hidden)
        ids = fb.input_ids.roll(-1)  # a chain's next token; rows off the accepted path: any valid id
        at, following, kept = [], [], []
        for i, (off, tokens) in enumerate(zip(spec.offsets, out.tokens)):
            path = [0, *(range(1, len(tokens)) if out.accepted_nodes is None else out.accepted_nodes[i])]
            for node, child in zip(path, path[1:]):
                if child != node + 1:  # a tree's branch: its child is not the next row
                    at.append(off + node)
                    following.append(spec.drafts[i][child - 1])
            kept.append(off + path[-1])
        ids[torch.tensor(at + kept, dtype=torch.int64, device=ids.device)] = torch.tensor(
            following + out.last_tokens, dtype=torch.int64, device=ids.device)
        self._keep(fb.req_pool_indices, self._head(fb, ids, features)[torch.tensor(kept, device=ids.device)])
