"""Thin wrapper over Mooncake's TransferEngine binding: return codes become exceptions.

P2P handshake mode needs no metadata server: a peer is addressed by its session id
"host:rpc_port", which the binding picks at initialize().
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

from baton.engine.disaggregation.base import KVTransferError

_INSTALL_HINT = ("install it with `pip install mooncake-transfer-engine` (GPU) or "
                 "`pip install mooncake-transfer-engine-non-cuda` plus `apt-get install libibverbs1` (CPU)")


class MooncakeTransferEngine:
    def __init__(self, hostname: str, protocol: str = "tcp", ib_device: Optional[str] = None) -> None:
        # Mooncake logs every connection at INFO; keep warnings and errors unless the user asks.
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise KVTransferError(f"the Mooncake transfer engine is not importable ({e}); {_INSTALL_HINT}") from e
        self._engine = TransferEngine()
        ret = self._engine.initialize(hostname, "P2PHANDSHAKE", protocol, ib_device or "")
        if ret != 0:
            raise KVTransferError(f"Mooncake initialize(host={hostname}, protocol={protocol}, "
                                  f"ib_device={ib_device}) failed with code {ret}")
        self.hostname = hostname
        self.session_id = f"{hostname}:{self._engine.get_rpc_port()}"
        self._registered: list[int] = []

    def register(self, ptrs: Sequence[int], lengths: Sequence[int]) -> None:
        ret = self._live().batch_register_memory(list(ptrs), list(lengths))
        if ret != 0:
            raise KVTransferError(f"Mooncake could not register {len(ptrs)} buffers ({sum(lengths)} bytes): code {ret}")
        self._registered.extend(ptrs)

    def close(self) -> None:
        """Deregisters the buffers and destroys the native engine now, in the caller's thread. A manager
        sits in reference cycles, so without this the engine dies at a garbage collection: the
        teardowns of every engine closed since the last one (about 0.6 s each, in Mooncake's own
        destructor) then run together in whichever thread started it. A dozen took 7.6 s on the 2-core
        VM; in CI such a pause held a TP follower's state report past a 15 s handshake wait."""
        if self._engine is None:
            return
        if self._registered:
            self._engine.batch_unregister_memory(self._registered)
            self._registered = []
        self._engine = None  # the binding's destructor runs here (a write in flight keeps it alive)

    def _live(self):
        if self._engine is None:
            raise KVTransferError("the Mooncake transfer engine is closed")
        return self._engine

    def batch_write(self, peer_session: str, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int]) -> None:
        """Synchronous: returns once every (src, dst, length) entry has landed in the peer's memory."""
        ret = self._live().batch_transfer_sync_write(peer_session, list(src), list(dst), list(lengths))
        if ret < 0:
            raise KVTransferError(f"Mooncake batch write of {len(src)} entries ({sum(lengths)} bytes) to "
                                  f"{peer_session} failed with code {ret}")
