"""Prefill side of the Mooncake backend: the room table fed by decode messages, and the transfer
threads that write page runs into the decode's pool with batched Mooncake writes.

Mooncake's TCP transport queues at most MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER (default 1024)
entries per peer; a batch beyond that is rejected and the peer's lanes stay unusable for a while.
So one batched write per decode peer is in flight at a time, of at most max_batch_entries runs.

Between different TP sizes a head slice moves as a byte stream over the decode's pages
(landing.py): token runs from this rank's pool, or gathered through a registered staging buffer.

A decode's Room message may arrive before or after the prefill creates the sender for that room;
whichever comes second pairs them. Chunks of one room go to one thread, in order, so the final
status is sent only after every earlier chunk has landed.
"""
from __future__ import annotations

import queue
import random
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Union

import numpy as np

from baton.engine.disaggregation.base import KVGeometry, KVPoll, KVTransferError, RoomInUse, contiguous_runs
from baton.engine.disaggregation.bootstrap_server import rank_key
from baton.engine.disaggregation.common import CommonKVSender, Destination, check_destination
from baton.engine.disaggregation.landing import ByteRuns, Pieces, merge_runs, slice_start, stream_runs, zip_runs
from baton.engine.disaggregation.mooncake import messages

if TYPE_CHECKING:
    from baton.engine.disaggregation.mooncake.side_channel import RoomsOwner


@dataclass(frozen=True)
class DecodePeer:
    session_id: str
    endpoint: str
    kv_ptrs: np.ndarray  # [2 * layer_num] int64, K layers then V layers
    kv_lens: tuple[int, ...]
    aux_ptr: int
    aux_len: int
    geometry: KVGeometry
    state_ptrs: np.ndarray  # [2 * linear layers] int64 (conv layers, then ssm layers); empty without state
    state_lens: tuple[int, ...]
    state_items: np.ndarray  # bytes per slot of each state buffer (its TP shard's); empty: as this rank's

    @classmethod
    def from_message(cls, msg: messages.Register) -> "DecodePeer":
        return cls(msg.session_id, msg.endpoint, np.asarray(msg.kv_ptrs, dtype=np.int64), tuple(msg.kv_lens),
                   msg.aux_ptrs[0], msg.aux_lens[0], KVGeometry(**msg.geometry),
                   np.asarray(msg.state_ptrs, dtype=np.int64), tuple(msg.state_lens),
                   np.asarray(msg.state_items, dtype=np.int64))


class MooncakeKVSender(CommonKVSender):
    def __init__(self, rooms: "PrefillRooms", room: int) -> None:
        super().__init__(room, rooms.config, rooms.metadata)
        self._rooms = rooms
        rooms.add(self)

    def _submit(self, src_pages: np.ndarray, dst_pages: np.ndarray, is_last: bool) -> None:
        first = self._sent - self.dest.prefix_pages - len(dst_pages)  # dst_pages = dest.pages[first:] (send())
        self._rooms.submit(self, src_pages, dst_pages, first, is_last)  # the state slot rides on self

    def _notify_abort(self, reason: str, conflict: bool = False) -> None:
        for dest in list(self.dests):
            self._rooms.reply(dest.peer.endpoint, self._rooms.status(self.room, KVPoll.Failed, reason, conflict))

    def clear(self) -> None:
        self._rooms.remove(self.room)


_Pending = Union[Destination, str]  # a destination, or why the room failed before its sender existed


class PrefillRooms:
    def __init__(self, mgr: "RoomsOwner") -> None:
        self.config, self.metadata, self._mgr = mgr.config, mgr.metadata, mgr
        args = mgr.args
        self._kv_ptrs = np.asarray(args.kv_data_ptrs, dtype=np.int64)  # [2 * layer_num]
        self._item_lens = np.asarray(args.kv_item_lens, dtype=np.int64)  # [2 * layer_num] bytes per page
        self._state_ptrs = np.asarray(args.state_data_ptrs, dtype=np.int64)  # [2 * linear layers], maybe empty
        self._state_items = np.asarray(args.state_item_lens, dtype=np.int64)  # bytes per slot
        self._state_rows = np.asarray(args.state_row_lens, dtype=np.int64)  # bytes per row of a slot
        self._lock = threading.Lock()
        self._peers: dict[str, DecodePeer] = {}
        self._senders: dict[int, MooncakeKVSender] = {}
        # rooms whose sender does not exist yet: (first arrival, what arrived: one destination per
        # decode rank, or a failure)
        self._pending: dict[int, tuple[float, list[_Pending]]] = {}
        self._last_sweep = time.monotonic()
        self._peer_locks: dict[str, threading.Lock] = {}  # decode session -> one batched write at a time
        self._rng = random.Random(self.config.fault_seed)
        self._local = threading.local()  # a transfer thread's queue, and its staging buffer once needed
        self._staging_lock = threading.Lock()
        self._stagings: list = []
        self._queues: list[queue.Queue] = [queue.Queue() for _ in range(self.config.num_transfer_threads)]
        self._threads = [threading.Thread(target=self._work, args=(q,), name=f"kv-transfer-{i}", daemon=True)
                         for i, q in enumerate(self._queues)]
        for t in self._threads:
            t.start()

    # ---- room table ----

    def add(self, sender: MooncakeKVSender) -> None:
        with self._lock:
            if sender.room in self._senders:
                raise RoomInUse(sender.room)
            self._senders[sender.room] = sender
            pending = self._pending.pop(sender.room, None)
        for item in pending[1] if pending is not None else ():
            self._apply(sender, item)

    def remove(self, room: int) -> None:
        with self._lock:
            self._senders.pop(room, None)

    def num_rooms(self) -> int:
        with self._lock:
            return len(self._senders)

    def _deliver(self, room: int, item: _Pending) -> None:
        with self._lock:
            sender = self._senders.get(room)
            if sender is None:
                self._pending.setdefault(room, (time.monotonic(), []))[1].append(item)
                return
        self._apply(sender, item)

    def _apply(self, sender: MooncakeKVSender, item: _Pending) -> None:
        if isinstance(item, str):
            sender.fail(item)
        elif (refusal := sender.attach(item)) is not None:
            self.reply(item.peer.endpoint, self.status(sender.room, KVPoll.Failed, refusal, conflict=True))

    def _sweep_pending(self) -> None:
        """Rooms whose prefill request never came: the decode gave up after waiting_timeout_s."""
        now = time.monotonic()
        if now - self._last_sweep < 1.0:
            return
        self._last_sweep = now
        with self._lock:
            stale = [r for r, (t, _) in self._pending.items() if now - t > self.config.waiting_timeout_s]
            for r in stale:
                del self._pending[r]

    # ---- side channel (listener thread) ----

    def handle(self, msg: messages.Message) -> None:
        if isinstance(msg, messages.Register):
            peer = DecodePeer.from_message(msg)
            with self._lock:
                self._peers[peer.session_id] = peer
        elif isinstance(msg, messages.Room):
            self._on_room(msg)
        elif isinstance(msg, messages.Abort):
            self._deliver(msg.room, f"aborted by the decode engine: {msg.reason}")
        self._sweep_pending()

    def _on_room(self, msg: messages.Room) -> None:
        with self._lock:
            peer = self._peers.get(msg.session_id)
        reason = self._check_destination(peer, msg)
        if reason is None:
            heads = tuple(msg.heads) if msg.heads is not None else None
            rows = tuple(tuple(r) for r in msg.state_rows) if msg.state_rows is not None else None
            self._deliver(msg.room, Destination(peer, msg.pages, msg.meta_slot, msg.prefix_pages, msg.state_slot,
                                                heads, msg.num_dests, rows, msg.landing))
            return
        self.reply(msg.endpoint, self.status(msg.room, KVPoll.Failed, reason))
        self._deliver(msg.room, reason)

    def _check_destination(self, peer: Optional[DecodePeer], msg: messages.Room) -> Optional[str]:
        if peer is None:
            return f"room {msg.room}: decode session {msg.session_id} never registered with this prefill"
        items = self._remote_state_items(peer)
        slots = peer.state_lens[0] // int(items[0]) if peer.state_lens and len(items) else 0
        return check_destination(msg.room, self._mgr.args, peer.geometry, peer.kv_lens[0], peer.aux_len,
                                 msg.pages, msg.meta_slot, msg.state_slot, slots,
                                 tuple(msg.heads) if msg.heads is not None else None,
                                 tuple(map(tuple, msg.state_rows)) if msg.state_rows is not None else None,
                                 tuple(int(x) for x in items), msg.landing)

    def _remote_state_items(self, peer: DecodePeer) -> np.ndarray:
        """Bytes per state slot of each of the decode rank's buffers (as this rank's where it did not say)."""
        return peer.state_items if len(peer.state_items) else self._state_items

    def status(self, room: int, status: KVPoll, reason: Optional[str] = None, conflict: bool = False) -> messages.Status:
        args = self._mgr.args
        return messages.Status(room, int(status), reason, rank_key(args.engine_rank, args.tp_rank), conflict)

    def reply(self, endpoint: str, msg: messages.Status) -> None:
        try:
            self._mgr.channel.send(endpoint, msg)
        except KVTransferError:
            pass  # the decode is gone; its heartbeat or timeout fails the request there

    # ---- transfer threads ----

    def submit(self, sender: MooncakeKVSender, src: np.ndarray, dst: np.ndarray, first: int, is_last: bool) -> None:
        """A chunk: source pages, and the destination's pages, dest.pages[first:first + len(dst)]."""
        self._queues[sender.room % len(self._queues)].put((sender, src, dst, first, is_last))

    def _work(self, q: queue.Queue) -> None:
        while (job := q.get()) is not None:
            sender, src, dst, first, is_last = job
            for i, dest in enumerate(sender.dests):
                if sender.done:
                    break  # aborted, or an earlier chunk failed
                try:
                    self._transfer(sender, i, dest, src, dst, first, is_last)
                except Exception as e:  # noqa: BLE001 - a failed transfer ends this request only
                    reason = f"room {sender.room}: KV transfer to decode {dest.peer.session_id} failed: {e}"
                    if sender.fail(reason):
                        for d in sender.dests:
                            self.reply(d.peer.endpoint, self.status(sender.room, KVPoll.Failed, reason))

    def _transfer(self, sender: MooncakeKVSender, index: int, dest: Destination, src: np.ndarray, dst: np.ndarray,
                  first: int, is_last: bool) -> None:
        with self._lock:
            peer_lock = self._peer_locks.setdefault(dest.peer.session_id, threading.Lock())
        with peer_lock:
            start = time.perf_counter()
            nbytes = self._write_pages(dest, src, dst, first)
            if is_last:
                nbytes += self._write_tail(dest, sender.state_slot, sender.meta_slot)
            sender.record(nbytes, time.perf_counter() - start)
        if not is_last:
            return
        if self._rng.random() < self.config.fault_probability:
            raise KVTransferError(f"injected fault (fault_probability={self.config.fault_probability})")
        self._mgr.channel.send(dest.peer.endpoint, self.status(sender.room, KVPoll.Success))
        sender.finish(index)

    def _write_pages(self, dest: Destination, src: np.ndarray, dst: np.ndarray, first: int) -> int:
        """Whole pages per contiguous run (the decode rank holds this rank's heads); a head slice as
        a stream (landing.py) where the decode rank holds exactly it or asked for it landed; else the
        slice of every token in place: one entry per token and buffer (the slow, obvious path)."""
        peer, heads = dest.peer, dest.heads
        geo, remote = self._mgr.args.geometry, peer.geometry
        if heads is not None and heads[2] == geo.head_num == remote.head_num:
            heads = None
        if heads is None:
            runs = contiguous_runs(src, dst)
            item = self._item_lens[:, None]  # [num_bufs, 1]
            return self._write_entries(peer, (self._kv_ptrs[:, None] + runs.src_starts[None, :] * item).ravel(),
                                       (peer.kv_ptrs[:, None] + runs.dst_starts[None, :] * item).ravel(),
                                       (runs.lengths[None, :] * item).ravel())
        src_head, dst_head, n = heads
        if n == 0 or len(src) == 0:
            return 0
        if dest.landing or n == remote.head_num:
            return self._write_stream(dest, src, first)
        ps = geo.page_size
        head_bytes = int(self._item_lens[0]) // (ps * geo.head_num)
        offsets = np.arange(ps, dtype=np.int64)
        src_slots = (src[:, None] * ps + offsets).ravel()  # [num_tokens]
        dst_slots = (dst[:, None] * ps + offsets).ravel()
        srcs = (self._kv_ptrs[:, None] + (src_slots * geo.head_num + src_head)[None, :] * head_bytes).ravel()
        dsts = (peer.kv_ptrs[:, None] + (dst_slots * remote.head_num + dst_head)[None, :] * head_bytes).ravel()
        return self._write_entries(peer, srcs, dsts, np.full(len(srcs), n * head_bytes, dtype=np.int64))

    def _write_stream(self, dest: Destination, src: np.ndarray, first: int) -> int:
        """This rank's slice of the chunk's tokens, token-major, at its place in the stream of the
        decode's pages (landing.py): straight from the pool where the slice is every head of a token
        here, else gathered through this thread's staging buffer, as many tokens at a time as it holds."""
        src_head, _, n = dest.heads
        geo, remote = self._mgr.args.geometry, dest.peer.geometry
        ps = geo.page_size
        head_bytes = int(self._item_lens[0]) // (ps * geo.head_num)
        token_bytes, page_bytes = n * head_bytes, ps * remote.head_num * head_bytes  # the decode's page
        slots = (src[:, None] * ps + np.arange(ps, dtype=np.int64)).ravel()  # [num_tokens]
        start = slice_start(dest.heads, len(dest.pages), ps, head_bytes, first)
        if n == geo.head_num or not (self._mgr.args.kv_tensors and self.config.staging_bytes):
            runs = merge_runs((slots * geo.head_num + src_head) * head_bytes, token_bytes)
            pieces = zip_runs(runs, stream_runs(dest.pages, page_bytes, start, len(slots) * token_bytes))
            return self._write_stream_pieces(dest.peer, self._kv_ptrs, pieces)
        nbytes = 0
        for i, t, bases in self._gathered(slots, src_head, n):
            whole = ByteRuns(np.zeros(1, dtype=np.int64), np.array([t * token_bytes], dtype=np.int64))
            pieces = zip_runs(whole, stream_runs(dest.pages, page_bytes, start + i * token_bytes, t * token_bytes))
            nbytes += self._write_stream_pieces(dest.peer, bases, pieces)
        return nbytes

    def _gathered(self, slots: np.ndarray, src_head: int, n: int):
        """Yields (first token, tokens, [buffers] staging address of each buffer's part) per piece
        of heads src_head.. of `slots` gathered into this thread's staging buffer (reused by the next)."""
        import torch

        bufs = self._mgr.args.kv_tensors
        nb, dim = len(bufs), bufs[0].shape[-1]
        token_bytes = n * dim * bufs[0].element_size()
        staging = self._staging()
        per_piece = staging.numel() // (nb * token_bytes)
        assert per_piece >= 1, f"staging_bytes {staging.numel()} holds no token of {nb} buffers"
        for i in range(0, len(slots), per_piece):
            t = min(per_piece, len(slots) - i)
            view = staging[:nb * t * token_bytes].view(bufs[0].dtype).view(nb, t, n, dim)
            index = torch.from_numpy(slots[i:i + t]).to(staging.device)
            for b, buf in enumerate(bufs):  # [t, n, head_dim] of every buffer
                torch.index_select(buf[:, src_head:src_head + n], 0, index, out=view[b])
            if staging.is_cuda:
                torch.cuda.current_stream(staging.device).synchronize()
            yield i, t, staging.data_ptr() + np.arange(nb, dtype=np.int64) * t * token_bytes

    def _write_stream_pieces(self, peer: DecodePeer, src_bases: np.ndarray, pieces: Pieces) -> int:
        """The same pieces in every layer buffer: from src_bases[b] + src, to the peer's buffer b + dst."""
        nb = len(peer.kv_ptrs)
        return self._write_entries(peer, (src_bases[:, None] + pieces.src[None, :]).ravel(),
                                   (peer.kv_ptrs[:, None] + pieces.dst[None, :]).ravel(),
                                   np.broadcast_to(pieces.lengths[None, :], (nb, len(pieces.lengths))).ravel())

    def _write_entries(self, peer: DecodePeer, srcs: np.ndarray, dsts: np.ndarray, lens: np.ndarray) -> int:
        step = self.config.max_batch_entries
        for i in range(0, len(lens), step):
            self._mgr.engine.batch_write(peer.session_id, srcs[i:i + step].tolist(), dsts[i:i + step].tolist(),
                                         lens[i:i + step].tolist())
        return int(lens.sum())

    def _staging(self):
        """This transfer thread's staging buffer, registered with Mooncake on first use."""
        import torch

        staging = getattr(self._local, "staging", None)
        if staging is None:
            device = self._mgr.args.kv_tensors[0].device
            staging = torch.empty(self.config.staging_bytes, dtype=torch.uint8, device=device)
            with self._staging_lock:
                self._mgr.engine.register([staging.data_ptr()], [staging.nbytes])
                self._stagings.append(staging)  # kept alive until the manager deregisters everything
            self._local.staging = staging
        return staging

    def _write_tail(self, dest: Destination, state_slot: Optional[int], meta_slot: int) -> int:
        """After the last chunk's pages, one batched write: a hybrid model's recurrent state (slot
        `state_slot` of every state buffer into the decode's slot; each buffer is contiguous and
        slot-major, so a slot is one entry per buffer; between different TP sizes, the rows of it the
        decode rank takes, a few ranges per buffer), then the metadata slot (its draft part from rank 0
        only: base.MetadataBuffers)."""
        size = self.metadata.item_bytes
        n = size if self._mgr.args.tp_rank == 0 else self.metadata.BASE_BYTES
        srcs, dsts, lens = [self.metadata.data_ptr + meta_slot * size], [dest.peer.aux_ptr + dest.meta_slot * size], [n]
        if len(self._state_ptrs):
            if state_slot is None:
                raise KVTransferError("the last chunk of a hybrid model's request came without its state slot")
            src_base = self._state_ptrs + state_slot * self._state_items  # [buffers]
            dst_base = dest.peer.state_ptrs + dest.state_slot * self._remote_state_items(dest.peer)
            if dest.state_rows is None:
                s_l, d_l, n_l = src_base.tolist(), dst_base.tolist(), self._state_items.tolist()
            else:
                half = len(self._state_ptrs) // 2  # conv buffers, then the delta-rule ones
                s_l, d_l, n_l = [], [], []
                for kind, src_row, dst_row, rows in dest.state_rows:
                    for b in range(kind * half, (kind + 1) * half):
                        row = int(self._state_rows[b])
                        s_l.append(int(src_base[b]) + src_row * row)
                        d_l.append(int(dst_base[b]) + dst_row * row)
                        n_l.append(rows * row)
            srcs, dsts, lens = s_l + srcs, d_l + dsts, n_l + lens
        self._mgr.engine.batch_write(dest.peer.session_id, srcs, dsts, lens)
        return int(sum(lens))

    def close(self) -> None:
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join(timeout=5)
