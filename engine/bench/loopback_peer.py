"""A KV-transfer peer (prefill or decode engine stand-in) in a child process, driven over a pipe.

The tests and `baton bench kv-transfer` need the honest PD setup: the other engine in another
process with its own pool, transfer engine and (prefill) bootstrap server, killable mid-transfer.
Commands are plain tuples; each answers one dict.

    prefill: ("send", {room, src_pages, chunks, metadata}) -> {status, reason, bytes, seconds}
             ("hold", {room})   sender created and bootstrapped, never sent -> {status}
             ("raw_write", {session_id, dst_ptrs, lengths}) -> {seconds}   Mooncake, no baton code
    decode:  ("recv", {bootstrap_addr, room, dst_pages, meta_slot}) -> {status, reason, metadata, seconds,
             done_at (time.monotonic() at its final poll: comparable across processes on one machine)}
"""
from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Callable, Optional

import torch

from baton.engine.disaggregation.base import (KVArgs, KVGeometry, KVManagerBase, KVMetadata, KVPoll,
                                              MetadataBuffers, TransferConfig)

_POLL_S = 0.001


@dataclass(frozen=True)
class PeerSpec:
    role: str  # "prefill" | "decode"
    geometry: KVGeometry
    num_pages: int  # usable pages of the pool (page 0, the dummy page, comes on top)
    config: TransferConfig = field(default_factory=TransferConfig)
    backend: str = "mooncake"
    bootstrap_port: int = 0  # prefill: its bootstrap server's port; 0 picks a free one
    fill_seed: Optional[int] = None  # prefill: fill the pool with fill_pool(seed)
    meta_slots: int = 64
    tp_rank: int = 0  # the TP rank whose shard of kv_heads_total this peer holds (geometry.head_num of them)
    tp_size: int = 1
    kv_heads_total: Optional[int] = None


def make_pool(geometry: KVGeometry, num_pages: int):
    from baton.engine.mem_cache.memory_pool import MHATokenToKVPool
    return MHATokenToKVPool(num_pages * geometry.page_size, geometry.page_size, getattr(torch, geometry.dtype),
                            geometry.head_num, geometry.head_dim, geometry.layer_num, "cpu")


def fill_pool(pool, seed: int) -> None:
    """Deterministic random KV, so another process can rebuild the expected bytes."""
    for i, buf in enumerate(pool.k_buffer + pool.v_buffer):
        gen = torch.Generator().manual_seed(seed * 1000 + i)
        buf.copy_(torch.randn(buf.shape, generator=gen).to(buf.dtype))


def wait_until(check: Callable[[], bool], timeout_s: float, poll_s: float = _POLL_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(poll_s)
    return check()


def wait_final(obj, timeout_s: float) -> KVPoll:
    wait_until(lambda: obj.poll() in (KVPoll.Success, KVPoll.Failed), timeout_s)
    return obj.poll()


class _Peer:
    """The child's state: pool, manager and the command handlers."""

    def __init__(self, spec: PeerSpec) -> None:
        from baton.engine.disaggregation import create_transfer_backend
        from baton.engine.disaggregation.bootstrap_server import KVBootstrapServer
        self.spec = spec
        self.pool = make_pool(spec.geometry, spec.num_pages)
        if spec.fill_seed is not None:
            fill_pool(self.pool, spec.fill_seed)
        self.metadata = MetadataBuffers(spec.meta_slots)
        self.server = None
        addr = None
        if spec.role == "prefill":
            self.server = KVBootstrapServer(spec.config.host, spec.bootstrap_port)
            addr = f"{spec.config.host}:{self.server.port}"
        self.args = KVArgs.from_pool(self.pool, self.metadata, tp_rank=spec.tp_rank, tp_size=spec.tp_size,
                                     kv_heads_total=spec.kv_heads_total)
        self.mgr: KVManagerBase = create_transfer_backend(spec.backend, self.args, self.metadata, spec.role,
                                                          spec.config, addr)
        self.held: list = []
        self.info = {"bootstrap_addr": addr, "session_id": getattr(self.mgr, "session_id", None),
                     "kv_ptrs": list(self.args.kv_data_ptrs), "kv_lens": list(self.args.kv_data_lens)}

    def send(self, room: int, src_pages: list[int], chunks: list[int], metadata: tuple,
             timeout_s: float = 30.0) -> dict:
        sender = self.mgr.create_sender(room)
        wait_until(lambda: sender.poll() != KVPoll.Bootstrapping, timeout_s)
        if sender.poll() == KVPoll.WaitingForInput:
            sender.init(len(src_pages), self.metadata.alloc())
            start = 0
            for i, n in enumerate(chunks):
                last = i == len(chunks) - 1
                sender.send(src_pages[start:start + n], is_last=last, metadata=KVMetadata(*metadata) if last else None)
                start += n
        t0 = time.perf_counter()
        status = wait_final(sender, timeout_s)
        out = {"status": int(status), "reason": sender.failure_reason(), "bytes": sender.stats().bytes,
               "seconds": sender.stats().seconds, "wait": time.perf_counter() - t0}
        if sender.meta_slot is not None:
            self.metadata.free(sender.meta_slot)
        sender.clear()
        return out

    def hold(self, room: int, timeout_s: float = 30.0) -> dict:
        sender = self.mgr.create_sender(room)
        self.held.append(sender)
        wait_until(lambda: sender.poll() != KVPoll.Bootstrapping, timeout_s)
        return {"status": int(sender.poll()), "reason": sender.failure_reason()}

    def raw_write(self, session_id: str, dst_ptrs: list[int], lengths: list[int]) -> dict:
        t0 = time.perf_counter()
        self.mgr.engine.batch_write(session_id, list(self.args.kv_data_ptrs), dst_ptrs, lengths)
        return {"seconds": time.perf_counter() - t0}

    def recv(self, bootstrap_addr: str, room: int, dst_pages: list[int], timeout_s: float = 30.0) -> dict:
        t0 = time.perf_counter()
        receiver = self.mgr.create_receiver(bootstrap_addr, room)
        slot = self.metadata.alloc()
        receiver.init(dst_pages, slot)
        status = wait_final(receiver, timeout_s)
        done_at = time.monotonic()
        meta = tuple(receiver.metadata()) if status == KVPoll.Success else None
        out = {"status": int(status), "reason": receiver.failure_reason(), "metadata": meta,
               "seconds": time.perf_counter() - t0, "done_at": done_at}
        self.metadata.free(slot)
        receiver.clear()
        return out

    def close(self) -> None:
        self.mgr.close()
        if self.server is not None:
            self.server.close()


def _child_main(conn: Connection, spec: PeerSpec) -> None:
    from baton.engine.utils.process import die_with_parent
    die_with_parent()
    peer = _Peer(spec)
    conn.send(peer.info)
    handlers = {"send": peer.send, "hold": peer.hold, "raw_write": peer.raw_write, "recv": peer.recv}
    while True:
        cmd, kwargs = conn.recv()
        if cmd == "exit":
            break
        try:
            conn.send(handlers[cmd](**kwargs))
        except Exception as e:  # noqa: BLE001 - report to the driver instead of dying silently
            conn.send({"error": f"{type(e).__name__}: {e}"})
    peer.close()
    conn.send({"closed": True})


class PeerProcess:
    """Use as a context manager; `close()` always ends the child (kill as the last resort)."""

    def __init__(self, spec: PeerSpec, start_timeout_s: float = 120.0) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_child_main, args=(child, spec), daemon=True)
        self.proc.start()
        child.close()
        try:
            self.info: dict[str, Any] = self._recv(start_timeout_s)
        except BaseException:
            self.kill()
            raise

    def _recv(self, timeout_s: float) -> dict:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"peer process {self.proc.pid} did not answer within {timeout_s:g}s")
        out = self._conn.recv()
        if "error" in out:
            raise RuntimeError(f"peer process: {out['error']}")
        return out

    def submit(self, cmd: str, **kwargs: Any) -> None:
        self._conn.send((cmd, kwargs))

    def result(self, timeout_s: float = 60.0) -> dict:
        return self._recv(timeout_s)

    def call(self, cmd: str, timeout_s: float = 60.0, **kwargs: Any) -> dict:
        self.submit(cmd, **kwargs)
        return self.result(timeout_s)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(timeout=10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self._conn.send(("exit", {}))
                self._conn.poll(10) and self._conn.recv()
            except (OSError, EOFError):
                pass
            self.proc.join(timeout=5)
        if self.proc.is_alive():
            self.kill()
        self._conn.close()

    def __enter__(self) -> "PeerProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
