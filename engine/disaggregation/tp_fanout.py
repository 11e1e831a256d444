"""PD disaggregation with tensor parallelism: every TP rank moves its own KV shard.

TP rank r of an engine holds the KV heads of shard r. With equal --tp-size a prefill's rank r writes
to the decode's rank r, which holds the same heads; with different sizes each decode rank takes its
heads' slices from the prefill ranks that hold them (head_slices.py; the backends do the pairing).
Every rank runs its own transfer backend (its Mooncake engine, side channel and registered shard),
and a prefill rank registers at its engine's bootstrap server under (DP rank, TP rank), with the
first KV head it holds, as SGLang's per-rank KV managers do.

Only the TP driver (rank 0) runs a scheduler. Its manager is a `TpKVManager`: each call on a sender
or receiver (create, init, send, abort, clear) runs on the driver's backend and is forwarded, in
order, to every follower's backend over a ZMQ channel on loopback; each follower reports a room's
poll state back whenever it changes, and the driver's poll() is the minimum over the ranks
(Failed < Bootstrapping < WaitingForInput < Transferring < Success). A request moves on only when
every shard has moved, and fails when any shard fails.

    driver (scheduler thread)                    follower r (service thread)
    TpKVSender.send(pages)    -- op ---------->  its sender.send(pages)     (its shard of those pages)
    TpKVSender.poll() = min(own, reported)  <--  (room, state, reason) on change

The idle integrity check counts every rank's rooms: the driver asks each follower over the same
link (after every earlier op, so cleared rooms never count) and waits for the answers.

Page indices and metadata slots are the driver's on every rank: the followers' pools and
req_to_token tables move in lockstep with the driver's (worker/tp_step.py), and a follower's KV
for a chunk is written before the driver's forward of that chunk can end (the layers' all-reduces
meet), which is before the driver asks for it to be sent.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import zmq

from baton.engine.disaggregation.base import (KVArgs, KVManagerBase, KVMetadata, KVPoll, KVReceiverBase,
                                              KVSenderBase, MetadataBuffers, PageList, TransferConfig,
                                              TransferStats, as_pages, model_kv_heads)

logger = logging.getLogger(__name__)

_POLL_MS = 10  # a follower's wait for the next op; its rooms are polled (timeouts, states) in between
COUNT_TIMEOUT_S = 2.0  # the idle integrity check's wait for every follower's room count


@dataclass(frozen=True)
class FollowerSetup:
    """What the driver tells its followers once, when its PD side starts."""

    mode: str  # "prefill" | "decode"
    backend: str  # transfer backend name
    config: dict  # TransferConfig fields
    metadata_size: int  # slots in the driver's MetadataBuffers (the followers use its slot numbers)
    bootstrap_addr: Optional[str]  # prefill: "host:port" of the engine's bootstrap server
    engine_rank: int
    dp_size: int
    metadata_draft_bytes: int = 0  # the slots' draft part (base.MetadataBuffers)


@dataclass(frozen=True)
class FollowerSetupProbe:
    """The driver's contribution to the start-up exchange (each follower contributes the endpoint
    of its op socket)."""

    status_endpoint: str  # the driver's socket for the followers' reports
    setup: FollowerSetup


def _all_gather(obj: Any, tp) -> list:
    import torch.distributed as dist

    from baton.engine.distributed.parallel_state import resolve_group

    out: list = [None] * tp.size
    dist.all_gather_object(out, obj, group=resolve_group(tp.cpu_group))
    return out


def _metadata(fields: list) -> KVMetadata:
    """A KVMetadata from its JSON list (the driver's `list(metadata)`)."""
    token, logprob, room, rope_delta, version = (list(fields) + [0, 0])[:5]
    return KVMetadata(int(token), float(logprob), int(room), int(rope_delta), int(version))


def _push(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 0)  # no limit: a send never blocks the scheduler on a slow follower
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def _pull(ctx: zmq.Context) -> tuple[zmq.Socket, str]:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 0)
    return sock, f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"


# ---------------------------------------------------------------------------------------- driver


class DriverLink:
    """The driver's end: op sockets to every follower, and the rooms' reported states."""

    def __init__(self) -> None:
        self._ctx = zmq.Context()
        self._reports, self.status_endpoint = _pull(self._ctx)
        self._ops: list[zmq.Socket] = []
        # room -> {follower rank: (state, reason)}; a rank not heard from yet counts as Bootstrapping
        self._states: dict[int, dict[int, tuple[KVPoll, Optional[str]]]] = {}
        self.followers = 0
        self._count_seq = 0
        self._counts: dict[int, int] = {}  # follower rank -> rooms, answers to the latest count op

    @classmethod
    def exchange(cls, tp, setup: FollowerSetup) -> "DriverLink":
        """Collective over the TP group's CPU group: every follower calls `FollowerKVService.join`
        at the matching point of its start-up (right after its model runner)."""
        assert tp.is_driver and tp.size > 1
        link = cls()
        gathered = _all_gather(FollowerSetupProbe(link.status_endpoint, setup), tp)
        link.connect(gathered[1:])
        return link

    def connect(self, ops_endpoints: list[str]) -> None:
        """Follower r's op endpoint at index r - 1."""
        self._ops = [_push(self._ctx, e) for e in ops_endpoints]
        self.followers = len(ops_endpoints)

    def op(self, header: dict, pages: Optional[np.ndarray] = None) -> None:
        frames = [json.dumps(header).encode()]
        if pages is not None:
            frames.append(np.ascontiguousarray(pages, dtype=np.int64).tobytes())
        for sock in self._ops:
            sock.send_multipart(frames)

    def track(self, room: int) -> None:
        self._states[room] = {}

    def forget(self, room: int) -> None:
        self._states.pop(room, None)

    def state(self, room: int) -> tuple[KVPoll, Optional[str]]:
        """The lowest state the followers reported for the room, with the reason of a failure
        ("TP rank r: ...")."""
        self._drain()
        ranks = self._states.get(room, {})
        worst, reason = KVPoll.Success, None
        for rank in range(1, self.followers + 1):
            state, why = ranks.get(rank, (KVPoll.Bootstrapping, None))
            if state < worst:
                worst, reason = state, (f"TP rank {rank}: {why}" if why else None)
        return worst, reason

    def count_rooms(self, timeout_s: float = COUNT_TIMEOUT_S) -> int:
        """The rooms the followers still hold, asked now: each answers after every op sent before
        (its clears included), so a room the driver has cleared never counts. A follower that does
        not answer within timeout_s counts as one room (its state is unknown, so not proven clean)."""
        self._count_seq += 1
        self._counts = {}
        self.op({"op": "count", "room": -1, "seq": self._count_seq})
        deadline = time.monotonic() + timeout_s
        while len(self._counts) < self.followers:
            left = deadline - time.monotonic()
            if left <= 0 or not self._reports.poll(int(left * 1000) + 1):
                break
            self._drain()
        return sum(self._counts.values()) + self.followers - len(self._counts)

    def _drain(self) -> None:
        while self._reports.poll(0):
            msg = json.loads(self._reports.recv())
            if "count_seq" in msg:
                if msg["count_seq"] == self._count_seq:
                    self._counts[msg["rank"]] = msg["rooms"]
                continue
            ranks = self._states.get(msg["room"])
            if ranks is not None:  # else a report about a room already cleared here
                ranks[msg["rank"]] = (KVPoll(msg["status"]), msg["reason"])

    def close(self) -> None:
        self.op({"op": "stop", "room": -1})
        for sock in self._ops:
            sock.close()
        self._reports.close()
        self._ctx.term()


class _FanOut:
    """What a sender and a receiver of the driver share: the rank-0 object `local`, its room, the
    followers' states through `link`."""

    local: Any
    link: DriverLink
    room: int

    def poll(self) -> KVPoll:
        return min(self.local.poll(), self.link.state(self.room)[0])

    def failure_reason(self) -> Optional[str]:
        if self.local.poll() == KVPoll.Failed:
            return self.local.failure_reason()
        state, reason = self.link.state(self.room)
        return reason if state == KVPoll.Failed else None

    def room_conflict(self) -> bool:
        return self.local.room_conflict()

    def abort(self, reason: str) -> None:
        self.local.abort(reason)
        self.link.op({"op": "abort", "room": self.room, "reason": reason})

    def clear(self) -> None:
        self.local.clear()
        self.link.op({"op": "clear", "room": self.room})
        self.link.forget(self.room)


class TpKVSender(_FanOut, KVSenderBase):
    def __init__(self, local: KVSenderBase, link: DriverLink, tp_size: int) -> None:
        self.local, self.link, self.room, self._tp_size = local, link, local.room, tp_size

    def init(self, num_pages: int, meta_slot: int) -> None:
        self.local.init(num_pages, meta_slot)
        self.link.op({"op": "sinit", "room": self.room, "num_pages": num_pages, "meta_slot": meta_slot})

    def send(self, page_indices: PageList, is_last: bool = False, metadata: Optional[KVMetadata] = None,
             state_slot: Optional[int] = None) -> None:
        pages = as_pages(page_indices)
        self.local.send(pages, is_last, metadata, state_slot)
        self.link.op({"op": "send", "room": self.room, "is_last": is_last, "state_slot": state_slot,
                      "metadata": list(metadata) if metadata is not None else None}, pages)

    def stats(self) -> TransferStats:
        """The engine's bytes: every rank moves a shard of the same size."""
        own = self.local.stats()
        return TransferStats(own.bytes * self._tp_size, own.seconds)


class TpKVReceiver(_FanOut, KVReceiverBase):
    def __init__(self, local: KVReceiverBase, link: DriverLink) -> None:
        self.local, self.link = local, link
        self.room, self.bootstrap_addr = local.room, local.bootstrap_addr

    def init(self, page_indices: PageList, meta_slot: int, prefix_pages: int = 0,
             state_slot: Optional[int] = None) -> None:
        pages = as_pages(page_indices)
        self.local.init(pages, meta_slot, prefix_pages, state_slot)
        self.link.op({"op": "rinit", "room": self.room, "meta_slot": meta_slot, "prefix_pages": prefix_pages,
                      "state_slot": state_slot}, pages)

    def metadata(self) -> KVMetadata:
        return self.local.metadata()

    def destination_untouched(self) -> bool:
        """Unknown for the followers' destinations (their prefill ranks answer them): never, so a
        failed transfer's pages wait out the abort grace on every rank."""
        return False


class TpKVManager(KVManagerBase):
    """The driver's manager: its own backend plus the followers'."""

    def __init__(self, local: KVManagerBase, link: DriverLink, tp_size: int) -> None:
        self.local, self.link, self.tp_size = local, link, tp_size
        self.args, self.mode, self.abort_grace_s = local.args, local.mode, local.abort_grace_s

    def create_sender(self, room: int) -> TpKVSender:
        sender = self.local.create_sender(room)  # first: it refuses what the followers would refuse too
        self.link.track(room)
        self.link.op({"op": "sender", "room": room})
        return TpKVSender(sender, self.link, self.tp_size)

    def create_receiver(self, bootstrap_addr: str, room: int) -> TpKVReceiver:
        receiver = self.local.create_receiver(bootstrap_addr, room)
        self.link.track(room)
        self.link.op({"op": "receiver", "room": room, "addr": bootstrap_addr})
        return TpKVReceiver(receiver, self.link)

    def num_rooms(self) -> int:
        """The driver's rooms plus every follower's (asked synchronously: the idle integrity check)."""
        return self.local.num_rooms() + self.link.count_rooms()

    def close(self) -> None:
        self.link.close()
        self.local.close()


def driver_manager(local_factory, tp, setup: FollowerSetup) -> KVManagerBase:
    """The driver's manager for a TP group: the start-up exchange with the followers first (they
    build their backends after it), then the driver's own backend from `local_factory()`."""
    link = DriverLink.exchange(tp, setup)
    try:
        local = local_factory()
    except Exception:
        link.close()
        raise
    return TpKVManager(local, link, tp.size)


# -------------------------------------------------------------------------------------- follower


class FollowerKVService:
    """A follower's end: its own backend, driven by the driver's ops on a background thread."""

    def __init__(self, tp_rank: int) -> None:
        """Binds the op socket (`endpoint`); start() connects to the driver and runs the backend."""
        self.tp_rank = tp_rank
        self._ctx = zmq.Context()
        self._ops, self.endpoint = _pull(self._ctx)
        self._reports: Optional[zmq.Socket] = None
        self.mgr: Optional[KVManagerBase] = None
        self.metadata: Optional[MetadataBuffers] = None
        self._items: dict[int, Any] = {}  # room -> this rank's sender or receiver
        self._meta_slots: dict[int, int] = {}
        self._reported: dict[int, tuple[KVPoll, Optional[str]]] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self, mgr: KVManagerBase, metadata: MetadataBuffers, status_endpoint: str) -> "FollowerKVService":
        self.mgr, self.metadata = mgr, metadata
        self._reports = _push(self._ctx, status_endpoint)
        self._thread = threading.Thread(target=self._loop, name=f"kv-tp{self.tp_rank}-follower", daemon=True)
        self._thread.start()
        return self

    @classmethod
    def join(cls, runner, tp) -> "FollowerKVService":
        """The follower's side of DriverLink.exchange, then its backend (a prefill rank registers at
        the bootstrap server here)."""
        from baton.engine.disaggregation import create_transfer_backend

        service = cls(tp.rank)
        try:
            probe: FollowerSetupProbe = _all_gather(service.endpoint, tp)[0]
            setup = probe.setup
            metadata = MetadataBuffers(setup.metadata_size, setup.metadata_draft_bytes)
            args = KVArgs.from_pool(runner.token_to_kv_pool, metadata, engine_rank=setup.engine_rank,
                                    dp_size=setup.dp_size, tp_rank=tp.rank, tp_size=tp.size,
                                    state_pool=runner.state_pool, model_config=runner.model_config,
                                    kv_heads_total=model_kv_heads(runner.model_config))
            mgr = create_transfer_backend(setup.backend, args, metadata, setup.mode, TransferConfig(**setup.config),
                                          setup.bootstrap_addr)
        except Exception:
            service.close()
            raise
        return service.start(mgr, metadata, probe.status_endpoint)

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self._ops.poll(_POLL_MS):
                while self._ops.poll(0):
                    frames = self._ops.recv_multipart()
                    self._apply(json.loads(frames[0]), frames[1] if len(frames) > 1 else None)
            self._report()

    def _apply(self, op: dict, payload: Optional[bytes]) -> None:
        kind, room = op["op"], op["room"]
        if kind == "stop":
            self._stop.set()
            return
        if kind == "count":  # rooms this rank holds: its senders/receivers and its backend's table
            rooms = max(len(self._items), self.mgr.num_rooms())
            self._reports.send(json.dumps({"count_seq": op["seq"], "rank": self.tp_rank, "rooms": rooms}).encode())
            return
        if kind in ("sender", "receiver"):
            try:
                self._items[room] = (self.mgr.create_sender(room) if kind == "sender"
                                     else self.mgr.create_receiver(op["addr"], room))
            except Exception as e:  # noqa: BLE001 - the room fails on the driver, the rank goes on
                logger.exception("TP rank %d: creating the %s of room %d failed", self.tp_rank, kind, room)
                self._send_report(room, KVPoll.Failed, f"could not create the {kind}: {e}")
            return
        item = self._items.get(room)
        if item is None:
            return  # cleared already (the driver may abort and clear in one go)
        pages = np.frombuffer(payload, dtype=np.int64) if payload is not None else None
        try:
            if kind == "sinit":
                self._meta_slots[room] = op["meta_slot"]
                item.init(op["num_pages"], op["meta_slot"])
            elif kind == "send":
                meta = op["metadata"]
                item.send(pages, op["is_last"], _metadata(meta) if meta else None,
                          op.get("state_slot"))
            elif kind == "rinit":
                self._meta_slots[room] = op["meta_slot"]
                item.init(pages, op["meta_slot"], op["prefix_pages"], op.get("state_slot"))
            elif kind == "abort":
                item.abort(op["reason"])
            elif kind == "clear":
                item.clear()
                del self._items[room]
                self._reported.pop(room, None)
                slot = self._meta_slots.pop(room, None)
                if slot is not None:  # the driver frees its slot now; the next user must not see this room
                    self.metadata.buffer[slot].zero_()
        except Exception as e:  # noqa: BLE001 - a bad op fails its room (the driver sees Failed), not the rank
            logger.exception("TP rank %d: %s of room %d failed", self.tp_rank, kind, room)
            item.abort(f"{kind} failed: {e}")

    def _report(self) -> None:
        for room, item in self._items.items():
            state = (item.poll(), item.failure_reason())
            if self._reported.get(room) != state:
                self._reported[room] = state
                self._send_report(room, *state)

    def _send_report(self, room: int, status: KVPoll, reason: Optional[str]) -> None:
        self._reports.send(json.dumps({"room": room, "rank": self.tp_rank, "status": int(status),
                                       "reason": reason}).encode())

    def num_rooms(self) -> int:
        return self.mgr.num_rooms()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.mgr is not None:
            self.mgr.close()
        self._ops.close()
        if self._reports is not None:
            self._reports.close()
        self._ctx.term()
