"""Decode side of the Mooncake backend: one background thread resolves prefill ranks through their
bootstrap servers, registers this engine with each new prefill session, and heartbeats them.

A prefill engine with DP ranks holds room R's KV on rank R % dp_size (its front end sends the request
there; the router pins a prefill rank by drawing such a room). Rank 0's route tells its dp_size; the
receiver of room R then binds to rank R % dp_size's route. With tensor parallelism this manager
holds TP rank T's shard of the KV heads; rank 0's route also tells the prefill's tp_size. Equal
sizes: the receiver binds to the prefill's TP rank T and takes whole pages. Different sizes: it
binds to every prefill TP rank that holds some of its heads (head_slices.py), sends each its
destination with the head slice and how many decode ranks will write to it, and succeeds once
every one of them has reported Success. Where it takes heads from several prefill ranks (it is
narrower), each lands its slice packed in the request's pages and the first poll() after the last
Success scatters them into place (landing.py), on the thread that owns the pages (the scheduler's,
or a TP follower's service thread), so a request that ends first is never scattered into.

Heartbeat window: a prefill whose /health fails `heartbeat_max_failures` times in a row, or whose
session changed (a restart), fails every unfinished receiver bound to it; the cached route is
dropped, so later requests bootstrap afresh against the restarted prefill. Each /health may take
HEALTH_TIMEOUT_S whatever the interval: a busy prefill that answers late is alive. An unreachable
bootstrap server need not mean dead ranks, so those receivers abort: their prefill ranks hear it
(if they can) and give up the rooms at once instead of at their own bootstrap timeout.

The thread survives anything one round throws (logged): it serves every receiver of the engine.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from dataclasses import asdict
from typing import TYPE_CHECKING, NamedTuple, Optional

from baton.engine.disaggregation.base import KVPoll, KVTransferError, RoomInUse
from baton.engine.disaggregation.bootstrap_server import PrefillRankInfo, check_health, fetch_prefill_rank
from baton.engine.disaggregation.common import CommonKVReceiver
from baton.engine.disaggregation.head_slices import decode_rank_plan, receivers_of, state_row_slices
from baton.engine.disaggregation.landing import scatter_landed
from baton.engine.disaggregation.mooncake import messages

if TYPE_CHECKING:
    from baton.engine.disaggregation.mooncake.side_channel import RoomsOwner

logger = logging.getLogger(__name__)

_RETRY_S = 0.2  # pause between route lookups of a bootstrap server that did not answer yet
_TICK_S = 0.05
HEALTH_TIMEOUT_S = 2.0  # one heartbeat's wait for /health, whatever the interval between heartbeats
_ABORT_LINGER_MS = 500  # how long the aborts of a dropped route may take to leave before its socket closes


class PeerRank(NamedTuple):
    """One prefill rank this decode rank takes KV heads from (head_slices.py)."""

    route: PrefillRankInfo
    heads: Optional[list[int]]  # [src_head, dst_head, num_heads]; None: the whole shard (equal TP sizes)
    num_dests: int  # decode ranks that send this prefill rank a destination for a room
    state_rows: Optional[list[list[int]]] = None  # hybrid, TP sizes that differ: the state rows it takes
    landing: bool = False  # its slice lands packed in the request's pages, for this rank to scatter


class MooncakeKVReceiver(CommonKVReceiver):
    def __init__(self, rooms: "DecodeRooms", bootstrap_addr: str, room: int) -> None:
        super().__init__(bootstrap_addr, room, rooms.config, rooms.metadata)
        self._rooms = rooms
        self.peer: Optional[list[PeerRank]]
        self._succeeded: set[str] = set()  # prefill ranks that reported Success
        self._landed = False  # every slice landed, not scattered yet: the next poll() scatters
        rooms.add(self)

    def _send_destination(self) -> None:
        mgr = self._rooms.mgr
        for p in self.peer:
            mgr.channel.send(p.route.endpoint, messages.Room(
                self.room, mgr.session_id, mgr.channel.endpoint, self.meta_slot, self.pages, self.prefix_pages,
                self.state_slot, p.heads, p.num_dests, p.state_rows, p.landing))

    def on_status(self, status: KVPoll, reason: Optional[str], rank: str = "", conflict: bool = False) -> None:
        """Success once every prefill rank of the plan reported it (and the landed slices are
        scattered: poll()); any failure fails the room."""
        if status == KVPoll.Success and self.peer is not None and len(self.peer) > 1:
            with self._lock:
                self._succeeded.add(rank)
                if len(self._succeeded) < len(self.peer):
                    return
            if any(p.landing for p in self.peer):
                self._landed = True
                return
        super().on_status(status, reason, rank, conflict)

    def poll(self) -> KVPoll:
        if self._landed and not self.done:
            self._landed = False
            try:
                args = self._rooms.mgr.args
                slices = sorted((p.heads[1], p.heads[2]) for p in self.peer if p.heads[2])
                scatter_landed(args.kv_tensors, self.pages, args.geometry.page_size, slices)
            except Exception as e:  # noqa: BLE001 - ends this request only
                self.fail(f"room {self.room}: scattering the landed KV heads failed: {e}")
            else:
                super().on_status(KVPoll.Success, None)
        return super().poll()

    def _num_peers(self) -> int:
        return len(self.peer or ())

    def bound_to(self, route: PrefillRankInfo) -> bool:
        return self.peer is not None and any(p.route is route for p in self.peer)

    def _notify_abort(self, reason: str) -> None:
        for p in self.peer:
            try:
                self._rooms.mgr.channel.send(p.route.endpoint, messages.Abort(self.room, reason))
            except KVTransferError:
                pass  # that prefill rank is gone; nothing to tell

    def clear(self) -> None:
        self._rooms.remove(self.room)


class DecodeRooms:
    def __init__(self, mgr: "RoomsOwner") -> None:
        self.mgr, self.config, self.metadata = mgr, mgr.config, mgr.metadata
        self._lock = threading.Lock()
        self._receivers: dict[int, MooncakeKVReceiver] = {}
        # (bootstrap addr, DP rank, TP rank) -> route, while healthy
        self._routes: dict[tuple[str, int, int], PrefillRankInfo] = {}
        self._registered: set[str] = set()  # prefill sessions that have our Register message
        self._failures: dict[str, int] = defaultdict(int)
        self._next_try: dict[str, float] = {}
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kv-decode-bootstrap", daemon=True)
        self._thread.start()

    # ---- room table ----

    def add(self, receiver: MooncakeKVReceiver) -> None:
        with self._lock:
            if receiver.room in self._receivers:
                raise RoomInUse(receiver.room)
            self._receivers[receiver.room] = receiver
        self._wake.set()

    def remove(self, room: int) -> None:
        with self._lock:
            self._receivers.pop(room, None)

    def num_rooms(self) -> int:
        with self._lock:
            return len(self._receivers)

    def handle(self, msg: messages.Message) -> None:
        """Listener thread: a Status from a prefill rank."""
        if not isinstance(msg, messages.Status):
            return
        with self._lock:
            receiver = self._receivers.get(msg.room)
        if receiver is not None:
            receiver.on_status(KVPoll(msg.status), msg.reason, msg.rank, msg.conflict)

    # ---- background thread ----

    def _loop(self) -> None:
        next_heartbeat = time.monotonic() + self.config.heartbeat_interval_s
        while not self.mgr.stopping.is_set():
            self._wake.wait(_TICK_S)
            self._wake.clear()
            try:
                self._bootstrap_pending()
                if time.monotonic() >= next_heartbeat:
                    next_heartbeat = time.monotonic() + self.config.heartbeat_interval_s
                    self._heartbeat()
            except Exception:  # noqa: BLE001 - a bug in one round must not strand every later receiver
                logger.exception("KV decode bootstrap: a round failed; the thread goes on")

    def _bootstrap_pending(self) -> None:
        with self._lock:
            pending = [r for r in self._receivers.values() if r.peer is None and not r.done]
        for r in pending:
            first = self._route(r.bootstrap_addr, 0, 0)
            if first is None:
                continue  # retried next tick; receivers time out in poll()
            plan = self._plan(first)
            rank = r.room % first.dp_size
            peers = []
            for prefill_tp_rank, *slice_plan in plan:
                route = self._route(r.bootstrap_addr, rank, prefill_tp_rank)
                if route is None:
                    break
                peers.append(PeerRank(route, *slice_plan))
            if len(peers) < len(plan):
                continue
            try:
                for p in peers:
                    self._ensure_registered(p.route)
            except KVTransferError as e:
                r.fail(f"room {r.room}: could not register with prefill rank {p.route.key} at {r.bootstrap_addr}: {e}")
                continue
            r.attach(peers)

    def _plan(self, first: PrefillRankInfo) -> list[tuple[int, Optional[list[int]], int, Optional[list[list[int]]],
                                                          bool]]:
        """(prefill TP rank, head slice, decode ranks it hears from, state rows, landing) for each
        prefill rank this decode rank talks to. Equal TP sizes: its own TP rank, whole pages and state
        slots. A prefill that tells another model's KV heads gets whole pages too: its handshake
        refuses the pair, naming what differs. Slices from several ranks land (landing.py) unless
        the config says otherwise or this rank cannot reach its pool's tensors."""
        args = self.mgr.args
        ours, theirs = args.geometry.kv_heads_total, first.geometry.get("kv_heads_total", 0)
        if first.tp_size == args.tp_size or not ours or ours != theirs:
            return [(args.tp_rank % first.tp_size, None, 1, None, False)]
        heads = args.linear_heads
        plan = decode_rank_plan(ours, first.tp_size, args.tp_size, args.tp_rank, heads[0] if heads else 0)
        land = self.config.land_slices and bool(args.kv_tensors) and sum(1 for s in plan if s.num_heads) > 1
        return [(s.prefill_rank, [s.src_head, s.dst_head, s.num_heads],
                 receivers_of(ours, first.tp_size, args.tp_size, s.prefill_rank, heads[0] if heads else 0),
                 [list(x) for x in state_row_slices(heads, first.tp_size, s.prefill_rank, args.tp_size, args.tp_rank)]
                 if heads else None, land and s.num_heads > 0)
                for s in plan]

    def _route(self, addr: str, rank: int, tp_rank: int) -> Optional[PrefillRankInfo]:
        key = (addr, rank, tp_rank)
        route = self._routes.get(key)
        if route is not None or time.monotonic() < self._next_try.get(key, 0.0):
            return route
        try:
            route = fetch_prefill_rank(addr, engine_rank=rank, timeout_s=1.0, tp_rank=tp_rank)
        except OSError:
            route = None
        if route is None:
            self._next_try[key] = time.monotonic() + _RETRY_S
            return None
        self._routes[key] = route
        self._failures[addr] = 0
        return route

    def _ensure_registered(self, route: PrefillRankInfo) -> None:
        if route.session_id in self._registered:
            return
        mgr, args = self.mgr, self.mgr.args
        mgr.channel.send(route.endpoint, messages.Register(
            mgr.session_id, mgr.channel.endpoint, list(args.kv_data_ptrs), list(args.kv_data_lens),
            list(args.aux_data_ptrs), list(args.aux_data_lens), asdict(args.geometry), list(args.state_data_ptrs),
            list(args.state_data_lens), list(args.state_item_lens)))
        self._registered.add(route.session_id)

    def _heartbeat(self) -> None:
        for addr in sorted({key[0] for key in self._routes}):
            try:
                sessions = check_health(addr, timeout_s=HEALTH_TIMEOUT_S)
            except OSError as e:
                self._failures[addr] += 1
                if self._failures[addr] >= self.config.heartbeat_max_failures:
                    self._drop_addr(addr, f"prefill at {addr} is unreachable: {self._failures[addr]} heartbeats "
                                          f"failed (last: {e})", tell=True)
                continue
            self._failures[addr] = 0
            for key, route in list(self._routes.items()):
                if key[0] == addr and (live := sessions.get(route.key)) != route.session_id:
                    self._drop(key, f"prefill at {addr} restarted (rank {route.key} session {route.session_id} "
                                    f"-> {live}); its in-flight KV is lost")

    def _drop_addr(self, addr: str, reason: str, tell: bool = False) -> None:
        for key in [k for k in self._routes if k[0] == addr]:
            self._drop(key, reason, tell)
        self._failures.pop(addr, None)

    def _drop(self, key: tuple[str, int, int], reason: str, tell: bool = False) -> None:
        """Fail the receivers bound to the route; `tell`: abort them, so prefill ranks that are still
        alive stop waiting for (or writing to) those rooms. A restarted rank's old session is gone:
        nothing to tell."""
        route = self._routes.pop(key)
        self._registered.discard(route.session_id)
        with self._lock:
            bound = [r for r in self._receivers.values() if r.bound_to(route)]
        for r in bound:
            if tell:
                r.abort(f"room {r.room}: {reason}")
            else:
                r.fail(f"room {r.room}: {reason}")
        self.mgr.channel.forget(route.endpoint, linger_ms=_ABORT_LINGER_MS if tell and bound else 0)

    def close(self) -> None:
        self._thread.join(timeout=5)
