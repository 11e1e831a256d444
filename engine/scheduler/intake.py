"""Request intake of the scheduler: messages from the tokenizer dispatched by type, a generate
request validated and admitted (to waiting_queue, a PD queue, or the grammar queue while its grammar
compiles), aborts found wherever the request is."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

from baton.engine.io_struct import (AbortReq, FlushCacheReq, FreezeGCReq, GetServerInfoOut, GetServerInfoReq,
                                    TokenizedGenerateReqInput)
from baton.engine.scheduler.req import Req
from baton.engine.utils.gc_freeze import freeze_gc

if TYPE_CHECKING:
    from baton.engine.scheduler.scheduler import Scheduler
    from baton.engine.server_args import ServerArgs

logger = logging.getLogger(__name__)


class SchedulerIntakeMixin:
    @staticmethod
    def _think_end_id(args: "ServerArgs", tokenizer: Any) -> Optional[int]:
        """With --reasoning-parser: the one token that ends the reasoning, after which a grammar of a
        request that reasons applies (None: grammars apply from the first token)."""
        if args.reasoning_parser is None or tokenizer is None:
            return None
        from baton.engine.parsers.reasoning import THINK_END

        ids = tokenizer.encode(THINK_END, add_special_tokens=False)
        if len(ids) != 1:
            logger.warning("%s is not one token of this tokenizer: structured output applies from the "
                           "first token, reasoning included", THINK_END)
            return None
        return ids[0]

    def process_input_requests(self: "Scheduler", msgs: list[Any]) -> None:
        for msg in msgs:
            if isinstance(msg, TokenizedGenerateReqInput):
                self.handle_generate_request(msg)
            elif isinstance(msg, AbortReq):
                self.abort_request(msg)
            elif isinstance(msg, FlushCacheReq):
                self.outbox.append(self.flush_cache())
            elif isinstance(msg, GetServerInfoReq):
                self.outbox.append(GetServerInfoOut(self.get_server_info(), self.dp_rank))
            elif isinstance(msg, FreezeGCReq):
                freeze_gc("scheduler")
            else:
                logger.error("unknown message type %s dropped", type(msg).__name__)

    def handle_generate_request(self: "Scheduler", recv: TokenizedGenerateReqInput) -> None:
        from baton.engine.sampling.sampling_batch_info import ReqSamplingState

        params = recv.sampling_params
        req = Req(rid=recv.rid, origin_input_ids=list(recv.input_ids), sampling_params=params,
                  eos_token_ids=self.eos_token_ids, origin_input_text=recv.input_text, stream=recv.stream,
                  return_logprob=recv.return_logprob, logprob_start_len=recv.logprob_start_len,
                  top_logprobs_num=recv.top_logprobs_num, priority=recv.priority or 0,
                  arrival_time=recv.received_time, require_reasoning=recv.require_reasoning,
                  bootstrap_host=recv.bootstrap_host, bootstrap_port=recv.bootstrap_port,
                  bootstrap_room=recv.bootstrap_room)
        error = self._validate(req)
        if error is None:
            stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
            req.sampling_state = ReqSamplingState(params, req.origin_input_ids, self.vocab_size, stop_ids,
                                                  self.server_args.device)
            max_queued = self.server_args.max_queued_requests
            if max_queued is not None and len(self.waiting_queue) + len(self.grammar_queue) >= max_queued:
                error = ("the server is overloaded: the waiting queue is full", 503)
            else:
                error, future = self._start_grammar(req)
                if future is not None and not future.done():  # admitted once it has compiled
                    self.grammar_queue.add(req, recv, future)
                    return
                if future is not None:
                    error = self._attach_grammar(req, future)
        self._admit(req, recv, error)

    def _admit(self: "Scheduler", req: Req, recv: TokenizedGenerateReqInput, error: Optional[tuple[str, int]]) -> None:
        """A request ready to be scheduled joins the PD strategy's first queue (colocated: the
        waiting queue); one with an error ends here."""
        if error is None:
            error = self.pd.admit(req, recv)
        if error is not None:
            req.abort(*error)
            self.stream_output([req])

    def _start_grammar(self: "Scheduler", req: Req) -> tuple[Optional[tuple[str, int]], Any]:
        """(error, future of the compiled grammar); both None for a request without a grammar."""
        from baton.engine.constrained.grammar import grammar_spec

        spec = grammar_spec(req.sampling_params)
        if spec is None:
            return None, None
        if self.grammar_backend is None:
            return ("structured output is off on this server (--grammar-backend none)", 400), None
        return None, self.grammar_backend.submit(*spec)

    def _attach_grammar(self: "Scheduler", req: Req, future: Any) -> Optional[tuple[str, int]]:
        from baton.engine.constrained.grammar import GrammarError

        try:
            reasoning_end = self.think_end_id if req.require_reasoning else None
            req.sampling_state.grammar = self.grammar_backend.grammar(future.result(), reasoning_end)
        except GrammarError as e:
            return str(e), 400
        except ImportError as e:
            return f"structured output needs the xgrammar package: {e}", 400
        return None

    def admit_compiled(self: "Scheduler") -> None:
        """Requests whose grammar has compiled since the last step join the queues."""
        for wait in self.grammar_queue.pop_ready():
            self._admit(wait.req, wait.recv, self._attach_grammar(wait.req, wait.future))

    def _validate(self: "Scheduler", req: Req) -> Optional[tuple[str, int]]:
        n = len(req.origin_input_ids)
        if n == 0:
            return "the prompt is empty", 400
        if n + 1 > self.context_len:
            return f"the prompt has {n} tokens; this model's context length is {self.context_len}", 400
        if n + req.sampling_params.max_new_tokens + self.page_size > min(self.max_total_tokens, self.context_len + self.page_size):
            room = min(self.max_total_tokens, self.context_len) - n
            if room < 1:
                return f"the prompt has {n} tokens; at most {min(self.max_total_tokens, self.context_len) - 1} fit", 400
            req.sampling_params.max_new_tokens = room  # cap, as OpenAI servers do
            req.sampling_params.min_new_tokens = min(req.sampling_params.min_new_tokens, room)
        if any(not 0 <= t < self.vocab_size for t in req.origin_input_ids):
            return "input_ids contain ids outside the vocabulary", 400
        return None

    def abort_request(self: "Scheduler", recv: AbortReq) -> None:
        for req in self.grammar_queue.remove(None if recv.abort_all else recv.rid):
            req.abort(recv.message, recv.status_code)  # never admitted: no memory, no PD entry
            self.stream_output([req])
        for req in list(self.waiting_queue):
            if recv.abort_all or req.rid == recv.rid:
                self.waiting_queue.remove(req)  # queued requests hold no memory
                req.abort(recv.message, recv.status_code)
                self.pd.release(req)  # PD: and tell the peer engine
                self.stream_output([req])
        live = list(self.running_batch.reqs) + ([self.chunked_req] if self.chunked_req else [])
        live += [r for launched in self.result_queue for r in launched.reqs]
        if self.last_batch is not None:
            live += self.last_batch.reqs
        for req in live:  # ends at the next result processing, which also frees its memory
            if recv.abort_all or req.rid == recv.rid:
                req.abort(recv.message, recv.status_code)
        self.pd.abort(recv)
