"""NGRAM speculation (SGLang's --speculative-algorithm NGRAM): drafts from each request's own tokens
(ngram_index.py), and with --speculative-ngram-capacity from recently finished requests' text where its own
hold no match (SharedNgrams), verified by the target model in one extend per step; no draft model.
When a step verifies and what its result does: verify_strategy.py.

--speculative-ngram-max-bfs-breadth b > 1 drafts trees of up to b continuations (NgramTreeIndex;
both attention backends mask them, any TP size runs them; a hybrid model's recurrent state runs
through them in waves by depth, layers/gated_delta_net.py GatedDeltaCore._tree_waves)."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from baton.engine.speculative.base import SpecView
from baton.engine.speculative.ngram_index import NgramIndex, NgramTreeIndex, SharedNgrams
from baton.engine.speculative.verify_strategy import VerifyingSpeculator

if TYPE_CHECKING:
    from baton.engine.core.req import Req
    from baton.engine.core.schedule_batch import ScheduleBatch

logger = logging.getLogger(__name__)


class NgramSpeculator(VerifyingSpeculator):
    algorithm = "NGRAM"

    def __init__(self, view: SpecView) -> None:
        super().__init__(view)
        args = view.config
        self.min_window = args.speculative_ngram_min_match_window_size
        self.max_window = args.speculative_ngram_max_match_window_size
        self.breadth = args.speculative_ngram_max_bfs_breadth
        # other requests' text to draft from (--speculative-ngram-capacity); None: each request's own
        self.shared = SharedNgrams(args.speculative_ngram_capacity) if args.speculative_ngram_capacity else None
        logger.info("speculative decoding: NGRAM, %d tokens per verify, match window %d..%d, %s, while fewer than "
                    "%d requests run%s", self.num_draft_tokens, self.min_window, self.max_window,
                    "chains" if self.breadth == 1 else f"trees of up to {self.breadth} continuations",
                    self.disable_by_batch_size, "" if self.shared is None else
                    f"; drafts from up to {self.shared.capacity} tokens of recent requests too")

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

    def draft_tree(self, req: "Req") -> tuple[list[int], Optional[list[int]]]:
        """The request's draft: as deep as its acceptance so far suggests (NgramIndex.draft_len) and
        its room allows; a tree of at most num_draft_tokens - 1 nodes with a breadth over 1."""
        index = req.spec_index
        if index is None:
            max_draft = self.num_draft_tokens - 1
            index = req.spec_index = (NgramIndex(self.min_window, self.max_window, max_draft) if self.breadth == 1
                                      else NgramTreeIndex(self.min_window, self.max_window, max_draft, self.breadth))
        columns = self.room(req)  # each node takes a KV column after the last token: no more than the row has left
        room = min(index.draft_len, columns)
        if room <= 0:
            return [], None
        self._catch_up(req, index)
        draft, parents = (index.propose(room), None) if self.breadth == 1 else \
            index.propose_tree(min(self.num_draft_tokens - 1, columns), room)
        if not draft and self.shared is not None:  # nothing in its own tokens: other requests' text
            draft = self.shared.propose(index.tokens, room, self.min_window, self.max_window)
        index.on_lookup(bool(draft))
        return draft, parents

    @staticmethod
    def _catch_up(req: "Req", index: NgramIndex) -> None:
        """Index what the request's prompt and output gained since its last lookup."""
        prompt, seen = req.origin_input_ids, len(index)
        if seen < len(prompt):
            index.extend(prompt[seen:])
            seen = len(prompt)
        index.extend(req.output_ids[seen - len(prompt):])

    def on_finished(self, req: "Req") -> None:
        """A request that drafted lends its text to the others (--speculative-ngram-capacity)."""
        if self.shared is not None and req.spec_index is not None:
            self._catch_up(req, req.spec_index)
            self.shared.add(req.spec_index)

    def on_verified(self, req: "Req", drafted: int, accepted: int) -> None:
        req.spec_index.on_verified(drafted, accepted)

    def server_info(self) -> dict:
        info = {**super().server_info(), "speculative_ngram_max_bfs_breadth": self.breadth}
        if self.shared is not None:
            info.update(spec_ngram_shared_tokens=self.shared.tokens, spec_ngram_shared_drafts=self.shared.hits)
        return info
