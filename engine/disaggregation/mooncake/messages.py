"""Side-channel messages of the Mooncake backend (ZMQ PUSH -> PULL); with the bootstrap server's
routes they are the whole contract between a prefill rank and a decode engine.

    decode  -> prefill  Register  once per (decode engine, prefill session): where to write
    decode  -> prefill  Room      per request: destination pages, metadata slot (and state slot)
    decode  -> prefill  Abort     per request, when the decode gives up
    prefill -> decode   Status    per request: Success, or Failed with the reason

Frames: [kind, JSON header] plus, for Room, the raw int64 page array.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Optional, Union

import numpy as np


@dataclass(frozen=True)
class Register:
    session_id: str  # decode's Mooncake session "host:port"
    endpoint: str  # decode's side-channel PULL address
    kv_ptrs: list[int]
    kv_lens: list[int]
    aux_ptrs: list[int]
    aux_lens: list[int]
    geometry: dict
    state_ptrs: list[int] = field(default_factory=list)  # hybrid models: conv layers, then ssm layers
    state_lens: list[int] = field(default_factory=list)
    state_items: list[int] = field(default_factory=list)  # bytes per slot of each (its TP shard's)


@dataclass(frozen=True)
class Room:
    room: int
    session_id: str
    endpoint: str
    meta_slot: int
    pages: np.ndarray  # [num_pages - prefix_pages] int64
    prefix_pages: int = 0  # leading prompt pages the decode already holds (prefix cache)
    state_slot: Optional[int] = None  # hybrid models: the decode's request row for the recurrent state
    # different TP sizes (head_slices.py): [src_head, dst_head, num_heads] of each page this decode
    # rank takes from this prefill rank (None: the whole shard, equal TP sizes), and how many
    # decode ranks send this prefill rank a destination for the room
    heads: Optional[list[int]] = None
    num_dests: int = 1
    # a hybrid model between different TP sizes: [buffers, src_row, dst_row, rows] of the state slot
    # rows this decode rank takes (head_slices.state_row_slices; None: the whole slot)
    state_rows: Optional[list[list[int]]] = None
    # a decode rank narrower than this prefill rank: write the slice packed into the pages, which the
    # decode scatters (disaggregation/landing.py); False: in place
    landing: bool = False


@dataclass(frozen=True)
class Abort:
    room: int
    reason: str


@dataclass(frozen=True)
class Status:
    room: int
    status: int  # KVPoll value
    reason: Optional[str] = None
    rank: str = ""  # the prefill rank's key (rank_key): a decode rank may hear from several
    # Failed before anything was written to the decode's destination: the room names another request
    # on the prefill (a room given to two pairings); the decode may reuse those pages at once
    conflict: bool = False


Message = Union[Register, Room, Abort, Status]
_KINDS: dict[bytes, type] = {b"register": Register, b"room": Room, b"abort": Abort, b"status": Status}
_KIND_OF = {cls: kind for kind, cls in _KINDS.items()}


def encode(msg: Message) -> list[bytes]:
    if isinstance(msg, Room):
        header = {"room": msg.room, "session_id": msg.session_id, "endpoint": msg.endpoint, "meta_slot": msg.meta_slot,
                  "prefix_pages": msg.prefix_pages, "state_slot": msg.state_slot, "heads": msg.heads,
                  "num_dests": msg.num_dests, "state_rows": msg.state_rows, "landing": msg.landing}
        return [b"room", json.dumps(header).encode(), np.ascontiguousarray(msg.pages, dtype=np.int64).tobytes()]
    return [_KIND_OF[type(msg)], json.dumps(asdict(msg)).encode()]


def decode(frames: list[bytes]) -> Message:
    kind, header = frames[0], json.loads(frames[1])
    if kind == b"room":
        return Room(pages=np.frombuffer(frames[2], dtype=np.int64).copy(), **header)
    if kind not in _KINDS:
        raise ValueError(f"unknown side-channel message kind {kind!r}")
    return _KINDS[kind](**header)
