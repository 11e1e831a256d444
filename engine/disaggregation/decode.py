"""The decode engine's side of PD disaggregation (--disaggregation-mode decode).

    arrive -> prealloc queue -> transfer queue -> prebuilt batch -> running_batch (normal decode)
              (handshake; then   (poll until      (first token from the prefill, no forward:
               reserve a row +    Success|Failed)  the row already holds the prompt's KV)
               the prompt's KV
               slots, send them)

The prompt's longest cached prefix (this engine's radix cache, filled by earlier requests) is
matched and locked first; only the pages after it are reserved and written by the prefill.

Reserved slots belong to the request but hold no computed KV until Success, so a request that
ends before that never gives them to the prefix cache. If its destination was already sent, a
write the prefill issued may still land in them: they sit in quarantine for the backend's
`abort_grace_s` before going back to the allocator. A decode request that is retracted later
re-prefills locally from its tokens like any other.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Optional

import torch

from baton.engine.disaggregation.base import KVMetadata, KVPoll, RoomInUse, TransferConfig, pages_from_slots
from baton.engine.disaggregation.bootstrap_server import DEFAULT_BOOTSTRAP_PORT
from baton.engine.disaggregation.colocated import DisaggregationMode
from baton.engine.disaggregation.disaggregated import Disaggregated, failure_status
from baton.engine.disaggregation.no_peer import NoPeerReceiver, is_no_peer
from baton.engine.io_struct import AbortReq, FinishReason, TokenizedGenerateReqInput

if TYPE_CHECKING:
    from baton.engine.core.req import Req
    from baton.engine.disaggregation.colocated import SchedulerView

logger = logging.getLogger(__name__)


class DecodeDisaggregation(Disaggregated):
    """Prealloc queue, transfer queue and the prebuilt batch of a decode Scheduler."""

    mode = DisaggregationMode.DECODE
    polls_in_background = True

    def __init__(self, view: "SchedulerView", config: Optional[TransferConfig] = None) -> None:
        super().__init__(view, config, view.max_running_requests + 1)
        self.connect()
        self.prealloc_queue: list["Req"] = []  # receiver created; nothing reserved yet
        self.transfer_queue: list["Req"] = []  # row + slots reserved, destination sent
        self.quarantine: list[tuple[float, torch.Tensor]] = []  # (release time, slots) of abandoned transfers

    # ------------------------------------------------------------------ intake
    def admit(self, req: "Req", recv: TokenizedGenerateReqInput) -> Optional[tuple[str, int]]:
        error = self.pd_request_error(req)
        if error is not None:
            return error
        port = req.bootstrap_port if req.bootstrap_port is not None else DEFAULT_BOOTSTRAP_PORT
        try:
            req.kv_transfer = (NoPeerReceiver(req.bootstrap_room) if is_no_peer(req.bootstrap_host)
                               else self.mgr.create_receiver(f"{req.bootstrap_host}:{port}", req.bootstrap_room))
        except RoomInUse as e:
            return str(e), 409
        self.prealloc_queue.append(req)
        return None

    # ------------------------------------------------------------------ per loop iteration
    def step(self) -> None:
        self._release_quarantine()
        self._preallocate()
        self._pop_transferred()

    def _preallocate(self) -> None:
        """In arrival order: reserve memory for handshaken requests while it lasts (no overtaking, so
        a long prompt is not starved by short ones)."""
        keep, blocked = [], False
        for req in self.prealloc_queue:
            status = req.kv_transfer.poll()
            if status == KVPoll.Failed:
                self.stats.bootstrap_failures += 1
                self._end(req, self._reason(req), failure_status(req.kv_transfer))
            elif blocked or status < KVPoll.WaitingForInput or not self._reserve(req):
                blocked |= status >= KVPoll.WaitingForInput
                keep.append(req)
            else:
                s, prefix = self.view, len(req.prefix_indices)
                slots = s.req_to_token_pool.req_to_token[req.req_pool_idx, prefix:len(req.origin_input_ids)]
                state_slot = req.req_pool_idx if s.state_pool is not None else None  # slot == row
                req.kv_transfer.init(pages_from_slots(slots, s.page_size), req.kv_meta_slot, prefix // s.page_size,
                                     state_slot)
                req.kv_transfer_started = time.monotonic()
                self.transfer_queue.append(req)
        self.prealloc_queue = keep

    def _reserve(self, req: "Req") -> bool:
        """A request row, a metadata slot and KV slots for the prompt after its cached prefix, if the
        running requests' expected growth still fits afterwards (the budget PrefillAdder keeps)."""
        s, n = self.view, len(req.origin_input_ids)
        holders = s.queues.running_batch.reqs + self.transfer_queue
        if len(holders) + len(s.queues.waiting) >= s.max_running_requests:
            return False
        # KV only: a hybrid model's state comes from the prefill, never from this engine's checkpoints
        match = s.tree_cache.match_kv_prefix(req.origin_input_ids[:n - 1])  # the prefill sends >= 1 page
        s.tree_cache.inc_lock_ref(match.last_node)  # before evicting: our own prefix must stay
        slots = self._alloc_suffix(req, match.device_indices, holders)
        if slots is None:
            s.tree_cache.dec_lock_ref(match.last_node)
            return False
        rows, meta_slot = self._alloc_row(), self.metadata.alloc()
        if rows is None or meta_slot is None:
            s.tree_cache.dec_lock_ref(match.last_node)
            s.allocator.free(slots)
            if rows is not None:
                s.req_to_token_pool.free(rows[0])
            if meta_slot is not None:
                self.metadata.free(meta_slot)
            return False
        req.prefix_indices, req.last_node, req.cached_tokens = match.device_indices, match.last_node, len(match.device_indices)
        req.req_pool_idx, req.kv_meta_slot = rows[0], meta_slot
        s.req_to_token_pool.req_to_token[req.req_pool_idx, :n] = torch.cat([match.device_indices, slots.to(match.device_indices.device)])
        req.kv_committed_len = req.kv_allocated_len = n
        return True

    def _alloc_row(self) -> Optional[list[int]]:
        """A free request row whose state slot no queued checkpoint copy still reads. A hybrid
        model's radix cache copies a finished request's row into a checkpoint during the next pass
        (hybrid_radix_cache.py); the prefill's state write into the row must not land before it."""
        pool, pending = self.view.req_to_token_pool, self.view.tree_cache.pending_state_sources()
        busy, rows = [], pool.alloc(1)
        while rows is not None and rows[0] in pending:
            busy.append(rows[0])
            rows = pool.alloc(1)
        if busy:
            pool.free(busy)  # after the next pass
        return rows

    def _alloc_suffix(self, req: "Req", prefix_indices: torch.Tensor, holders: list["Req"]) -> Optional[torch.Tensor]:
        s, n, prefix = self.view, len(req.origin_input_ids), len(prefix_indices)
        growth = sum(r.remaining_token_budget() for r in holders + [req]) * s.new_token_ratio()
        need = -(-(n - prefix) // s.page_size) * s.page_size
        if holders and need + growth > s.allocator.available_size() + s.tree_cache.evictable_size():
            return None
        if need > s.allocator.available_size():
            s.tree_cache.evict(need - s.allocator.available_size())
        return s.allocator.alloc_extend([prefix], [n], [int(prefix_indices[-1]) if prefix else -1])

    def _pop_transferred(self) -> None:
        done, keep = [], []
        for req in self.transfer_queue:
            status = req.kv_transfer.poll()
            if status == KVPoll.Success and (refusal := self._version_refusal(req)) is not None:
                req.kv_transfer_started = 0.0  # the transfer has ended: nothing lands in its pages any more
                self._end(req, refusal, 409)
            elif status == KVPoll.Success:
                done.append(req)
                if is_no_peer(req.bootstrap_host):
                    continue  # nothing moved: keep it out of the transfer statistics
                pool = self.view.kv_pool
                # K and V of every layer (and a hybrid's state), on every TP rank (each moves its shard)
                nbytes = (len(req.origin_input_ids) * pool.bytes_per_token * 2 * pool.layer_num
                          + sum(self.mgr.args.state_item_lens)) * self.view.tp.size
                self.stats.transfer_done(nbytes, time.monotonic() - req.kv_transfer_started)
            elif status == KVPoll.Failed:
                self.stats.transfer_failures += 1
                self._end(req, self._reason(req), failure_status(req.kv_transfer))
            else:
                keep.append(req)
        self.transfer_queue = keep
        if done:
            self._merge_prebuilt(done)

    def _version_refusal(self, req: "Req") -> Optional[str]:
        """Why KV prefilled under other weights than this engine's is refused, or None (core/weight_version.py)."""
        if self.weight_version is None or is_no_peer(req.bootstrap_host):
            return None
        refusal = self.weight_version.mismatch(req.kv_transfer.metadata().weight_version_hash)
        if refusal is not None:
            logger.warning("request %s refused: %s", req.rid, refusal)
        return refusal

    def _merge_prebuilt(self, reqs: list["Req"]) -> None:
        """The transferred requests join running_batch with their first token, without a forward."""
        s = self.view
        for req in reqs:
            meta = req.kv_transfer.metadata()
            top = self.metadata.get_top_logprobs(req.kv_meta_slot)  # the slot is zeroed by release()
            prime = None if s.drafter is None else s.drafter.prime_from(self.metadata, req.kv_meta_slot)
            self.release(req)
            req.fill_ids = list(req.origin_input_ids)
            if req.sampling_params.max_new_tokens == 0:  # the prefill only: no token, the KV is cached
                req.finished_reason = FinishReason("length")
                continue
            self._take_first_token(req, meta, top, prime)
        live = [r for r in reqs if not r.finished()]
        for req in reqs:
            if req.finished():
                s.finish_request(req)  # the prompt's KV is real now: it goes to the prefix cache
        if live:
            batch = s.new_batch(live)
            batch.output_ids = torch.tensor([r.output_ids[-1] for r in live], dtype=torch.int64)
            s.queues.running_batch.merge_batch(batch)
        s.stream_output(reqs)

    def _take_first_token(self, req: "Req", meta: KVMetadata, top: list, prime: Any) -> None:
        """The token the prefill sampled, with its logprobs, as if this engine had sampled it."""
        req.rope_delta = meta.rope_delta  # the prompt's images, as the prefill placed them
        req.output_ids.append(meta.output_token_id)
        req.sampling_state.on_sampled(meta.output_token_id)
        req.sampling_state.next_draw()  # the prefill's draw: this side's next is the colocated one's
        if req.grammar is not None:  # the prefill sampled it under the same grammar
            req.accept_grammar_token(meta.output_token_id)
        if req.return_logprob:
            req.output_token_logprobs.append((meta.output_logprob, meta.output_token_id))
            if req.top_logprobs_num > 0:
                req.output_top_logprobs.append(top[:req.top_logprobs_num])
        req.first_token_time = req.first_token_time or time.time()
        # a draft head: its first draft and output where the prefill sent them, else it has not run
        # here for the request yet and its first step drafts nothing
        req.spec_prime, req.spec_primed = prime, prime is not None
        req.check_finished(self.view.tokenizer)
        self.view.count_generated(1)

    # ------------------------------------------------------------------ endings
    def abort(self, recv: AbortReq) -> None:
        for queue in (self.prealloc_queue, self.transfer_queue):
            for req in [r for r in queue if recv.abort_all or r.rid == recv.rid]:
                queue.remove(req)
                self._end(req, recv.message, recv.status_code)

    def _end(self, req: "Req", message: str, status_code: int) -> None:
        """End a request whose KV never arrived: the prefill is told, reserved memory goes back (after
        the abort grace where a write to it may still land)."""
        req.abort(message, status_code)
        transfer = req.kv_transfer
        may_land = transfer is not None and req.kv_transfer_started > 0.0 and not transfer.destination_untouched()
        self.release(req)
        s = self.view
        if req.req_pool_idx is not None:
            own = s.req_to_token_pool.req_to_token[req.req_pool_idx, len(req.prefix_indices):req.kv_allocated_len]
            if may_land and self.mgr.abort_grace_s > 0:
                self.quarantine.append((time.monotonic() + self.mgr.abort_grace_s, own.clone()))
            else:
                s.allocator.free(own)
            s.tree_cache.dec_lock_ref(req.last_node)
            s.req_to_token_pool.free(req.req_pool_idx)
            req.req_pool_idx, req.kv_committed_len, req.kv_allocated_len = None, 0, 0
        req._finish_handled = True  # its memory is settled here, not by finish_request
        s.stream_output([req])

    @staticmethod
    def _reason(req: "Req") -> str:
        return f"KV transfer failed: {req.kv_transfer.failure_reason() or 'unknown reason'}"

    def release(self, req: "Req") -> None:
        receiver = req.kv_transfer
        if receiver is None:
            return
        if receiver.poll() not in (KVPoll.Success, KVPoll.Failed):
            message = req.finished_reason.message if req.finished_reason is not None else "request ended"
            receiver.abort(f"aborted on the decode engine: {message}")
        receiver.clear()
        req.kv_transfer = None
        if req.kv_meta_slot is not None:
            self.metadata.free(req.kv_meta_slot)
            req.kv_meta_slot = None

    def _release_quarantine(self) -> None:
        now = time.monotonic()
        while self.quarantine and self.quarantine[0][0] <= now:
            self.view.allocator.free(self.quarantine.pop(0)[1])

    # ------------------------------------------------------------------ introspection
    def num_reqs_holding_rows(self) -> int:
        return len(self.transfer_queue)

    def is_idle(self) -> bool:
        """Quarantined pages count as work: the loop must keep ticking to give them back."""
        return not self.prealloc_queue and not self.transfer_queue and not self.quarantine

    def log_fields(self) -> str:
        return f", #prealloc-req: {len(self.prealloc_queue)}, #transfer-req: {len(self.transfer_queue)}"

    def server_info(self) -> dict:
        return {"disaggregation_mode": "decode", "num_prealloc_reqs": len(self.prealloc_queue),
                "num_transfer_reqs": len(self.transfer_queue), **self.stats.to_info()}
