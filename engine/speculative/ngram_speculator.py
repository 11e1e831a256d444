"""NGRAM speculation (SGLang's --speculative-algorithm NGRAM): drafts from each request's own tokens
(ngram.py), verified by the target model in one extend per step; no draft model. When a step verifies
and what its result does: verifying.py."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from baton.engine.speculative.base import SpecView
from baton.engine.speculative.ngram import NgramIndex
from baton.engine.speculative.verifying import VerifyingSpeculator

if TYPE_CHECKING:
    from baton.engine.scheduler.req import Req
    from baton.engine.scheduler.schedule_batch import ScheduleBatch

logger = logging.getLogger(__name__)


class NgramSpeculator(VerifyingSpeculator):
    algorithm = "NGRAM"

    def __init__(self, view: SpecView) -> None:
        super().__init__(view)
        args = view.server_args
        self.min_window = args.speculative_ngram_min_match_window_size
        self.max_window = args.speculative_ngram_max_match_window_size
        logger.info("speculative decoding: NGRAM, %d tokens per verify, match window %d..%d, while fewer than %d "
                    "requests run", self.num_draft_tokens, self.min_window, self.max_window,
                    self.disable_by_batch_size)

    def wants_verify(self, batch: "ScheduleBatch") -> bool:
        """Once per decode step: an eligible batch with a request due to look for a draft (a request
        whose lookups found nothing waits some steps: NgramIndex.on_lookup; this counts them down)."""
        if not self.eligible(batch):
            return False
        due = False
        for req in batch.reqs:
            index = req.spec_index
            if index is None or index.backoff == 0:
                due = True
            else:
                index.backoff -= 1
        return due

    def draft(self, req: "Req") -> list[int]:
        """The request's draft: as far as its acceptance so far suggests (NgramIndex.draft_len) and
        its room allows."""
        index = req.spec_index
        if index is None:
            index = req.spec_index = NgramIndex(self.min_window, self.max_window, self.num_draft_tokens - 1)
        room = min(index.draft_len, self.room(req))
        if room <= 0:
            return []
        prompt, seen = req.origin_input_ids, len(index)
        if seen < len(prompt):
            index.extend(prompt[seen:])
            seen = len(prompt)
        index.extend(req.output_ids[seen - len(prompt):])
        draft = index.propose(room)
        index.on_lookup(bool(draft))
        return draft

    def on_verified(self, req: "Req", drafted: int, accepted: int) -> None:
        req.spec_index.on_verified(drafted, accepted)
