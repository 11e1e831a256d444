"""Per-request bookkeeping shared by every transfer backend (validation, poll states, timeouts).

A backend subclasses these and supplies only the I/O hooks: how a sender submits a chunk and
tells the decode about an abort, how a receiver sends its destination and tells the prefill.
Methods named in the base contract run on the scheduler thread; `attach`, `record`, `finish` and
`on_status` are called by the backend's threads.
"""
from __future__ import annotations

import threading
import time
from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from baton.engine.disaggregation.base import (KVArgs, KVGeometry, KVMetadata, KVPoll, KVReceiverBase, KVSenderBase,
                                              KVTransferError, MetadataBuffers, PageList, RoomStatus,
                                              TransferConfig, TransferStats, as_pages, deadline_passed)


@dataclass(frozen=True)
class Destination:
    """Where the decode wants one request's KV, as received by the prefill."""

    peer: Any  # backend handle of the decode engine (session, registered pointers)
    pages: np.ndarray  # [num_pages - prefix_pages] decode page indices, token order
    meta_slot: int
    prefix_pages: int = 0  # leading prompt pages the decode already holds: not sent
    state_slot: Optional[int] = None  # hybrid models: the decode row the recurrent state goes to
    heads: Optional[tuple[int, int, int]] = None  # (src, dst, count) head slice; None: the whole shard
    num_dests: int = 1  # decode ranks that send this prefill rank a destination for the room
    # a hybrid between different TP sizes: (buffers, src row, dst row, rows) of the state slot to move
    # (head_slices.state_row_slices); None: the whole slot
    state_rows: Optional[tuple[tuple[int, int, int, int], ...]] = None
    landing: bool = False  # the slice goes packed into the pages, for the decode to scatter (landing.py)


def check_destination(room: int, local: KVArgs, remote_geometry: KVGeometry, remote_kv_len: int,
                      remote_aux_len: int, pages: np.ndarray, meta_slot: int, state_slot: Optional[int] = None,
                      remote_state_slots: int = 0, heads: Optional[tuple[int, int, int]] = None,
                      state_rows: Optional[tuple] = None,
                      remote_state_items: Optional[tuple[int, ...]] = None, landing: bool = False) -> Optional[str]:
    """Why the prefill (`local`) must refuse a decode's destination, or None when it fits.
    `remote_state_items`: bytes per state slot of each of the decode rank's state buffers."""
    mismatch = local.geometry.mismatch(remote_geometry)
    if mismatch:
        return (f"room {room}: KV page geometry differs between prefill and decode (prefill != decode): {mismatch}; "
                "both engines must serve the same model with the same --page-size, --kv-cache-dtype and "
                "--mamba-ssm-dtype")
    if heads is None and local.geometry.head_num != remote_geometry.head_num:
        return f"room {room}: the decode rank holds {remote_geometry.head_num} KV heads and this rank " \
               f"{local.geometry.head_num}, but the decode asked for whole pages"
    if landing and heads is None:
        return f"room {room}: the decode asked for whole pages to land as a head slice"
    if heads is not None:
        src, dst, n = heads
        if min(src, dst, n) < 0 or src + n > local.geometry.head_num or dst + n > remote_geometry.head_num:
            return f"room {room}: KV head slice {list(heads)} out of range ({local.geometry.head_num} heads here, " \
                   f"{remote_geometry.head_num} on the decode rank)"
        if local.has_state and state_rows is None:
            return (f"room {room}: the decode runs another --tp-size but named no recurrent-state rows to take "
                    "(an engine that cannot move a hybrid's state between TP sizes)")
    if state_rows is not None and (reason := _check_state_rows(local, state_rows, remote_state_items)):
        return f"room {room}: {reason}"
    g, here = remote_geometry, local.geometry
    elem_bytes = local.kv_item_lens[0] // (here.page_size * here.head_num * here.head_dim)
    page_bytes = g.page_size * g.head_num * g.head_dim * elem_bytes  # a page of the decode rank (its heads)
    if len(pages) and (pages.min() < 0 or (int(pages.max()) + 1) * page_bytes > remote_kv_len):
        return f"room {room}: destination page out of the decode pool's range"
    if meta_slot < 0 or (meta_slot + 1) * local.aux_item_lens[0] > remote_aux_len:
        return f"room {room}: metadata slot {meta_slot} out of the decode's range"
    if local.has_state and (state_slot is None or not 0 <= state_slot < remote_state_slots):
        return f"room {room}: recurrent-state slot {state_slot} out of the decode's range ({remote_state_slots} slots)"
    return None


def _check_state_rows(local: KVArgs, state_rows: tuple, remote_items: Optional[tuple[int, ...]]) -> Optional[str]:
    """Every state row slice inside a slot on both sides (buffers 0: conv, 1: delta-rule)."""
    if not local.has_state:
        return "state rows named for a model without recurrent state"
    half = len(local.state_item_lens) // 2  # conv buffers, then as many delta-rule buffers
    remote = remote_items or local.state_item_lens
    for kind, src, dst, rows in state_rows:
        if kind not in (0, 1) or min(src, dst, rows) < 0:
            return f"state row slice {[kind, src, dst, rows]} is malformed"
        b = kind * half
        row = local.state_row_lens[b]
        if (src + rows) * row > local.state_item_lens[b] or (dst + rows) * row > remote[b]:
            return f"state row slice {[kind, src, dst, rows]} out of a slot's range"
    return None


class _RoomStatusMixin:
    """fail()/done over the `_status: RoomStatus` every sender and receiver keeps."""

    _status: RoomStatus

    def fail(self, reason: str, conflict: bool = False) -> bool:
        return self._status.fail(reason, conflict)

    @property
    def done(self) -> bool:
        return self._status.done

    def room_conflict(self) -> bool:
        return self._status.conflict


class CommonKVSender(_RoomStatusMixin, KVSenderBase):
    def __init__(self, room: int, config: TransferConfig, metadata: MetadataBuffers) -> None:
        self.room = room
        self.config = config
        self._metadata = metadata
        self._status = RoomStatus()
        self._created = time.monotonic()
        self.dest: Optional[Destination] = None  # the first of `dests`, once all arrived (attach())
        self.dests: list[Destination] = []  # one per decode TP rank that takes heads from this rank
        self.num_pages: Optional[int] = None
        self.meta_slot: Optional[int] = None
        self.state_slot: Optional[int] = None  # the prefill's row with the final state, set by the last send()
        self._sent = 0  # prompt pages handed to send() so far (prefix pages the decode holds included)
        self._bytes, self._seconds = 0, 0.0
        self._attach_lock = threading.Lock()
        self._finished: set[int] = set()  # indices into dests written to the end

    # ---- backend side ----

    def attach(self, dest: Destination) -> Optional[str]:
        """A decode rank's destination. Every decode rank reserved the same pages (its driver's), so
        they differ only in where the heads go; the sender waits for all `num_dests` of them. One
        more is another decode request given this room: refused (the reason returned, for the backend
        to tell that decode as a room conflict), and nothing is ever written to it."""
        with self._attach_lock:
            if self.dest is not None:
                return (f"bootstrap_room {self.room} is already paired with a decode request on the prefill: "
                        "one room must name one prefill request and one decode request")
            self.dests.append(dest)
            ready = len(self.dests) == dest.num_dests
        if ready:
            self.dest = self.dests[0]
            self._status.advance(KVPoll.WaitingForInput)
        return None

    def record(self, nbytes: int, seconds: float) -> None:
        self._bytes += nbytes
        self._seconds += seconds

    def finish(self, dest_index: int = 0) -> None:
        """Destination `dest_index` has every page and the metadata: Success once all have."""
        with self._attach_lock:
            self._finished.add(dest_index)
            done = len(self._finished) == len(self.dests)
        if done:
            self._status.advance(KVPoll.Success)

    @abstractmethod
    def _submit(self, src_pages: np.ndarray, dst_pages: np.ndarray, is_last: bool) -> None:
        """Queue one chunk for writing; on is_last also write the metadata slot and notify the decode."""

    @abstractmethod
    def _notify_abort(self, reason: str, conflict: bool = False) -> None:
        """Tell every decode destination the room failed; `conflict`: refused before anything was
        written to it (the room names another request)."""

    # ---- scheduler side ----

    def init(self, num_pages: int, meta_slot: int) -> None:
        """Before any chunk: a destination for another prompt (a room given to two pairings) is
        refused now, before anything is written to it."""
        assert self.num_pages is None, f"init() twice for room {self.room}"
        assert num_pages >= 0 and 0 <= meta_slot < self._metadata.size
        self.num_pages, self.meta_slot = num_pages, meta_slot
        held = self.dest.prefix_pages + len(self.dest.pages) if self.dest is not None else num_pages
        if held != num_pages:
            reason = (f"bootstrap_room {self.room} pairs requests of different prompts: the prefill's has "
                      f"{num_pages} pages, the decode's {held}; one room must name one prefill request and one "
                      "decode request")
            if self._status.fail(reason, conflict=True):
                self._notify_abort(reason, conflict=True)

    def send(self, page_indices: PageList, is_last: bool = False, metadata: Optional[KVMetadata] = None,
             state_slot: Optional[int] = None) -> None:
        if self._status.done:
            return
        if self.dest is None:
            raise KVTransferError(f"room {self.room}: send() before poll() reached WaitingForInput")
        assert self.num_pages is not None, "init() before send()"
        assert not is_last or metadata is not None, "the last chunk carries the metadata"
        pages = as_pages(page_indices)
        reason = self._check_chunk(len(pages), is_last)
        if reason is not None:
            self.abort(reason)
            return
        skip = self.dest.prefix_pages
        start, self._sent = self._sent, self._sent + len(pages)
        first = max(start, skip)  # pages before `skip` are already in the decode's prefix cache
        src, dst = pages[first - start:], self.dest.pages[first - skip:self._sent - skip]
        if is_last:
            self._metadata.set(self.meta_slot, metadata)
            self.state_slot = state_slot
        elif len(src) == 0:
            return
        self._status.advance(KVPoll.Transferring)
        self._submit(src, dst, is_last)

    def _check_chunk(self, n: int, is_last: bool) -> Optional[str]:
        total = self.dest.prefix_pages + len(self.dest.pages)
        if self.num_pages != total:
            return (f"room {self.room}: page count mismatch, prefill has {self.num_pages} pages, "
                    f"decode holds {self.dest.prefix_pages} and reserved {len(self.dest.pages)}")
        end = self._sent + n
        if end > total or (is_last and end != total):
            return f"room {self.room}: chunk ends at page {end} of {total} (is_last={is_last})"
        return None

    def poll(self) -> KVPoll:
        timeout_s = self.config.bootstrap_timeout_s
        if self._status.status == KVPoll.Bootstrapping and deadline_passed(self._created, timeout_s):
            self._status.fail(f"bootstrap timeout: no destination from a decode engine for room {self.room} "
                              f"within {timeout_s:g}s")
        return self._status.status

    def failure_reason(self) -> Optional[str]:
        return self._status.reason

    def stats(self) -> TransferStats:
        return TransferStats(self._bytes, self._seconds)

    def abort(self, reason: str) -> None:
        if self._status.fail(reason) and self.dests:
            self._notify_abort(reason)


class CommonKVReceiver(_RoomStatusMixin, KVReceiverBase):
    def __init__(self, bootstrap_addr: str, room: int, config: TransferConfig, metadata: MetadataBuffers) -> None:
        self.bootstrap_addr = bootstrap_addr
        self.room = room
        self.config = config
        self._metadata = metadata
        self._status = RoomStatus()
        self._created = time.monotonic()
        self._lock = threading.Lock()  # peer / pages / _dest_sent, set from two threads
        self.peer: Any = None  # backend handle of the prefill rank, filled by attach()
        self.pages: Optional[np.ndarray] = None
        self.meta_slot: Optional[int] = None
        self.prefix_pages = 0
        self.state_slot: Optional[int] = None
        self._init_time: Optional[float] = None
        self._dest_sent = False
        self._refused_by: set[str] = set()  # prefill ranks that refused the destination (a room conflict)

    # ---- backend side ----

    def attach(self, peer: Any) -> None:
        with self._lock:
            self.peer = peer
            send_now = self.pages is not None and not self._dest_sent
            self._dest_sent |= send_now
        self._status.advance(KVPoll.WaitingForInput)
        if send_now:
            self._send_destination_safely()

    def on_status(self, status: KVPoll, reason: Optional[str], rank: str = "", conflict: bool = False) -> None:
        """`conflict`: prefill rank `rank` refused the destination before writing to it."""
        if status != KVPoll.Success:
            if conflict:
                with self._lock:
                    self._refused_by.add(rank)
            self._status.fail(reason or "prefill reported failure", conflict)
            return
        got = self._metadata.get(self.meta_slot).bootstrap_room
        if got != self.room:
            self._status.fail(f"corrupted transfer: metadata slot {self.meta_slot} carries bootstrap_room {got}, "
                              f"expected {self.room}")
        else:
            self._status.advance(KVPoll.Success)

    @abstractmethod
    def _send_destination(self) -> None:
        """Tell the prefill rank `self.peer` the pages and metadata slot for this room."""

    @abstractmethod
    def _notify_abort(self, reason: str) -> None: ...

    def _send_destination_safely(self) -> None:
        try:
            self._send_destination()
        except Exception as e:  # noqa: BLE001 - any I/O error ends this request only
            self._status.fail(f"room {self.room}: could not send the destination to {self.bootstrap_addr}: {e}")

    # ---- scheduler side ----

    def init(self, page_indices: PageList, meta_slot: int, prefix_pages: int = 0,
             state_slot: Optional[int] = None) -> None:
        assert 0 <= meta_slot < self._metadata.size and prefix_pages >= 0
        with self._lock:
            assert self.pages is None, f"init() twice for room {self.room}"
            self.pages, self.meta_slot, self.prefix_pages = as_pages(page_indices), meta_slot, prefix_pages
            self.state_slot = state_slot
            self._init_time = time.monotonic()
            send_now = self.peer is not None and not self._dest_sent
            self._dest_sent |= send_now
        if send_now:
            self._send_destination_safely()

    def poll(self) -> KVPoll:
        """A timeout is an abort: once the destination is out, the prefill must be told to write
        nothing more, before the decode gives those pages to another request."""
        status = self._status.status
        if status == KVPoll.Bootstrapping and deadline_passed(self._created, self.config.bootstrap_timeout_s):
            self.abort(f"bootstrap timeout: prefill at {self.bootstrap_addr} not reachable for room "
                       f"{self.room} within {self.config.bootstrap_timeout_s:g}s")
        elif status in (KVPoll.WaitingForInput, KVPoll.Transferring) and self._init_time is not None \
                and deadline_passed(self._init_time, self.config.waiting_timeout_s):
            self.abort(f"waiting timeout: no KV from prefill at {self.bootstrap_addr} for room {self.room} "
                       f"within {self.config.waiting_timeout_s:g}s")
        return self._status.status

    def metadata(self) -> KVMetadata:
        assert self._status.status == KVPoll.Success, "metadata() before Success"
        return self._metadata.get(self.meta_slot)

    def failure_reason(self) -> Optional[str]:
        return self._status.reason

    def destination_untouched(self) -> bool:
        with self._lock:
            return len(self._refused_by) >= self._num_peers()

    def _num_peers(self) -> int:
        """The prefill ranks the destination goes to."""
        return 1

    def abort(self, reason: str) -> None:
        if self._status.fail(reason) and self.peer is not None:
            self._notify_abort(reason)
