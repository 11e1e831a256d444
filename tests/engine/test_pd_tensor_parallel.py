"""PD disaggregation with tensor parallelism: every TP rank moves its own KV shard to the same TP
rank of the decode engine (engine/disaggregation/tp_fanout.py).

First in this process, with real Mooncake over TCP on 127.0.0.1: two ranks per side, each with its
own pool filled differently, the rank-0 managers driving the rank-1 ones through the fan-out link
as a TP driver does. Each decode rank must receive exactly its prefill rank's pages; a failure on
one rank fails the request on both sides, naming the rank; a decode of another TP size is refused.
Then the real thing: a prefill and a decode engine with --tp-size 2 each (`baton serve`), greedy
tokens equal to HF."""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace

import httpx
import numpy as np
import pytest
import torch

from baton.engine.bench.launcher import EngineProcess, engine_command, free_port
from baton.engine.disaggregation import create_transfer_backend
from baton.engine.disaggregation.base import KVArgs, KVGeometry, KVMetadata, KVPoll, MetadataBuffers, TransferConfig
from baton.engine.disaggregation.bootstrap_server import KVBootstrapServer, check_health, fetch_prefill_rank
from baton.engine.bench.loopback_peer import fill_pool, make_pool, wait_final, wait_until
from baton.engine.disaggregation.head_slices import (CONV, HeadSlice, decode_rank_plan, kv_head_range, receivers_of,
                                                     state_row_slices)
from baton.engine.disaggregation.tp_fanout import DriverLink, FollowerKVService, TpKVManager
from engine_server import STARTUP_TIMEOUT_S, wait_idle_integrity
from test_scheduler_vs_hf import hf_greedy

pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine(-non-cuda) is a test dependency")

CONFIG = TransferConfig(bootstrap_timeout_s=15, waiting_timeout_s=30, heartbeat_interval_s=0.2,
                        heartbeat_max_failures=2)
GEO = KVGeometry(page_size=4, dtype="float16", layer_num=2, head_num=2, head_dim=8)  # per shard
NUM_PAGES = 32


class Side:
    """One engine's transfer state over `tp_size` ranks: rank 0's manager drives the others."""

    def __init__(self, mode: str, tp_size: int, addr=None, seed: int = 0, configs=None, kv_heads: int = 4) -> None:
        self.pools, self.metas, self.services, self.mgrs, self.link = [], [], [], [], None
        self.kv_heads = kv_heads
        local = None
        for rank in range(tp_size):
            geo = replace(GEO, head_num=kv_head_range(kv_heads, tp_size, rank)[1])
            pool, meta = make_pool(geo, NUM_PAGES), MetadataBuffers(8)
            if mode == "prefill":
                fill_pool(pool, seed + rank)
            config = (configs or {}).get(rank, CONFIG)
            args = KVArgs.from_pool(pool, meta, tp_rank=rank, tp_size=tp_size, kv_heads_total=kv_heads)
            mgr = create_transfer_backend("mooncake", args, meta, mode, config, addr)
            self.pools.append(pool)
            self.metas.append(meta)
            self.mgrs.append(mgr)
            if rank == 0:
                local = mgr
            else:
                self.services.append((FollowerKVService(rank), mgr, meta))
        if tp_size == 1:
            self.mgr = local
            return
        self.link = DriverLink()
        self.link.connect([svc.endpoint for svc, _, _ in self.services])
        for svc, mgr, meta in self.services:
            svc.start(mgr, meta, self.link.status_endpoint)
        self.services = [svc for svc, _, _ in self.services]
        self.mgr = TpKVManager(local, self.link, tp_size)

    def close(self, check: bool = True) -> None:
        """Checks that every rank let go of its rooms (unless the test failed already), then closes
        them all whatever the check says: a failed test must not leave engines for the collector."""
        try:
            if check:
                assert self.mgr.num_rooms() == 0, "a sender or receiver was not cleared on rank 0"
                assert all(wait_until(lambda s=s: s.num_rooms() == 0, 10) for s in self.services), \
                    "a follower kept a room after the driver cleared it"
        finally:
            self.mgr.close()  # stops the followers' service threads through the link
            for svc in self.services:
                svc.close()


@contextlib.contextmanager
def engines(decode_tp: int = 2, prefill_configs=None, prefill_tp: int = 2, kv_heads: int = 4, decode_configs=None):
    server = KVBootstrapServer("127.0.0.1", 0)
    addr = f"127.0.0.1:{server.port}"
    passed = []  # the body ended without an exception: only then are the rooms checked at close
    with contextlib.ExitStack() as stack:  # every close runs, whichever fails
        stack.callback(server.close)
        prefill = Side("prefill", prefill_tp, addr, seed=11, configs=prefill_configs, kv_heads=kv_heads)
        stack.callback(lambda: prefill.close(check=bool(passed)))
        decode = Side("decode", decode_tp, configs=decode_configs, kv_heads=kv_heads)
        stack.callback(lambda: decode.close(check=bool(passed)))
        yield addr, prefill, decode
        passed.append(True)


def _transfer(addr: str, prefill: Side, decode: Side, room: int, src: list[int], dst: list[int]):
    receiver = decode.mgr.create_receiver(addr, room)
    receiver.init(np.array(dst), decode.metas[0].alloc())
    sender = prefill.mgr.create_sender(room)
    assert wait_until(lambda: sender.poll() != KVPoll.Bootstrapping, 15), _describe(prefill, decode, sender, receiver)
    if sender.poll() == KVPoll.WaitingForInput:
        slot = prefill.metas[0].alloc()
        sender.init(len(src), slot)
        prefill.metas[0].set_top_logprobs(slot, TOP_LOGPROBS)  # as the prefill's driver does (rank 0 only)
        sender.send(src[:1])  # two chunks, as a chunked prefill sends them
        sender.send(src[1:], is_last=True, metadata=KVMetadata(42, -0.5, room))
    return sender, receiver


TOP_LOGPROBS = [(-0.25, 17), (-1.5, 3)]  # the first token's top logprobs, (logprob, token id)


def _assert_first_token_arrived(decode: Side, receiver, room: int) -> None:
    """The metadata slot the decode's driver reads: the first token and its top logprobs, whichever
    prefill ranks wrote to it."""
    assert receiver.metadata() == KVMetadata(42, -0.5, room)
    assert decode.metas[0].get_top_logprobs(getattr(receiver, "local", receiver).meta_slot) == TOP_LOGPROBS


def _describe(prefill: Side, decode: Side, sender, receiver) -> str:
    """Where a transfer stands on every rank, for an assertion's message: a handshake that hangs now and
    then under load (room 7004 in CI) should say where."""
    try:
        local, remote = getattr(sender, "local", sender), getattr(receiver, "local", receiver)
        out = {"sender": (local.poll().name, local.failure_reason(), len(local.dests)),
               "receiver": (remote._status.status.name, remote.failure_reason(), remote.peer is not None,
                            remote._dest_sent)}
        if getattr(sender, "link", None) is not None:
            out["prefill followers"] = {r: (s.name, why) for r, (s, why) in sender.link._states.get(sender.room,
                                                                                                   {}).items()}
        rooms = decode.mgrs[0].rooms
        out["decode bootstrap"] = (rooms._thread.is_alive(), sorted(rooms._routes), dict(rooms._failures))
        for i, mgr in enumerate(prefill.mgrs):
            out[f"prefill rank {i}"] = (mgr._listener.is_alive(), sorted(mgr.rooms._pending),
                                       sorted(mgr.rooms._senders), len(mgr.rooms._peers))
        for svc in prefill.services:  # its thread, the rooms it holds, what it reported of them
            out[f"prefill follower {svc.tp_rank}"] = (svc._thread.is_alive(), sorted(svc._items),
                                                      {r: (s.name, why) for r, (s, why) in svc._reported.items()})
        return repr(out)
    except Exception as e:  # noqa: BLE001 - a description must not hide the failure it describes
        return f"(no description: {type(e).__name__}: {e})"


def _finish(prefill: Side, decode: Side, sender, receiver) -> None:
    if getattr(sender, "local", sender).meta_slot is not None:
        prefill.metas[0].free(getattr(sender, "local", sender).meta_slot)
    sender.clear()
    decode.metas[0].free(getattr(receiver, "local", receiver).meta_slot)
    receiver.clear()


def test_the_integrity_count_includes_a_room_only_a_follower_holds():
    """The idle check's room count asks the followers: a room left on rank 1 alone (a planted
    follower-only sender) makes the engine's count non-zero until it is cleared there."""
    with engines() as (_, prefill, _decode):
        assert prefill.mgr.num_rooms() == 0
        prefill.link.op({"op": "sender", "room": 4242})  # rank 1 only: the driver holds nothing
        assert prefill.mgr.local.num_rooms() == 0 and prefill.mgr.num_rooms() == 1
        prefill.link.op({"op": "clear", "room": 4242})
        assert prefill.mgr.num_rooms() == 0
        assert prefill.link.count_rooms(timeout_s=5) == 0


def test_a_follower_that_does_not_answer_the_count_is_not_proven_clean():
    link = DriverLink()
    silent = FollowerKVService(1)  # its op socket is bound, but no thread reads it
    try:
        link.connect([silent.endpoint])
        assert link.count_rooms(timeout_s=0.2) == 1
    finally:
        link._ops[0].close()
        link._reports.close()
        link._ctx.term()
        silent.close()


def test_each_decode_rank_receives_its_prefill_ranks_shard():
    with engines() as (addr, prefill, decode):
        sessions = check_health(addr, 5)
        assert sorted(sessions) == ["0", "0.1"] and len(set(sessions.values())) == 2
        assert fetch_prefill_rank(addr, 0, tp_rank=1).tp_size == 2
        src, dst = [3, 4, 5], [9, 10, 2]
        sender, receiver = _transfer(addr, prefill, decode, 7001, src, dst)
        assert wait_final(sender, 15) == KVPoll.Success, sender.failure_reason()
        assert wait_final(receiver, 15) == KVPoll.Success, receiver.failure_reason()
        _assert_first_token_arrived(decode, receiver, 7001)
        ps = GEO.page_size
        for rank in range(2):
            src_pool, dst_pool = prefill.pools[rank], decode.pools[rank]
            for s_buf, d_buf in zip(src_pool.k_buffer + src_pool.v_buffer, dst_pool.k_buffer + dst_pool.v_buffer):
                for s, d in zip(src, dst):
                    assert torch.equal(d_buf[d * ps:(d + 1) * ps], s_buf[s * ps:(s + 1) * ps]), f"rank {rank}"
        other = prefill.pools[1].k_buffer[0][src[0] * ps:(src[0] + 1) * ps]
        assert not torch.equal(decode.pools[0].k_buffer[0][dst[0] * ps:(dst[0] + 1) * ps], other), \
            "the ranks' shards were filled alike: the check above proves nothing"
        assert sender.stats().bytes == 2 * sender.local.stats().bytes  # the engine's bytes: both shards
        _finish(prefill, decode, sender, receiver)


def test_a_failure_on_one_rank_fails_the_request_on_both_sides_and_names_the_rank():
    faulty = TransferConfig(bootstrap_timeout_s=15, heartbeat_interval_s=0.2, fault_probability=1.0)
    with engines(prefill_configs={1: faulty}) as (addr, prefill, decode):
        sender, receiver = _transfer(addr, prefill, decode, 7002, [1, 2], [5, 6])
        assert wait_final(sender, 15) == KVPoll.Failed
        assert sender.failure_reason().startswith("TP rank 1: ") and "injected fault" in sender.failure_reason()
        # rank 0's shard goes through (it may still be on its way when rank 1's failure is in)
        assert wait_final(sender.local, 15) == KVPoll.Success, sender.local.failure_reason()
        assert wait_final(receiver, 15) == KVPoll.Failed and "TP rank 1: " in receiver.failure_reason()
        _finish(prefill, decode, sender, receiver)


def test_an_abort_on_the_decode_reaches_every_prefill_rank():
    with engines() as (addr, prefill, decode):
        receiver = decode.mgr.create_receiver(addr, 7003)
        receiver.init(np.array([1]), decode.metas[0].alloc())
        sender = prefill.mgr.create_sender(7003)
        assert wait_until(lambda: sender.poll() == KVPoll.WaitingForInput, 15), sender.failure_reason()
        receiver.abort("client disconnected")
        assert wait_final(sender, 15) == KVPoll.Failed and "client disconnected" in sender.failure_reason()
        assert wait_until(lambda: prefill.link.state(7003)[0] == KVPoll.Failed, 15), "rank 1 never heard of it"
        _finish(prefill, decode, sender, receiver)


@pytest.fixture
def scatters(monkeypatch) -> list:
    """The landed requests a decode rank scattered (landing.py), as (pages, slices)."""
    from baton.engine.disaggregation.mooncake import receiver

    calls = []

    def counted(bufs, pages, page_size, slices):
        calls.append((list(pages), list(slices)))
        return receiver_scatter(bufs, pages, page_size, slices)

    receiver_scatter = receiver.scatter_landed
    monkeypatch.setattr(receiver, "scatter_landed", counted)
    return calls


def _count_writes(side: Side) -> list:
    """Every batched write's entry count, over all of the side's ranks."""
    counts = []
    for mgr in side.mgrs:
        def counted(session, srcs, dsts, lens, write=mgr.engine.batch_write):
            counts.append(len(lens))
            return write(session, srcs, dsts, lens)
        mgr.engine.batch_write = counted
    return counts


@pytest.mark.parametrize("prefill_tp,decode_tp,kv_heads,land", [
    (1, 2, 4, True), (2, 1, 4, True), (2, 4, 2, True), (4, 1, 2, True), (3, 2, 6, True), (2, 1, 4, False)],
    ids=["tp1-to-tp2", "tp2-to-tp1", "tp2-to-tp4-replicated", "tp4-replicated-to-tp1", "tp3-to-tp2",
         "tp2-to-tp1-in-place"])
def test_each_decode_rank_receives_exactly_its_heads_from_a_prefill_of_another_tp_size(prefill_tp, decode_tp,
                                                                                        kv_heads, land, scatters):
    """Every rank's pool filled differently (replicas of a head too): each decode rank's heads of
    every page are the bytes of the first prefill rank holding that head (head_slices.py), whether
    one sender feeds several receivers (gathering the slices in a staging buffer that holds 3 tokens
    here, so in several pieces) or several senders one receiver (each slice lands packed in the
    request's pages, non-consecutive here, and the decode rank scatters it once: landing.py; 3 -> 2
    mixes both, with slices of 2 and 1 heads, one gathered); a prefill rank nobody needs (a replica)
    still ends the request. Slices move in runs, far fewer writes than tokens, except on the slow
    path a decode asks for with land_slices=False (one write per token and layer buffer)."""
    small = replace(CONFIG, staging_bytes=3 * 4 * 2 * 8 * 2)  # 3 tokens x 4 buffers x 2 heads x 8 x fp16
    with engines(decode_tp=decode_tp, prefill_tp=prefill_tp, kv_heads=kv_heads,
                 prefill_configs={r: small for r in range(prefill_tp)},
                 decode_configs={r: replace(CONFIG, land_slices=land) for r in range(decode_tp)}) as (addr, prefill,
                                                                                                     decode):
        writes = _count_writes(prefill)
        src, dst = [3, 4, 5, 9], [9, 10, 2, 3]
        sender, receiver = _transfer(addr, prefill, decode, 7004, src, dst)
        assert wait_final(sender, 15) == KVPoll.Success, _describe(prefill, decode, sender, receiver)
        assert wait_final(receiver, 15) == KVPoll.Success, receiver.failure_reason()
        _assert_first_token_arrived(decode, receiver, 7004)
        ps = GEO.page_size
        for r in range(decode_tp):
            d_start, d_num = kv_head_range(kv_heads, decode_tp, r)
            for h in range(d_start, d_start + d_num):
                p = next(p for p in range(prefill_tp) if kv_head_range(kv_heads, prefill_tp, p)[0] <= h
                         < sum(kv_head_range(kv_heads, prefill_tp, p)))
                p_start = kv_head_range(kv_heads, prefill_tp, p)[0]
                src_pool, dst_pool = prefill.pools[p], decode.pools[r]
                for s_buf, d_buf in zip(src_pool.k_buffer + src_pool.v_buffer, dst_pool.k_buffer + dst_pool.v_buffer):
                    for s_page, d_page in zip(src, dst):
                        assert torch.equal(d_buf[d_page * ps:(d_page + 1) * ps, h - d_start],
                                           s_buf[s_page * ps:(s_page + 1) * ps, h - p_start]), (r, h, p)
        plans = [[s for s in decode_rank_plan(kv_heads, prefill_tp, decode_tp, r) if s.num_heads]
                 for r in range(decode_tp)]
        narrower = sum(len(plan) > 1 for plan in plans)  # decode ranks taking heads from several prefill ranks
        assert len(scatters) == (narrower if land else 0) and all(pages == dst for pages, _ in scatters)
        per_token = 4 * len(src) * ps * sum(map(len, plans))  # 4 layer buffers; a slice of each token into each
        tails = sum(len(decode_rank_plan(kv_heads, prefill_tp, decode_tp, r)) for r in range(decode_tp))
        kv_writes = sum(writes) - tails  # each destination's last batch: its metadata slot
        assert kv_writes == per_token if not land else kv_writes <= per_token // 2, writes
        _finish(prefill, decode, sender, receiver)


def test_an_abort_between_the_slices_of_a_narrower_decode_ends_both_sides_without_a_scatter(scatters):
    """TP 2 -> 1: prefill rank 0's slice has landed (Success) when the decode gives up, before rank 1
    wrote: the receiver fails and never scatters into the pages, which go back (or to quarantine) as
    any failed request's; both prefill ranks fail; no rank keeps a room (Side.close)."""
    with engines(decode_tp=1) as (addr, prefill, decode):
        receiver = decode.mgr.create_receiver(addr, 7008)
        receiver.init(np.array([2, 3]), decode.metas[0].alloc())
        sender = prefill.mgr.create_sender(7008)
        assert wait_until(lambda: sender.poll() == KVPoll.WaitingForInput, 15), sender.failure_reason()
        assert sender.local.dests[0].landing, "the decode asked rank 0 to land its slice"
        sender.init(2, prefill.metas[0].alloc())
        sender.local.send([5, 6], is_last=True, metadata=KVMetadata(42, -0.5, 7008))  # rank 0 only
        assert wait_final(sender.local, 15) == KVPoll.Success, sender.local.failure_reason()
        assert wait_until(lambda: len(receiver._succeeded) == 1, 15), "rank 0's Success never came"
        assert receiver.poll() == KVPoll.WaitingForInput, "one prefill rank's slice is not the request"
        receiver.abort("client disconnected")
        assert receiver.poll() == KVPoll.Failed and "client disconnected" in receiver.failure_reason()
        assert wait_until(lambda: prefill.link.state(7008)[0] == KVPoll.Failed, 15), "rank 1 never heard of it"
        assert sender.poll() == KVPoll.Failed and scatters == []
        _finish(prefill, decode, sender, receiver)


def test_a_fault_on_one_of_two_senders_into_one_receiver_fails_both_sides():
    """TP 2 -> TP 1: the decode's one receiver hears from two prefill ranks; rank 1 fails its write."""
    faulty = TransferConfig(bootstrap_timeout_s=15, heartbeat_interval_s=0.2, fault_probability=1.0)
    with engines(decode_tp=1, prefill_configs={1: faulty}) as (addr, prefill, decode):
        sender, receiver = _transfer(addr, prefill, decode, 7005, [1, 2], [5, 6])
        assert wait_final(sender, 15) == KVPoll.Failed and sender.failure_reason().startswith("TP rank 1: ")
        assert wait_final(receiver, 15) == KVPoll.Failed and "injected fault" in receiver.failure_reason()
        _finish(prefill, decode, sender, receiver)


def test_an_abort_on_either_receiver_of_one_sender_fails_the_sender():
    """TP 1 -> TP 2: one prefill rank waits for both decode ranks' destinations; an abort (from the
    decode driver, fanned out to its follower) fails the prefill's request."""
    with engines(decode_tp=2, prefill_tp=1) as (addr, prefill, decode):
        receiver = decode.mgr.create_receiver(addr, 7006)
        receiver.init(np.array([1]), decode.metas[0].alloc())
        sender = prefill.mgr.create_sender(7006)
        assert wait_until(lambda: sender.poll() == KVPoll.WaitingForInput, 15), sender.failure_reason()
        assert len(sender.dests) == 2, "both decode ranks sent their destination"
        receiver.abort("client disconnected")
        assert wait_final(sender, 15) == KVPoll.Failed and "client disconnected" in sender.failure_reason()
        _finish(prefill, decode, sender, receiver)


def test_destinations_of_several_decode_ranks_that_come_before_the_sender_all_count():
    """TP 1 -> TP 2 with both decode ranks' destinations in before the prefill has the request
    (the usual order: the decode reserves while the prefill still queues it): the sender must get
    both, not the last one only (it would wait for the other until its bootstrap timeout)."""
    with engines(decode_tp=2, prefill_tp=1) as (addr, prefill, decode):
        receiver = decode.mgr.create_receiver(addr, 7007)
        receiver.init(np.array([2, 3]), decode.metas[0].alloc())
        rooms = prefill.mgr.rooms  # the backend's table of rooms without a sender yet
        assert wait_until(lambda: len(rooms._pending.get(7007, (0, []))[1]) == 2, 15), "destinations never came"
        sender = prefill.mgr.create_sender(7007)
        assert sender.poll() == KVPoll.WaitingForInput and len(sender.dests) == 2
        sender.init(2, prefill.metas[0].alloc())
        sender.send([5, 6], is_last=True, metadata=KVMetadata(42, -0.5, 7007))
        assert wait_final(sender, 15) == KVPoll.Success, sender.failure_reason()
        assert wait_final(receiver, 15) == KVPoll.Success, receiver.failure_reason()
        _finish(prefill, decode, sender, receiver)


def test_head_slice_plans_cover_every_decode_head_once():
    for total, prefill_tp, decode_tp in [(4, 1, 2), (4, 2, 1), (4, 2, 4), (2, 4, 1), (8, 4, 2), (2, 1, 4), (4, 4, 4)]:
        senders = {p: 0 for p in range(prefill_tp)}
        for r in range(decode_tp):
            start, n = kv_head_range(total, decode_tp, r)
            got = []
            for s in decode_rank_plan(total, prefill_tp, decode_tp, r):
                senders[s.prefill_rank] += 1
                p_start, p_num = kv_head_range(total, prefill_tp, s.prefill_rank)
                assert s.src_head + s.num_heads <= p_num
                got += [p_start + s.src_head + i for i in range(s.num_heads)]
                assert [start + s.dst_head + i for i in range(s.num_heads)] == got[len(got) - s.num_heads:]
            assert sorted(got) == list(range(start, start + n)), (total, prefill_tp, decode_tp, r)
        assert all(senders[p] == receivers_of(total, prefill_tp, decode_tp, p) >= 1 for p in senders), \
            "every prefill rank hears from the decode ranks it counts on, at least one"
    assert decode_rank_plan(4, 2, 2, 1) == [HeadSlice(1, 0, 0, 2)], "equal sizes: the whole shard of the same rank"


@pytest.mark.parametrize("linear_heads,kv_heads", [((2, 4, 3, 5), 2), ((4, 8, 2, 3), 2), ((4, 4, 2, 2), 1)])
def test_state_row_slices_rebuild_every_decode_ranks_slot(linear_heads, kv_heads):
    """A hybrid's recurrent state between TP sizes: every row of each decode rank's conv and
    delta-rule slot comes from exactly one prefill rank, and it is the row the model's heads put there
    ([q | k | v] of the rank's key heads, then its value heads); the plan pairs every prefill rank
    holding a decode rank's linear heads with it, also where the KV heads (fewer, replicated) would not."""
    hk, hv, dk, dv = linear_heads

    def rows_of(tp: int, rank: int) -> tuple[list, list]:
        """The model's (part, head, index) of each conv row and the value head of each state row."""
        k0, kn = kv_head_range(hk, tp, rank)
        v0, vn = k0 * (hv // hk), kn * (hv // hk)
        conv = [(part, k0 + i // dk, i % dk) for part in "qk" for i in range(kn * dk)]
        conv += [("v", v0 + i // dv, i % dv) for i in range(vn * dv)]
        return conv, list(range(v0, v0 + vn))

    for prefill_tp, decode_tp in [(1, 2), (2, 1), (2, 4), (4, 1), (4, 2), (2, 2)]:
        if max(prefill_tp, decode_tp) > hk:
            continue
        for r in range(decode_tp):
            want_conv, want_ssm = rows_of(decode_tp, r)
            got_conv, got_ssm = [None] * len(want_conv), [None] * len(want_ssm)
            plan = {s.prefill_rank for s in decode_rank_plan(kv_heads, prefill_tp, decode_tp, r, hk)}
            for p in range(prefill_tp):
                src_conv, src_ssm = rows_of(prefill_tp, p)
                slices = state_row_slices(linear_heads, prefill_tp, p, decode_tp, r)
                assert not slices or p in plan, (prefill_tp, decode_tp, r, p)
                for kind, src, dst, n in slices:
                    got, src_rows = (got_conv, src_conv) if kind == CONV else (got_ssm, src_ssm)
                    assert all(x is None for x in got[dst:dst + n]), "a row written twice"
                    got[dst:dst + n] = src_rows[src:src + n]
            assert got_conv == want_conv and got_ssm == want_ssm, (prefill_tp, decode_tp, r)


def test_the_bootstrap_server_keeps_each_tp_ranks_route():
    server = KVBootstrapServer("127.0.0.1", 0)
    try:
        addr = f"127.0.0.1:{server.port}"
        assert fetch_prefill_rank(addr, 0, tp_rank=1) is None
        bad = httpx.get(f"http://{addr}/route?engine_rank=0&tp_rank=x", timeout=5)
        assert bad.status_code == 400 and "integers" in bad.json()["error"]
    finally:
        server.close()


# ------------------------------------------------------------------------------- served engines

MAX_NEW = 8
PROMPTS = [[(7 * i + 3 * j) % 500 + 6 for j in range(5 + 6 * i)] for i in range(6)]
PROMPTS += [PROMPTS[5][:24] + [11, 12, 13]]  # a radix hit on both engines


@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    return tiny_model_factory("llama")  # 4 heads / 2 KV heads: one KV head per TP rank


@pytest.fixture(scope="module")
def hybrid_path(tiny_model_factory) -> str:
    # Qwen3.5: 2 KV heads, 2 linear key heads / 4 value heads: one of each per rank at TP 2
    return tiny_model_factory("qwen3_5", initializer_range=0.02)


@pytest.mark.parametrize("arch,prefill_tp,decode_tp", [("llama", 2, 2), ("llama", 1, 2), ("llama", 2, 1),
                                                       ("hybrid", 1, 2), ("hybrid", 2, 1), ("eagle", 2, 2)],
                         ids=["tp2-tp2", "tp1-tp2", "tp2-tp1", "hybrid-tp1-tp2", "hybrid-tp2-tp1", "eagle-tp2-tp2"])
def test_prefill_and_decode_tp_sizes_serve_hf_greedy_tokens(request, tmp_path, arch, prefill_tp, decode_tp):
    """Equal sizes: each rank moves its own shard. Different sizes: the decode rank takes its KV heads'
    slices from whichever prefill ranks hold them (head_slices.py), and a hybrid's recurrent state as
    the rows of its linear heads (state_row_slices). EAGLE on both: the draft head's KV layer travels
    too, the prefill's rank 0 writes its first draft and output into the decode's metadata slot (the
    other ranks the base only), and the decode's driver hands them to its follower in the first
    verify step."""
    model_path = request.getfixturevalue("hybrid_path" if arch == "hybrid" else "model_path")
    common = ["--disaggregation-transfer-backend", "mooncake", "--page-size", "4", "--max-total-tokens", "1024"]
    if arch == "eagle":
        from tiny_models import make_eagle_draft

        common += ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path",
                   make_eagle_draft(model_path, tmp_path / "eagle", "EAGLE"), "--speculative-disable-by-batch-size", "64"]
    bootstrap_port, prefill_port, decode_port = free_port(), free_port(), free_port()
    prefill = EngineProcess(engine_command(model_path, prefill_port, [
        "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap_port),
        "--chunked-prefill-size", "16", "--tp-size", str(prefill_tp), *common]), prefill_port)
    decode = EngineProcess(engine_command(model_path, decode_port, ["--disaggregation-mode", "decode", "--tp-size",
                                                                    str(decode_tp), *common]), decode_port)
    with prefill, decode:
        prefill.wait_healthy(STARTUP_TIMEOUT_S, "waiting for the prefill engine")
        decode.wait_healthy(STARTUP_TIMEOUT_S, "waiting for the decode engine")
        sessions = httpx.get(f"http://127.0.0.1:{bootstrap_port}/health", timeout=10).json()["sessions"]
        assert sorted(sessions) == ["0", "0.1"][:prefill_tp], sessions

        async def run(prompts):
            async with httpx.AsyncClient(timeout=120) as c:
                async def both(p):
                    body = {"input_ids": p, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0},
                            "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port,
                            "bootstrap_room": int(np.random.randint(1 << 62))}
                    return await asyncio.gather(c.post(f"{prefill.base_url}/generate", json=body),
                                                c.post(f"{decode.base_url}/generate", json=body))
                return await asyncio.gather(*[both(p) for p in prompts])

        results = asyncio.run(run(PROMPTS[:-1])) + asyncio.run(run(PROMPTS[-1:]))
        for p, (pre, dec) in zip(PROMPTS, results):
            assert pre.status_code == 200 and dec.status_code == 200, (pre.text, dec.text)
            want = hf_greedy(model_path, p, MAX_NEW)
            assert dec.json()["output_ids"] == want, p
            assert pre.json()["output_ids"] == want[:1]
        assert results[-1][1].json()["meta_info"]["cached_tokens"] > 0, "the decode's radix cache was not hit"
        for engine, tp in ((prefill, prefill_tp), (decode, decode_tp)):
            info = wait_idle_integrity(engine.base_url, timeout_s=60)
            assert info["integrity_ok"] is True and info["tp_size"] == tp, info
        info = httpx.get(f"{prefill.base_url}/get_server_info", timeout=10).json()
        assert info["kv_transfer_bytes"] > 0
        if arch == "eagle":
            info = httpx.get(f"{decode.base_url}/get_server_info", timeout=10).json()
            assert info["speculative_algorithm"] == "EAGLE" and info["spec_verify_steps"] > 0, info
