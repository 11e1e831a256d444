"""PD disaggregation of hybrid models: the prefill sends every linear-attention layer's
recurrent state (conv + delta-rule) with the last chunk, into the decode's request row.

In one process first (the real schedulers, joined by the in-process fake backend, as in
test_pd_scheduler.py): greedy tokens equal HF's, a decode radix hit reuses KV but never state,
retraction on the decode, aborts at each stage. Then real Mooncake over TCP: the state lands in
exactly the decode's slot, and a mismatched pair is refused on both sides with the reason.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from baton.engine.disaggregation import create_transfer_backend
from baton.engine.disaggregation.base import KVArgs, KVMetadata, KVPoll, MetadataBuffers, TransferConfig
from baton.engine.disaggregation.bootstrap_server import KVBootstrapServer
from baton.engine.bench.loopback_peer import wait_final, wait_until
from baton.engine.mem_cache.memory_pool import MHATokenToKVPool
from baton.engine.mem_cache.state_pool import LinearStateShapes, RecurrentStatePool
from baton.engine.utils.process import free_port
from test_pd_scheduler import PDPair, _run, pair_factory  # noqa: F401 - the fixture
from test_scheduler_vs_hf import hf_greedy, workload

ARCH = "qwen3_5"  # dense hybrid: the cheapest; qwen3_next (MoE) runs in the first test too


def _state_pool(pair: PDPair, side: str) -> RecurrentStatePool:
    return getattr(pair, side).scheduler.worker.model_runner.state_pool


@pytest.mark.parametrize("arch,overlap,page_size", [(ARCH, False, 1), (ARCH, True, 16), ("qwen3_next", True, 4)],
                         ids=["qwen3_5-plain-page1", "qwen3_5-overlap-page16", "qwen3_next-overlap-page4"])
def test_hybrid_pd_matches_hf_concurrent_chunked(tiny_model_factory, pair_factory, arch, overlap, page_size):
    path = tiny_model_factory(arch)
    pair = pair_factory(path, page_size=page_size, max_total_tokens=4096, enable_overlap_schedule=overlap,
                        disable_overlap_schedule=not overlap, prefill_args={"chunked_prefill_size": 32})
    prompts = workload()
    _run(pair, prompts)
    for i, p in enumerate(prompts):
        got, pre = pair.decode.results[str(i)], pair.prefill.results[str(i)]
        assert got.ids == hf_greedy(path, p), f"request {i} (len {len(p)}) differs from HF"
        assert pre.ids == got.ids[:1], "the prefill answers the first token"
    assert any(len(p) > 32 for p in prompts), "some prompts are chunked"
    assert pair.prefill.scheduler.stats.cache_hit_rate() > 0, "shared prefixes hit the prefill's state cache"
    pair.assert_settled()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
def test_hybrid_pd_decode_radix_hit_reuses_kv_but_takes_the_state_from_the_prefill(tiny_model_factory, pair_factory,
                                                                                   overlap):
    """The decode holds the first request's prompt (KV, and state checkpoints of its own): the second
    request's transfer skips the shared pages but still carries the whole state, which must be the
    prefill's (a decode that kept its checkpoint or a zero state would answer other tokens)."""
    path = tiny_model_factory(ARCH)
    page = 4
    pair = pair_factory(path, page_size=page, max_total_tokens=2048, enable_overlap_schedule=overlap,
                        disable_overlap_schedule=not overlap, prefill_args={"chunked_prefill_size": 16})
    first = workload()[6]
    second = first[:32] + [11, 12, 13, 14, 15]
    pair.submit("first", first)
    pair.run_until_idle()
    sent_before = pair.prefill.scheduler.pd.transferred_bytes
    pair.submit("second", second)
    pair.run_until_idle()
    got = pair.decode.results["second"]
    assert got.ids == hf_greedy(path, second)
    assert got.cached_tokens == 32, "the decode reuses the 8 shared pages of KV"
    pool = pair.prefill.scheduler.worker.model_runner.token_to_kv_pool
    page_bytes = page * pool.bytes_per_token * 2 * pool.layer_num
    state_bytes = sum(pair.prefill.scheduler.pd.mgr.args.state_item_lens)
    states = _state_pool(pair, "prefill")
    assert state_bytes == states.shapes.bytes_per_row(states.conv[0].dtype, states.ssm[0].dtype)
    sent = pair.prefill.scheduler.pd.transferred_bytes - sent_before
    meta = pair.prefill.scheduler.pd.metadata.item_bytes
    assert sent == (-(-len(second) // page) - 32 // page) * page_bytes + state_bytes + meta
    pair.assert_settled()


@pytest.mark.slow  # ~60 s on 2 cores; colocated hybrid retraction is covered fast in test_hybrid_models.py
def test_hybrid_pd_decode_retracts_and_reprefills_locally(tiny_model_factory, pair_factory):
    """A decode pool too small for every request's 40 tokens: retracted requests re-prefill on the
    decode from their tokens (and its own state checkpoints) and still match HF."""
    path = tiny_model_factory(ARCH)
    prompts = workload(seed=1)
    max_new = 40
    pool = int(0.6 * (sum(map(len, prompts)) + max_new * len(prompts)))
    pair = pair_factory(path, page_size=1, max_total_tokens=pool, chunked_prefill_size=32,
                        prefill_args={"max_total_tokens": 4096})
    _run(pair, prompts, max_new_tokens=max_new, ignore_eos=True)
    assert pair.decode.scheduler.stats.retractions > 0, "the decode pool is meant to be too small"
    for i, p in enumerate(prompts):
        assert pair.decode.results[str(i)].ids == hf_greedy(path, p, max_new, ignore_eos=True), f"request {i}"
    pair.assert_settled()


def test_hybrid_pd_decode_reserves_no_row_whose_checkpoint_copy_is_pending(tiny_model_factory, pair_factory):
    """A finished request's row is copied into a radix checkpoint by the next forward pass; until
    then the prefill's state write must not land in it. Two requests finish in one step on an idle
    decode (no pass follows): the next reservation takes the third row, the one after that waits
    until a pass has run, and every output is still HF's."""
    path = tiny_model_factory(ARCH)
    prompts = workload()
    pair = pair_factory(path, page_size=1, max_total_tokens=2048, max_running_requests=2)
    decode = pair.decode.scheduler
    for rid in ("a", "b"):
        pair.submit(rid, prompts[1], max_new_tokens=4, ignore_eos=True)
    pair.run_until_idle()
    pending = decode.tree_cache.pending_state_sources()
    assert len(pending) == 2, "both finished rows wait for their checkpoint copy"
    rooms = {}
    for rid, p in (("c", prompts[2]), ("d", prompts[3])):
        rooms[rid] = next(pair.rooms)
        pair.decode.submit_pd(rid, p, rooms[rid], pair.port)
    pair.decode.step()
    (c,) = decode.pd.transfer_queue
    assert c.rid == "c" and c.req_pool_idx not in pending
    assert [r.rid for r in decode.pd.prealloc_queue] == ["d"], "every other free row is a pending copy's source"
    for rid, p in (("c", prompts[2]), ("d", prompts[3])):
        pair.prefill.submit_pd(rid, p, rooms[rid], pair.port)
    pair.run_until_idle()
    for rid, p in (("a", prompts[1]), ("c", prompts[2]), ("d", prompts[3])):
        want = hf_greedy(path, p, 4, ignore_eos=True) if rid == "a" else hf_greedy(path, p)
        assert pair.decode.results[rid].ids == want, rid
    pair.assert_settled()


def _step_until(pair: PDPair, done, limit: int = 200) -> None:
    for _ in range(limit):
        if done():
            return
        pair.step()
    raise AssertionError("the pair never reached the stage")


@pytest.mark.parametrize("when", ["prealloc", "transfer", "prefill_queued", "prefill_mid_chunks", "decoding"])
def test_hybrid_pd_aborts_at_every_stage_free_rows_slots_and_pages(tiny_model_factory, pair_factory, when):
    """A client abort at each stage of a request's way through the pair (on the decode, which tells
    the prefill; on the prefill while it waits or sends); a request beside it is unaffected, and
    both engines end idle with every page, row (= state slot), metadata slot and room back."""
    path = tiny_model_factory(ARCH)
    prompts = workload()
    pair = pair_factory(path, page_size=4, max_total_tokens=2048, prefill_args={"chunked_prefill_size": 16})
    pair.submit("other", prompts[4])
    gone = prompts[5]
    prefill, decode = pair.prefill.scheduler, pair.decode.scheduler
    if when == "prealloc":  # the decode waits for a prefill that never answers: nothing reserved yet
        pair.decode.submit_pd("gone", gone, next(pair.rooms), pair.port + 1000)
        pair.decode.step()
        assert decode.pd.prealloc_queue
        pair.decode.abort("gone")
    else:
        room = next(pair.rooms)
        pair.decode.submit_pd("gone", gone, room, pair.port)
        pair.decode.step()
        assert decode.pd.transfer_queue, "the decode waits for the KV and state by now"
        if when == "transfer":
            pair.decode.abort("gone")
        pair.prefill.submit_pd("gone", gone, room, pair.port)
        if when == "prefill_queued":
            pair.prefill.abort("gone")
        elif when == "prefill_mid_chunks":  # 70 tokens in 16-token chunks: some KV is sent already
            _step_until(pair, lambda: getattr(prefill.queues.chunked_req, "rid", None) == "gone")
            pair.prefill.abort("gone")
        elif when == "decoding":
            _step_until(pair, lambda: any(r.rid == "gone" for r in decode.running_batch.reqs))
            pair.decode.abort("gone")
    pair.run_until_idle()
    assert pair.decode.results["gone"].finish.kind == "abort"
    assert pair.decode.results["other"].ids == hf_greedy(path, prompts[4])
    assert prefill.req_to_token_pool.available_size() == prefill.req_to_token_pool.size
    pair.assert_settled()


# ---------------------------------------------------------------------------------- Mooncake TCP

pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine(-non-cuda) is a test dependency")

SHAPES = LinearStateShapes(num_layers=2, conv=(12, 3), ssm=(2, 4, 4))
CONFIG = TransferConfig(bootstrap_timeout_s=10, waiting_timeout_s=20, heartbeat_interval_s=0.5)


class _Side:
    """One engine's registered memory (KV + state + metadata) and its Mooncake manager."""

    def __init__(self, mode: str, seed: int, ssm_dtype: torch.dtype = torch.float32, bootstrap: str = "") -> None:
        self.kv = MHATokenToKVPool(64, 4, torch.float32, 2, 8, 2, "cpu")
        self.state = RecurrentStatePool(SHAPES, rows=6, conv_dtype=torch.float32, ssm_dtype=ssm_dtype, device="cpu",
                                        checkpoints=2)
        gen = torch.Generator().manual_seed(seed)
        for t in [*self.kv.k_buffer, *self.kv.v_buffer, *self.state.conv, *self.state.ssm]:
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
        self.meta = MetadataBuffers(4)
        self.args = KVArgs.from_pool(self.kv, self.meta, state_pool=self.state)
        self.mgr = create_transfer_backend("mooncake", self.args, self.meta, mode, CONFIG, bootstrap or None)

    def close(self) -> None:
        self.mgr.close()


@pytest.fixture
def mooncake_server():
    server = KVBootstrapServer(port=free_port())
    yield f"127.0.0.1:{server.port}"
    server.close()


def _transfer(prefill: _Side, decode: _Side, addr: str, room: int, src_row: int, dst_row: int):
    receiver = decode.mgr.create_receiver(addr, room)
    sender = prefill.mgr.create_sender(room)
    receiver.init(np.array([3, 4]), decode.meta.alloc(), 0, dst_row)
    wait_until(lambda: sender.poll() >= KVPoll.WaitingForInput or sender.poll() == KVPoll.Failed, 15)
    if sender.poll() != KVPoll.Failed:
        sender.init(2, prefill.meta.alloc())
        sender.send(np.array([7, 9]), is_last=True, metadata=KVMetadata(5, -0.5, room), state_slot=src_row)
    return sender, receiver


def test_state_lands_in_exactly_the_decode_row_over_mooncake(mooncake_server):
    prefill, decode = _Side("prefill", 1, bootstrap=mooncake_server), _Side("decode", 2)
    try:
        before = [t.clone() for t in [*decode.state.conv, *decode.state.ssm]]
        sender, receiver = _transfer(prefill, decode, mooncake_server, 11, src_row=2, dst_row=4)
        assert wait_final(receiver, 15) == KVPoll.Success, receiver.failure_reason()
        assert wait_final(sender, 15) == KVPoll.Success
        for src, dst, old in zip([*prefill.state.conv, *prefill.state.ssm], [*decode.state.conv, *decode.state.ssm],
                                 before):
            assert torch.equal(dst[4], src[2]), "the prefill's row 2 lands in the decode's row 4"
            rest = [r for r in range(dst.shape[0]) if r != 4]
            assert torch.equal(dst[rest], old[rest]), "no other slot is touched"
        src_slots = torch.tensor([28, 29, 30, 31, 36, 37, 38, 39])  # pages 7 and 9, page size 4
        for layer in range(2):
            assert torch.equal(decode.kv.k_buffer[layer][12:20], prefill.kv.k_buffer[layer][src_slots])
            assert torch.equal(decode.kv.v_buffer[layer][12:20], prefill.kv.v_buffer[layer][src_slots])
        for s in (sender, receiver):
            s.clear()
    finally:
        decode.close()
        prefill.close()


def test_state_dtype_mismatch_is_refused_on_both_sides(mooncake_server):
    prefill = _Side("prefill", 1, bootstrap=mooncake_server)
    decode = _Side("decode", 2, ssm_dtype=torch.bfloat16)
    try:
        sender, receiver = _transfer(prefill, decode, mooncake_server, 12, src_row=1, dst_row=1)
        assert wait_final(receiver, 15) == KVPoll.Failed and wait_final(sender, 15) == KVPoll.Failed
        for s in (sender, receiver):
            reason = s.failure_reason()
            assert "state_dtype conv float32, ssm float32 != conv float32, ssm bfloat16" in reason, reason
            s.clear()
    finally:
        decode.close()
        prefill.close()
