"""KV transfer for PD disaggregation: real Mooncake over TCP on 127.0.0.1.

The honest setup puts the prefill in a child process (its own pool, transfer engine, bootstrap
server; killable) and the decode in this process, where its pool is inspected. Cheaper cases
(timeouts, fault injection, aborts) run both managers in this process, for Mooncake and the fake.
"""
from __future__ import annotations

import contextlib
import logging
import math
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
import zmq

from baton.engine.disaggregation import create_transfer_backend
from baton.engine.disaggregation.base import (KVArgs, KVGeometry, KVMetadata, KVPoll, KVTransferError,
                                              MetadataBuffers, RoomInUse, TransferConfig, contiguous_runs,
                                              pages_from_slots)
from baton.engine.disaggregation import bootstrap_server
from baton.engine.disaggregation.bootstrap_server import KVBootstrapServer
from baton.engine.bench.loopback_peer import (PeerProcess, PeerSpec, fill_pool, make_pool, wait_final,
                                                       wait_until)
from baton.engine.disaggregation.mooncake import messages
from baton.engine.utils.process import free_port

pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine(-non-cuda) is a test dependency")

SEED = 7
HEARTBEAT_S, HEARTBEAT_FAILURES = 0.2, 2
CONFIG = TransferConfig(bootstrap_timeout_s=15, waiting_timeout_s=30, heartbeat_interval_s=HEARTBEAT_S,
                        heartbeat_max_failures=HEARTBEAT_FAILURES, max_batch_entries=16)


def geometry(page_size: int, dtype: str = "float16") -> KVGeometry:
    return KVGeometry(page_size=page_size, dtype=dtype, layer_num=2, head_num=2, head_dim=8)


class DecodeSide:
    """A decode engine's transfer state in this process."""

    def __init__(self, geo: KVGeometry, num_pages: int, config: TransferConfig = CONFIG, backend: str = "mooncake"):
        self.pool = make_pool(geo, num_pages)
        self.metadata = MetadataBuffers(16)
        self.mgr = create_transfer_backend(backend, KVArgs.from_pool(self.pool, self.metadata), self.metadata,
                                           "decode", config)

    def receive(self, addr: str, room: int, pages: np.ndarray):
        receiver = self.mgr.create_receiver(addr, room)
        receiver.init(pages, self.metadata.alloc())
        return receiver

    def finish(self, receiver) -> None:
        self.metadata.free(receiver.meta_slot)
        receiver.clear()

    def close(self) -> None:
        """Closes the manager, then checks it held no room: a failed check must not leave an engine
        open for the garbage collector to tear down in a later test."""
        rooms = self.mgr.num_rooms()
        self.mgr.close()
        assert rooms == 0, "a receiver was not cleared"


def _close_pair(server, prefill, decode) -> None:
    """Closes a decode side, a prefill manager and its bootstrap server, all of them whatever the
    checks say, then checks that neither manager held a room."""
    rooms = prefill.num_rooms()
    try:
        decode.close()
    finally:
        prefill.close()
        server.close()
    assert rooms == 0, "a sender was not cleared"


@pytest.fixture(scope="module", params=[1, 16], ids=["page1", "page16"])
def pd_pair(request):
    page_size = request.param
    num_pages = 256 // page_size + 16
    spec = PeerSpec("prefill", geometry(page_size), num_pages, CONFIG, fill_seed=SEED)
    with PeerProcess(spec) as prefill:
        decode = DecodeSide(geometry(page_size), num_pages)
        try:
            yield prefill, decode, num_pages
        finally:
            decode.close()


def _page_plan(rng: np.random.Generator, num_pages: int, lengths: list[int], page_size: int):
    """Disjoint page lists for each request on both sides: some runs, some scattered pages."""
    counts = [math.ceil(n / page_size) for n in lengths]
    src_all = rng.permutation(np.arange(1, num_pages + 1))[:sum(counts)]
    dst_all = np.sort(rng.choice(np.arange(1, num_pages + 1), sum(counts), replace=False))
    bounds = np.cumsum([0] + counts)
    plan = []
    for i in range(len(counts)):
        src, dst = src_all[bounds[i]:bounds[i + 1]], dst_all[bounds[i]:bounds[i + 1]]
        plan.append((np.sort(src) if i % 2 else src, dst if i % 3 else rng.permutation(dst)))
    return plan


def _chunks(n: int) -> list[int]:
    return [n] if n < 3 else [n // 3, n // 3, n - 2 * (n // 3)]


def _expected_decode_pool(geo: KVGeometry, num_pages: int, plan) -> list[torch.Tensor]:
    src = make_pool(geo, num_pages)
    fill_pool(src, SEED)
    ps = geo.page_size
    expected = [torch.zeros_like(b) for b in src.k_buffer + src.v_buffer]
    for src_pages, dst_pages in plan:
        for exp, buf in zip(expected, src.k_buffer + src.v_buffer):
            for s, d in zip(src_pages.tolist(), dst_pages.tolist()):
                exp[d * ps:(d + 1) * ps] = buf[s * ps:(s + 1) * ps]
    return expected


def test_pages_land_exactly_at_the_decode_slots(pd_pair):
    prefill, decode, num_pages = pd_pair
    geo = decode.mgr.args.geometry
    plan = _page_plan(np.random.default_rng(0), num_pages, [1, 5, 16, 37, 100], geo.page_size)
    rooms = [1000 + i for i in range(len(plan))]
    receivers = [decode.receive(prefill.info["bootstrap_addr"], r, dst) for r, (_, dst) in zip(rooms, plan)]
    for room, (src, _) in zip(rooms, plan):
        prefill.submit("send", room=room, src_pages=src.tolist(), chunks=_chunks(len(src)),
                       metadata=(room % 1000 + 3, -0.25, room))
    sent = [prefill.result() for _ in rooms]
    try:
        for room, receiver, result in zip(rooms, receivers, sent):
            assert result["status"] == KVPoll.Success, result
            assert wait_final(receiver, 10) == KVPoll.Success, receiver.failure_reason()
            assert receiver.metadata() == KVMetadata(room % 1000 + 3, -0.25, room)
    finally:
        for receiver in receivers:
            decode.finish(receiver)
    expected = _expected_decode_pool(geo, num_pages, plan)
    for exp, got in zip(expected, decode.pool.k_buffer + decode.pool.v_buffer):
        assert torch.equal(exp, got), "KV bytes differ from the plan (wrong place, or written outside it)"


def test_metadata_room_mismatch_is_reported_as_corruption(pd_pair):
    prefill, decode, _ = pd_pair
    receiver = decode.receive(prefill.info["bootstrap_addr"], 2001, np.array([3]))
    sent = prefill.call("send", room=2001, src_pages=[4], chunks=[1], metadata=(5, 0.0, 9999))
    try:
        assert sent["status"] == KVPoll.Success  # the prefill cannot know; the decode checks
        assert wait_final(receiver, 10) == KVPoll.Failed
        assert "corrupted transfer" in receiver.failure_reason() and "9999" in receiver.failure_reason()
    finally:
        decode.finish(receiver)


@pytest.mark.parametrize("differs", ["page_size", "dtype"])
def test_geometry_mismatch_is_refused_at_handshake(pd_pair, differs):
    prefill, ours, _ = pd_pair
    page_size = ours.mgr.args.geometry.page_size
    if differs == "page_size":
        other = 17 - page_size  # 1 <-> 16
        decode_geo, needle = geometry(other), f"page_size {page_size} != {other}"
    else:
        decode_geo, needle = geometry(page_size, "bfloat16"), "dtype float16 != bfloat16"
    decode = DecodeSide(decode_geo, 8)
    try:
        receiver = decode.receive(prefill.info["bootstrap_addr"], 3001, np.array([1]))
        sent = prefill.call("send", room=3001, src_pages=[1], chunks=[1], metadata=(1, 0.0, 3001))
        assert sent["status"] == KVPoll.Failed and needle in sent["reason"], sent
        assert wait_final(receiver, 10) == KVPoll.Failed
        assert needle in receiver.failure_reason() and "geometry" in receiver.failure_reason()
        decode.finish(receiver)
    finally:
        decode.close()


def test_killed_prefill_fails_receivers_within_heartbeat_window_and_restart_works():
    geo, port = geometry(1), free_port()
    spec = PeerSpec("prefill", geo, 64, CONFIG, bootstrap_port=port, fill_seed=SEED)
    decode = DecodeSide(geo, 64)
    try:
        with PeerProcess(spec) as prefill:
            receiver = decode.receive(prefill.info["bootstrap_addr"], 4001, np.arange(1, 9))
            assert prefill.call("hold", room=4001)["status"] == KVPoll.WaitingForInput
            assert receiver.poll() == KVPoll.WaitingForInput
            prefill.kill()
            killed_at = time.monotonic()
            window = HEARTBEAT_S * (HEARTBEAT_FAILURES + 1) + 5.0  # + HTTP timeouts and CI slack
            assert wait_final(receiver, window) == KVPoll.Failed
            assert time.monotonic() - killed_at < window
            assert "unreachable" in receiver.failure_reason() or "restarted" in receiver.failure_reason()
            decode.finish(receiver)
        with PeerProcess(spec) as restarted:
            receiver = decode.receive(restarted.info["bootstrap_addr"], 4002, np.arange(1, 9))
            sent = restarted.call("send", room=4002, src_pages=list(range(10, 18)), chunks=[8], metadata=(1, 0.0, 4002))
            assert sent["status"] == KVPoll.Success, sent
            assert wait_final(receiver, 10) == KVPoll.Success, receiver.failure_reason()
            decode.finish(receiver)
    finally:
        decode.close()


def test_the_in_process_fake_refuses_tp_ranks():
    """TP ranks each move their own KV shard from their own process: the fake cannot carry that."""
    import dataclasses

    pool, meta = make_pool(geometry(4), 32), MetadataBuffers(8)
    args = dataclasses.replace(KVArgs.from_pool(pool, meta), tp_size=2)
    with pytest.raises(ValueError, match="crosses processes"):
        create_transfer_backend("fake", args, meta, "decode", CONFIG)
    with pytest.raises(ValueError, match="unknown KV transfer backend 'nope'"):
        create_transfer_backend("nope", args, meta, "decode", CONFIG)


# ---- both managers in this process: cheap failure paths, for Mooncake and the fake ----

@pytest.fixture(params=["mooncake", "fake"])
def pair_factory(request):
    made = []

    def make(prefill_config: TransferConfig = CONFIG, decode_config: TransferConfig = CONFIG):
        server = KVBootstrapServer("127.0.0.1", 0)
        addr = f"127.0.0.1:{server.port}"
        pool, meta = make_pool(geometry(4), 32), MetadataBuffers(8)
        fill_pool(pool, SEED)
        prefill = create_transfer_backend(request.param, KVArgs.from_pool(pool, meta), meta, "prefill",
                                          prefill_config, addr)
        decode = DecodeSide(geometry(4), 32, decode_config, request.param)
        made.append((server, prefill, decode))
        return addr, prefill, pool, meta, decode

    yield make
    with contextlib.ExitStack() as stack:  # every pair closes, whichever check fails
        for pair in made:
            stack.callback(_close_pair, *pair)


def _send_all(prefill, meta, room: int, src: list[int], metadata: KVMetadata):
    sender = prefill.create_sender(room)
    assert wait_until(lambda: sender.poll() != KVPoll.Bootstrapping, 10), sender.failure_reason()
    if sender.poll() == KVPoll.WaitingForInput:
        sender.init(len(src), meta.alloc())
        sender.send(src, is_last=True, metadata=metadata)
    return sender


def test_in_process_transfer_copies_pages(pair_factory):
    addr, prefill, pool, meta, decode = pair_factory()
    receiver = decode.receive(addr, 5001, np.array([9, 10, 2]))
    sender = _send_all(prefill, meta, 5001, [3, 4, 5], KVMetadata(11, -1.5, 5001))
    assert wait_final(sender, 10) == KVPoll.Success, sender.failure_reason()
    assert wait_final(receiver, 10) == KVPoll.Success, receiver.failure_reason()
    assert receiver.metadata() == KVMetadata(11, -1.5, 5001)
    for src_buf, dst_buf in zip(pool.k_buffer + pool.v_buffer, decode.pool.k_buffer + decode.pool.v_buffer):
        assert torch.equal(dst_buf[36:44], src_buf[12:20]) and torch.equal(dst_buf[8:12], src_buf[20:24])
    assert sender.stats().bytes == 3 * 4 * 2 * 8 * 2 * 4 + meta.item_bytes
    meta.free(sender.meta_slot)
    sender.clear()
    decode.finish(receiver)


def test_a_room_in_use_is_refused_and_its_holder_goes_on(pair_factory):
    """A second sender or receiver for a live room (a client that picks rooms reused one) is refused with
    RoomInUse; the first pair still transfers. (An assertion here stopped the scheduler before.)"""
    addr, prefill, pool, meta, decode = pair_factory()
    receiver = decode.receive(addr, 5009, np.array([9, 10, 2]))
    with pytest.raises(RoomInUse, match="bootstrap_room 5009 is already in use"):
        decode.mgr.create_receiver(addr, 5009)
    sender = _send_all(prefill, meta, 5009, [3, 4, 5], KVMetadata(11, -1.5, 5009))
    with pytest.raises(RoomInUse, match="bootstrap_room 5009 is already in use"):
        prefill.create_sender(5009)
    assert wait_final(sender, 10) == KVPoll.Success, sender.failure_reason()
    assert wait_final(receiver, 10) == KVPoll.Success, receiver.failure_reason()
    meta.free(sender.meta_slot)
    sender.clear()
    decode.finish(receiver)
    prefill.create_sender(5009).clear()  # once cleared, the room is free again


def test_fault_injection_fails_both_sides(pair_factory):
    addr, prefill, _, meta, decode = pair_factory(prefill_config=TransferConfig(
        heartbeat_interval_s=HEARTBEAT_S, fault_probability=1.0))
    receiver = decode.receive(addr, 5002, np.array([1, 2]))
    sender = _send_all(prefill, meta, 5002, [1, 2], KVMetadata(1, 0.0, 5002))
    assert wait_final(sender, 10) == KVPoll.Failed and "injected fault" in sender.failure_reason()
    assert wait_final(receiver, 10) == KVPoll.Failed and "injected fault" in receiver.failure_reason()
    meta.free(sender.meta_slot)
    sender.clear()
    decode.finish(receiver)


def test_bootstrap_timeouts_on_both_sides(pair_factory):
    short = TransferConfig(bootstrap_timeout_s=0.5, heartbeat_interval_s=HEARTBEAT_S)
    _, prefill, _, _, decode = pair_factory(prefill_config=short, decode_config=short)
    receiver = decode.receive(f"127.0.0.1:{free_port()}", 5003, np.array([1]))  # nobody listens there
    sender = prefill.create_sender(5004)  # no decode ever asks for room 5004
    assert wait_final(receiver, 10) == KVPoll.Failed and "bootstrap timeout" in receiver.failure_reason()
    assert wait_final(sender, 10) == KVPoll.Failed and "bootstrap timeout" in sender.failure_reason()
    sender.clear()
    decode.finish(receiver)


def test_waiting_timeout_and_decode_abort(pair_factory):
    short = TransferConfig(waiting_timeout_s=0.5, heartbeat_interval_s=HEARTBEAT_S)
    addr, prefill, _, _, decode = pair_factory(decode_config=short)
    waiting = decode.receive(addr, 5005, np.array([1]))
    assert wait_final(waiting, 10) == KVPoll.Failed and "waiting timeout" in waiting.failure_reason()
    aborted = decode.receive(addr, 5006, np.array([2]))
    sender = prefill.create_sender(5006)
    assert wait_until(lambda: sender.poll() == KVPoll.WaitingForInput, 10)
    aborted.abort("client disconnected")
    assert wait_final(sender, 10) == KVPoll.Failed and "client disconnected" in sender.failure_reason()
    sender.clear()
    decode.finish(waiting)
    decode.finish(aborted)


def test_page_count_mismatch_fails_both_sides_as_a_room_conflict(pair_factory):
    """A destination for another prompt (a room given to two pairings) is refused at the sender's
    init, before anything is written: a conflict on both sides, the decode's pages untouched."""
    addr, prefill, _, meta, decode = pair_factory()
    receiver = decode.receive(addr, 5007, np.array([1, 2, 3]))
    sender = _send_all(prefill, meta, 5007, [1, 2], KVMetadata(1, 0.0, 5007))
    assert wait_final(sender, 10) == KVPoll.Failed and "pairs requests of different prompts" in sender.failure_reason()
    assert wait_final(receiver, 10) == KVPoll.Failed and "pairs requests of different prompts" in receiver.failure_reason()
    assert sender.room_conflict() and receiver.room_conflict() and receiver.destination_untouched()
    assert sender.stats().bytes == 0
    meta.free(sender.meta_slot)
    sender.clear()
    decode.finish(receiver)


# ---- peers that misbehave: the rank's threads live on (Mooncake; the fake has no side channel) ----

@pytest.fixture
def mooncake_pair():
    """A prefill manager with its bootstrap server, a decode side; all closed by the test's end."""
    server = KVBootstrapServer("127.0.0.1", 0)
    addr = f"127.0.0.1:{server.port}"
    pool, meta = make_pool(geometry(4), 32), MetadataBuffers(8)
    fill_pool(pool, SEED)
    prefill = create_transfer_backend("mooncake", KVArgs.from_pool(pool, meta), meta, "prefill", CONFIG, addr)
    decode = DecodeSide(geometry(4), 32)
    try:
        yield server, addr, prefill, meta, decode
    finally:
        _close_pair(server, prefill, decode)


def _transfer_ok(addr: str, prefill, meta, decode, room: int) -> None:
    receiver = decode.receive(addr, room, np.array([9, 10]))
    sender = _send_all(prefill, meta, room, [3, 4], KVMetadata(7, -0.25, room))
    assert wait_final(sender, 10) == KVPoll.Success, (sender.failure_reason(), receiver.failure_reason())
    assert wait_final(receiver, 10) == KVPoll.Success, receiver.failure_reason()
    assert receiver.metadata() == KVMetadata(7, -0.25, room)
    meta.free(sender.meta_slot)
    sender.clear()
    decode.finish(receiver)


def test_side_channel_messages_that_cannot_be_read_do_not_deafen_either_side(mooncake_pair, caplog):
    """Stray or malformed frames on a rank's side channel (another version, a port scanner) are
    dropped with a warning; the listener threads of both sides go on and the next transfer works."""
    _, addr, prefill, meta, decode = mooncake_pair
    junk = [[b"room", b"{not json"], [b"nonsense", b"{}"], [b"lonely"], [b"register", b'{"session_id": "x"}'],
            [b"room", b'{"room": 1}', b"\x01\x02\x03"]]
    ctx = zmq.Context()
    try:
        for side in (prefill, decode.mgr):
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)  # ctx.term() must not wait on it, also when an assert fails
            sock.connect(side.channel.endpoint)
            with caplog.at_level(logging.WARNING, logger="baton.engine.disaggregation.mooncake.conn"):
                for frames in junk:
                    sock.send_multipart(frames)
                assert wait_until(lambda: sum("could not be handled" in r.message for r in caplog.records)
                                  >= len(junk), 10), [r.message for r in caplog.records]
            caplog.clear()
    finally:
        ctx.destroy(linger=0)
    assert prefill._listener.is_alive() and decode.mgr._listener.is_alive()
    _transfer_ok(addr, prefill, meta, decode, 5101)


class _GarbageHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        body = b"<html>not a bootstrap server</html>" if "route" in self.path else b"[1, 2]"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def _garbage_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _GarbageHandler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_a_bootstrap_address_that_answers_garbage_times_out_its_receiver_and_no_other(mooncake_pair):
    """A --disaggregation-bootstrap-addr that points at some other HTTP server (answers that are not
    JSON, or not routes) is an unreachable prefill for that request: its receiver fails at its
    bootstrap timeout, and the decode's bootstrap thread, shared by every request, goes on."""
    _, addr, prefill, meta, decode = mooncake_pair
    short = DecodeSide(geometry(4), 32, TransferConfig(bootstrap_timeout_s=1.0, heartbeat_interval_s=HEARTBEAT_S))
    try:
        with _garbage_server() as wrong:
            with pytest.raises(OSError, match="not an answer of a bootstrap server"):
                bootstrap_server.fetch_prefill_rank(wrong)
            with pytest.raises(OSError, match="not an answer of a bootstrap server"):
                bootstrap_server.check_health(wrong, 1.0)
            lost = short.receive(wrong, 5102, np.array([1]))
            assert wait_final(lost, 10) == KVPoll.Failed and "bootstrap timeout" in lost.failure_reason()
            short.finish(lost)
        assert short.mgr.rooms._thread.is_alive(), "the decode's bootstrap thread died on a garbage answer"
        _transfer_ok(addr, prefill, meta, short, 5103)
    finally:
        short.close()


def test_the_bootstrap_server_refuses_a_route_that_is_not_one():
    """400 with the reason, not a traceback and a cut connection; the server goes on serving."""
    server = KVBootstrapServer("127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.port}/route"
    try:
        for body in ({"engine_rank": 0}, {"bogus": 1}, [1, 2]):
            code, answer = bootstrap_server._request("PUT", url, body, 2.0)
            assert code == 400 and "not a prefill rank's route" in answer["error"], (body, code, answer)
        assert bootstrap_server.check_health(f"127.0.0.1:{server.port}", 2.0) == {}
    finally:
        server.close()


def test_a_slow_health_answer_is_a_live_prefill(mooncake_pair, monkeypatch):
    """/health answering after 0.6 s, three times the heartbeat interval: the prefill is busy, not
    gone. Nothing fails; the transfer that was waiting completes."""
    _, addr, prefill, meta, decode = mooncake_pair
    answered = []
    plain = bootstrap_server._Handler.do_GET

    def slow(handler) -> None:
        if handler.path.startswith("/health"):
            time.sleep(0.6)
            answered.append(time.monotonic())
        plain(handler)

    receiver = decode.receive(addr, 5104, np.array([9, 10]))
    sender = prefill.create_sender(5104)
    assert wait_until(lambda: sender.poll() == KVPoll.WaitingForInput, 10), sender.failure_reason()
    monkeypatch.setattr(bootstrap_server._Handler, "do_GET", slow)
    assert wait_until(lambda: len(answered) >= 4, 10), "the decode stopped asking /health"
    assert receiver.poll() == KVPoll.WaitingForInput, receiver.failure_reason()
    sender.init(2, meta.alloc())
    sender.send([3, 4], is_last=True, metadata=KVMetadata(1, 0.0, 5104))
    assert wait_final(sender, 10) == KVPoll.Success, sender.failure_reason()
    assert wait_final(receiver, 10) == KVPoll.Success, receiver.failure_reason()
    meta.free(sender.meta_slot)
    sender.clear()
    decode.finish(receiver)


def test_an_unreachable_bootstrap_server_aborts_the_rooms_on_prefill_ranks_still_alive(mooncake_pair):
    """The prefill's bootstrap server goes away while its rank lives on: the decode's heartbeats
    fail, it gives up the room and tells the rank, which ends its sender at once (it would otherwise
    wait for KV it should no longer write)."""
    server, addr, prefill, _, decode = mooncake_pair
    receiver = decode.receive(addr, 5105, np.array([1, 2]))
    sender = prefill.create_sender(5105)
    assert wait_until(lambda: sender.poll() == KVPoll.WaitingForInput, 10), sender.failure_reason()
    server.close()
    window = HEARTBEAT_S * (HEARTBEAT_FAILURES + 1) + 5.0
    assert wait_final(receiver, window) == KVPoll.Failed and "unreachable" in receiver.failure_reason()
    assert wait_final(sender, 5) == KVPoll.Failed, "the live prefill rank was never told"
    assert "aborted by the decode engine" in sender.failure_reason() and "unreachable" in sender.failure_reason()
    sender.clear()
    decode.finish(receiver)


def test_closing_a_manager_destroys_its_native_engine_at_once():
    """close() tears the Mooncake engine down in the caller's thread: its handshake port stops
    answering at once, and a late write is a KVTransferError rather than a call into a freed engine.
    Left to the garbage collector, the teardowns of a dozen closed engines once landed together in a
    KV follower's thread (7.6 s) and held its state reports past a handshake timeout."""
    pool, meta = make_pool(geometry(4), 8), MetadataBuffers(2)
    mgr = create_transfer_backend("mooncake", KVArgs.from_pool(pool, meta), meta, "decode", CONFIG)
    engine = mgr.engine  # a reference that outlives the manager, as a cycle would
    host, port = engine.session_id.rsplit(":", 1)
    socket.create_connection((host, int(port)), timeout=2).close()  # it answers while open
    mgr.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, int(port)), timeout=2).close()
    with pytest.raises(KVTransferError, match="closed"):
        engine.batch_write("127.0.0.1:1", [0], [0], [8])


# ---- pure helpers ----

def test_contiguous_runs_coalesce_only_where_both_sides_advance():
    runs = contiguous_runs(np.array([5, 6, 7, 9, 10, 11]), np.array([1, 2, 3, 4, 8, 9]))
    assert runs.src_starts.tolist() == [5, 9, 10] and runs.dst_starts.tolist() == [1, 4, 8]
    assert runs.lengths.tolist() == [3, 1, 2]
    assert contiguous_runs(np.zeros(0, np.int64), np.zeros(0, np.int64)).lengths.size == 0


def test_pages_from_slots_and_metadata_roundtrip():
    assert pages_from_slots(torch.tensor([32, 33, 34, 35, 16, 17]), 4).tolist() == [8, 4]
    buf = MetadataBuffers(4)
    slot = buf.alloc()
    buf.set(slot, KVMetadata(123, -0.125, 2**62 + 5))
    assert buf.get(slot) == KVMetadata(123, -0.125, 2**62 + 5)
    buf.free(slot)
    assert buf.get(slot) == KVMetadata(0, 0.0, 0) and buf.available_size() == 4


def test_side_channel_messages_roundtrip():
    room = messages.Room(2**63 - 1, "h:1", "tcp://h:2", 3, np.array([4, 5], dtype=np.int64), prefix_pages=7)
    back = messages.decode(messages.encode(room))
    assert back.room == room.room and back.pages.tolist() == [4, 5] and back.endpoint == "tcp://h:2"
    assert back.prefix_pages == 7
    status = messages.Status(1, int(KVPoll.Failed), "why")
    assert messages.decode(messages.encode(status)) == status
