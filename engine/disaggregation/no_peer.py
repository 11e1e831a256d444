"""Sender and receiver for requests that run on one engine of a PD pair without a peer.

A request whose `bootstrap_host` is FAKE_BOOTSTRAP_HOST (SGLang's value, so routers and probes that
know it work unchanged) goes through the normal queues, forward passes and memory accounting, but
no KV moves: the prefill's sender succeeds once its last chunk is handed over; the decode's receiver
succeeds once its pages are reserved and yields token 0 as the "first token". `/health_generate`
uses it to prove the scheduler and model run on a prefill or decode engine.
"""
from __future__ import annotations

from typing import Optional

from baton.engine.disaggregation.base import (KVMetadata, KVPoll, KVReceiverBase, KVSenderBase, PageList,
                                              RoomStatus, TransferStats)
from baton.engine.disaggregation.common import _RoomStatusMixin

FAKE_BOOTSTRAP_HOST = "2.2.2.2"


def is_no_peer(bootstrap_host: Optional[str]) -> bool:
    return bootstrap_host == FAKE_BOOTSTRAP_HOST


class NoPeerSender(_RoomStatusMixin, KVSenderBase):
    def __init__(self, room: int) -> None:
        self.room = room
        self._status = RoomStatus()
        self._status.advance(KVPoll.WaitingForInput)  # the "destination" is known at once

    def init(self, num_pages: int, meta_slot: int) -> None:
        pass

    def send(self, page_indices: PageList, is_last: bool = False, metadata: Optional[KVMetadata] = None,
             state_slot: Optional[int] = None) -> None:
        if is_last:
            self._status.advance(KVPoll.Success)

    def poll(self) -> KVPoll:
        return self._status.status

    def failure_reason(self) -> Optional[str]:
        return self._status.reason

    def stats(self) -> TransferStats:
        return TransferStats(0, 0.0)

    def abort(self, reason: str) -> None:
        self._status.fail(reason)

    def clear(self) -> None:
        pass


class NoPeerReceiver(_RoomStatusMixin, KVReceiverBase):
    def __init__(self, room: int) -> None:
        self.room, self.bootstrap_addr = room, FAKE_BOOTSTRAP_HOST
        self._status = RoomStatus()
        self._status.advance(KVPoll.WaitingForInput)

    def init(self, page_indices: PageList, meta_slot: int, prefix_pages: int = 0,
             state_slot: Optional[int] = None) -> None:
        self._status.advance(KVPoll.Success)

    def poll(self) -> KVPoll:
        return self._status.status

    def metadata(self) -> KVMetadata:
        return KVMetadata(0, 0.0, self.room)

    def failure_reason(self) -> Optional[str]:
        return self._status.reason

    def abort(self, reason: str) -> None:
        self._status.fail(reason)

    def clear(self) -> None:
        pass
