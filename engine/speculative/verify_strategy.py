"""What every drafting strategy shares (NGRAM, NEXTN): when a decode step verifies, the verify step's
KV and state slots, and what happens to its result. A strategy says only how it drafts (`draft`, or
`draft_tree` for a strategy that drafts trees: spec_info.py) and what it learns from a verified draft
(`on_verified`).

A decode step verifies drafts when the running batch is small (fewer requests than
--speculative-disable-by-batch-size: at large batches a step is compute-bound and drafts only cost).
Every request can verify: accept_host.py processes each position's logits as the sampler would (penalties,
logit bias, the grammar's mask, min_new_tokens), so structured output and penalised requests draft too.

Memory: the verify step allocates KV for [last, *draft] of every request (ScheduleBatch.prepare_for_verify,
which sets its committed length to all of them); once the result is known the request keeps the
positions it emitted and the rest go back to the pool at once (whole pages beyond the last one it keeps;
mem_cache/base.py's ownership table: committed == allocated again). So the radix cache, which takes a
request's committed KV, only ever sees accepted tokens. Without room for the drafts the step is a plain
one (retraction is the plain step's business). A tree's accepted nodes need not be its first ones: the
worker has moved their KV to the columns right after the last token's before the result comes back
(TpModelWorker._move_accepted_kv), so keeping the first positions keeps them here too.

Lagged verify steps (the overlap loop, a draft head's strategies: their drafts are made in the worker):
the next verify step is built and launched while the one before it still runs, as the overlap loop
does plain decode steps, and the running step's result is processed while the next one computes. The
scheduler does not know yet how many tokens the running step emits (1 .. 1 + its deepest branch), so it
builds the next step from the running step's start and reserves each request's KV up to the most both
steps can reach (the most the running step emits, then this step's columns); the running step's last
tokens and emitted counts reach the next one through the future map, and the worker moves each row on
by them before the pass (TpModelWorker._resolve_lagged). When the running step's result comes, the
request's KV is its accepted positions, but the slots past them stay allocated while the lagged step
writes there (cut_kv); the last result in frees them. Drafts (a tree's nodes: a column each) stay
within max_new_tokens counting the most the running step may emit (room), so the reservation never runs
past the request's row. Where any request
cannot lag (not in the running step, a grammar, a batch that grew or switches to plain steps), the
results are processed first and the step is built as before (DecodeManager.prepare).

Hybrid models: a request's recurrent state goes through every token of the step (a tree's in waves
by depth, each node from its parent's: GatedDeltaCore._tree_waves); the layers keep the state after each of its
drafts in scratch slots (state_pool.scratch_slot), and the result rolls the row back to the one after
its kept tokens (roll_back_state: a copy before the next pass; spec_info.state_node names the node they
end at). Where verify steps lag, consecutive steps use alternate scratch sets that also keep the state
after the whole step, and the worker rolls each row back at the start of the step behind, by the node
the running step's tokens end at, on the device (TpModelWorker._roll_back_lagged_states); a request
that ends while a step runs behind it gets the state after its kept tokens from its own step's set (the
step behind writes the other one) before its end state is cached.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from baton.engine.core.spec_info import VerifyInput, first_chain, node_depths, state_node
from baton.engine.speculative.base import NoSpeculation, SpecView
from baton.engine.speculative.stats import SpecStats

if TYPE_CHECKING:
    from baton.engine.core.req import Req
    from baton.engine.core.schedule_batch import ScheduleBatch


class VerifyingSpeculator(NoSpeculation):
    def __init__(self, view: SpecView) -> None:
        args = view.config
        self.view = view
        # tokens a verify step runs per request: its last token and up to num_draft_tokens - 1 drafts
        self.num_draft_tokens = args.speculative_num_draft_tokens
        self.disable_by_batch_size = args.speculative_disable_by_batch_size
        self.stats = SpecStats(self.num_draft_tokens)
        self._scratch_set = 0  # a hybrid model's: the scratch set the last verify step built used

    # ------------------------------------------------------------------ what a strategy says
    def draft(self, req: "Req") -> list[int]:
        """The request's draft for this step (at most num_draft_tokens - 1 tokens; may be empty)."""
        raise NotImplementedError

    def draft_tree(self, req: "Req") -> tuple[list[int], Optional[list[int]]]:
        """The request's draft as tree nodes (at most num_draft_tokens - 1) and their parents
        (spec_info.py; None: a chain). By default draft()'s chain."""
        return self.draft(req), None

    def on_verified(self, req: "Req", drafted: int, accepted: int) -> None:
        """A verify step kept `accepted` tokens of the request's draft, which reached `drafted` tokens
        deep (a chain's length, a tree's longest branch)."""

    # ------------------------------------------------------------------ when
    def eligible(self, batch: "ScheduleBatch") -> bool:
        return 0 < len(batch.reqs) < self.disable_by_batch_size and all(r.sampling_state is not None
                                                                        for r in batch.reqs)

    def wants_verify(self, batch: "ScheduleBatch") -> bool:
        return self.eligible(batch)

    def room(self, req: "Req") -> int:
        """Drafts the request may take this step: never more than it may still emit after the
        target's own token (max_new_tokens), counting all a verify step still running for it may emit."""
        running = req.spec_reach if req.spec_flight else 0
        return min(self.num_draft_tokens - 1, req.sampling_params.max_new_tokens - len(req.output_ids) - running - 1)

    def prepare_lagged(self, batch: "ScheduleBatch", in_flight: list) -> bool:
        """A verify step behind the one still running (module docstring, "Lagged verify steps"): only
        where every request of the batch is in that step and nothing of the step's tokens is needed
        on the host to build this one (no grammar)."""
        if not self.lags or len(in_flight) != 1 or in_flight[0].mwb.spec_info is None or not self.eligible(batch):
            return False
        running = {id(r) for r in in_flight[0].reqs}
        if not all(id(r) in running and r.spec_flight == 1 and r.grammar is None for r in batch.reqs):
            return False
        return self.prepare_verify(batch, lagged=True)

    def prepare_verify(self, batch: "ScheduleBatch", lagged: bool = False) -> bool:
        if not self.eligible(batch):
            return False
        reqs = batch.reqs
        drafts, trees = zip(*[self.draft_tree(req) for req in reqs])
        if not any(drafts):
            return False
        extents = [1 + len(d) for d in drafts]  # the KV columns each request's step writes
        reach = [1 + (len(d) if t is None else max(node_depths(t))) for d, t in zip(drafts, trees)]  # most it emits
        if lagged:  # each request's running step starts where it was built to, moved on by the step before's
            starts = [r.spec_start + (r.spec_emitted if r.spec_lag else 0) for r in reqs]
            # past the most the running step may emit and this one's columns after it
            reserve_to = [max(r.kv_allocated_len, s + r.spec_reach + e) for r, s, e in zip(reqs, starts, extents)]
            need = sum(t - r.kv_allocated_len for r, t in zip(reqs, reserve_to))
        else:
            starts, need = [r.kv_committed_len for r in reqs], sum(extents)
        if not self._reserve(need, len(reqs)):
            return False
        state_slots = self._state_slots(drafts)
        parents = None if all(t is None for t in trees) else list(trees)
        spec = self.verify_input(list(drafts), state_slots, parents)
        if lagged:
            spec.lagged = (-batch.output_ids).tolist()  # the running step's future-map slots
            if state_slots is not None:
                spec.lagged_states = [r.spec_state_slots for r in reqs]
            batch.prepare_for_verify(spec, starts, reserve_to)
        else:
            batch.prepare_for_verify(spec)
        for i, (req, start, most) in enumerate(zip(reqs, starts, reach)):
            req.spec_flight += 1
            req.spec_start, req.spec_lag, req.spec_reach = start, lagged, most
            if state_slots is not None:
                req.spec_state_slots = state_slots[i]
        return True

    def _state_slots(self, drafts: tuple) -> Optional[list[list[int]]]:
        """A hybrid model's scratch slots per request: the state after each of its draft tokens (module
        docstring, "Hybrid models"). Where verify steps lag, after all of its tokens too, and
        consecutive steps use alternate sets."""
        scratch = self.view.state_scratch
        if scratch is None:
            return None
        lagging = self.view.state_scratch_sets == 2
        which = self._scratch_set = (self._scratch_set + 1) % self.view.state_scratch_sets
        return [[scratch(i, j + 1, which) for j in range(len(d) + lagging)] for i, d in enumerate(drafts)]

    def verify_input(self, drafts: list[list[int]], state_slots: Optional[list[list[int]]],
                     parents: Optional[list[Optional[list[int]]]]) -> VerifyInput:
        """What the verify step carries to the worker (a strategy may add to it)."""
        return VerifyInput(drafts, state_slots, parents)

    def _reserve(self, tokens: int, bs: int) -> bool:
        """Room in the KV pool for the verify step's new `tokens` (evicting cached prefixes if needed)."""
        allocator = self.view.allocator
        page = allocator.page_size
        need = tokens + (bs * page if page > 1 else 0)
        free = allocator.available_size()
        if free < need:
            self.view.tree_cache.evict(need - free)
        return allocator.available_size() >= need

    # ------------------------------------------------------------------ results
    def process_verify_result(self, launched: Any, result: Any) -> None:
        spec: VerifyInput = launched.mwb.spec_info
        out = result.verify
        self.stats.on_verify_step(spec.lagged is not None)
        for i, req in enumerate(launched.reqs):
            start = launched.mwb.extend_prefix_lens_cpu[i]  # the KV it held: its last token sits there
            req.spec_flight -= 1
            req.spec_emitted = len(out.tokens[i])  # where a step built behind this one starts
            later = req.spec_flight > 0  # a lagged step behind this one writes the KV past it
            if req.finished():
                # aborted while the step ran: its tokens so far stay, the step's go; or ended by the
                # result of the step before (a lagged step), which cut its KV already
                self.roll_back_state(spec, i, req, 0, later)
                self.cut_kv(req, min(start + 1, req.kv_committed_len), later)
                self.view.finish_request(req)
                continue
            tokens = out.tokens[i]
            emitted = 0
            for j, token in enumerate(tokens):
                self.view.append_token(req, token, out.logprobs[i][j] if out.logprobs is not None else None,
                                       out.top_logprobs[i][j] if out.top_logprobs is not None else None)
                emitted += 1
                req.check_finished(self.view.tokenizer)  # a stop, EOS or max_tokens inside the run ends it there
                if req.finished():
                    break
            tree = spec.tree(i)
            branched = tree is not None and out.accepted_nodes[i] != first_chain(tree)[1:len(tokens)]
            self.stats.on_request(len(spec.drafts[i]), len(tokens) - 1, branched)
            self.on_verified(req, spec.depth(i), len(tokens) - 1)
            # KV is computed for [last, emitted[:-1]]: the newest token's comes with the next step
            self.roll_back_state(spec, i, req, state_node(out.accepted_nodes, i, emitted), later)
            self.cut_kv(req, start + emitted, later)
            if req.finished():
                self.view.finish_request(req)

    def roll_back_state(self, spec: VerifyInput, i: int, req: "Req", node: int, later: bool) -> None:
        """A hybrid model: the row's recurrent state went through all 1 + k tokens of the step (a tree:
        its last node's state); when the tokens it keeps end at `node` (state_node), the next pass
        starts by copying the state after that node (kept in a scratch slot by the layers) into the
        row. Queued before anything else this request queues
        (its end state into the radix cache, if it finished), so those copies see the rolled-back one.
        With a lagged step behind this one (`later`) the worker rolled the row back at that step's
        start, by the count on the device, and the step moved it on: only a request that ends here
        gets its state back (after its kept tokens: this step's scratch set, which the step behind
        does not write). Once per request: a request that ended is not rolled back by the steps that
        were still behind it."""
        if spec.state_slots is None or req.spec_state_final:
            return
        req.spec_state_final = req.finished()
        if later and not req.finished():
            return
        if later or node < len(spec.drafts[i]):
            self.view.tree_cache.queue_state_copy(spec.state_slots[i][node], req.req_pool_idx)

    def cut_kv(self, req: "Req", length: int, later: bool) -> None:
        """The request's KV is its first `length` positions. While a lagged step behind this one runs,
        that step still writes past them: the slots stay allocated (freed once its result is in)."""
        if later:
            req.kv_committed_len = length
        else:
            self.keep_kv(req, length)

    def keep_kv(self, req: "Req", length: int) -> None:
        """Keep the request's first `length` KV positions; free the pages wholly past them (the slots
        left in the last kept page stay with it, as a decode step's page does)."""
        page = self.view.allocator.page_size
        keep = -(-length // page) * page
        if req.kv_allocated_len > keep:
            row = self.view.req_to_token_pool.req_to_token[req.req_pool_idx]
            self.view.allocator.free(row[keep:req.kv_allocated_len])
        req.kv_committed_len = req.kv_allocated_len = length

    def server_info(self) -> dict:
        return {"speculative_algorithm": self.algorithm, "speculative_num_draft_tokens": self.num_draft_tokens,
                "speculative_disable_by_batch_size": self.disable_by_batch_size, **self.stats.server_info()}
