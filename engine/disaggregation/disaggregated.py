"""What the prefill and the decode strategy share (prefill.py, decode.py): the transfer settings, the
metadata slots, the KV manager of this rank (with TP, one that drives the other ranks': tp_fanout.py),
PD counters, and the check that a request carries the bootstrap fields a PD router adds."""
from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Optional

from baton.engine.disaggregation import create_transfer_backend
from baton.engine.disaggregation.base import KVArgs, KVManagerBase, MetadataBuffers, TransferConfig, model_kv_heads
from baton.engine.disaggregation.colocated import Colocated
from baton.engine.disaggregation.stats import PDStats

if TYPE_CHECKING:
    from baton.engine.core.req import Req
    from baton.engine.disaggregation.base import KVReceiverBase, KVSenderBase
    from baton.engine.disaggregation.colocated import SchedulerView
    from baton.engine.disaggregation.config import PDConfig

TRANSFER_FAILED_STATUS = 500
ROOM_CONFLICT_STATUS = 409  # a room given to two pairings: the client's (or its router's) error


def failure_status(transfer: "KVSenderBase | KVReceiverBase") -> int:
    """The HTTP status of a failed transfer: a room conflict is the client's error, the rest the server's."""
    return ROOM_CONFLICT_STATUS if transfer.room_conflict() else TRANSFER_FAILED_STATUS


def transfer_config_from(args: "PDConfig") -> TransferConfig:
    """Server args; where a flag is unset, SGLang's environment variable of the same meaning (so
    users can move over), else SGLang's default."""
    def pick(flag, env_name: str, default: float) -> float:
        return flag if flag is not None else float(os.environ.get(env_name, default))

    return TransferConfig(
        host=advertised_host(args.host), protocol=args.disaggregation_protocol,
        ib_device=args.disaggregation_ib_device,
        bootstrap_timeout_s=pick(args.disaggregation_bootstrap_timeout, "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300),
        waiting_timeout_s=pick(args.disaggregation_waiting_timeout, "SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300),
        heartbeat_interval_s=pick(args.disaggregation_heartbeat_interval, "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", 5),
        heartbeat_max_failures=int(pick(args.disaggregation_heartbeat_max_failures,
                                        "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", 2)),
        fault_probability=args.disaggregation_fault_probability)


def advertised_host(bind_host: str) -> str:
    """The address peers reach this engine at: the bind address unless it is a wildcard."""
    if bind_host not in ("0.0.0.0", "::", ""):
        return bind_host
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent; picks the outgoing interface
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def create_kv_manager(view: "SchedulerView", mode: str, config: TransferConfig, metadata: MetadataBuffers,
                      bootstrap_addr: Optional[str] = None) -> KVManagerBase:
    """This rank's transfer backend; with TP, one that drives the other ranks' too (tp_fanout.py)."""
    from dataclasses import asdict

    from baton.engine.disaggregation.tp_fanout import FollowerSetup, driver_manager

    pool, tp, pd = view.kv_pool, view.tp, view.config
    args = KVArgs.from_pool(pool, metadata, engine_rank=view.dp_rank, dp_size=pd.dp_size,
                            tp_size=tp.size, state_pool=view.state_pool, model_config=view.model_config,
                            kv_heads_total=model_kv_heads(view.model_config))
    backend = pd.disaggregation_transfer_backend

    def local() -> KVManagerBase:
        return create_transfer_backend(backend, args, metadata, mode, config, bootstrap_addr)

    if tp.size == 1:
        return local()
    setup = FollowerSetup(mode, backend, asdict(config), metadata.size, bootstrap_addr, view.dp_rank,
                          pd.dp_size, metadata.draft_bytes)
    return driver_manager(local, tp, setup)


def metadata_draft_bytes(view: "SchedulerView") -> int:
    """The metadata slots' draft part: the draft head's first draft and output, on both sides."""
    return 0 if view.drafter is None else view.drafter.metadata_bytes()


def pd_request_error(req: "Req", mode: str) -> Optional[tuple[str, int]]:
    """Why a request cannot run on a PD engine (message, status), or None."""
    if req.bootstrap_room is None:
        return (f"this engine runs in {mode} mode (PD disaggregation): the request needs bootstrap_room "
                "(and bootstrap_host/bootstrap_port), as a PD router adds them", 400)
    if req.return_logprob and req.top_logprobs_num > MetadataBuffers.TOP_LOGPROBS:
        return (f"top_logprobs_num {req.top_logprobs_num}: a prefill/decode pair returns at most "
                f"{MetadataBuffers.TOP_LOGPROBS} top logprobs per token", 400)
    return None


class Disaggregated(Colocated):
    """The base of both PD sides: `metadata_slots` metadata buffers, the transfer settings (`config`, or
    the server args'), PD counters. The subclass connects its KV manager (`connect`) once it knows its
    bootstrap address."""

    def __init__(self, view: "SchedulerView", config: Optional[TransferConfig], metadata_slots: int) -> None:
        super().__init__(view)
        self.config = config or transfer_config_from(view.config)
        self.metadata = MetadataBuffers(metadata_slots, metadata_draft_bytes(view))
        self.stats = PDStats()
        self.mgr: Optional[KVManagerBase] = None  # set by connect()

    def connect(self, bootstrap_addr: Optional[str] = None) -> None:
        self.mgr = create_kv_manager(self.view, self.mode.value, self.config, self.metadata, bootstrap_addr)

    def pd_request_error(self, req: "Req") -> Optional[tuple[str, int]]:
        return pd_request_error(req, self.mode.value)

    def check_integrity(self) -> bool:
        return self.metadata.available_size() == self.metadata.size and self.mgr.num_rooms() == 0

    def close(self) -> None:
        self.mgr.close()
