"""The scheduler's side of the weight endpoints: updates, the weight-update group, reads, the version.

SGLang's endpoints: updates from disk, from tensors and over a weight-update group, that group, reads
by name, and the weights' version.

An update runs in the scheduler's thread between two steps, with nothing in flight:

    drain          the overlap loop's launched batches are processed: no forward runs during it
    abort          with abort_all_requests, every request ends (waiting, running, PD queues: 503)
    settle         the last prefill joins the running batch; on a PD engine the KV transfers in
                   flight end first (a prefill's KV leaves stamped with the version it came from)
    check, write   on every TP rank (worker/weights.py); a refused update writes nothing
    flush_cache    the running requests are retracted (their KV came from the old weights: each
                   re-prefills its prompt and output so far under the new weights and goes on), a
                   PD prefill's chunked request is aborted (its first chunks left already), then
                   the prefix cache (a hybrid's state checkpoints with it) is emptied
    version        the request's weight_version, else the count of updates (core/weight_version.py)

Without flush_cache (a trainer sending its weights in several calls, flushing on the last) running
requests go on with the KV they have, and the cache keeps what it holds.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

from baton.engine.core.weight_version import WeightVersion
from baton.engine.io_struct import (AbortReq, DestroyWeightsUpdateGroupReqInput, GetWeightsByNameReqInput,
                                    GetWeightsByNameReqOutput, InitWeightsUpdateGroupReqInput,
                                    UpdateWeightFromDiskReqInput, UpdateWeightsFromDistributedReqInput,
                                    UpdateWeightsFromTensorReqInput, UpdateWeightsReqOutput)
from baton.engine.worker.weights import (DestroyGroup, DiskUpdate, DriverWeights, GroupUpdate, InitGroup, Outcome,
                                         RankWeights, ReadWeight, TensorUpdate, WeightOp)

logger = logging.getLogger(__name__)

TRANSFER_WAIT_S = 60.0  # a PD engine's update waits this long at most for its KV transfers in flight
_TENSOR_FORMATS = (None, "auto", "direct")
_ABORT = "aborted: the weights are being updated (abort_all_requests)"
_CHUNK_ABORT = "aborted: the weights changed during its chunked prefill, whose first chunks had left"


class WeightsControl:
    """The weight endpoints' handlers over one scheduler (registered in its control table)."""

    def __init__(self, scheduler: Any) -> None:
        """`scheduler`: the scheduler.Scheduler whose queues, cache, worker and PD strategy it uses
        (typed Any: that module imports this one)."""
        s = self.s = scheduler
        self.version = WeightVersion(s.server_args.weight_version)
        s.pd.weight_version = self.version  # a PD prefill stamps it, a decode checks it
        sender = s.worker.step_sender
        self.driver = DriverWeights(RankWeights(s.worker.model_runner, s.worker.tp),
                                    None if sender is None else sender.send_weights)

    def handlers(self) -> dict[type, Callable[[Any], Any]]:
        return {
            UpdateWeightFromDiskReqInput: self.update_from_disk,
            UpdateWeightsFromTensorReqInput: self.update_from_tensor,
            UpdateWeightsFromDistributedReqInput: self.update_from_distributed,
            InitWeightsUpdateGroupReqInput: self.init_group,
            DestroyWeightsUpdateGroupReqInput: self.destroy_group,
            GetWeightsByNameReqInput: self.get_weights_by_name,
        }

    # ---- updates ----
    def update_from_disk(self, req: UpdateWeightFromDiskReqInput) -> UpdateWeightsReqOutput:
        return self._update(DiskUpdate(req.model_path, req.load_format), req.abort_all_requests, req.flush_cache,
                            req.weight_version)

    def update_from_tensor(self, req: UpdateWeightsFromTensorReqInput) -> UpdateWeightsReqOutput:
        if req.load_format not in _TENSOR_FORMATS:
            return self._reply(False, f"load_format {req.load_format!r} is not supported: serialized (name, tensor) "
                                      "lists only (direct)")
        return self._update(TensorUpdate(tuple(req.serialized_named_tensors)), req.abort_all_requests,
                            req.flush_cache, req.weight_version)

    def update_from_distributed(self, req: UpdateWeightsFromDistributedReqInput) -> UpdateWeightsReqOutput:
        if not len(req.names) == len(req.dtypes) == len(req.shapes):
            return self._reply(False, f"names, dtypes and shapes differ in length ({len(req.names)}, "
                                      f"{len(req.dtypes)}, {len(req.shapes)})")
        op = GroupUpdate(req.group_name, tuple(req.names), tuple(req.dtypes), tuple(tuple(s) for s in req.shapes))
        return self._update(op, req.abort_all_requests, req.flush_cache, req.weight_version)

    def _update(self, op: WeightOp, abort: bool, flush: bool, version: Optional[str]) -> UpdateWeightsReqOutput:
        self._quiesce(abort)
        outcome = self._run(op)
        if not outcome.success:
            logger.error("weight update refused: %s", outcome.message)
            return self._reply(False, outcome.message)
        paused = self._flush() if flush else 0
        new = self.version.advance(version)
        logger.info("weights updated (%s); weight version %s", outcome.message, new)
        return self._reply(True, f"{outcome.message}; weight version {new}", paused)

    # ---- the weight-update group ----
    def init_group(self, req: InitWeightsUpdateGroupReqInput) -> UpdateWeightsReqOutput:
        tp, cuda = self.s.worker.tp, self.driver.device.startswith("cuda")
        backend = req.backend or ("nccl" if cuda else "gloo")
        if backend == "nccl" and not cuda:
            return self._reply(False, "backend nccl needs a CUDA engine; this one runs on CPU: use gloo")
        if not 1 <= req.rank_offset or req.rank_offset + tp.size > req.world_size:
            return self._reply(False, f"rank_offset {req.rank_offset} with this engine's {tp.size} TP rank(s) does "
                                      f"not fit world_size {req.world_size} (the trainer holds rank 0)")
        return self._reply(*self._run(InitGroup(req.master_address, req.master_port, req.rank_offset, req.world_size,
                                                req.group_name, backend))[:2])

    def destroy_group(self, req: DestroyWeightsUpdateGroupReqInput) -> UpdateWeightsReqOutput:
        return self._reply(*self._run(DestroyGroup(req.group_name))[:2])

    # ---- reads ----
    def get_weights_by_name(self, req: GetWeightsByNameReqInput) -> GetWeightsByNameReqOutput:
        outcome = self._run(ReadWeight(req.name, max(1, req.truncate_size)))
        return GetWeightsByNameReqOutput(outcome.value if outcome.success else None, outcome.message,
                                         self.s.dp_rank)

    # ---- steps ----
    def _run(self, op: WeightOp) -> Outcome:
        """On every rank, with nothing in flight (the TP followers take it between steps)."""
        self.s.drain_results()
        return self.driver.run(op)

    def _reply(self, success: bool, message: str, paused: int = 0) -> UpdateWeightsReqOutput:
        return UpdateWeightsReqOutput(success, message, self.version.current, paused, self.s.dp_rank)

    def _quiesce(self, abort: bool) -> None:
        s = self.s
        s.drain_results()
        if abort:
            s.intake.abort_request(AbortReq(abort_all=True, message=_ABORT, status_code=503))
        self._settle()
        if s.pd.num_reqs_holding_rows():
            self._wait_transfers()
            self._settle()

    def _settle(self) -> None:
        """Nothing launched, the last prefill merged into the running batch, finished requests freed."""
        s = self.s
        s.drain_results()
        s.releaser.flush()
        last, s.last_batch = s.last_batch, None
        if last is not None and last.forward_mode.is_extend():
            s._merge_last_prefill(last)
        s.output.reap_finished(s.running_batch.reqs)
        s.running_batch.filter_batch()
        s.releaser.flush()

    def _wait_transfers(self) -> None:
        """A PD engine: the requests whose KV is in transfer (a prefill's leaving, a decode's arriving)
        hold KV of the weights before the update: let their transfers end."""
        s, end = self.s, time.monotonic() + TRANSFER_WAIT_S
        while s.pd.num_reqs_holding_rows() and time.monotonic() < end:
            s.pd.step()
            time.sleep(0.001)
        if s.pd.num_reqs_holding_rows():
            logger.warning("weight update: %d KV transfers still in flight after %.0f s; their prefixes stay cached "
                           "until they end", s.pd.num_reqs_holding_rows(), TRANSFER_WAIT_S)

    def _flush(self) -> int:
        """The KV of the old weights out: running requests retracted, a PD prefill's chunked request
        aborted, the prefix cache emptied. Returns the requests retracted."""
        s = self.s
        chunked = s.chunked_req
        if chunked is not None and not s.pd.keeps_prefilled_requests:
            chunked.abort(_CHUNK_ABORT, 503)
            s.chunked_req = None
            s.output.reap_finished([chunked])
        retracted = list(s.running_batch.reqs) + ([s.chunked_req] if s.chunked_req is not None else [])
        for req in retracted:
            s.releaser.release_now(req)
            req.reset_for_retract()
        s.chunked_req = None
        s.running_batch.filter_batch(keep=[])
        s.waiting_queue.extend(retracted)
        s.releaser.flush()
        s.sessions.release_all()  # a session's held history was computed by the old weights
        cache = s.tree_cache
        if cache.protected_size() == 0:
            cache.reset()
        else:  # prefixes of KV transfers still in flight (PD): everything else goes
            cache.evict(cache.evictable_size())
        return len(retracted)
