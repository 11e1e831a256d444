"""ScheduleBatch (the scheduler's CPU view of a batch) and ModelWorkerBatch (what the forward needs).

Memory per request follows the ownership table in mem_cache/base.py. Each decode step the input of
request i is its last sampled token, which in overlap mode is still a placeholder (a negative index
into the worker's future map) when the batch is built.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from baton.engine.core.forward_batch import ForwardMode
from baton.engine.core.req import Req
from baton.engine.mem_cache.state_pool import StateOps
from baton.engine.multimodal.inputs import MmBatch, plan_splices
from baton.engine.multimodal.mrope import rope_positions_for

if TYPE_CHECKING:
    from baton.engine.core.lora import LoraStep
    from baton.engine.core.spec_info import VerifyInput
    from baton.engine.mem_cache.allocator import TokenToKVPoolAllocator
    from baton.engine.mem_cache.base import BasePrefixCache
    from baton.engine.mem_cache.memory_pool import ReqToTokenPool

# Tokens of decode headroom each running request is assumed to need after a retraction
# (SGLang's SGLANG_RETRACT_DECODE_STEPS).
RETRACT_DECODE_STEPS = 20


def _token_at(req: Req, position: int) -> int:
    """The request's token at `position` of its prompt and output so far, -1 past them."""
    prompt = req.origin_input_ids
    if position < len(prompt):
        return prompt[position]
    position -= len(prompt)
    return req.output_ids[position] if position < len(req.output_ids) else -1


def _mm_batch(reqs: list[Req], prefix_lens: list[int], seq_lens: list[int]) -> Optional[MmBatch]:
    """An extend's image work: None when no request in it has images."""
    if all(r.mm_inputs is None for r in reqs):
        return None
    splices, rows, offset = [], [], 0
    for r, p, s in zip(reqs, prefix_lens, seq_lens):
        mm = r.mm_inputs
        if mm is None:
            rows.append(torch.arange(p, s, dtype=torch.int64).expand(3, -1))
        else:
            splices += plan_splices(mm.items, p, s, offset)
            rows.append(rope_positions_for(p, s, mm.mrope_positions, mm.mrope_delta))
        offset += s - p
    return MmBatch(splices, torch.cat(rows, dim=1))


class OutOfMemoryError(RuntimeError):
    """The KV pool cannot hold what the admission budget promised; a scheduler bug."""


@dataclass
class ModelWorkerBatch:
    forward_mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens] int64; may hold negative future placeholders
    positions: torch.Tensor  # [num_tokens] int64
    req_pool_indices: torch.Tensor  # [bs] int64
    seq_lens_cpu: list[int]
    out_cache_loc: torch.Tensor  # [num_tokens] int64
    extend_prefix_lens_cpu: Optional[list[int]]
    extend_seq_lens_cpu: Optional[list[int]]
    sampling_states: list  # [bs] ReqSamplingState, or None for a row that must not sample
    return_logprob: bool
    top_logprobs_nums: list[int]
    # EXTEND rows whose input logprobs are wanted:
    # (batch index, first prompt position to score, prompt length, prompt token after this chunk or -1)
    input_logprob_reqs: list[tuple[int, int, int, int]]
    # filled by the overlap worker client: where this batch's sampled tokens go in the future map
    future_indices: Optional[torch.Tensor] = None
    # --enable-mixed-chunk: the batch's last rows are one decode step of running requests, each an
    # extend of one token over its whole sequence
    num_decode_rows: int = 0
    # each row's draw number for the CPU sampler, taken when the batch is launched
    # (TpModelWorker.assign_draws): the same whichever path samples it, in either loop
    draws: Optional[list[int]] = None
    # hybrid models: recurrent-state copies and checkpoints this pass makes (mem_cache/state_pool.py)
    state_ops: Optional[StateOps] = None
    # a verify step of speculative decoding (core/spec_info.py VerifyInput): each row extends
    # over its last token and its draft; the worker checks the drafts instead of sampling once
    spec_info: Optional["VerifyInput"] = None
    # EXTEND: per row, the token after its chunk where the request's tokens go on (a chunk that is not
    # the prompt's last), else -1 (the sampled token follows); a draft head reads it (head_worker.py)
    next_prompt_ids: Optional[list[int]] = None
    # EXTEND with images: where their embeddings go, and the batch's M-RoPE positions (multimodal/inputs.py)
    mm: Optional[MmBatch] = None
    # multi-LoRA serving: each row's adapter slot and the pool's loads (core/lora.py), set by the scheduler
    # as it launches the batch (scheduler/lora.py); None without --enable-lora
    lora: Optional["LoraStep"] = None


class ScheduleBatch:
    def __init__(self, reqs: list[Req], req_to_token_pool: "ReqToTokenPool",
                 allocator: "TokenToKVPoolAllocator", tree_cache: "BasePrefixCache", device: str) -> None:
        self.reqs = reqs
        self.req_to_token_pool, self.allocator, self.tree_cache = req_to_token_pool, allocator, tree_cache
        self.device = device
        self.forward_mode = ForwardMode.IDLE
        # [bs] int64: each request's next decode input (real token id or future placeholder);
        # set by whoever processed or launched the previous pass of these requests.
        self.output_ids: Optional[torch.Tensor] = None
        self.batch_is_full = False
        self.model_worker_batch: Optional[ModelWorkerBatch] = None

    def is_empty(self) -> bool:
        return not self.reqs

    def __len__(self) -> int:
        return len(self.reqs)

    # ------------------------------------------------------------------ memory
    def _alloc(self, fn, *args) -> torch.Tensor:
        out = fn(*args)
        if out is None:
            need = self._tokens_needed_hint
            self.tree_cache.evict(need)
            out = fn(*args)
        if out is None:
            raise OutOfMemoryError(f"KV pool exhausted (needed ~{self._tokens_needed_hint} tokens, "
                                   f"free {self.allocator.available_size()})")
        return out

    def _last_locs(self, rows: list[int], lens: list[int]) -> list[int]:
        """The slot of each request's last token, -1 for an empty one (one gather: indexing the table
        per request cost ~0.3 ms a decode step at batch 32)."""
        if self.allocator.page_size == 1 or not rows:
            return [-1] * len(rows)  # a page of one token never continues: the allocator ignores them
        table = self.req_to_token_pool.req_to_token
        lens_t = torch.tensor(lens, dtype=torch.int64)
        locs = table[torch.tensor(rows, dtype=torch.int64).to(table.device),
                     (lens_t - 1).clamp(min=0).to(table.device)].cpu()
        return torch.where(lens_t > 0, locs, -1).tolist()

    def _write_table(self, rows: list[int], starts: list[int], lens: list[int], slots: torch.Tensor) -> None:
        """req_to_token[rows[i], starts[i]:starts[i] + lens[i]] = the next lens[i] of `slots` (CPU).
        On CPU, a slice per request; on a GPU table, one scatter: a slice assignment per request
        would be a blocking host-to-device copy each."""
        table = self.req_to_token_pool.req_to_token
        if not table.is_cuda:
            offset = 0
            for row, start, n in zip(rows, starts, lens):
                table[row, start:start + n] = slots[offset:offset + n]
                offset += n
            return
        total = int(slots.numel())
        lens_t = torch.tensor(lens, dtype=torch.int64)
        req = torch.repeat_interleave(torch.arange(len(rows)), lens_t, output_size=total)
        first = torch.cumsum(lens_t, 0) - lens_t  # where each request's slots begin in `slots`
        cols = torch.tensor(starts, dtype=torch.int64)[req] + torch.arange(total) - first[req]
        index = torch.stack([torch.tensor(rows, dtype=torch.int64)[req], cols, slots]).to(table.device)
        table[index[0], index[1]] = index[2]

    def _alloc_extend_rows(self, rows: list[int], prefix_lens: list[int], seq_lens: list[int],
                           extend_lens: list[int]) -> torch.Tensor:
        """KV slots for each request's positions prefix_lens[i] .. seq_lens[i], written into its row and
        counted as computed (an extend, or a verify step). Returns them, packed."""
        self._tokens_needed_hint = sum(extend_lens) + len(self.reqs) * self.allocator.page_size
        out_cache_loc = self._alloc(self.allocator.alloc_extend, prefix_lens, seq_lens, self._last_locs(rows, prefix_lens))
        self._write_table(rows, prefix_lens, extend_lens, out_cache_loc)
        for req, s in zip(self.reqs, seq_lens):
            req.kv_committed_len = req.kv_allocated_len = s
        return out_cache_loc

    # ------------------------------------------------------------------ extend
    def prepare_for_extend(self, chunked_req: Optional[Req] = None) -> None:
        """`chunked_req`: the request whose chunk in this batch is not its last (it must not sample)."""
        self.forward_mode = ForwardMode.EXTEND
        new = [r for r in self.reqs if r.req_pool_idx is None]
        if new:
            rows = self.req_to_token_pool.alloc(len(new))
            if rows is None:
                raise OutOfMemoryError("no free request rows")
            table = self.req_to_token_pool.req_to_token
            for req, row in zip(new, rows):
                req.req_pool_idx = row
                n = len(req.prefix_indices)
                if n:
                    table[row, :n] = req.prefix_indices
                req.kv_committed_len = req.kv_allocated_len = n
        rows = [r.req_pool_idx for r in self.reqs]
        prefix_lens = [r.kv_committed_len for r in self.reqs]
        seq_lens = [len(r.fill_ids) for r in self.reqs]
        extend_lens = [s - p for s, p in zip(seq_lens, prefix_lens)]
        assert all(e > 0 for e in extend_lens), "an extend must compute at least one token"
        out_cache_loc = self._alloc_extend_rows(rows, prefix_lens, seq_lens, extend_lens)
        state_ops = self._extend_state_ops(new, prefix_lens, seq_lens, chunked_req)
        input_ids = [t for r, p in zip(self.reqs, prefix_lens) for t in r.fill_ids[p:]]
        # a request with images runs on its M-RoPE positions (mm below); these are its indices
        positions = torch.cat([torch.arange(p, s, dtype=torch.int64) for p, s in zip(prefix_lens, seq_lens)])
        self.model_worker_batch = ModelWorkerBatch(
            forward_mode=ForwardMode.EXTEND,
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=positions,
            req_pool_indices=torch.tensor(rows, dtype=torch.int64),
            seq_lens_cpu=seq_lens,
            out_cache_loc=out_cache_loc,
            extend_prefix_lens_cpu=prefix_lens,
            extend_seq_lens_cpu=extend_lens,
            sampling_states=[None if r is chunked_req else r.sampling_state for r in self.reqs],
            return_logprob=any(r.return_logprob for r in self.reqs),
            top_logprobs_nums=[r.top_logprobs_num for r in self.reqs],
            input_logprob_reqs=[(i, r.logprob_start_len, len(r.origin_input_ids),
                                 r.origin_input_ids[s] if s < len(r.origin_input_ids) else -1)
                                for i, (r, s) in enumerate(zip(self.reqs, seq_lens))
                                if r.return_logprob and r.logprob_start_len >= 0 and not r.input_logprobs_sent],
            state_ops=state_ops,
            next_prompt_ids=[_token_at(r, s) for r, s in zip(self.reqs, seq_lens)],
            mm=_mm_batch(self.reqs, prefix_lens, seq_lens),
        )

    def _extend_state_ops(self, new: list[Req], prefix_lens: list[int], seq_lens: list[int],
                          chunked_req: Optional[Req]) -> Optional[StateOps]:
        """A hybrid model's state work in this extend (hybrid_radix_cache.py): the new requests that
        hit a cached prefix start from its checkpoint (queued first: nothing may take that slot
        before), then every request's tracked positions."""
        cache = self.tree_cache
        if not cache.tracks_state:
            return cache.take_state_ops()  # a speculative step's rollback, if any (hybrid models)
        for req in new:
            if len(req.prefix_indices):
                cache.restore_state(req)
        tracks = {}
        for i, (req, p, s) in enumerate(zip(self.reqs, prefix_lens, seq_lens)):
            planned = cache.plan_extend_tracks(req, p, s, more_chunks=req is chunked_req)
            if planned:
                tracks[i] = planned
        return cache.take_state_ops(tracks)

    # ------------------------------------------------------------------ decode
    def new_page_tokens_needed(self) -> int:
        """KV slots the next decode step may take from the free pool."""
        page = self.allocator.page_size
        if page == 1:
            return len(self.reqs)
        return sum(page for r in self.reqs if r.kv_committed_len % page == 0)

    def check_decode_mem(self) -> bool:
        need = self.new_page_tokens_needed()
        free = self.allocator.available_size()
        if free >= need:
            return True
        self.tree_cache.evict(need - free)
        return self.allocator.available_size() >= need

    def prepare_for_decode(self) -> None:
        assert self.output_ids is not None and self.output_ids.shape[0] == len(self.reqs)
        self.forward_mode = ForwardMode.DECODE
        rows = [r.req_pool_idx for r in self.reqs]
        prefix_lens = [r.kv_committed_len for r in self.reqs]
        seq_lens = [n + 1 for n in prefix_lens]
        self._tokens_needed_hint = self.new_page_tokens_needed()
        out_cache_loc = self._alloc(self.allocator.alloc_decode, seq_lens, self._last_locs(rows, prefix_lens))
        rows_t = torch.tensor(rows, dtype=torch.int64)
        cols = torch.tensor(prefix_lens, dtype=torch.int64)
        table = self.req_to_token_pool.req_to_token  # .to() is a no-op on a CPU table
        table[rows_t.to(table.device), cols.to(table.device)] = out_cache_loc.to(table.device)
        positions = torch.tensor([p + r.rope_delta for r, p in zip(self.reqs, prefix_lens)], dtype=torch.int64)
        tracks = {}
        if self.tree_cache.tracks_state:
            tracks = {i: t for i, r in enumerate(self.reqs)
                      if (t := self.tree_cache.plan_decode_track(r, r.kv_committed_len + 1))}
        state_ops = self.tree_cache.take_state_ops(tracks)
        for req in self.reqs:
            req.kv_committed_len += 1
            req.kv_allocated_len += 1
        self.model_worker_batch = ModelWorkerBatch(
            forward_mode=ForwardMode.DECODE,
            input_ids=self.output_ids,
            positions=positions,
            req_pool_indices=rows_t,
            seq_lens_cpu=seq_lens,
            out_cache_loc=out_cache_loc,
            extend_prefix_lens_cpu=None,
            extend_seq_lens_cpu=None,
            sampling_states=[r.sampling_state for r in self.reqs],
            return_logprob=any(r.return_logprob for r in self.reqs),
            top_logprobs_nums=[r.top_logprobs_num for r in self.reqs],
            input_logprob_reqs=[],
            state_ops=state_ops,
        )

    def prepare_for_verify(self, spec: "VerifyInput", starts: Optional[list[int]] = None,
                           reserve_to: Optional[list[int]] = None) -> None:
        """A decode step that verifies drafts (speculative/): request i runs as an extend of
        [its last token, *spec.drafts[i]] over the KV it holds (a tree's nodes at their depths'
        positions: spec_info.py). KV slots are allocated for all of them and counted as committed; the
        speculator cuts each request back to what it accepted once the result is known
        (VerifyingSpeculator.keep_kv). For the scheduler it stays a decode step.

        A lagged step (spec.lagged: built while the verify step before it runs) gives, per request,
        where its row starts as far as the scheduler knows (`starts`: the running step's start) and how
        far its row's KV is reserved (`reserve_to`: past the most both steps can reach). Its last token
        is that step's future-map placeholder; the worker moves each lagged row on by what that step
        emitted (TpModelWorker._resolve_lagged)."""
        self.forward_mode = ForwardMode.DECODE
        rows = [r.req_pool_idx for r in self.reqs]
        extend_lens = [1 + len(d) for d in spec.drafts]
        if spec.lagged is None:
            prefix_lens = [r.kv_committed_len for r in self.reqs]
            assert all(len(r.origin_input_ids) + len(r.output_ids) == p + 1 for r, p in zip(self.reqs, prefix_lens)), \
                "a verify step starts from every request's last token (the overlap loop's results processed)"
            seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
            out_cache_loc = self._alloc_extend_rows(rows, prefix_lens, seq_lens, extend_lens)
            lasts = [r.output_ids[-1] for r in self.reqs]
        else:
            prefix_lens = starts
            seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
            held = [r.kv_allocated_len for r in self.reqs]
            self._alloc_extend_rows(rows, held, reserve_to, [t - h for h, t in zip(held, reserve_to)])
            # the worker reads the slots from the table once it knows where each row starts
            out_cache_loc = torch.zeros(sum(extend_lens), dtype=torch.int64, device=self.allocator.device)
            lasts = [r.output_ids[-1] if s == 0 else -s for r, s in zip(self.reqs, spec.lagged)]
        input_ids = [t for last, d in zip(lasts, spec.drafts) for t in (last, *d)]
        tracks = {} if spec.state_slots is None else \
            {i: [(j + 1, slot) for j, slot in enumerate(slots)] for i, slots in enumerate(spec.state_slots) if slots}
        self.model_worker_batch = ModelWorkerBatch(
            forward_mode=ForwardMode.EXTEND,
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=(torch.cat([torch.arange(p, s, dtype=torch.int64) + r.rope_delta
                                  for r, p, s in zip(self.reqs, prefix_lens, seq_lens)])
                       if spec.parents is None else
                       torch.tensor([q + r.rope_delta for i, (r, p) in enumerate(zip(self.reqs, prefix_lens))
                                     for q in spec.positions(i, p)])),
            req_pool_indices=torch.tensor(rows, dtype=torch.int64),
            seq_lens_cpu=seq_lens,
            out_cache_loc=out_cache_loc,
            extend_prefix_lens_cpu=prefix_lens,
            extend_seq_lens_cpu=extend_lens,
            sampling_states=[r.sampling_state for r in self.reqs],
            return_logprob=any(r.return_logprob for r in self.reqs),
            top_logprobs_nums=[r.top_logprobs_num for r in self.reqs],
            input_logprob_reqs=[],
            state_ops=self.tree_cache.take_state_ops(tracks),
            spec_info=spec,
        )

    def mix_with_running(self, running: "ScheduleBatch") -> None:
        """--enable-mixed-chunk: this extend batch also runs `running`'s next decode step; its
        requests move here (behind the prefills), and `running` is left empty. The caller checked
        that the decode step fits (running.check_decode_mem()). After the forward the batch merges
        back into the running batch, as any prefill batch does."""
        assert self.forward_mode.is_extend() and not running.is_empty()
        running.prepare_for_decode()
        a, b = self.model_worker_batch, running.model_worker_batch
        self.model_worker_batch = ModelWorkerBatch(
            forward_mode=ForwardMode.EXTEND,
            input_ids=torch.cat([a.input_ids, b.input_ids.to(a.input_ids.device)]),
            positions=torch.cat([a.positions, b.positions]),
            req_pool_indices=torch.cat([a.req_pool_indices, b.req_pool_indices]),
            seq_lens_cpu=a.seq_lens_cpu + b.seq_lens_cpu,
            out_cache_loc=torch.cat([a.out_cache_loc, b.out_cache_loc.to(a.out_cache_loc.device)]),
            extend_prefix_lens_cpu=a.extend_prefix_lens_cpu + [s - 1 for s in b.seq_lens_cpu],
            extend_seq_lens_cpu=a.extend_seq_lens_cpu + [1] * len(b.seq_lens_cpu),
            sampling_states=a.sampling_states + b.sampling_states,
            return_logprob=a.return_logprob or b.return_logprob,
            top_logprobs_nums=a.top_logprobs_nums + b.top_logprobs_nums,
            input_logprob_reqs=a.input_logprob_reqs,  # rows of the prefills, which come first
            num_decode_rows=len(running.reqs),
            state_ops=(a.state_ops or StateOps()).merged(b.state_ops, len(a.seq_lens_cpu)) or None,
            next_prompt_ids=(a.next_prompt_ids or [-1] * len(a.seq_lens_cpu)) + [-1] * len(b.seq_lens_cpu),
            mm=None if a.mm is None else MmBatch(a.mm.splices, torch.cat([a.mm.mrope_positions,
                                                                         b.positions.expand(3, -1)], dim=1)),
        )
        self.reqs = self.reqs + running.reqs
        running.reqs, running.output_ids = [], None

    def retract_decode(self, release, may_empty: bool = False) -> tuple[list[Req], float]:
        """Take requests out until the next decode step fits. `release(req)` gives a request's memory
        back (its computed KV goes to the prefix cache, so a later re-prefill hits it).
        `may_empty`: memory is also held outside this batch (a chunked prefill, PD transfers whose KV
        is still coming), so even the last request may have to yield; otherwise one request always
        fits (admission caps max_new_tokens to the pool) and not fitting is a bug.
        Returns the retracted requests and the recalibrated new_token_ratio."""
        order = sorted(range(len(self.reqs)),
                       key=lambda i: (len(self.reqs[i].output_ids), -len(self.reqs[i].origin_input_ids)),
                       reverse=True)
        retracted: list[Req] = []
        while not self.check_decode_mem():
            if not order:
                break
            assert may_empty or len(order) > 1, "a single request does not fit in the KV pool"
            req = self.reqs[order.pop()]
            release(req)
            req.reset_for_retract()
            retracted.append(req)
        gone = set(map(id, retracted))
        self.filter_batch(keep=[i for i, r in enumerate(self.reqs) if id(r) not in gone])
        decoded = sum(len(r.output_ids) for r in self.reqs)
        budget = sum(r.sampling_params.max_new_tokens for r in self.reqs)
        ratio = (decoded + RETRACT_DECODE_STEPS * len(self.reqs)) / max(budget, 1)
        return retracted, min(1.0, ratio)

    # ------------------------------------------------------------------ membership
    def filter_batch(self, keep: Optional[list[int]] = None, exclude: Optional[Req] = None) -> None:
        if keep is None:
            keep = [i for i, r in enumerate(self.reqs) if not r.finished() and r is not exclude]
        if len(keep) == len(self.reqs):
            return
        self.reqs = [self.reqs[i] for i in keep]
        if self.output_ids is not None:
            self.output_ids = self.output_ids[torch.tensor(keep, dtype=torch.int64)]

    def merge_batch(self, other: "ScheduleBatch") -> None:
        assert other.output_ids is not None or not other.reqs
        if not other.reqs:
            return
        if not self.reqs:
            self.reqs, self.output_ids = list(other.reqs), other.output_ids
            return
        self.reqs = self.reqs + other.reqs
        self.output_ids = torch.cat([self.output_ids, other.output_ids])
