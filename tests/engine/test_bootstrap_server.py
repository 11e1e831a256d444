"""The prefill's bootstrap server when a client leaves before its answer (a decode whose timeout ran
out): one log line, no traceback, and the server keeps answering."""
from __future__ import annotations

import logging
import socket
import struct
import time

import pytest

from baton.engine.disaggregation.bootstrap_server import KVBootstrapServer, check_health


@pytest.fixture
def server():
    srv = KVBootstrapServer("127.0.0.1", 0)
    yield srv
    srv.close()


def _reset_mid_request(port: int) -> None:
    """A PUT whose body never comes, then a reset (SO_LINGER 0): the server's read fails."""
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"PUT /route HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def _gone_before_the_answer(port: int) -> None:
    """A GET, then the client closes at once (what a timed-out urllib client does)."""
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def test_a_client_that_leaves_is_one_log_line_not_a_traceback(server, capfd, caplog):
    caplog.set_level(logging.WARNING, logger="baton.engine.disaggregation.bootstrap_server")
    _reset_mid_request(server.port)
    for _ in range(20):
        _gone_before_the_answer(server.port)
    assert check_health(f"127.0.0.1:{server.port}", 5.0) == {}  # still serving
    deadline = time.monotonic() + 10
    while not (lines := [r for r in caplog.records if "left before its answer" in r.getMessage()]):
        assert time.monotonic() < deadline, "no log line for the client that left"
        time.sleep(0.01)
    assert all(r.levelno == logging.WARNING for r in lines)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception occurred" not in err, err
