"""Speculation with a draft head (SGLang's --speculative-algorithm NEXTN, EAGLE, EAGLE3): a small model
beside the target drafts a chain of --speculative-num-steps tokens per request and step from the
target's hidden states: NEXTN the checkpoint's own multi-token-prediction head (models/qwen3_next.py
MtpHead), EAGLE / EAGLE3 a draft checkpoint (--speculative-draft-model-path, models/eagle.py). The
drafting runs in the worker, next to the target's passes (head_drafter.py); the scheduler's half only
reserves each verify step's slots, as NGRAM's does (verifying.py), with placeholder drafts the worker
overwrites before the verify pass runs.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from baton.engine.speculative.base import SpecView
from baton.engine.speculative.spec_info import VerifyInput
from baton.engine.speculative.verifying import VerifyingSpeculator

if TYPE_CHECKING:
    from baton.engine.scheduler.req import Req
    from baton.engine.scheduler.schedule_batch import ScheduleBatch

logger = logging.getLogger(__name__)

_WHAT = {"NEXTN": "the checkpoint's MTP head", "EAGLE": "an EAGLE draft head", "EAGLE3": "an EAGLE-3 draft head"}


class HeadSpeculator(VerifyingSpeculator):
    def __init__(self, view: SpecView) -> None:
        super().__init__(view)
        self.algorithm = view.server_args.speculative_algorithm
        self.num_steps = view.server_args.speculative_num_steps
        logger.info("speculative decoding: %s (%s), chains of %d drafts, while fewer than %d requests run",
                    self.algorithm, _WHAT[self.algorithm], self.num_steps, self.disable_by_batch_size)

    def prepare_verify(self, batch: "ScheduleBatch") -> bool:
        self._primes: list = []  # per request of the batch, in order: the prime its first step puts in its row
        return super().prepare_verify(batch)

    def draft(self, req: "Req") -> list[int]:
        """As many placeholders as the request may take: the worker's drafter writes the head's tokens.
        None for a request the head has not run for on this engine (a PD decode's transferred request
        whose prefill sent no first draft: the prefill computed the head's KV over the prompt, not the
        drafter's row): this step, a plain row of the verify (or a plain step), runs the head for it.
        A transferred request whose prefill sent its head's first draft and output drafts at once: the
        worker puts them in its row first (a step already run for it has filled the row instead)."""
        prime, req.spec_prime = req.spec_prime, None
        self._primes.append(prime if prime is not None and len(req.output_ids) == 1 else None)
        if not req.spec_primed:
            req.spec_primed = True
            return []
        return [0] * max(0, self.room(req))

    def verify_input(self, drafts: list[list[int]], state_slots: Optional[list[list[int]]],
                     parents: Optional[list[Optional[list[int]]]]) -> VerifyInput:
        primes = {i: p for i, (p, d) in enumerate(zip(self._primes, drafts)) if p is not None and d}
        return VerifyInput(drafts, state_slots, parents, primes or None)

    def server_info(self) -> dict:
        return {**super().server_info(), "speculative_num_steps": self.num_steps, "speculative_eagle_topk": 1}
