"""Process helpers: child processes die with their parent, free ports, IPC names."""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import tempfile
from typing import Optional

from baton.ports import free_port  # noqa: F401 - the engine's callers take it from here

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux), so a crashed or killed
    server never leaves a scheduler holding memory behind."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


IPC_PREFIX = "baton-ipc-"


def ipc_names(count: int) -> tuple[str, list[str]]:
    """A fresh private directory and `count` ZMQ IPC addresses inside it. The socket files stay
    after their sockets close, so the owner removes the directory when it shuts down; the
    directories of engines that were killed (no shutdown ran) go at the next start."""
    remove_stale_ipc_dirs()
    directory = tempfile.mkdtemp(prefix=f"{IPC_PREFIX}{os.getpid()}-")
    return directory, [f"ipc://{os.path.join(directory, str(i))}" for i in range(count)]


def remove_stale_ipc_dirs(parent: Optional[str] = None) -> list[str]:
    """Remove the IPC directories (`baton-ipc-<pid>-*`) whose process no longer exists; returns them."""
    parent = parent or tempfile.gettempdir()
    removed = []
    for name in os.listdir(parent):
        pid = name[len(IPC_PREFIX):].split("-", 1)[0] if name.startswith(IPC_PREFIX) else ""
        if not pid.isdigit() or _alive(int(pid)):
            continue
        path = os.path.join(parent, name)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        pass
    return True


def process_age_s() -> float:
    """Seconds since this process was created (Linux /proc; 0.0 elsewhere): at a process's entry
    point, what interpreter start-up and the imports of a spawned child took."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
