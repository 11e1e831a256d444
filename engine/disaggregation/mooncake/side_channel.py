"""The ZMQ side channel a rank's room tables talk to their peers over, and what those tables
(sender.py PrefillRooms, receiver.py DecodeRooms) read of the manager that owns them (conn.py
MooncakeKVManager): the tables sit below the manager, which builds them."""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Optional, Protocol

import zmq

from baton.engine.disaggregation.base import KVTransferError
from baton.engine.disaggregation.mooncake import messages

if TYPE_CHECKING:
    from baton.engine.disaggregation.base import KVArgs, MetadataBuffers, TransferConfig
    from baton.engine.disaggregation.mooncake.transfer_engine import MooncakeTransferEngine


class SideChannel:
    """A bound PULL socket for what peers send us, and PUSH sockets (one per peer) to answer them."""

    def __init__(self, host: str) -> None:
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self.endpoint = f"tcp://{host}:{self._pull.bind_to_random_port(f'tcp://{host}')}"
        self._push: dict[str, zmq.Socket] = {}
        self._lock = threading.Lock()  # zmq sockets are not thread-safe

    def send(self, endpoint: str, msg: messages.Message) -> None:
        with self._lock:
            sock = self._push.get(endpoint)
            if sock is None:
                sock = self._push[endpoint] = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(endpoint)
            try:
                sock.send_multipart(messages.encode(msg), flags=zmq.NOBLOCK)
            except zmq.Again as e:
                raise KVTransferError(f"side channel to {endpoint} is full or down") from e

    def recv(self, timeout_ms: int) -> Optional[messages.Message]:
        if not self._pull.poll(timeout_ms):
            return None
        return messages.decode(self._pull.recv_multipart())

    def forget(self, endpoint: str, linger_ms: int = 0) -> None:
        """Close the socket to `endpoint`; what it still queues may leave for `linger_ms` (in the
        background: close() does not wait)."""
        with self._lock:
            sock = self._push.pop(endpoint, None)
            if sock is not None:
                sock.close(linger=linger_ms)

    def close(self) -> None:
        with self._lock:
            for sock in self._push.values():
                sock.close()
            self._push.clear()
            self._pull.close()
        self._ctx.term()


class RoomsOwner(Protocol):
    """What a rank's room table reads of its manager."""

    args: "KVArgs"  # this rank's registered buffers and geometry
    metadata: "MetadataBuffers"
    config: "TransferConfig"
    channel: SideChannel
    engine: "MooncakeTransferEngine"
    stopping: threading.Event  # set when the manager shuts down

    @property
    def session_id(self) -> str: ...
