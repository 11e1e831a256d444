"""The worker half of speculation with a draft head (NEXTN, EAGLE, EAGLE3; head_speculator.py): the
head's passes beside the target's. The head: NEXTN's MTP head (models/qwen3_next.py MtpHead) or an
EAGLE draft checkpoint's (models/eagle.py), each

    forward(embeds, positions, features, forward_batch) -> out    one pass over a batch's positions
    own_lm_head                                                   False: the target's LM head reads out;
    draft_ids(out)                                                True: the head's (EAGLE3, its own vocabulary)
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

Either leaves, per request row, the head's prediction at the row's last kept position (the first draft
of the next step) and its output (`tokens`, `hidden`). A verify step of a request with k drafts
(position L = its last token's) then runs k - 1 decode passes of the head: step j at position L + j - 2
over (d[j-1], its previous output in place of the target's features), into the verify step's own
slots; the verify pass runs [last, d1 .. dk]. The head's KV those steps wrote is rewritten by the
after-verify pass.

Drafts are greedy (the head's argmax): a deterministic proposal, so verify.py's acceptance rules hold as
for NGRAM. A request whose row holds no prediction of its own yet (a PD decode's transferred request:
the prefill computed the head's KV over the prompt, not this row's buffers) drafts nothing in its first
step (head_speculator.py), whose pass after it fills the row.

The target runs its plain forward (no CUDA graphs or torch.compile with a head yet), or on CPU its
native forward where the head needs only final hidden states (the head's passes then plan their own
attention metadata). With tensor parallelism every rank runs these passes in the driver's order (the
head's layers and LM head are collectives); scheduler/tp_step.py says what the followers are sent.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from baton.engine.model_executor.forward_batch import ForwardMode

if TYPE_CHECKING:
    from baton.engine.model_executor.forward_batch import ForwardBatch
    from baton.engine.model_executor.model_runner import ModelRunner
    from baton.engine.speculative.spec_info import VerifyInput, VerifyOutput


class HeadDrafter:
    def __init__(self, runner: "ModelRunner", num_steps: int) -> None:
        model = runner.model
        assert runner.draft_head is not None, "the model was loaded without a draft head"
        assert runner.cuda_graph_runner is None and runner.compiled_model is None, \
            "a draft head runs beside the model's plain (or native) forward only"
        self.runner, self.head, self.embed = runner, runner.draft_head, model.model.embed_tokens
        self.num_steps = num_steps
        rows, dev = runner.req_to_token_pool.size, runner.device
        self.tokens = torch.zeros(rows, dtype=torch.int64, device=dev)  # each row's first draft
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
        A pass the native forward ran planned no attention metadata: the head's pass plans it."""
        if self.runner.native_forward is not None:
            self.runner.attn_backend.init_forward_metadata(fb)
        return fb.aux_hidden if self.head.aux_layers else hidden

    def _predict(self, out: torch.Tensor) -> torch.Tensor:
        """The head's outputs [m, hidden] -> its greedy tokens [m] (target vocabulary ids)."""
        if self.head.own_lm_head:
            return self.head.draft_ids(out)
        return torch.argmax(self.runner.compute_logits(out), dim=-1)

    def _keep(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        """Each row's prediction and hidden output at its last kept position."""
        self.tokens[rows] = self._predict(out)
        self.hidden[rows] = out
        if out.is_cuda:
            self.done = torch.cuda.Event()
            self.done.record()

    # ------------------------------------------------------------------ PD: the row travels with the KV
    def metadata_bytes(self) -> int:
        """The draft part of a PD metadata slot (disaggregation/base.py MetadataBuffers)."""
        from baton.engine.disaggregation.base import MetadataBuffers

        return MetadataBuffers.draft_bytes_for(self.hidden.shape[1], self.hidden.dtype)

    def row_draft(self, row: int) -> tuple[int, torch.Tensor]:
        """A prefill's request row once its last chunk ran: its first draft and the head's output."""
        if self.done is not None:
            self.done.synchronize()
        return int(self.tokens[row]), self.hidden[row].cpu()

    def prime_from(self, metadata, slot: int) -> Optional[tuple[int, torch.Tensor]]:
        """A decode's transferred request: what its prefill's row_draft sent, if anything."""
        return metadata.get_draft(slot, self.hidden.shape[1], self.hidden.dtype)

    def _prime(self, rows: torch.Tensor, primes: dict[int, tuple[int, torch.Tensor]]) -> None:
        """Put primes (batch index -> first draft, head output) into the batch's rows."""
        idx = torch.tensor(list(primes), dtype=torch.int64, device=rows.device)
        self.tokens[rows[idx]] = torch.tensor([t for t, _ in primes.values()], dtype=torch.int64, device=rows.device)
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
        """Before a verify pass (`fb`, its input ids holding placeholder drafts): each request's chain,
        into spec.drafts and the pass's input ids."""
        runner, lens = self.runner, [len(d) for d in spec.drafts]
        rows, prefix = fb.req_pool_indices, fb.extend_prefix_lens_cpu
        if spec.primes:
            self._prime(rows, spec.primes)
        chain = torch.zeros(len(lens), max(lens), dtype=torch.int64, device=rows.device)
        chain[:, 0] = self.tokens[rows]
        if max(lens) > 1:
            out = self.hidden[rows]
        for j in range(1, max(lens)):  # draft j + 1 from (draft j, the head's output there) at position L + j - 1
            sel = [i for i, n in enumerate(lens) if n > j]
            idx = torch.tensor(sel, dtype=torch.int64, device=rows.device)
            seq_lens = [prefix[i] + j for i in sel]
            step = runner.make_forward_batch(
                ForwardMode.DECODE, input_ids=chain[idx, j - 1], positions=torch.tensor(seq_lens, device=rows.device) - 1,
                req_pool_indices=rows[idx], seq_lens=torch.tensor(seq_lens, device=rows.device),
                out_cache_loc=fb.out_cache_loc[torch.tensor([spec.offsets[i] + j - 1 for i in sel], device=rows.device)],
                seq_lens_cpu=seq_lens)
            runner.attn_backend.init_forward_metadata(step)
            step_out = self._head(step, step.input_ids, out[idx])
            chain[idx, j] = self._predict(step_out)
            out[idx] = step_out
        drafts = chain.tolist()
        for i, n in enumerate(lens):
            spec.drafts[i][:] = drafts[i][:n]
        at = [spec.offsets[i] + 1 + t for i, n in enumerate(lens) for t in range(n)]
        fb.input_ids[torch.tensor(at, dtype=torch.int64, device=rows.device)] = torch.tensor(
            [t for d in spec.drafts for t in d], dtype=torch.int64, device=rows.device)

    @torch.inference_mode()
    def after_verify(self, fb: "ForwardBatch", hidden: torch.Tensor, spec: "VerifyInput", out: "VerifyOutput") -> None:
        """After a verify pass and its acceptance (`out`): the head over the pass's positions, each
        request's row after its last accepted draft taking the target's token."""
        features = self._features(fb, hidden)
        ids = fb.input_ids.roll(-1)  # rows past a request's kept one: any valid id (rejected positions)
        kept = torch.tensor([off + len(t) - 1 for off, t in zip(spec.offsets, out.tokens)], device=ids.device)
        ids[kept] = torch.tensor(out.last_tokens, dtype=torch.int64, device=ids.device)
        self._keep(fb.req_pool_indices, self._head(fb, ids, features)[kept])
