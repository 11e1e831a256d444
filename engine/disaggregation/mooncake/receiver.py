"""Decode side of the Mooncake backend: one background thread resolves prefill ranks through their
bootstrap servers, registers this engine with each new prefill session, and heartbeats them.

Heartbeat window: a prefill whose /health fails `heartbeat_max_failures` times in a row, or whose
session changed (a restart), fails every unfinished receiver bound to it; the cached route is
dropped, so later requests bootstrap afresh against the restarted prefill.
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import asdict
from typing import TYPE_CHECKING, Optional

from baton.engine.disaggregation.base import KVPoll, KVTransferError
from baton.engine.disaggregation.bootstrap_server import PrefillRankInfo, check_health, fetch_prefill_rank
from baton.engine.disaggregation.common import CommonKVReceiver
from baton.engine.disaggregation.mooncake import messages

if TYPE_CHECKING:
    from baton.engine.disaggregation.mooncake.conn import MooncakeKVManager

_RETRY_S = 0.2  # pause between route lookups of a bootstrap server that did not answer yet
_TICK_S = 0.05


class MooncakeKVReceiver(CommonKVReceiver):
    def __init__(self, rooms: "DecodeRooms", bootstrap_addr: str, room: int) -> None:
        super().__init__(bootstrap_addr, room, rooms.config, rooms.metadata)
        self._rooms = rooms
        self.peer: Optional[PrefillRankInfo]
        rooms.add(self)

    def _send_destination(self) -> None:
        mgr = self._rooms.mgr
        mgr.channel.send(self.peer.endpoint, messages.Room(self.room, mgr.session_id, mgr.channel.endpoint,
                                                           self.meta_slot, self.pages, self.prefix_pages))

    def _notify_abort(self, reason: str) -> None:
        try:
            self._rooms.mgr.channel.send(self.peer.endpoint, messages.Abort(self.room, reason))
        except KVTransferError:
            pass  # the prefill is gone; nothing to tell

    def clear(self) -> None:
        self._rooms.remove(self.room)


class DecodeRooms:
    def __init__(self, mgr: "MooncakeKVManager") -> None:
        self.mgr, self.config, self.metadata = mgr, mgr.config, mgr.metadata
        self._lock = threading.Lock()
        self._receivers: dict[int, MooncakeKVReceiver] = {}
        self._routes: dict[str, PrefillRankInfo] = {}  # bootstrap addr -> its rank 0, while healthy
        self._registered: set[str] = set()  # prefill sessions that have our Register message
        self._failures: dict[str, int] = defaultdict(int)
        self._next_try: dict[str, float] = {}
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kv-decode-bootstrap", daemon=True)
        self._thread.start()

    # ---- room table ----

    def add(self, receiver: MooncakeKVReceiver) -> None:
        with self._lock:
            assert receiver.room not in self._receivers, f"two receivers for room {receiver.room}"
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
            receiver.on_status(KVPoll(msg.status), msg.reason)

    # ---- background thread ----

    def _loop(self) -> None:
        next_heartbeat = time.monotonic() + self.config.heartbeat_interval_s
        while not self.mgr.stopping.is_set():
            self._wake.wait(_TICK_S)
            self._wake.clear()
            self._bootstrap_pending()
            if time.monotonic() >= next_heartbeat:
                self._heartbeat()
                next_heartbeat = time.monotonic() + self.config.heartbeat_interval_s

    def _bootstrap_pending(self) -> None:
        with self._lock:
            pending = [r for r in self._receivers.values() if r.peer is None and not r.done]
        by_addr: dict[str, list[MooncakeKVReceiver]] = defaultdict(list)
        for r in pending:
            by_addr[r.bootstrap_addr].append(r)
        for addr, receivers in by_addr.items():
            route = self._route(addr)
            if route is None:
                continue  # retried next tick; receivers time out in poll()
            try:
                self._ensure_registered(route)
            except KVTransferError as e:
                for r in receivers:
                    r.fail(f"room {r.room}: could not register with prefill at {addr}: {e}")
                continue
            for r in receivers:
                r.attach(route)

    def _route(self, addr: str) -> Optional[PrefillRankInfo]:
        route = self._routes.get(addr)
        if route is not None or time.monotonic() < self._next_try.get(addr, 0.0):
            return route
        try:
            route = fetch_prefill_rank(addr, engine_rank=0, timeout_s=1.0)
        except OSError:
            route = None
        if route is None:
            self._next_try[addr] = time.monotonic() + _RETRY_S
            return None
        self._routes[addr] = route
        self._failures[addr] = 0
        return route

    def _ensure_registered(self, route: PrefillRankInfo) -> None:
        if route.session_id in self._registered:
            return
        mgr, args = self.mgr, self.mgr.args
        mgr.channel.send(route.endpoint, messages.Register(
            mgr.session_id, mgr.channel.endpoint, list(args.kv_data_ptrs), list(args.kv_data_lens),
            list(args.aux_data_ptrs), list(args.aux_data_lens), asdict(args.geometry)))
        self._registered.add(route.session_id)

    def _heartbeat(self) -> None:
        for addr, route in list(self._routes.items()):
            try:
                sessions = check_health(addr, timeout_s=min(self.config.heartbeat_interval_s, 2.0))
            except OSError as e:
                self._failures[addr] += 1
                if self._failures[addr] >= self.config.heartbeat_max_failures:
                    self._drop(addr, f"prefill at {addr} is unreachable: {self._failures[addr]} heartbeats "
                                     f"failed (last: {e})")
                continue
            self._failures[addr] = 0
            live = sessions.get(route.engine_rank)
            if live != route.session_id:
                self._drop(addr, f"prefill at {addr} restarted (session {route.session_id} -> {live}); "
                                 f"its in-flight KV is lost")

    def _drop(self, addr: str, reason: str) -> None:
        route = self._routes.pop(addr)
        self._registered.discard(route.session_id)
        self._failures.pop(addr, None)
        self.mgr.channel.forget(route.endpoint)
        with self._lock:
            bound = [r for r in self._receivers.values() if r.peer is route]
        for r in bound:
            r.fail(f"room {r.room}: {reason}")

    def close(self) -> None:
        self._thread.join(timeout=5)
