"""Requests written over a plain socket, for what no client library sends: heads and bodies that stall
or never end."""
from __future__ import annotations

import select
import socket
import time


def send_body_until_answered(port: int, head: bytes, parts, wait_s: float) -> tuple[bytes, int]:
    """Send a request's head, then its body parts while no answer has come (the body's end is the
    caller's: none here means the body never ends), and wait up to `wait_s` for one: (the status line
    or b"" when none came, how many parts went out)."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(head)
        sent = 0
        for part in parts:
            if select.select([s], [], [], 0)[0]:
                break
            try:
                s.sendall(part)
            except OSError:  # answered and closed while this part went out
                break
            sent += 1
        s.settimeout(wait_s)
        try:
            return s.recv(4096).split(b"\r\n")[0], sent
        except (TimeoutError, OSError):
            return b"", sent


def read_until_closed(sock: socket.socket, wait_s: float) -> bytes:
    """Everything the server sends on `sock` until it closes the connection (each read waits up to
    `wait_s`: TimeoutError when the server keeps it open)."""
    sock.settimeout(wait_s)
    got = b""
    while chunk := sock.recv(4096):
        got += chunk
    return got


def talk(port: int, parts: list[bytes], pause: float = 0.0, wait_s: float = 15.0) -> tuple[float, bytes]:
    """Open a connection, send `parts` (`pause` s after each), then read until the server closes it:
    (seconds from the connection to the close, all it sent)."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        start = time.monotonic()
        for part in parts:
            s.sendall(part)
            time.sleep(pause)
        got = read_until_closed(s, wait_s)
        return time.monotonic() - start, got
