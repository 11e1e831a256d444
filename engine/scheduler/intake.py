"""Request intake of the scheduler: a generate request validated and admitted (to the waiting queue,
a PD queue, or the grammar queue while its grammar compiles); an abort found by its rid."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from baton.engine.core.req import Req
from baton.engine.io_struct import AbortReq, TokenizedGenerateReqInput
from baton.engine.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from baton.engine.core.queues import SchedulerQueues
    from baton.engine.disaggregation.colocated import Colocated
    from baton.engine.scheduler.grammar_queue import GrammarQueue
    from baton.engine.scheduler.lora import LoraScheduler
    from baton.engine.scheduler.output_processor import OutputProcessor
    from baton.engine.scheduler.request_table import RequestTable
    from baton.engine.scheduler.config import SchedulerConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelLimits:
    """What a request is checked against at intake."""

    vocab_size: int
    context_len: int
    max_total_tokens: int
    page_size: int
    eos_token_ids: frozenset[int]


class RequestIntake:
    def __init__(self, config: "SchedulerConfig", limits: ModelLimits, queues: "SchedulerQueues",
                 grammar_queue: "GrammarQueue", table: "RequestTable", output: "OutputProcessor",
                 tokenizer: Any) -> None:
        self.config, self.limits, self.queues = config, limits, queues
        self.grammar_queue, self.table, self.output = grammar_queue, table, output
        self.grammar_backend: Any = None  # constrained.grammar.GrammarBackend when structured output is on
        if config.grammar_backend == "xgrammar" and tokenizer is not None:
            from baton.engine.constrained.grammar import GrammarBackend

            self.grammar_backend = GrammarBackend(tokenizer, limits.vocab_size, list(limits.eos_token_ids),
                                                  any_whitespace=not config.constrained_json_disable_any_whitespace)
        self.think_end_id = self._think_end_id(config, tokenizer)
        self.pd: "Colocated" = None  # the PD strategy, set by the Scheduler once built
        self.lora: "LoraScheduler" = None  # which adapter a request runs under, set by the Scheduler

    @staticmethod
    def _think_end_id(args: "SchedulerConfig", tokenizer: Any) -> Optional[int]:
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

    def handle_generate_request(self, recv: TokenizedGenerateReqInput) -> None:
        """Admit one request. What goes wrong before it joins a queue ends it (500) and leaves the
        scheduler running: the HTTP layer validates what clients send, and a gap there must cost one
        request, not the engine."""
        try:
            req = self._new_req(recv)
        except Exception as e:  # noqa: BLE001  (a bug's cost is one request)
            self._refuse(recv, e)
            return
        self.table.add(req)  # the tokenizer manager refuses a rid still in flight
        try:
            error, compiling = self._check(req, recv)
        except Exception as e:  # noqa: BLE001
            self.table.remove(req)
            self._refuse(recv, e)
            return
        if not compiling:  # else admitted once its grammar has compiled
            self._admit(req, recv, error)

    def _refuse(self, recv: TokenizedGenerateReqInput, e: Exception) -> None:
        """End a request that could not be admitted: an answer with the error, nothing held."""
        logger.exception("request %s could not be admitted", recv.rid)
        req = Req(rid=recv.rid, origin_input_ids=list(recv.input_ids), sampling_params=SamplingParams(),
                  eos_token_ids=self.limits.eos_token_ids, stream=bool(recv.stream))
        self.table.add(req)
        req.abort(f"the engine could not admit the request: {type(e).__name__}: {e}", 500)
        self.output.stream_output([req])

    def _new_req(self, recv: TokenizedGenerateReqInput) -> Req:
        return Req(rid=recv.rid, origin_input_ids=list(recv.input_ids), sampling_params=recv.sampling_params,
                   eos_token_ids=self.limits.eos_token_ids, origin_input_text=recv.input_text, stream=recv.stream,
                   return_logprob=recv.return_logprob, logprob_start_len=recv.logprob_start_len,
                   top_logprobs_num=recv.top_logprobs_num, priority=recv.priority or 0,
                   arrival_time=recv.received_time, require_reasoning=recv.require_reasoning,
                   bootstrap_host=recv.bootstrap_host, bootstrap_port=recv.bootstrap_port,
                   bootstrap_room=recv.bootstrap_room, mm_inputs=recv.mm_inputs)

    def _check(self, req: Req, recv: TokenizedGenerateReqInput) -> tuple[Optional[tuple[str, int]], bool]:
        """(the request's error as (message, status), None when it may join a queue; whether it waits in
        the grammar queue instead)."""
        from baton.engine.sampling.sampling_batch_info import ReqSamplingState

        params = req.sampling_params
        error = self._validate(req) or self.lora.resolve(req, recv.lora_name)
        if error is not None:
            return error, False
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.limits.eos_token_ids))
        req.sampling_state = ReqSamplingState(params, req.origin_input_ids, self.limits.vocab_size, stop_ids,
                                              self.config.device)
        max_queued = self.config.max_queued_requests
        if max_queued is not None and len(self.queues.waiting) + len(self.grammar_queue) >= max_queued:
            return ("the server is overloaded: the waiting queue is full", 503), False
        error, future = self._start_grammar(req)
        if future is not None and not future.done():
            self.grammar_queue.add(req, recv, future)  # the last step: nothing after it can fail
            return None, True
        if future is not None:
            error = self._attach_grammar(req, future)
        return error, False

    def _admit(self, req: Req, recv: TokenizedGenerateReqInput, error: Optional[tuple[str, int]]) -> None:
        """A request ready to be scheduled joins the PD strategy's first queue (colocated: the
        waiting queue); one with an error ends here."""
        if error is None:
            error = self.pd.admit(req, recv)
        if error is not None:
            req.abort(*error)
            self.output.stream_output([req])

    def _start_grammar(self, req: Req) -> tuple[Optional[tuple[str, int]], Any]:
        """(error, future of the compiled grammar); both None for a request without a grammar."""
        from baton.engine.constrained.grammar import grammar_spec

        spec = grammar_spec(req.sampling_params)
        if spec is None:
            return None, None
        if self.grammar_backend is None:
            return ("structured output is off on this server (--grammar-backend none)", 400), None
        return None, self.grammar_backend.submit(*spec)

    def _attach_grammar(self, req: Req, future: Any) -> Optional[tuple[str, int]]:
        from baton.engine.constrained.grammar import GrammarError

        try:
            reasoning_end = self.think_end_id if req.require_reasoning else None
            req.sampling_state.grammar = self.grammar_backend.grammar(future.result(), reasoning_end)
        except GrammarError as e:
            return str(e), 400
        except ImportError as e:
            return f"structured output needs the xgrammar package: {e}", 400
        return None

    def admit_compiled(self) -> None:
        """Requests whose grammar has compiled since the last step join the queues."""
        for wait in self.grammar_queue.pop_ready():
            self._admit(wait.req, wait.recv, self._attach_grammar(wait.req, wait.future))

    def _validate(self, req: Req) -> Optional[tuple[str, int]]:
        n, lim = len(req.origin_input_ids), self.limits
        if n == 0:
            return "the prompt is empty", 400
        if n + 1 > lim.context_len:
            return f"the prompt has {n} tokens; this model's context length is {lim.context_len}", 400
        if n + req.sampling_params.max_new_tokens + lim.page_size > min(lim.max_total_tokens, lim.context_len + lim.page_size):
            room = min(lim.max_total_tokens, lim.context_len) - n
            if room < 1:
                return f"the prompt has {n} tokens; at most {min(lim.max_total_tokens, lim.context_len) - 1} fit", 400
            req.sampling_params.max_new_tokens = room  # cap, as OpenAI servers do
            req.sampling_params.min_new_tokens = min(req.sampling_params.min_new_tokens, room)
        if any(not 0 <= t < lim.vocab_size for t in req.origin_input_ids):
            return "input_ids contain ids outside the vocabulary", 400
        return None

    def abort_request(self, recv: AbortReq) -> None:
        """Wherever the request is: compiling its grammar or waiting (ended here, they hold no
        memory), in a PD queue (the strategy ends it), or running (it ends at its next result
        processing, which frees its memory)."""
        for req in self.grammar_queue.remove(None if recv.abort_all else recv.rid):
            req.abort(recv.message, recv.status_code)  # never admitted: no memory, no PD entry
            self.output.stream_output([req])
        found = self.table.get(recv.rid) if not recv.abort_all else None
        targets = list(self.table) if recv.abort_all else [found] if found is not None else []
        waiting = self.queues.waiting
        for req in targets:
            req.abort(recv.message, recv.status_code)
            if any(r is req for r in waiting):
                waiting.remove(req)  # queued requests hold no memory,
                if req.req_pool_idx is not None:  # but a session's next turn that took its history's row
                    self.output.releaser.release_now(req)
                self.pd.release(req)  # PD: and tell the peer engine
                self.output.stream_output([req])
        self.pd.abort(recv)
