"""Start an engine (`baton serve`) as a subprocess, wait until `/health` answers 200, always stop it.

    with EngineProcess(engine_command(model_path, port, extra_args), port) as engine:
        engine.wait_healthy(timeout_s=600)
        ... requests to engine.base_url ...

The engine spawns its own children (scheduler, detokenizer), so it runs in a session of its own and
is stopped by signalling the whole process group: SIGTERM, then SIGKILL after a grace period.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional

import httpx
from tqdm.auto import tqdm

from baton.ports import free_port  # noqa: F401 - launchers' callers take it from here

HEALTH_POLL_INTERVAL_S = 0.25
STOP_GRACE_S = 15.0


class EngineStartError(RuntimeError):
    pass


def engine_command(model_path: str, port: int, extra_args: list[str] = (), host: str = "127.0.0.1") -> list[str]:
    return [sys.executable, "-m", "baton", "serve", "--model-path", model_path, "--host", host,
            "--port", str(port), *extra_args]


class EngineProcess:
    """A server subprocess whose output goes to a log file (shown when it fails to start)."""

    def __init__(self, command: list[str], port: int, host: str = "127.0.0.1", api_key: Optional[str] = None):
        self.command = list(command)
        self.base_url = f"http://{host}:{port}"
        self.api_key = api_key
        self.log_path = ""  # set by start()
        self._proc: Optional[subprocess.Popen] = None

    def __enter__(self) -> "EngineProcess":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        if self.log_path and os.path.exists(self.log_path):  # a killed run's log, kept until now
            os.remove(self.log_path)
        fd, self.log_path = tempfile.mkstemp(prefix="baton-engine-", suffix=".log")
        with os.fdopen(fd, "wb") as log:
            self._proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)

    def wait_healthy(self, timeout_s: float, desc: str = "waiting for the engine") -> float:
        """Poll `/health` until it answers 200; return the seconds it took. Shows a live timer."""
        assert self._proc is not None, "start() first"
        started = time.monotonic()
        deadline = started + timeout_s
        last_draw = started
        with tqdm(desc=f"{desc} ({self.base_url}/health)", bar_format="{desc}: {elapsed}", leave=False) as progress:
            while True:
                if self._proc.poll() is not None:
                    raise EngineStartError(f"engine exited with code {self._proc.returncode}\n{self.log_tail()}")
                if self._is_healthy():
                    return time.monotonic() - started
                if time.monotonic() > deadline:
                    raise EngineStartError(f"engine not healthy after {timeout_s:.0f}s\n{self.log_tail()}")
                if time.monotonic() - last_draw >= 1.0:  # redraw the elapsed time once a second
                    progress.refresh()
                    last_draw = time.monotonic()
                time.sleep(HEALTH_POLL_INTERVAL_S)  # a poll interval, bounded by the deadline above

    def _is_healthy(self) -> bool:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            return httpx.get(self.base_url + "/health", headers=headers, timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, errors="replace") as f:
            tail = f.readlines()[-lines:]
        return f"--- last lines of {self.log_path} ---\n" + "".join(tail)

    def stop(self) -> None:
        """Stop the process group; safe to call twice and when start() failed."""
        proc, self._proc = self._proc, None
        if proc is not None:
            _signal_group(proc.pid, signal.SIGTERM)
            if not _wait_group_gone(proc, STOP_GRACE_S):
                _signal_group(proc.pid, signal.SIGKILL)
                _wait_group_gone(proc, STOP_GRACE_S)
        if self.log_path and os.path.exists(self.log_path):
            os.remove(self.log_path)

    def terminate(self) -> None:
        """SIGTERM to the server's main process only, as Kubernetes stops a pod (its PID 1)."""
        if self._proc is not None:
            self._proc.send_signal(signal.SIGTERM)

    def wait_exit(self, timeout_s: float) -> Optional[int]:
        """The exit code once the main process and every child of its group are gone; None on timeout."""
        if self._proc is None or not _wait_group_gone(self._proc, timeout_s):
            return None
        return self._proc.returncode

    def kill(self) -> None:
        """Crash the server: SIGKILL its whole process group, no shutdown path runs. start() again to restart."""
        proc, self._proc = self._proc, None
        if proc is not None:
            _signal_group(proc.pid, signal.SIGKILL)
            _wait_group_gone(proc, STOP_GRACE_S)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _wait_group_gone(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait until the leader is reaped and no process of its group is left (children included)."""
    deadline = time.monotonic() + timeout_s
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False
    while time.monotonic() < deadline:
        if not _group_alive(proc.pid):
            return True
        time.sleep(0.05)  # poll interval, bounded by the deadline
    return False


def _group_alive(pgid: int) -> bool:
    """Whether a live (non-zombie) process of group `pgid` exists. Zombies count as gone: in a
    container whose PID 1 does not reap orphans they would otherwise look alive forever."""
    if not os.path.isdir("/proc"):
        try:
            os.killpg(pgid, 0)
            return True
        except ProcessLookupError:
            return False
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "(comm)": state ppid pgrp ...
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False
