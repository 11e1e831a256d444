"""The prefill engine's side of PD disaggregation (--disaggregation-mode prefill).

    arrive -> bootstrap queue -> waiting queue -> extend (chunked or not) -> inflight queue -> done
              (sender handshake:  (normal prefill     (KV sent per chunk;   (poll until Success |
               poll >= WaitingFor  scheduling)         the last chunk       Failed, then free the
               Input)                                  carries token 1)     KV and answer)

The request finishes only after its transfer ended: its first token is sampled here but held back
until Success, so the response (first token, input logprobs) never claims a transfer that failed.
On the prefill side a request generates exactly one token (max_new_tokens is set to 1).
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Optional

from baton.engine.disaggregation import transfer_backend_class
from baton.engine.disaggregation.base import KVMetadata, KVPoll, RoomInUse, TransferConfig, pages_from_slots
from baton.engine.disaggregation.colocated import DisaggregationMode
from baton.engine.disaggregation.disaggregated import Disaggregated, failure_status
from baton.engine.disaggregation.no_peer import NoPeerSender, is_no_peer
from baton.engine.io_struct import AbortReq, FinishReason, TokenizedGenerateReqInput

if TYPE_CHECKING:
    from baton.engine.core.batch_result import LaunchedBatch
    from baton.engine.core.req import Req
    from baton.engine.disaggregation.colocated import SchedulerView

logger = logging.getLogger(__name__)

class PrefillDisaggregation(Disaggregated):
    """Bootstrap queue, per-chunk KV sending and the inflight queue of a prefill Scheduler."""

    mode = DisaggregationMode.PREFILL
    keeps_prefilled_requests = False  # they wait in the inflight queue until their KV is sent
    polls_in_background = True

    def __init__(self, view: "SchedulerView", config: Optional[TransferConfig] = None) -> None:
        from baton.engine.disaggregation.bootstrap_server import KVBootstrapServer

        super().__init__(view, config, 2 * view.max_running_requests + 2)
        args = view.config
        self.bootstrap_server = None
        port = args.disaggregation_bootstrap_port
        # with DP ranks, rank 0 serves and the others register with it (an in-process backend needs none)
        if transfer_backend_class(args.disaggregation_transfer_backend).uses_bootstrap_server and view.dp_rank == 0:
            self.bootstrap_server = KVBootstrapServer(port=port)
            port = self.bootstrap_server.port
        self.bootstrap_port = port
        self.connect(f"{self.config.host}:{port}")
        self.bootstrap_queue: list["Req"] = []
        self.inflight_queue: list["Req"] = []
        self.transferred_bytes = 0
        self.transfer_seconds = 0.0

    # ------------------------------------------------------------------ intake
    def admit(self, req: "Req", recv: TokenizedGenerateReqInput) -> Optional[tuple[str, int]]:
        """Returns an error (message, status) or None when the request joined the bootstrap queue."""
        error = self.pd_request_error(req)
        if error is not None:
            return error
        req.sampling_params.max_new_tokens = 1  # the decode engine generates the rest
        req.sampling_params.min_new_tokens = min(req.sampling_params.min_new_tokens, 1)
        room = req.bootstrap_room
        try:
            req.kv_transfer = NoPeerSender(room) if is_no_peer(req.bootstrap_host) else self.mgr.create_sender(room)
        except RoomInUse as e:
            return str(e), 409
        self.bootstrap_queue.append(req)
        return None

    # ------------------------------------------------------------------ per loop iteration
    def step(self) -> None:
        self._pop_bootstrapped()
        self._fail_waiting()
        self._pop_transferred()

    def _pop_bootstrapped(self) -> None:
        """Requests whose decode sent its destination move on to the waiting queue."""
        ps, keep = self.view.page_size, []
        for req in self.bootstrap_queue:
            status = req.kv_transfer.poll()
            if status == KVPoll.Failed:
                self._end_failed(req)
            elif status >= KVPoll.WaitingForInput and (slot := self.metadata.alloc()) is not None:
                req.kv_meta_slot = slot
                req.kv_transfer.init(-(-len(req.origin_input_ids) // ps), slot)
                if req.kv_transfer.poll() == KVPoll.Failed:  # the destination is another prompt's
                    self._end_failed(req)
                    continue
                req.queue_start_time = time.time()  # queue time: from here, not from the bootstrap wait
                self.view.queues.waiting.append(req)
            else:
                keep.append(req)
        self.bootstrap_queue = keep

    def _fail_waiting(self) -> None:
        """The decode may give up (abort, timeout) while the request still waits here for a prefill."""
        queues = self.view.queues
        failed = [r for r in queues.waiting if r.kv_transfer is not None and r.kv_transfer.poll() == KVPoll.Failed]
        for req in failed:
            queues.waiting.remove(req)
            self._end_failed(req)
        chunked = queues.chunked_req
        if chunked is not None and chunked.kv_transfer is not None and chunked.kv_transfer.poll() == KVPoll.Failed:
            chunked.abort(self._reason(chunked), failure_status(chunked.kv_transfer))  # reaped between chunks

    def _pop_transferred(self) -> None:
        s, keep = self.view, []
        for req in self.inflight_queue:
            status = req.kv_transfer.poll()
            if status not in (KVPoll.Success, KVPoll.Failed):
                keep.append(req)
                continue
            stats = req.kv_transfer.stats()
            self.transferred_bytes += stats.bytes
            self.transfer_seconds += stats.seconds
            if status == KVPoll.Failed:
                self.stats.transfer_failures += 1
                req.abort(self._reason(req), failure_status(req.kv_transfer))
            else:
                self.stats.transfer_done(stats.bytes, stats.seconds)
                req.check_finished(s.tokenizer)
                if not req.finished():  # min_new_tokens held back a stop token: still one token here
                    req.finished_reason = FinishReason("length")
            s.finish_request(req)  # clears the sender, frees the KV (the radix cache keeps the prompt)
            s.stream_output([req])
        self.inflight_queue = keep

    # ------------------------------------------------------------------ results of a prefill forward
    def on_extend_result(self, launched: "LaunchedBatch", result) -> bool:
        s = self.view
        for i, req in enumerate(launched.reqs):
            if not s.extend_result_prologue(req, i, result):
                continue
            if req.is_chunked > 0:
                req.is_chunked -= 1
                self._send(req, launched.mwb.seq_lens_cpu[i] // s.page_size)
                continue
            tok = result.next_token_ids[i]
            logprob = result.next_token_logprobs[i] if result.next_token_logprobs is not None else 0.0
            s.record_token(req, i, result)
            if req.return_logprob and req.top_logprobs_num and result.next_top_logprobs is not None:
                self.metadata.set_top_logprobs(req.kv_meta_slot, result.next_top_logprobs[i])
            if s.drafter is not None:  # the decode's first step drafts from these (base.MetadataBuffers)
                self.metadata.set_draft(req.kv_meta_slot, *s.drafter.row_draft(req.req_pool_idx))
            version = 0 if self.weight_version is None else self.weight_version.hash
            meta = KVMetadata(tok, logprob, req.bootstrap_room, req.rope_delta, version)
            self._send(req, -(-len(req.origin_input_ids) // s.page_size), meta)
            self.inflight_queue.append(req)
        return True

    def _send(self, req: "Req", end_page: int, metadata: Optional[KVMetadata] = None) -> None:
        """Pages [kv_pages_sent, end_page) of the request's row; the last call carries the metadata
        and, for a hybrid model, the row's recurrent state. Called with a chunk's result, so the
        forward that wrote that KV and state has ended; the overlap loop's next pass may run
        already, but never with this request after its last chunk, and its row stays held (and
        unwritten) until the transfer has ended."""
        ps = self.view.page_size
        if end_page <= req.kv_pages_sent and metadata is None:
            return
        row = self.view.req_to_token_pool.req_to_token[req.req_pool_idx]
        slots = row[req.kv_pages_sent * ps:end_page * ps]
        req.kv_pages_sent = end_page
        state_slot = req.req_pool_idx if self.view.state_pool is not None else None
        req.kv_transfer.send(pages_from_slots(slots, ps), is_last=metadata is not None, metadata=metadata,
                             state_slot=state_slot)

    # ------------------------------------------------------------------ endings
    def abort(self, recv: AbortReq) -> None:
        """Queued here means no KV yet; inflight requests end at their next poll (the sender fails)."""
        for req in [r for r in self.bootstrap_queue if recv.abort_all or r.rid == recv.rid]:
            self.bootstrap_queue.remove(req)
            req.abort(recv.message, recv.status_code)
            self.release(req)
            self.view.stream_output([req])
        for req in self.inflight_queue:
            if recv.abort_all or req.rid == recv.rid:
                req.abort(recv.message, recv.status_code)
                req.kv_transfer.abort(f"aborted on the prefill engine: {recv.message}")

    def _end_failed(self, req: "Req") -> None:
        """A request that failed before its KV was sent (no decode peer, or the peer gave up)."""
        self.stats.bootstrap_failures += 1
        req.abort(self._reason(req), failure_status(req.kv_transfer))
        self.release(req)
        self.view.stream_output([req])

    @staticmethod
    def _reason(req: "Req") -> str:
        return f"KV transfer failed: {req.kv_transfer.failure_reason() or 'unknown reason'}"

    def release(self, req: "Req") -> None:
        """Forget the request's sender (telling the decode when it ends early) and its metadata slot."""
        sender = req.kv_transfer
        if sender is None:
            return
        if sender.poll() not in (KVPoll.Success, KVPoll.Failed):
            message = req.finished_reason.message if req.finished_reason is not None else "request ended"
            sender.abort(f"aborted on the prefill engine: {message}")
        sender.clear()
        req.kv_transfer = None
        if req.kv_meta_slot is not None:
            self.metadata.free(req.kv_meta_slot)
            req.kv_meta_slot = None

    # ------------------------------------------------------------------ introspection
    def num_reqs_holding_rows(self) -> int:
        return len(self.inflight_queue)

    def is_idle(self) -> bool:
        return not self.bootstrap_queue and not self.inflight_queue

    def log_fields(self) -> str:
        return f", #bootstrap-req: {len(self.bootstrap_queue)}, #inflight-req: {len(self.inflight_queue)}"

    def server_info(self) -> dict:
        return {"disaggregation_mode": "prefill", "bootstrap_port": self.bootstrap_port,
                "num_bootstrap_reqs": len(self.bootstrap_queue), "num_inflight_reqs": len(self.inflight_queue),
                "kv_transfer_bytes": self.transferred_bytes, "kv_transfer_seconds": self.transfer_seconds,
                **self.stats.to_info()}

    def close(self) -> None:
        super().close()
        if self.bootstrap_server is not None:
            self.bootstrap_server.close()

