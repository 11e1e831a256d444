"""Process helpers: child processes die with their parent, free ports, IPC names."""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import tempfile
import uuid

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux), so a crashed or killed
    server never leaves a scheduler holding memory behind."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ipc_names(count: int) -> list[str]:
    base = os.path.join(tempfile.gettempdir(), f"baton-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    return [f"ipc://{base}-{i}" for i in range(count)]
