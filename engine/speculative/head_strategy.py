"""Speculation with a draft head (SGLang's --speculative-algorithm NEXTN, EAGLE, EAGLE3): a small model
beside the target drafts --speculative-num-steps tokens per request and step from the target's hidden
states: NEXTN the checkpoint's own multi-token-prediction head (models/qwen3_next.py MtpHead), EAGLE /
EAGLE3 a draft checkpoint (--speculative-draft-model-path, models/eagle.py). The drafting runs in the
worker, next to the target's passes (head_worker.py); the scheduler's half only reserves each verify
step's slots, as NGRAM's does (verify_strategy.py), with placeholder drafts the worker overwrites before the
verify pass runs.

--speculative-eagle-topk k > 1 drafts a tree grown best-first by the head's scores, as SGLang's EAGLE
(head_worker.py): k candidates per step, the --speculative-num-draft-tokens - 1 best of them. The
scheduler reserves its slots before the head has run: the node count (spec_info.tree_size) and a
placeholder shape, whose parents and positions the drafter replaces.
A hybrid model's trees run its recurrent state in waves by depth, each node from its parent's state
(layers/gated_delta_net.py GatedDeltaCore._tree_waves). A request drafts a chain where the tree cannot
serve: a PD-transferred request's first step where its prefill ran with a smaller topk (the metadata
slot carries the prefill head's candidates).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from baton.engine.core.spec_info import VerifyInput, placeholder_tree, tree_size
from baton.engine.speculative.base import SpecView
from baton.engine.speculative.verify_strategy import VerifyingSpeculator

if TYPE_CHECKING:
    from baton.engine.core.req import Req
    from baton.engine.core.schedule_batch import ScheduleBatch

logger = logging.getLogger(__name__)

_WHAT = {"NEXTN": "the checkpoint's MTP head", "EAGLE": "an EAGLE draft head", "EAGLE3": "an EAGLE-3 draft head"}


class HeadSpeculator(VerifyingSpeculator):
    def __init__(self, view: SpecView) -> None:
        super().__init__(view)
        self.algorithm = view.config.speculative_algorithm
        self.num_steps = view.config.speculative_num_steps
        self.topk = view.config.speculative_eagle_topk
        logger.info("speculative decoding: %s (%s), %s of %d drafts, while fewer than %d requests run",
                    self.algorithm, _WHAT[self.algorithm], "chains" if self.topk == 1 else
                    f"best-first trees ({self.topk} candidates per step, {self.num_draft_tokens - 1} nodes)",
                    self.num_steps, self.disable_by_batch_size)

    def allow_lagging(self, overlap: bool) -> None:
        """The drafts are the worker's, so a verify step can be built before the one running ends
        (verify_strategy.py). With TP the driver resolves the step and sends it resolved; the followers'
        future maps get each verify step's last tokens. A hybrid model's scratch states come in two
        sets for it (ServerArgs.may_lag_verify_steps), and with TP every rank rolls its rows back by
        the state copies the resolved step carries."""
        self.lags = overlap and (self.view.state_scratch is None or self.view.state_scratch_sets == 2)

    def prepare_verify(self, batch: "ScheduleBatch", lagged: bool = False) -> bool:
        self._primes: list = []  # per request of the batch, in order: the prime its first step puts in its row
        return super().prepare_verify(batch, lagged)

    def draft_tree(self, req: "Req") -> tuple[list[int], Optional[list[int]]]:
        """Placeholders for as many drafts as the request may take (num_steps deep, and with topk > 1 a
        tree's nodes): the worker's drafter writes the head's tokens (and a tree's shape). None for a request the head
        has not run for on this engine (a PD decode's transferred request whose prefill sent no first
        draft: the prefill computed the head's KV over the prompt, not the drafter's row): this step, a
        plain row of the verify (or a plain step), runs the head for it. A transferred request whose
        prefill sent its head's first-draft candidates and output drafts at once: the worker puts them
        in its row first (a step already run for it has filled the row instead); a chain where the
        prefill sent fewer candidates than this engine's topk."""
        prime, req.spec_prime = req.spec_prime, None
        primed = prime if prime is not None and len(req.output_ids) == 1 else None
        self._primes.append(primed)
        if not req.spec_primed:
            req.spec_primed = True
            return [], None
        room = self.room(req)
        depth = min(self.num_steps, room)
        if depth <= 0:
            return [], None
        if self.topk == 1 or (primed is not None and len(primed[0]) < self.topk):
            return [0] * depth, None
        # each node takes a KV column after the last token: no more of them than the row has left
        nodes, depth = tree_size(depth, self.topk, min(self.num_draft_tokens - 1, room))
        return [0] * nodes, (placeholder_tree(depth, nodes) if nodes > 1 else None)

    def verify_input(self, drafts: list[list[int]], state_slots: Optional[list[list[int]]],
                     parents: Optional[list[Optional[list[int]]]]) -> VerifyInput:
        primes = {i: p for i, (p, d) in enumerate(zip(self._primes, drafts)) if p is not None and d}
        return VerifyInput(drafts, state_slots, parents, primes or None)

    def server_info(self) -> dict:
        return {**super().server_info(), "speculative_num_steps": self.num_steps, "speculative_eagle_topk": self.topk}
