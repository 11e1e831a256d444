"""MooncakeKVManager: one per engine rank. Owns the transfer engine with the registered KV and
metadata buffers, the ZMQ side channel and the listener thread; the role-specific room tables
live in sender.py (prefill) and receiver.py (decode).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import asdict
from typing import Optional, Union

import zmq

from baton.engine.disaggregation.base import (DisaggregationMode, KVArgs, KVManagerBase,
                                              MetadataBuffers, TransferConfig)
from baton.engine.disaggregation.bootstrap_server import PrefillRankInfo, register_prefill_rank
from baton.engine.disaggregation.mooncake.receiver import DecodeRooms, MooncakeKVReceiver
from baton.engine.disaggregation.mooncake.sender import MooncakeKVSender, PrefillRooms
from baton.engine.disaggregation.mooncake.side_channel import SideChannel
from baton.engine.disaggregation.mooncake.transfer_engine import MooncakeTransferEngine

logger = logging.getLogger(__name__)


class MooncakeKVManager(KVManagerBase):
    """`bootstrap_addr` ("host:port" of this engine's bootstrap server) is required in prefill mode."""

    def __init__(self, args: KVArgs, metadata: MetadataBuffers, mode: Union[DisaggregationMode, str],
                 config: TransferConfig, bootstrap_addr: Optional[str] = None) -> None:
        self.args, self.metadata, self.config = args, metadata, config
        self.abort_grace_s = config.abort_grace_s
        self.mode = DisaggregationMode(mode)
        self.engine = MooncakeTransferEngine(config.host, config.protocol, config.ib_device)
        self.engine.register(args.kv_data_ptrs + args.aux_data_ptrs + args.state_data_ptrs,
                             args.kv_data_lens + args.aux_data_lens + args.state_data_lens)
        self.channel = SideChannel(config.host)
        self.stopping = threading.Event()
        self.rooms: Union[PrefillRooms, DecodeRooms]
        if self.mode == DisaggregationMode.PREFILL:
            assert bootstrap_addr, "a prefill manager registers with its engine's bootstrap server"
            self.rooms = PrefillRooms(self)
        else:
            self.rooms = DecodeRooms(self)
        self._listener = threading.Thread(target=self._listen, name=f"kv-{self.mode.value}-listener", daemon=True)
        self._listener.start()
        if self.mode == DisaggregationMode.PREFILL:
            info = PrefillRankInfo(args.engine_rank, self.channel.endpoint, self.engine.session_id,
                                   asdict(args.geometry), args.dp_size, args.tp_rank, args.tp_size, args.head_start)
            register_prefill_rank(bootstrap_addr, info, config.bootstrap_timeout_s)

    @property
    def session_id(self) -> str:
        return self.engine.session_id

    def _listen(self) -> None:
        """Every peer message of this rank comes through here: one that cannot be read or handled
        (another version, a stray client on the port, a bug) is logged and dropped, never the thread."""
        while not self.stopping.is_set():
            try:
                msg = self.channel.recv(timeout_ms=100)
                if msg is not None:
                    self.rooms.handle(msg)
            except zmq.ZMQError:
                if self.stopping.is_set():
                    return
                raise
            except Exception as e:  # noqa: BLE001 - a bad message is the sender's problem
                logger.warning("KV %s side channel %s: dropped a message that could not be handled (%s: %s)",
                               self.mode.value, self.channel.endpoint, type(e).__name__, e)

    def create_sender(self, room: int) -> MooncakeKVSender:
        assert isinstance(self.rooms, PrefillRooms), "senders live on prefill engines"
        return MooncakeKVSender(self.rooms, room)

    def create_receiver(self, bootstrap_addr: str, room: int) -> MooncakeKVReceiver:
        assert isinstance(self.rooms, DecodeRooms), "receivers live on decode engines"
        return MooncakeKVReceiver(self.rooms, bootstrap_addr, room)

    def num_rooms(self) -> int:
        return self.rooms.num_rooms()

    def close(self) -> None:
        self.stopping.set()
        self._listener.join(timeout=5)
        self.rooms.close()
        self.channel.close()
        self.engine.close()
