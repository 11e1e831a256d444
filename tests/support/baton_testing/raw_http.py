"""Requests written over a plain socket, for what no client library sends: bodies that stall or never
end."""
from __future__ import annotations

import select
import socket


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
