"""Processing a batch's result: append tokens, logprobs, finish checks, memory release, streaming."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Optional

from baton.engine.core.req import Req
from baton.engine.io_struct import BatchTokenIDOut, FinishReason

if TYPE_CHECKING:
    from baton.engine.core.batch_result import LaunchedBatch
    from baton.engine.core.stats import SchedulerStats
    from baton.engine.disaggregation.colocated import Colocated
    from baton.engine.mem_cache.base import BasePrefixCache
    from baton.engine.scheduler.release import ReqReleaser
    from baton.engine.scheduler.config import SchedulerConfig
    from baton.engine.scheduler.request_table import RequestTable
    from baton.engine.speculative.base import NoSpeculation


class OutputProcessor:
    """Results of launched batches into their requests; finished requests end (memory, PD transfer)
    and every output goes to the detokenizer through `outbox`."""

    def __init__(self, config: "SchedulerConfig", tokenizer: Any, tree_cache: "BasePrefixCache",
                 releaser: "ReqReleaser", table: "RequestTable", stats: "SchedulerStats", outbox: list) -> None:
        self.config, self.tokenizer, self.tree_cache = config, tokenizer, tree_cache
        self.releaser, self.table, self.stats, self.outbox = releaser, table, stats, outbox
        self.pd: "Colocated" = None  # the PD strategy, set by the Scheduler once built (it needs this processor)
        self.spec: "NoSpeculation" = None  # the speculation strategy, set by the Scheduler once built

    def process_batch_result(self, launched: "LaunchedBatch") -> None:
        # Requests finished by the previous result were still in the batch we now hold the result
        # of (overlap mode); only now is their memory no longer read.
        ready = self.releaser.take_waiting()
        result = launched.wait()
        if launched.mwb.spec_info is not None:  # a verify step: a decode step of 1 + accepted tokens each
            self.spec.process_verify_result(launched, result)
        elif launched.mwb.forward_mode.is_extend():
            if not self.pd.on_extend_result(launched, result):  # a PD prefill sends the tokens on
                self._process_extend(launched, result)
        else:
            self._process_decode(launched, result)
        for req in ready:
            self.releaser.release_now(req)
        self.stream_output(launched.reqs)

    def extend_result_prologue(self, req: Req, i: int, result) -> bool:
        """What every extend result does first: keep the chunk's input logprobs; end a request that
        was aborted while in flight. Returns False when the request needs nothing more."""
        if i in result.input_logprobs:
            lps, tops = result.input_logprobs[i]
            req.input_token_logprobs.extend(lps)
            req.input_top_logprobs.extend(tops)
        if req.finished():
            self.finish_request(req)
            return False
        return True

    def _process_extend(self, launched: "LaunchedBatch", result) -> None:
        # --enable-mixed-chunk: rows from here on were decode steps of running requests
        first_decode = len(launched.reqs) - launched.mwb.num_decode_rows
        for i, req in enumerate(launched.reqs):
            if not self.extend_result_prologue(req, i, result):
                continue
            if req.is_chunked > 0:  # an intermediate chunk: its sampled token is meaningless
                req.is_chunked -= 1
                continue
            if result.embeddings is not None:  # an embedding engine: the prompt's vector ends the request
                self._finish_embedding(req, result.embeddings[i])
                continue
            self._append_token(req, i, result)
            if req.finished():
                self.finish_request(req)
            elif not self.config.disable_radix_cache and i < first_decode:
                # make the prompt's KV shareable right away (concurrent requests with the same prefix)
                req.sync_fill_ids()
                self.tree_cache.cache_unfinished_req(req)

    def _process_decode(self, launched: "LaunchedBatch", result) -> None:
        # The per-token loop of every decode step: record_token's work inlined for the common case
        # (no logprobs, first token long sent), the token counter bumped once per batch.
        ids, tokenizer, plain = result.next_token_ids, self.tokenizer, result.next_token_logprobs is None
        appended = 0
        for i, req in enumerate(launched.reqs):
            if req.finished_reason is not None:
                # overlap: the extra step after a finish, or an abort while in flight
                self.finish_request(req)
                continue
            if plain and req.first_token_time is not None and req.grammar is None:
                req.output_ids.append(ids[i])
                appended += 1
            else:
                self.record_token(req, i, result)
            req.check_finished(tokenizer)
            if req.finished_reason is not None:
                self.finish_request(req)
        self.stats.generated_tokens += appended

    def _finish_embedding(self, req: Req, vector: list[float]) -> None:
        """An embedding engine's request after its prefill's last chunk: its vector, no tokens; its KV
        goes to the prefix cache as any finished request's."""
        req.embedding = vector
        req.finished_reason = FinishReason("length")
        self.finish_request(req)

    def _append_token(self, req: Req, i: int, result) -> None:
        if req.sampling_params.max_new_tokens == 0:  # the prefill only (prompt logprobs, cache warming)
            req.finished_reason = FinishReason("length")
            return
        self.record_token(req, i, result)
        req.check_finished(self.tokenizer)

    def record_token(self, req: Req, i: int, result) -> None:
        """Append row i's sampled token (and logprobs) without the finish checks."""
        logprobs = req.return_logprob and result.next_token_logprobs is not None
        self.append_token(req, result.next_token_ids[i], result.next_token_logprobs[i] if logprobs else None,
                          result.next_top_logprobs[i] if logprobs else None)

    def append_token(self, req: Req, token_id: int, logprob: Optional[float] = None,
                     top_logprobs: Optional[list] = None) -> None:
        """Append one token (and its logprobs, where the request asked for them and the step made
        them) without the finish checks."""
        req.output_ids.append(token_id)
        if req.grammar is not None:
            req.accept_grammar_token(token_id)
        self.stats.generated_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = time.time()
        if req.return_logprob and logprob is not None:
            req.output_token_logprobs.append((logprob, token_id))
            if req.top_logprobs_num > 0:
                req.output_top_logprobs.append(top_logprobs)

    def finish_request(self, req: Req) -> None:
        """Release a finished request's memory once (deferred in overlap mode)."""
        if getattr(req, "_finish_handled", False):
            return
        req._finish_handled = True
        self.spec.on_finished(req)
        self.pd.release(req)
        if req.req_pool_idx is not None:
            self.releaser.release(req)

    def reap_finished(self, reqs: list[Req]) -> None:
        """End the finished requests among `reqs` and send their last outputs."""
        finished = [r for r in reqs if r.finished()]
        for req in finished:
            self.finish_request(req)
        self.stream_output(finished)

    def stream_output(self, reqs: list[Req]) -> None:
        interval = self.config.stream_interval
        out = None
        for req in reqs:
            if getattr(req, "_final_sent", False):
                continue
            new = len(req.output_ids) - req.sent_offset
            finished = req.finished()
            if not finished:
                if not req.stream or new == 0 or (new < interval and req.sent_offset > 0):
                    continue
            if out is None:
                out = BatchTokenIDOut([], [], [], [], [], [], [], [], [], [], [], [], [])
            self._add_output(out, req)
            req.sent_offset = len(req.output_ids)
            if finished:
                req._final_sent = True
                self.table.remove(req)
        if out is not None:
            self.outbox.append(out)

    @staticmethod
    def _add_output(out: BatchTokenIDOut, req: Req) -> None:
        p = req.sampling_params
        start = req.sent_offset
        out.rids.append(req.rid)
        out.finished_reasons.append(req.finished_reason)
        out.new_token_ids.append(req.output_ids[start:])
        out.output_offsets.append(start)
        out.skip_special_tokens.append(p.skip_special_tokens)
        out.spaces_between_special_tokens.append(p.spaces_between_special_tokens)
        out.stop_strs.append(p.stop)
        out.no_stop_trim.append(p.no_stop_trim)
        out.meta.append((len(req.origin_input_ids), len(req.output_ids), req.cached_tokens))
        out.embeddings.append(req.embedding)
        if req.return_logprob:
            out.output_token_logprobs.append(req.output_token_logprobs[start:])
            out.output_top_logprobs.append(req.output_top_logprobs[start:] if req.top_logprobs_num else None)
            first = not req.input_logprobs_sent and (req.output_ids or req.finished())
            out.input_token_logprobs.append(req.input_token_logprobs if first else None)
            out.input_top_logprobs.append(req.input_top_logprobs if first and req.top_logprobs_num else None)
            if first:
                req.input_logprobs_sent = True
        else:
            for lst in (out.output_token_logprobs, out.output_top_logprobs, out.input_token_logprobs,
                        out.input_top_logprobs):
                lst.append(None)
