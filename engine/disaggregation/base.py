"""The KV-transfer contract between a prefill engine and a decode engine (PD disaggregation).

One manager per engine (per rank) owns the registered memory and the side channel; one sender
(prefill side) and one receiver (decode side) exist per request, paired by `bootstrap_room`.

    decode                                    prefill
    receiver = mgr.create_receiver(addr, R)   sender = mgr.create_sender(R)
      poll() Bootstrapping -> WaitingForInput   poll() Bootstrapping
    receiver.init(dst_pages, meta_slot)  ---->  poll() WaitingForInput   (destination arrived)
                                                sender.init(num_pages, meta_slot)
                                                sender.send(pages_of_chunk)            (per chunk)
      (KV pages written straight into the     sender.send(last_pages, is_last=True, metadata=M)
       decode pool, then the metadata slot)     poll() Transferring -> Success | Failed
      poll() Success | Failed  <------------  (status notification)

Page p covers pool slots [p * page_size, (p + 1) * page_size); page 0 is the dummy page. Both
sides list the request's pages in token order; the prefill's i-th page lands on the decode's i-th
(with different TP sizes, each decode rank's KV heads of it: head_slices.py). A hybrid model's
recurrent state goes with the last chunk, from the prefill's request row into the decode's.
The poll states are ordered so that ranks agree by taking the minimum.
"""
from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from enum import Enum, IntEnum
from typing import TYPE_CHECKING, NamedTuple, Optional, Sequence, Union

import numpy as np
import torch

if TYPE_CHECKING:
    from baton.engine.mem_cache.memory_pool import MHATokenToKVPool
    from baton.engine.mem_cache.state_pool import RecurrentStatePool
    from baton.engine.model_config import ModelConfig

PageList = Union[Sequence[int], np.ndarray, torch.Tensor]


class KVPoll(IntEnum):
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class DisaggregationMode(str, Enum):
    """--disaggregation-mode: an engine's PD role (null: colocated)."""

    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


class KVTransferError(RuntimeError):
    """A transfer could not be set up or carried out; the message says which side and why."""


class RoomInUse(KVTransferError):
    """A request asked for a bootstrap room another live request of this engine holds (a client that
    picks rooms itself and reused one): the new request is refused, the other one goes on."""

    def __init__(self, room: int) -> None:
        super().__init__(f"bootstrap_room {room} is already in use by another request on this engine")


@dataclass(frozen=True)
class KVGeometry:
    """What must be identical on both sides for page i of one pool to mean page i of the other."""

    page_size: int
    dtype: str  # the KV cache's
    layer_num: int  # KV layers (a hybrid model's full-attention layers)
    head_num: int  # this rank's KV heads (a TP shard)
    head_dim: int
    kv_heads_total: int = 0  # the model's KV heads (0: not told; then head_num must match)
    # what else must agree for the state and the KV to mean the same on both sides (empty: not told)
    model: str = ""  # architecture and sizes (model_identity)
    layer_layout: str = ""  # one letter per layer: F full attention, L linear attention
    state_dtype: str = ""  # a hybrid's recurrent state: "conv <dtype>, ssm <dtype>"; "" without one
    state_shape: str = ""  # its linear layers and heads (the model's, whatever the TP size)

    def mismatch(self, other: "KVGeometry") -> Optional[str]:
        """None when equal, else 'page_size 16 != 1, dtype ...' naming every differing field. A
        rank's own head count may differ where both tell the model's (different TP sizes)."""
        skip = {"head_num"} if self.kv_heads_total and other.kv_heads_total else set()
        diffs = [f"{f.name} {getattr(self, f.name)} != {getattr(other, f.name)}"
                 for f in fields(self) if f.name not in skip and getattr(self, f.name) != getattr(other, f.name)]
        return ", ".join(diffs) or None


def model_identity(config: Optional["ModelConfig"]) -> tuple[str, str]:
    """(model, layer_layout) of a KVGeometry: the architecture with the sizes that shape its KV and
    state, and one letter per layer (F full attention, L linear attention)."""
    if config is None:
        return "", ""
    return f"{config.architecture} hidden {config.text.hidden_size} vocab {config.text.vocab_size}", config.layer_layout


def model_kv_heads(config: Optional["ModelConfig"]) -> Optional[int]:
    """The model's KV heads (all TP ranks together), or None without a config."""
    return None if config is None else config.heads.num_kv_heads


def model_linear_heads(config: Optional["ModelConfig"]) -> tuple[int, ...]:
    """A hybrid model's (key heads, value heads, key head dim, value head dim) of its linear-attention
    layers, all TP ranks together; () without a config."""
    linear = None if config is None else config.heads.linear
    return () if linear is None else linear.as_tuple()


@dataclass(frozen=True)
class KVArgs:
    """The memory one engine registers: KV buffers (all K layers, then all V layers), metadata
    buffers and, for a hybrid model, its recurrent-state buffers (every linear layer's conv state,
    then every linear layer's delta-rule state; one contiguous tensor each, slot-major).

    Item lengths are bytes per page for the KV buffers, bytes per slot for the metadata and state
    buffers. A state slot is a request row (mem_cache/state_pool.py).
    """

    geometry: KVGeometry
    kv_data_ptrs: tuple[int, ...]
    kv_data_lens: tuple[int, ...]
    kv_item_lens: tuple[int, ...]
    aux_data_ptrs: tuple[int, ...]
    aux_data_lens: tuple[int, ...]
    aux_item_lens: tuple[int, ...]
    engine_rank: int = 0  # this engine's DP rank
    dp_size: int = 1  # its engine's DP ranks
    tp_rank: int = 0  # the TP rank whose KV shard this is (disaggregation/tp_fanout.py)
    tp_size: int = 1
    state_data_ptrs: tuple[int, ...] = ()  # hybrid models only (see above)
    state_data_lens: tuple[int, ...] = ()
    state_item_lens: tuple[int, ...] = ()
    head_start: int = 0  # the first of the model's KV heads this rank holds (head_slices.py)
    # hybrid models: bytes per row of each state buffer's slot (a conv channel, a delta-rule value head)
    # and the model's linear heads (key heads, value heads, key dim, value dim): what a decode of
    # another TP size takes from this rank is rows of a slot (head_slices.state_row_slices)
    state_row_lens: tuple[int, ...] = ()
    linear_heads: tuple[int, ...] = ()
    # the KV buffers themselves ([slots, head_num, head_dim] each, same order as kv_data_ptrs): a
    # prefill gathers head slices from them when the decode rank holds fewer heads (head_slices.py)
    kv_tensors: tuple = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        assert len(self.kv_data_ptrs) == len(self.kv_data_lens) == len(self.kv_item_lens) == 2 * self.geometry.layer_num
        assert len(self.aux_data_ptrs) == len(self.aux_data_lens) == len(self.aux_item_lens) >= 1
        assert len(self.state_data_ptrs) == len(self.state_data_lens) == len(self.state_item_lens)
        assert bool(self.state_data_ptrs) == bool(self.geometry.state_dtype), "state buffers and state geometry go together"

    @property
    def has_state(self) -> bool:
        return bool(self.state_data_ptrs)

    def state_slots(self) -> int:
        """Slots each state buffer holds (0 without state)."""
        return self.state_data_lens[0] // self.state_item_lens[0] if self.has_state else 0

    @classmethod
    def from_pool(cls, pool: "MHATokenToKVPool", metadata: "MetadataBuffers", engine_rank: int = 0,
                  dp_size: int = 1, tp_rank: int = 0, tp_size: int = 1, state_pool: Optional["RecurrentStatePool"] = None,
                  model_config: Optional["ModelConfig"] = None, kv_heads_total: Optional[int] = None) -> "KVArgs":
        """`kv_heads_total`: the model's KV heads (default: the pool's times tp_size, no replication)."""
        from baton.engine.disaggregation.head_slices import kv_head_range

        total = kv_heads_total or pool.head_num * tp_size
        head_start, head_num = kv_head_range(total, tp_size, tp_rank)
        assert head_num == pool.head_num, f"TP rank {tp_rank} of {tp_size} holds {head_num} of {total} KV heads"
        ptrs, lens, per_token = pool.get_contiguous_buf_infos()
        model, layout = model_identity(model_config)
        state_dtype = state_shape = ""
        state_ptrs: list[int] = []
        state_lens: list[int] = []
        state_items: list[int] = []
        row_lens: list[int] = []
        linear_heads: tuple[int, ...] = ()
        if state_pool is not None:
            bufs = [*state_pool.conv, *state_pool.ssm]
            assert all(t.is_contiguous() for t in bufs)
            state_ptrs, state_lens = [t.data_ptr() for t in bufs], [t.nbytes for t in bufs]
            state_items = [t[0].nbytes for t in bufs]
            row_lens = [t[0][0].nbytes for t in bufs]
            shapes = state_pool.shapes
            state_dtype = ", ".join(f"{name} {str(t.dtype).removeprefix('torch.')}"
                                    for name, t in (("conv", state_pool.conv[0]), ("ssm", state_pool.ssm[0])))
            state_shape = f"{shapes.num_layers} linear layers, conv {list(shapes.conv)}, ssm {list(shapes.ssm)}"
            linear_heads = model_linear_heads(model_config)
            if linear_heads:  # the model's heads: the same on both sides whatever their TP sizes
                hk, hv, dk, dv = linear_heads
                state_shape = (f"{shapes.num_layers} linear layers, key heads {hk} x {dk}, value heads {hv} x {dv}, "
                               f"conv kernel {shapes.conv[1] + 1}")
        geometry = KVGeometry(pool.page_size, str(pool.dtype).removeprefix("torch."), pool.layer_num,
                              pool.head_num, pool.head_dim, total, model, layout, state_dtype, state_shape)
        return cls(geometry, tuple(ptrs), tuple(lens), tuple(b * pool.page_size for b in per_token),
                   (metadata.data_ptr,), (metadata.nbytes,), (metadata.item_bytes,), engine_rank, dp_size,
                   tp_rank, tp_size, tuple(state_ptrs), tuple(state_lens), tuple(state_items), head_start,
                   tuple(row_lens), linear_heads, tuple(pool.k_buffer + pool.v_buffer))


@dataclass(frozen=True)
class TransferConfig:
    """Knobs of a transfer backend. Timeouts follow SGLang's defaults (SGLANG_DISAGGREGATION_*)."""

    host: str = "127.0.0.1"  # this engine's address for the transfer engine and the side channel
    protocol: str = "tcp"  # "tcp" | "rdma"
    ib_device: Optional[str] = None  # "mlx5_0,mlx5_1" for rdma
    bootstrap_timeout_s: float = 300.0  # creation -> peer handshake done
    waiting_timeout_s: float = 300.0  # decode: destination sent -> KV arrived
    heartbeat_interval_s: float = 5.0
    heartbeat_max_failures: int = 2
    fault_probability: float = 0.0  # tests: report this fraction of transfers as failed
    fault_seed: Optional[int] = None
    # decode: pages of a request given up on mid-transfer stay out of use this long, since a write
    # the prefill already issued may still land in them
    abort_grace_s: float = 10.0
    max_batch_entries: int = 512  # runs per batched write; below Mooncake TCP's per-peer queue (1024)
    # prefill: per transfer thread, registered memory to gather head slices in (TP sizes that differ)
    staging_bytes: int = 64 << 20
    # decode narrower than its prefill: each prefill rank's heads land packed in the request's own
    # pages and are scattered into place (landing.py); False: one write per token and layer buffer
    # in place (the slow, obvious path)
    land_slices: bool = True
    num_transfer_threads: int = 2

    def __post_init__(self) -> None:
        assert self.protocol in ("tcp", "rdma"), f"unknown protocol {self.protocol!r}"
        assert 0.0 <= self.fault_probability <= 1.0
        assert self.max_batch_entries >= 1 and self.num_transfer_threads >= 1


class KVMetadata(NamedTuple):
    """What the prefill hands over besides the KV: the first output token, and the room as a check."""

    output_token_id: int
    output_logprob: float
    bootstrap_room: int
    # a prompt with images: what positions past it add to their index (M-RoPE, core/req.py rope_delta);
    # the decode continues from it without ever seeing the images' pixels
    rope_delta: int = 0
    # the 63-bit hash of the weight version the prefill ran (core/weight_version.py; 0: none told):
    # the decode refuses KV of weights other than its own
    weight_version_hash: int = 0


class MetadataBuffers:
    """Registered per-request metadata slots: a 64-byte base (one int64 row of 8), the first token's
    top logprobs, then with a draft head (speculation NEXTN / EAGLE) a draft part of `draft_bytes`.

    Base columns: 0 output token id | 1 bootstrap_room | 2 output logprob (float64 bits) | 3 rope delta
    (M-RoPE) | 4 the prefill's weight version hash | 5..7 spare.
    Top part: column 8 how many top logprobs follow (0: the request asked for none) | 9..136 their
    token ids, best first | 137..264 their logprobs (float64 bits); at most TOP_LOGPROBS (a request
    asking a PD pair for more is refused at admission).
    Draft part: how many first-draft candidates follow (0: none) | the head's candidates for the
    request's first draft, its argmax first (--speculative-eagle-topk of them, at most
    PRIME_CANDIDATES: the width never depends on flags, so two sides whose flags differ still agree on
    it) | their log-probabilities under the head (float64 bits: a best-first tree's scores) | then the
    head's output at the prompt's last position (the next draft step's input), as raw bytes of the
    model's dtype. Every prefill TP rank writes the base; only rank 0 writes the rest (the metadata's
    JSON hop to the other ranks carries the base only), which the decode's rank 0, the one that reads
    the slot, gets from it: whatever the two TP sizes, prefill rank 0 holds KV head 0, so it writes to
    decode rank 0.
    Slots are handed out by alloc()/free(); the decode side passes its slot to the prefill.
    """

    COLUMNS = 8
    BASE_BYTES = COLUMNS * 8
    TOP_LOGPROBS = 128  # as SGLang's PD metadata buffers hold
    TOP_COLUMNS = 1 + 2 * TOP_LOGPROBS
    PRIME_CANDIDATES = 8

    def __init__(self, size: int, draft_bytes: int = 0) -> None:
        assert size > 0 and draft_bytes % 8 == 0
        self.size, self.draft_bytes = size, draft_bytes
        self._draft = self.COLUMNS + self.TOP_COLUMNS  # where the draft part starts
        # [size, 8 + top part (+ draft)]
        self.buffer = torch.zeros((size, self._draft + draft_bytes // 8), dtype=torch.int64)
        self._free = list(range(size))

    @staticmethod
    def draft_bytes_for(hidden_size: int, dtype: torch.dtype) -> int:
        """The draft part for a head whose outputs are `hidden_size` values of `dtype`."""
        return 8 * (1 + 2 * MetadataBuffers.PRIME_CANDIDATES) + -(-hidden_size * dtype.itemsize // 8) * 8

    @property
    def data_ptr(self) -> int:
        return self.buffer.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    @property
    def item_bytes(self) -> int:
        return self.buffer.shape[1] * self.buffer.element_size()

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self) -> Optional[int]:
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        assert 0 <= slot < self.size and slot not in self._free, f"bad or double free of metadata slot {slot}"
        self.buffer[slot].zero_()
        self._free.append(slot)

    def set(self, slot: int, meta: KVMetadata) -> None:
        row = self.buffer[slot]
        row[0], row[1], row[3] = meta.output_token_id, meta.bootstrap_room, meta.rope_delta
        row[2:3].view(torch.float64)[0] = meta.output_logprob
        row[4] = meta.weight_version_hash

    def get(self, slot: int) -> KVMetadata:
        row = self.buffer[slot]
        return KVMetadata(int(row[0]), float(row[2:3].view(torch.float64)[0]), int(row[1]), int(row[3]),
                          int(row[4]))

    def set_top_logprobs(self, slot: int, top: Sequence[tuple[float, int]]) -> None:
        """The first token's top logprobs, as the sampler gives them: (logprob, token id), best first."""
        n, width = len(top), self.TOP_LOGPROBS
        assert n <= width, f"{n} top logprobs do not fit a metadata slot ({width})"
        part = self.buffer[slot, self.COLUMNS:self._draft]
        part[0] = n
        if n:
            part[1:1 + n] = torch.tensor([t for _, t in top], dtype=torch.int64)
            part[1 + width:1 + width + n].view(torch.float64)[:] = torch.tensor([v for v, _ in top], dtype=torch.float64)

    def get_top_logprobs(self, slot: int) -> list[tuple[float, int]]:
        part, width = self.buffer[slot, self.COLUMNS:self._draft], self.TOP_LOGPROBS
        n = int(part[0])
        values = part[1 + width:1 + width + n].view(torch.float64).tolist()
        return list(zip(values, part[1:1 + n].tolist()))

    def set_draft(self, slot: int, candidates: tuple[int, ...], hidden: torch.Tensor,
                  logps: tuple[float, ...]) -> None:
        """The head's candidates for the request's next first draft (argmax first), their
        log-probabilities and its output there."""
        n, width = min(len(candidates), self.PRIME_CANDIDATES), self.PRIME_CANDIDATES
        part = self.buffer[slot, self._draft:]
        part[0] = n
        part[1:1 + n] = torch.tensor(candidates[:n], dtype=torch.int64)
        part[1 + width:1 + width + n].view(torch.float64)[:] = torch.tensor(logps[:n], dtype=torch.float64)
        raw = hidden.detach().to("cpu").contiguous().view(torch.uint8)
        part[1 + 2 * width:].view(torch.uint8)[:raw.numel()] = raw

    def get_draft(self, slot: int, hidden_size: int,
                  dtype: torch.dtype) -> Optional[tuple[tuple[int, ...], torch.Tensor, tuple[float, ...]]]:
        """(first-draft candidates, the head's output, the candidates' log-probabilities) where the
        prefill's rank 0 wrote them, else None."""
        if not self.draft_bytes:
            return None
        part, width = self.buffer[slot, self._draft:], self.PRIME_CANDIDATES
        n = int(part[0])
        if n == 0:
            return None
        raw = part[1 + 2 * width:].view(torch.uint8)[:hidden_size * dtype.itemsize]
        logps = tuple(part[1 + width:1 + width + n].view(torch.float64).tolist())
        return tuple(part[1:1 + n].tolist()), raw.view(dtype).clone(), logps


def as_pages(pages: PageList) -> np.ndarray:
    """Page indices as a 1-D int64 numpy array."""
    if isinstance(pages, torch.Tensor):
        pages = pages.detach().to("cpu", torch.int64).numpy()
    return np.ascontiguousarray(pages, dtype=np.int64).reshape(-1)


def pages_from_slots(slots: PageList, page_size: int) -> np.ndarray:
    """A request's slot indices (token order, page-aligned as the allocator hands them out) -> its pages."""
    slots = as_pages(slots)
    return slots[::page_size] // page_size


class ContiguousRuns(NamedTuple):
    src_starts: np.ndarray  # [num_runs] first source page of each run
    dst_starts: np.ndarray  # [num_runs] first destination page of each run
    lengths: np.ndarray  # [num_runs] pages per run


def contiguous_runs(src: np.ndarray, dst: np.ndarray) -> ContiguousRuns:
    """Split paired page lists into maximal runs where both sides advance by one page.

    One run is one (address, length) entry per layer buffer; fewer, longer entries are what makes
    TCP transfers fast.
    """
    assert src.shape == dst.shape and src.ndim == 1
    if len(src) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return ContiguousRuns(empty, empty, empty)
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [len(src)])))
    return ContiguousRuns(src[starts], dst[starts], lengths)


class RoomStatus:
    """A request's poll state, shared between the scheduler thread and transfer threads.

    It only moves forward; Success and Failed are final, and the first failure reason is kept, with
    whether it was a room conflict (the room names another request on the peer engine).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.status = KVPoll.Bootstrapping
        self.reason: Optional[str] = None
        self.conflict = False

    @property
    def done(self) -> bool:
        return self.status in (KVPoll.Success, KVPoll.Failed)

    def advance(self, status: KVPoll) -> bool:
        with self._lock:
            if self.done or status <= self.status:
                return False
            self.status = status
            return True

    def fail(self, reason: str, conflict: bool = False) -> bool:
        with self._lock:
            if self.done:
                return False
            self.status, self.reason, self.conflict = KVPoll.Failed, reason, conflict
            return True


class TransferStats(NamedTuple):
    bytes: int
    seconds: float  # summed over the batched writes of the request (not queueing)


class KVSenderBase(ABC):
    """Prefill side of one request. Created when the request arrives; all methods are non-blocking.

    Contract for the caller:
    - wait until poll() >= WaitingForInput (the decode's destination arrived) before send();
    - init(num_pages, meta_slot) once: num_pages must equal the pages the decode reserved;
    - send(pages) per computed chunk in token order; a non-last chunk sends whole pages only;
      the last one passes is_last=True and the metadata (written to meta_slot, then transferred),
      and with a hybrid model `state_slot`: the request's row, whose recurrent state the forward
      that computed the last chunk has finished writing (it goes after the pages, before the
      metadata);
    - source pages (and the state slot) must stay allocated until poll() returns Success or
      Failed; then clear().
    """

    room: int

    @abstractmethod
    def init(self, num_pages: int, meta_slot: int) -> None: ...

    @abstractmethod
    def send(self, page_indices: PageList, is_last: bool = False, metadata: Optional[KVMetadata] = None,
             state_slot: Optional[int] = None) -> None: ...

    @abstractmethod
    def poll(self) -> KVPoll: ...

    @abstractmethod
    def failure_reason(self) -> Optional[str]: ...

    @abstractmethod
    def stats(self) -> TransferStats: ...

    @abstractmethod
    def abort(self, reason: str) -> None:
        """Fail this request here and tell the decode side (if known)."""

    @abstractmethod
    def clear(self) -> None:
        """Forget the request in the manager; call once after a final poll() or abort()."""

    def room_conflict(self) -> bool:
        """Failed because the room pairs this request with another request of the peer engine (a client
        or router gave one room to two pairings): a client error (409), no KV moved."""
        return False


class KVReceiverBase(ABC):
    """Decode side of one request. Creation starts the handshake with the prefill in the background.

    Contract for the caller:
    - poll() reaches WaitingForInput once the prefill rank is known and registered with;
    - init(page_indices, meta_slot, prefix_pages, state_slot) once with the pages reserved for the
      prompt (token order), after the first `prefix_pages` pages the decode already holds (its prefix
      cache), and with a hybrid model the state slot (the request's row) the prefill's final
      recurrent state goes to: state always comes from the prefill, even after a prefix hit;
    - on Success the pages hold the prompt's KV (and the slot its state), metadata() the first token; on Failed,
      failure_reason() says why (timeout, prefill gone, geometry mismatch, corruption ...);
    - destination pages stay allocated until poll() is final; then clear().
    """

    room: int
    bootstrap_addr: str

    @abstractmethod
    def init(self, page_indices: PageList, meta_slot: int, prefix_pages: int = 0,
             state_slot: Optional[int] = None) -> None: ...

    @abstractmethod
    def poll(self) -> KVPoll: ...

    @abstractmethod
    def metadata(self) -> KVMetadata:
        """The transferred metadata; valid once poll() returned Success."""

    @abstractmethod
    def failure_reason(self) -> Optional[str]: ...

    @abstractmethod
    def abort(self, reason: str) -> None:
        """Fail this request here and tell the prefill side (if known)."""

    @abstractmethod
    def clear(self) -> None: ...

    def room_conflict(self) -> bool:
        """Failed because a prefill rank found the room paired with another of its requests: a client
        error (409)."""
        return False

    def destination_untouched(self) -> bool:
        """Every prefill rank the destination went to refused it before writing to it (a room
        conflict): its pages may be reused at once, without the abort grace."""
        return False


class KVManagerBase(ABC):
    """Per engine rank: registers `args` memory once, runs the background threads, makes senders/receivers.

    Prefill managers register their side-channel address with the engine's bootstrap server.
    """

    args: KVArgs
    mode: DisaggregationMode
    # decode: how long destination pages of an abandoned transfer must stay untouched (0: writes
    # are synchronous, nothing can be in flight)
    abort_grace_s: float = 0.0
    # prefill: peers find this rank through the engine's bootstrap server (an in-process backend finds
    # them without one)
    uses_bootstrap_server = True

    @abstractmethod
    def create_sender(self, room: int) -> KVSenderBase: ...

    @abstractmethod
    def create_receiver(self, bootstrap_addr: str, room: int) -> KVReceiverBase: ...

    @abstractmethod
    def num_rooms(self) -> int:
        """Requests still known to the manager (not yet clear()ed): 0 when idle, for leak checks."""

    @abstractmethod
    def close(self) -> None:
        """Stop threads and deregister memory; call before the pools are freed."""


def deadline_passed(since: float, timeout_s: float) -> bool:
    return time.monotonic() - since > timeout_s
