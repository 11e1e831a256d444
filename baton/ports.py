"""Free ports for servers started a little later (launchers, a DP engine's workers, tests, benches)."""
from __future__ import annotations

import random
import socket
import threading

_PORTS_FROM = 20000  # above the ranges Mooncake's TCP transport (15000-17000) and well-known servers take
_handed_out: set[int] = set()
_ports_lock = threading.Lock()
_port_rng = random.SystemRandom()  # not the random module's: tests seed that one, alike in every process


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range of source ports for outgoing connections (Linux's default where unreadable)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to now, for a server that binds it a little later (launchers, a DP
    engine's workers, tests); never the same one twice in a process. Drawn below the kernel's
    ephemeral range: a port from bind(0) is an ephemeral one, which any outgoing connection may take
    as its source port before the server binds it ("address already in use": an engine's HTTP port
    in CI, 15 s after free_port chose it). bind(0) only where that range leaves no room below it."""
    low, _ = ephemeral_port_range()
    if low - _PORTS_FROM >= 1000:
        for _ in range(100):
            port = _port_rng.randrange(_PORTS_FROM, low)
            with _ports_lock:
                if port in _handed_out:
                    continue
                if _bindable(host, port):
                    _handed_out.add(port)
                    return port
    with _ports_lock:
        while True:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if port not in _handed_out:
                _handed_out.add(port)
                return port


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        # as servers bind: a closed connection's TIME_WAIT does not hold the port, a live one's does
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True
