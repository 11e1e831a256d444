"""Drive a real Scheduler in-process (same run_step the scheduler process loops on), no ZMQ/HTTP."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from transformers import AutoTokenizer

from baton.engine.io_struct import BatchTokenIDOut, FinishReason, TokenizedGenerateReqInput
from baton.engine.sampling.sampling_params import SamplingParams
from baton.engine.scheduler.scheduler import Scheduler
from baton.engine.server_args import ServerArgs


@dataclass
class Collected:
    ids: list[int] = field(default_factory=list)
    finish: Optional[FinishReason] = None
    output_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    input_logprobs: Optional[list] = None
    cached_tokens: int = 0
    after_finish: int = 0  # outputs that arrived after the request had finished (must stay 0)
    embedding: Optional[list[float]] = None  # an embedding engine's vector (--is-embedding)


class SchedulerHarness:
    def __init__(self, model_path: str, tp: Any = None, **overrides: Any) -> None:
        """`tp`: a joined TpGroup (tp_group.py) whose driver this scheduler becomes."""
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.scheduler = Scheduler(ServerArgs(model_path=model_path, **overrides), self.tokenizer, tp=tp)
        self.results: dict[str, Collected] = {}

    def submit(self, rid: str, input_ids: list[int], return_logprob: bool = False, logprob_start_len: int = -1,
               priority: int = 0, require_reasoning: bool = False, top_logprobs_num: int = 0,
               mm_inputs: Any = None, **sampling: Any) -> None:
        params = SamplingParams(**{"max_new_tokens": 16, "temperature": 0.0, **sampling})
        self.scheduler.process_input_requests([TokenizedGenerateReqInput(
            rid=rid, input_text=None, input_ids=list(input_ids), sampling_params=params,
            return_logprob=return_logprob, logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
            priority=priority, mm_inputs=mm_inputs,
            require_reasoning=require_reasoning)])
        self._collect()

    def step(self) -> bool:
        ran = self.scheduler.run_step()
        self._collect()
        return ran

    def run_until_idle(self, max_steps: int = 2000) -> dict[str, Collected]:
        for _ in range(max_steps):
            ran = self.step()
            if not ran and self.scheduler.is_idle():
                return self.results
            if not ran:  # e.g. only grammars compiling (as the process loop, block instead of spinning)
                self.scheduler.grammar_queue.wait(timeout_s=1.0)
        raise AssertionError(f"scheduler not idle after {max_steps} steps")

    def _collect(self) -> None:
        for msg in self.scheduler.outbox:
            if not isinstance(msg, BatchTokenIDOut):
                continue
            for i, rid in enumerate(msg.rids):
                c = self.results.setdefault(rid, Collected())
                c.after_finish += c.finish is not None
                c.ids.extend(msg.new_token_ids[i])
                c.finish = msg.finished_reasons[i]
                c.cached_tokens = msg.meta[i][2]
                if msg.output_token_logprobs[i] is not None:
                    c.output_logprobs.extend(msg.output_token_logprobs[i])
                if msg.output_top_logprobs[i] is not None:
                    c.output_top_logprobs.extend(msg.output_top_logprobs[i])
                if msg.input_token_logprobs[i] is not None:
                    c.input_logprobs = msg.input_token_logprobs[i]
                if msg.embeddings and msg.embeddings[i] is not None:
                    c.embedding = msg.embeddings[i]
        self.scheduler.outbox.clear()
