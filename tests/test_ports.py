"""baton.ports.free_port: the ports servers are started on later (launchers, a DP engine's workers,
tests, benches). They are drawn below the kernel's ephemeral range, so an outgoing connection cannot
take one as its source port before its server binds it (CI saw "address already in use" for an
engine's port chosen by bind(0) 15 s before the engine bound it)."""
from __future__ import annotations

import socket

from baton import ports


def test_free_ports_are_bindable_distinct_and_below_the_ephemeral_range():
    low, high = ports.ephemeral_port_range()
    assert 0 < low <= high < 65536
    got = [ports.free_port() for _ in range(200)]
    assert len(set(got)) == len(got), "a port was handed out twice"
    if low - ports._PORTS_FROM >= 1000:
        assert all(ports._PORTS_FROM <= p < low for p in got), [p for p in got if not ports._PORTS_FROM <= p < low]
    for p in got[:20]:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", p))
            s.listen()


def test_a_port_an_outgoing_connection_holds_is_not_handed_out(monkeypatch):
    """The draw skips what is bound now: here every draw names the source port of a live connection
    but the last, which is free."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        client = socket.create_connection(server.getsockname())
        try:
            held = client.getsockname()[1]
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                spare = probe.getsockname()[1]
            draws = iter([held, held, spare])
            monkeypatch.setattr(ports, "_PORTS_FROM", 1024)
            monkeypatch.setattr(ports, "ephemeral_port_range", lambda: (65000, 65535))
            monkeypatch.setattr(ports._port_rng, "randrange", lambda a, b: next(draws))
            monkeypatch.setattr(ports, "_handed_out", set())
            assert ports.free_port() == spare
        finally:
            client.close()


def test_without_room_below_the_ephemeral_range_it_asks_the_kernel(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_port_range", lambda: (1024, 65535))
    port = ports.free_port()
    assert 1024 <= port < 65536 and port in ports._handed_out
