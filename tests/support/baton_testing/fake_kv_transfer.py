"""An in-process transfer backend for scheduler tests on machines without Mooncake (a test double).

Importing this module registers it as `--disaggregation-transfer-backend fake` in this process
(engine/disaggregation/__init__.py register_transfer_backend; tests/engine/conftest.py imports it); the
package does not ship it. It crosses no process boundary, so an engine with TP ranks cannot use it.

Same states, checks, fault injection and timeouts as the real one; a chunk is copied synchronously
(memmove between the registered CPU buffers) inside send(). Prefill managers are found by
bootstrap address in a FakeHub, which stands in for the bootstrap servers and the network; closing
a prefill manager is its "process death": receivers bound to it fail at their next poll().
"""
from __future__ import annotations

import ctypes
import random
import threading
from typing import Optional, Union

import numpy as np

from baton.engine.disaggregation import register_transfer_backend
from baton.engine.disaggregation.base import (DisaggregationMode, KVArgs, KVManagerBase, KVPoll, KVTransferError,
                                              MetadataBuffers, RoomInUse, TransferConfig, contiguous_runs)
from baton.engine.disaggregation.common import CommonKVReceiver, CommonKVSender, Destination, check_destination


class FakeHub:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._prefills: dict[str, "FakeKVManager"] = {}

    def register(self, addr: str, mgr: "FakeKVManager") -> None:
        with self._lock:
            self._prefills[addr] = mgr

    def unregister(self, addr: str, mgr: "FakeKVManager") -> None:
        with self._lock:
            if self._prefills.get(addr) is mgr:
                del self._prefills[addr]

    def lookup(self, addr: str) -> Optional["FakeKVManager"]:
        with self._lock:
            return self._prefills.get(addr)


DEFAULT_HUB = FakeHub()  # lets engines built from server args find each other inside one test process


class FakeKVSender(CommonKVSender):
    def __init__(self, mgr: "FakeKVManager", room: int) -> None:
        super().__init__(room, mgr.config, mgr.metadata)
        self._mgr = mgr
        mgr.add_sender(self)

    def _submit(self, src_pages: np.ndarray, dst_pages: np.ndarray, is_last: bool) -> None:
        decode: FakeKVManager = self.dest.peer
        try:
            self.record(self._mgr.copy_pages(decode, src_pages, dst_pages), 0.0)
            if is_last:
                self.record(self._mgr.copy_state(decode, self.state_slot, self.dest.state_slot), 0.0)
                self.record(self._mgr.copy_metadata(decode, self.meta_slot, self.dest.meta_slot), 0.0)
                if self._mgr.rng.random() < self.config.fault_probability:
                    raise KVTransferError(f"injected fault (fault_probability={self.config.fault_probability})")
        except KVTransferError as e:
            reason = f"room {self.room}: KV transfer failed: {e}"
            if self.fail(reason):
                decode.on_status(self.room, KVPoll.Failed, reason)
            return
        if is_last:
            decode.on_status(self.room, KVPoll.Success, None)
            self.finish()

    def _notify_abort(self, reason: str, conflict: bool = False) -> None:
        self.dest.peer.on_status(self.room, KVPoll.Failed, reason, conflict)

    def clear(self) -> None:
        self._mgr.remove(self.room)


class FakeKVReceiver(CommonKVReceiver):
    def __init__(self, mgr: "FakeKVManager", bootstrap_addr: str, room: int) -> None:
        super().__init__(bootstrap_addr, room, mgr.config, mgr.metadata)
        self._mgr = mgr
        mgr.add_receiver(self)
        self._try_attach()

    def _try_attach(self) -> None:
        prefill = self._mgr.hub.lookup(self.bootstrap_addr)
        if prefill is not None:
            self.attach(prefill)

    def poll(self) -> KVPoll:
        if self.peer is None and not self.done:
            self._try_attach()
        elif self.peer is not None and self.peer.closed:
            self.fail(f"room {self.room}: prefill at {self.bootstrap_addr} is gone")
        return super().poll()

    def _send_destination(self) -> None:
        self.peer.on_room(self.room, self._mgr, self.pages, self.meta_slot, self.prefix_pages, self.state_slot)

    def _notify_abort(self, reason: str) -> None:
        self.peer.on_abort(self.room, reason)

    def clear(self) -> None:
        self._mgr.remove(self.room)


class FakeKVManager(KVManagerBase):
    uses_bootstrap_server = False  # prefill managers are found in the FakeHub

    def __init__(self, args: KVArgs, metadata: MetadataBuffers, mode: Union[DisaggregationMode, str],
                 config: TransferConfig, bootstrap_addr: Optional[str] = None, hub: Optional[FakeHub] = None) -> None:
        if args.tp_size > 1:
            raise ValueError("the fake KV transfer backend runs in one process; TP ranks (each moving its own KV "
                             "shard) need a transfer backend that crosses processes: mooncake")
        self.args, self.metadata, self.config = args, metadata, config
        self.mode = DisaggregationMode(mode)
        self.hub = hub or DEFAULT_HUB
        self.rng = random.Random(config.fault_seed)
        self.closed = False
        self._lock = threading.Lock()
        self._rooms: dict[int, Union[FakeKVSender, FakeKVReceiver]] = {}
        self._pending: dict[int, Union[Destination, str]] = {}  # prefill: arrived before the sender
        self._addr = bootstrap_addr
        if self.mode == DisaggregationMode.PREFILL:
            assert bootstrap_addr, "a prefill manager needs its bootstrap address"
            self.hub.register(bootstrap_addr, self)

    def create_sender(self, room: int) -> FakeKVSender:
        assert self.mode == DisaggregationMode.PREFILL
        return FakeKVSender(self, room)

    def create_receiver(self, bootstrap_addr: str, room: int) -> FakeKVReceiver:
        assert self.mode == DisaggregationMode.DECODE
        return FakeKVReceiver(self, bootstrap_addr, room)

    def add_sender(self, sender: FakeKVSender) -> None:
        with self._lock:
            if sender.room in self._rooms:  # as Mooncake's room table
                raise RoomInUse(sender.room)
            self._rooms[sender.room] = sender
            item = self._pending.pop(sender.room, None)
        self._apply(sender, item)

    def add_receiver(self, receiver: FakeKVReceiver) -> None:
        with self._lock:
            if receiver.room in self._rooms:
                raise RoomInUse(receiver.room)
            self._rooms[receiver.room] = receiver

    def remove(self, room: int) -> None:
        with self._lock:
            self._rooms.pop(room, None)

    def num_rooms(self) -> int:
        with self._lock:
            return len(self._rooms)

    @staticmethod
    def _apply(sender: FakeKVSender, item: Union[Destination, str, None]) -> None:
        if isinstance(item, str):
            sender.fail(item)
        elif item is not None and (refusal := sender.attach(item)) is not None:
            item.peer.on_status(sender.room, KVPoll.Failed, refusal, conflict=True)

    # ---- called by the peer manager ----

    def on_room(self, room: int, decode: "FakeKVManager", pages: np.ndarray, meta_slot: int,
                prefix_pages: int = 0, state_slot: Optional[int] = None) -> None:
        reason = check_destination(room, self.args, decode.args.geometry, decode.args.kv_data_lens[0],
                                   decode.args.aux_data_lens[0], pages, meta_slot, state_slot, decode.args.state_slots())
        if reason is not None:
            decode.on_status(room, KVPoll.Failed, reason)
        self._deliver(room, reason or Destination(decode, pages, meta_slot, prefix_pages, state_slot))

    def on_abort(self, room: int, reason: str) -> None:
        self._deliver(room, f"aborted by the decode engine: {reason}")

    def _deliver(self, room: int, item: Union[Destination, str]) -> None:
        with self._lock:
            sender = self._rooms.get(room)
            if sender is None:
                self._pending[room] = item
                return
        self._apply(sender, item)

    def on_status(self, room: int, status: KVPoll, reason: Optional[str], conflict: bool = False) -> None:
        with self._lock:
            receiver = self._rooms.get(room)
        if receiver is not None:
            receiver.on_status(status, reason, conflict=conflict)

    # ---- copies (CPU memory only) ----

    def copy_pages(self, decode: "FakeKVManager", src: np.ndarray, dst: np.ndarray) -> int:
        runs, nbytes = contiguous_runs(src, dst), 0
        for sp, dp, item in zip(self.args.kv_data_ptrs, decode.args.kv_data_ptrs, self.args.kv_item_lens):
            for s, d, n in zip(runs.src_starts.tolist(), runs.dst_starts.tolist(), runs.lengths.tolist()):
                ctypes.memmove(dp + d * item, sp + s * item, n * item)
                nbytes += n * item
        return nbytes

    def copy_state(self, decode: "FakeKVManager", src_slot: Optional[int], dst_slot: Optional[int]) -> int:
        """A hybrid model's recurrent state: one slot of every state buffer."""
        if not self.args.has_state:
            return 0
        if src_slot is None:
            raise KVTransferError("the last chunk of a hybrid model's request came without its state slot")
        for sp, dp, item in zip(self.args.state_data_ptrs, decode.args.state_data_ptrs, self.args.state_item_lens):
            ctypes.memmove(dp + dst_slot * item, sp + src_slot * item, item)
        return sum(self.args.state_item_lens)

    def copy_metadata(self, decode: "FakeKVManager", src_slot: int, dst_slot: int) -> int:
        size = self.metadata.item_bytes
        ctypes.memmove(decode.metadata.data_ptr + dst_slot * size, self.metadata.data_ptr + src_slot * size, size)
        return size

    def close(self) -> None:
        self.closed = True
        if self._addr is not None:
            self.hub.unregister(self._addr, self)


register_transfer_backend("fake", FakeKVManager)
