"""PD disaggregation through the real schedulers, in one process: a prefill Scheduler and a decode
Scheduler joined by the in-process fake KV transfer backend, stepped alternately. Greedy tokens
must equal HF `generate`; failures must end the request on both sides and leave memory whole."""
from __future__ import annotations

import itertools
import time
from typing import Any, Optional

import pytest
from transformers import AutoTokenizer

from baton.engine.disaggregation.base import TransferConfig
from baton.engine.io_struct import AbortReq, TokenizedGenerateReqInput
from baton.engine.sampling.sampling_params import SamplingParams
from baton.engine.scheduler.scheduler import Scheduler
from baton.engine.server_args import ServerArgs
from scheduler_harness import SchedulerHarness
from test_scheduler_vs_hf import MAX_NEW, hf_greedy, workload

_PORTS = itertools.count(41000)  # fake bootstrap ports: only keys of the in-process hub


class PDSide(SchedulerHarness):
    """One engine of the pair: a SchedulerHarness whose Scheduler gets a TransferConfig."""

    def __init__(self, model_path: str, tokenizer: Any, config: TransferConfig, **overrides: Any) -> None:
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(ServerArgs(model_path=model_path, disaggregation_transfer_backend="fake",
                                              **overrides), tokenizer, config)
        self.results = {}

    def submit_pd(self, rid: str, prompt: list[int], room: Optional[int], port: int, return_logprob: bool = False,
                  top_logprobs_num: int = 0, **sampling: Any) -> None:
        params = SamplingParams(**{"max_new_tokens": MAX_NEW, "temperature": 0.0, **sampling})
        self.scheduler.process_input_requests([TokenizedGenerateReqInput(
            rid=rid, input_text=None, input_ids=list(prompt), sampling_params=params, return_logprob=return_logprob,
            logprob_start_len=0 if return_logprob else -1, top_logprobs_num=top_logprobs_num,
            bootstrap_host="127.0.0.1", bootstrap_port=port, bootstrap_room=room)])
        self._collect()

    def abort(self, rid: str) -> None:
        self.scheduler.process_input_requests([AbortReq(rid=rid, message="client disconnected")])
        self._collect()

    def settled(self) -> bool:
        s = self.scheduler
        return s.is_idle() and s.check_memory_integrity() and s.pd.mgr.num_rooms() == 0


class PDPair:
    """Requests go to both engines, as a PD router sends them; steps alternate prefill, decode."""

    def __init__(self, model_path: str, prefill_config: TransferConfig = TransferConfig(),
                 decode_config: TransferConfig = TransferConfig(), prefill_args: Optional[dict] = None,
                 **common: Any) -> None:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.port = next(_PORTS)
        self.prefill = PDSide(model_path, tokenizer, prefill_config, disaggregation_mode="prefill",
                              disaggregation_bootstrap_port=self.port, **{**common, **(prefill_args or {})})
        self.decode = PDSide(model_path, tokenizer, decode_config, disaggregation_mode="decode", **common)
        self.rooms = itertools.count(1 << 40)

    def submit(self, rid: str, prompt: list[int], decode_first: bool = False, **kw: Any) -> int:
        room = next(self.rooms)
        sides = (self.decode, self.prefill) if decode_first else (self.prefill, self.decode)
        for side in sides:
            side.submit_pd(rid, prompt, room, self.port, **kw)
        return room

    def step(self) -> None:
        self.prefill.step()
        self.decode.step()

    def run_until_idle(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.step()
            if self.prefill.scheduler.is_idle() and self.decode.scheduler.is_idle():
                return
        raise AssertionError("the PD pair did not become idle in time")

    def assert_settled(self) -> None:
        assert self.prefill.settled(), "prefill: memory, metadata slots or transfer rooms leaked"
        assert self.decode.settled(), "decode: memory, metadata slots or transfer rooms leaked"

    def close(self) -> None:
        self.prefill.scheduler.close()
        self.decode.scheduler.close()


@pytest.fixture
def pair_factory():
    pairs: list[PDPair] = []

    def make(*args: Any, **kw: Any) -> PDPair:
        pairs.append(PDPair(*args, **kw))
        return pairs[-1]

    yield make
    for p in pairs:
        p.close()


def _run(pair: PDPair, prompts: list[list[int]], **sampling: Any) -> None:
    half = len(prompts) // 2
    for i, p in enumerate(prompts[:half]):
        pair.submit(str(i), p, decode_first=i % 2 == 1, **sampling)
    for _ in range(3):  # later arrivals join while the first ones decode
        pair.step()
    for i, p in enumerate(prompts[half:], start=half):
        pair.submit(str(i), p, decode_first=i % 2 == 1, **sampling)
    pair.run_until_idle()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_pd_matches_hf_concurrent_chunked_radix(tiny_model_factory, pair_factory, page_size, overlap):
    path = tiny_model_factory("llama")
    pair = pair_factory(path, page_size=page_size, max_total_tokens=4096, enable_overlap_schedule=overlap,
                        disable_overlap_schedule=not overlap, prefill_args={"chunked_prefill_size": 32})
    prompts = workload()
    _run(pair, prompts)
    for i, p in enumerate(prompts):
        got = pair.decode.results[str(i)]
        assert got.ids == hf_greedy(path, p), f"request {i} (len {len(p)}) differs from HF"
        assert got.finish is not None and got.finish.kind in ("length", "stop")
        pre = pair.prefill.results[str(i)]
        assert pre.ids == got.ids[:1] and pre.finish.kind in ("length", "stop"), "the prefill answers token 1"
    assert pair.prefill.scheduler.stats.cache_hit_rate() > 0, "shared prefixes should hit the prefill's radix cache"
    assert pair.prefill.scheduler.pd.transferred_bytes > 0
    pair.assert_settled()


@pytest.mark.parametrize("page_size", [1, 16])
def test_pd_decode_retracts_and_reprefills_locally(tiny_model_factory, pair_factory, page_size):
    """A decode pool too small for every request's 40 tokens: decode retracts PD requests, which then
    re-prefill on the decode engine from their tokens and still match HF."""
    path = tiny_model_factory("llama")
    prompts = workload(seed=1)
    max_new = 40
    pool = int(0.6 * (sum(map(len, prompts)) + max_new * len(prompts))) // page_size * page_size
    pair = pair_factory(path, page_size=page_size, max_total_tokens=pool, chunked_prefill_size=32,
                        prefill_args={"max_total_tokens": 4096})
    _run(pair, prompts, max_new_tokens=max_new, ignore_eos=True)
    assert pair.decode.scheduler.stats.retractions > 0, "the decode pool is meant to be too small"
    # the transferred prompt KV is real KV: finished requests leave it in the decode's radix cache
    assert pair.decode.scheduler.tree_cache.total_size() > 0
    for i, p in enumerate(prompts):
        assert pair.decode.results[str(i)].ids == hf_greedy(path, p, max_new, ignore_eos=True), f"request {i}"
    pair.assert_settled()


def test_pd_first_token_logprob_travels(tiny_model_factory, pair_factory):
    path = tiny_model_factory("llama")
    ref = SchedulerHarness(path, max_total_tokens=2048)
    prompt = workload()[3]
    ref.submit("a", prompt, return_logprob=True, logprob_start_len=0, max_new_tokens=6)
    want = ref.run_until_idle()["a"]
    pair = pair_factory(path, max_total_tokens=2048, prefill_args={"chunked_prefill_size": 16})
    pair.submit("a", prompt, return_logprob=True, max_new_tokens=6)
    pair.run_until_idle()
    got, pre = pair.decode.results["a"], pair.prefill.results["a"]
    assert got.ids == want.ids
    assert [t for _, t in got.output_logprobs] == want.ids
    for (lp, _), (ref_lp, _) in zip(got.output_logprobs, want.output_logprobs):
        assert lp == pytest.approx(ref_lp, abs=1e-5)
    assert [t for _, t in pre.input_logprobs] == prompt, "the prefill returns the input logprobs"
    assert pre.input_logprobs[0][0] is None
    for (lp, _), (ref_lp, _) in zip(pre.input_logprobs[1:], want.input_logprobs[1:]):
        assert lp == pytest.approx(ref_lp, abs=1e-5)
    pair.assert_settled()


def test_pd_first_token_top_logprobs_travel_with_its_kv(tiny_model_factory, pair_factory):
    """The prefill samples the first token and computes its top logprobs; they reach the decode in the
    metadata slot, so a PD answer carries them for every token, as a colocated engine's does (the
    decode answered [] for the first token before)."""
    path = tiny_model_factory("llama")
    ref = SchedulerHarness(path, max_total_tokens=2048)
    prompt = workload()[3]
    ref.submit("a", prompt, return_logprob=True, top_logprobs_num=3, max_new_tokens=4)
    want = ref.run_until_idle()["a"]
    pair = pair_factory(path, max_total_tokens=2048, prefill_args={"chunked_prefill_size": 16})
    pair.submit("a", prompt, return_logprob=True, top_logprobs_num=3, max_new_tokens=4)
    pair.submit("b", prompt, return_logprob=True, max_new_tokens=4)  # asks for none: none travel
    pair.run_until_idle()
    got = pair.decode.results["a"]
    assert got.ids == want.ids and len(got.output_top_logprobs) == 4
    for tops, ref_tops in zip(got.output_top_logprobs, want.output_top_logprobs):
        assert [t for _, t in tops] == [t for _, t in ref_tops] and len(tops) == 3
        assert [v for v, _ in tops] == pytest.approx([v for v, _ in ref_tops], abs=1e-5)
    assert pair.decode.results["b"].output_top_logprobs == []
    pair.assert_settled()


def test_pd_injected_transfer_fault_ends_both_sides(tiny_model_factory, pair_factory):
    path = tiny_model_factory("llama")
    pair = pair_factory(path, page_size=16, max_total_tokens=2048, prefill_config=TransferConfig(fault_probability=1.0))
    prompts = workload()[:4]
    for i, p in enumerate(prompts):
        pair.submit(str(i), p)
    pair.run_until_idle()
    for side in (pair.prefill, pair.decode):
        for i in range(len(prompts)):
            finish = side.results[str(i)].finish
            assert finish.kind == "abort" and finish.status_code == 500 and "injected fault" in finish.message
    assert pair.decode.results["0"].ids == []
    pair.assert_settled()


@pytest.mark.parametrize("when", ["before_prefill_arrives", "waiting_for_prefill"])
def test_pd_decode_abort_frees_both_sides(tiny_model_factory, pair_factory, when):
    """A client disconnect on the decode is propagated to the prefill through the receiver's abort;
    a request running beside it is unaffected."""
    path = tiny_model_factory("llama")
    prompts = workload()
    pair = pair_factory(path, max_total_tokens=2048, prefill_args={"chunked_prefill_size": 16})
    pair.submit("other", prompts[4])
    room = next(pair.rooms)
    pair.decode.submit_pd("gone", prompts[5], room, pair.port)
    pair.decode.step()  # handshake, reservation and destination happen on the decode now
    assert pair.decode.scheduler.pd.transfer_queue, "the decode should wait for the KV by now"
    if when == "waiting_for_prefill":
        pair.prefill.submit_pd("gone", prompts[5], room, pair.port)
        pair.prefill.step()
    pair.decode.abort("gone")
    if when == "before_prefill_arrives":
        pair.prefill.submit_pd("gone", prompts[5], room, pair.port)
    pair.run_until_idle()
    assert pair.decode.results["gone"].finish.kind == "abort"
    prefill_end = pair.prefill.results["gone"].finish
    assert prefill_end.kind == "abort" and prefill_end.status_code == 500
    assert "aborted by the decode engine" in prefill_end.message
    assert pair.decode.results["other"].ids == hf_greedy(path, prompts[4])
    pair.assert_settled()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
def test_pd_decode_radix_hit_transfers_only_the_suffix(tiny_model_factory, pair_factory, overlap):
    """The decode's own prefix cache (prompts of finished requests) is matched before reserving: the
    prefill writes only the pages after it, and the output is still HF's."""
    path = tiny_model_factory("llama")
    page = 4
    pair = pair_factory(path, page_size=page, max_total_tokens=2048, enable_overlap_schedule=overlap,
                        disable_overlap_schedule=not overlap, prefill_args={"chunked_prefill_size": 16})
    first = workload()[6]
    assert len(first) >= 33, "the shared prefix below needs 8 whole pages"
    second = first[:32] + [11, 12, 13, 14, 15]
    pair.submit("first", first)
    pair.run_until_idle()
    sent_before = pair.prefill.scheduler.pd.transferred_bytes
    pair.submit("second", second)
    pair.run_until_idle()
    got = pair.decode.results["second"]
    assert got.ids == hf_greedy(path, second)
    assert got.cached_tokens == 32, "the decode should hold the 8 shared pages already"
    pool = pair.prefill.scheduler.worker.model_runner.token_to_kv_pool
    page_bytes = page * pool.bytes_per_token * 2 * pool.layer_num  # K and V, every layer
    sent = pair.prefill.scheduler.pd.transferred_bytes - sent_before
    meta_bytes = pair.prefill.scheduler.pd.metadata.item_bytes
    assert sent == (-(-len(second) // page) - 32 // page) * page_bytes + meta_bytes
    pair.assert_settled()


def test_pd_decode_quarantines_pages_of_an_abandoned_transfer(tiny_model_factory, pair_factory):
    """A write the prefill already issued may land after the decode gives up: the request's pages
    stay out of the allocator for abort_grace_s, then come back; nothing leaks."""
    path = tiny_model_factory("llama")
    pair = pair_factory(path, page_size=4, max_total_tokens=2048)
    decode = pair.decode.scheduler
    decode.pd.mgr.abort_grace_s = 0.3  # the fake backend writes synchronously, so its own grace is 0
    free_before = decode.allocator.available_size()
    room = next(pair.rooms)
    prompt = workload()[5]
    pair.decode.submit_pd("gone", prompt, room, pair.port)
    pair.decode.step()
    assert decode.pd.transfer_queue, "the destination should be sent by now"
    pair.decode.abort("gone")
    held = -(-len(prompt) // 4) * 4
    assert decode.allocator.available_size() == free_before - held, "the pages must not be reusable yet"
    assert not decode.is_idle()
    deadline = time.monotonic() + 10
    while not decode.is_idle() and time.monotonic() < deadline:
        pair.decode.step()
    assert decode.allocator.available_size() == free_before
    assert pair.decode.results["gone"].finish.kind == "abort"
    pair.prefill.submit_pd("gone", prompt, room, pair.port)  # arrives late: told the decode gave up
    pair.run_until_idle()
    assert "aborted by the decode engine" in pair.prefill.results["gone"].finish.message
    pair.assert_settled()


def test_pd_decode_waiting_timeout_tells_the_prefill_before_its_pages_are_reused(tiny_model_factory, pair_factory):
    """The decode gives up on a transfer at its waiting timeout and frees the pages it had sent as the
    destination. The prefill must hear of it: if it prefilled the request later and wrote its KV
    there, it would overwrite whoever holds those pages now (found by the PD fuzz, seed 1: a greedy
    request's tokens went wrong after the pages of a timed-out one came back to it)."""
    path = tiny_model_factory("llama")
    pair = pair_factory(path, page_size=4, max_total_tokens=2048, decode_config=TransferConfig(waiting_timeout_s=0.2))
    decode = pair.decode.scheduler
    late, victim = workload()[5], workload()[6]
    room = next(pair.rooms)
    pair.decode.submit_pd("late", late, room, pair.port)  # the prefill hears of it only much later
    pair.decode.step()
    assert decode.pd.transfer_queue, "the destination should be sent by now"
    time.sleep(0.3)
    pair.decode.step()
    assert pair.decode.results["late"].finish.kind == "abort"
    assert "waiting timeout" in pair.decode.results["late"].finish.message
    pair.submit("victim", victim)  # takes the pages "late" gave back
    for _ in range(3):
        pair.step()
    assert decode.running_batch.reqs, "the victim should be decoding"
    pair.prefill.submit_pd("late", late, room, pair.port)  # now the prefill runs it
    pair.run_until_idle()
    assert pair.decode.results["victim"].ids == hf_greedy(path, victim)
    assert "aborted by the decode engine" in pair.prefill.results["late"].finish.message
    pair.assert_settled()


@pytest.mark.parametrize("queue", ["bootstrap", "waiting"])
def test_pd_prefill_abort_fails_the_decode(tiny_model_factory, pair_factory, queue):
    """Told directly once the decode's destination has arrived; before that the prefill cannot reach
    the decode, which then gives up at its waiting timeout."""
    path = tiny_model_factory("llama")
    pair = pair_factory(path, page_size=16, max_total_tokens=2048, decode_config=TransferConfig(waiting_timeout_s=0.5))
    prompt = workload()[4]
    pair.submit("gone", prompt, decode_first=True)
    if queue == "waiting":
        pair.decode.step()
        pair.prefill.scheduler.pd.step()  # handshake done: the request moves on to the waiting queue
        assert pair.prefill.scheduler.waiting_queue
    pair.prefill.abort("gone")
    pair.run_until_idle()
    assert pair.prefill.results["gone"].finish.kind == "abort"
    decode_end = pair.decode.results["gone"].finish
    assert decode_end.kind == "abort" and decode_end.status_code == 500
    expected = "aborted on the prefill engine" if queue == "waiting" else "waiting timeout"
    assert expected in decode_end.message
    pair.assert_settled()


def test_pd_bootstrap_timeouts(tiny_model_factory, pair_factory):
    """A prefill whose decode never shows up, and a decode whose prefill is unknown, both give up."""
    path = tiny_model_factory("llama")
    fast = TransferConfig(bootstrap_timeout_s=0.3)
    pair = pair_factory(path, max_total_tokens=2048, prefill_config=fast, decode_config=fast)
    prompt = workload()[2]
    pair.prefill.submit_pd("lonely_prefill", prompt, 11, pair.port)
    pair.decode.submit_pd("lonely_decode", prompt, 12, pair.port + 10_000)  # nobody registered there
    pair.run_until_idle(timeout_s=30)
    for side, rid in ((pair.prefill, "lonely_prefill"), (pair.decode, "lonely_decode")):
        finish = side.results[rid].finish
        assert finish.kind == "abort" and finish.status_code == 500 and "bootstrap timeout" in finish.message
    pair.assert_settled()


def test_pd_requests_need_bootstrap_room(tiny_model_factory, pair_factory):
    path = tiny_model_factory("llama")
    pair = pair_factory(path, max_total_tokens=2048)
    for side in (pair.prefill, pair.decode):
        side.submit_pd("no_room", workload()[0], None, pair.port)
        finish = side.results["no_room"].finish
        assert finish.status_code == 400 and "bootstrap_room" in finish.message
    pair.assert_settled()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
def test_pd_decode_lone_request_makes_room_for_a_reserved_transfer(tiny_model_factory, pair_factory, overlap):
    """The decode reserves a prompt's pages for a transfer whose KV has not arrived (the prefill has
    not even seen it), counting only the expected growth of the request running beside it. That one
    then outgrows the pool alone: it is retracted (and re-prefilled from its cached tokens later)
    instead of failing the engine, as CI once saw (`a single request does not fit in the KV pool`).
    Both then match HF and nothing leaks."""
    path = tiny_model_factory("llama")
    pair = pair_factory(path, max_total_tokens=256, enable_overlap_schedule=overlap,
                        disable_overlap_schedule=not overlap, prefill_args={"max_total_tokens": 4096})
    long_out, big = workload()[2][:20], [(7 * i) % 500 + 6 for i in range(60)]
    pair.submit("a", long_out, max_new_tokens=200, ignore_eos=True)
    d = pair.decode.scheduler
    for _ in range(200):
        pair.step()
        if d.running_batch.reqs:
            break
    room = next(pair.rooms)
    pair.decode.submit_pd("b", big, room, pair.port, max_new_tokens=1, ignore_eos=True)  # the prefill: later
    pair.decode.step()
    assert d.pd.transfer_queue, "the decode should hold b's pages by now"
    for _ in range(400):
        pair.decode.step()
        if d.stats.retractions:
            break
    assert d.stats.retractions > 0 and d.pd.transfer_queue, "a should have outgrown the pool beside b's pages"
    for _ in range(30):  # b's KV is still not coming: a waits (or re-prefills and yields again), no crash
        pair.decode.step()
    pair.prefill.submit_pd("b", big, room, pair.port, max_new_tokens=1, ignore_eos=True)
    pair.run_until_idle()
    assert pair.decode.results["a"].ids == hf_greedy(path, long_out, 200, ignore_eos=True)
    assert pair.decode.results["b"].ids == hf_greedy(path, big, 1, ignore_eos=True)
    pair.assert_settled()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"], ids=["torch-forward", "native-step"])
def test_pd_seeded_sampling_gives_the_colocated_tokens(tiny_model_factory, pair_factory, dtype):
    """A seeded sampled request through a PD pair: the prefill draws token 1, the decode goes on
    from the next draw number, so the text is the colocated engine's (the CPU sampler's draw is a
    function of the seed and the draw number)."""
    path = tiny_model_factory("llama")
    prompts = workload()[:4]
    sampling = dict(max_new_tokens=12, ignore_eos=True, temperature=0.9, top_p=0.95, seed=17)
    alone = SchedulerHarness(path, dtype=dtype, max_total_tokens=4096)
    for i, p in enumerate(prompts):
        alone.submit(str(i), p, **{**sampling, "seed": 17 + i})
    want = {rid: c.ids for rid, c in alone.run_until_idle().items()}
    alone.scheduler.close()
    pair = pair_factory(path, dtype=dtype, max_total_tokens=4096)
    for i, p in enumerate(prompts):
        pair.submit(str(i), p, decode_first=i % 2 == 1, **{**sampling, "seed": 17 + i})
    pair.run_until_idle()
    assert {rid: pair.decode.results[rid].ids for rid in want} == want
    assert len({tuple(ids) for ids in want.values()}) == len(want)
    pair.assert_settled()


def test_a_bootstrap_room_in_use_is_refused_with_409_and_the_first_request_goes_on(tiny_model_factory, pair_factory):
    """A client that picks rooms itself sends a second request with a live room: both engines refuse the
    newcomer (409, naming the room) and serve the first; nothing leaks. (Both schedulers crashed on an
    assertion before, stopping the engines.)"""
    path = tiny_model_factory("llama")
    pair = pair_factory(path, page_size=4, max_total_tokens=2048)
    prompt = [5, 6, 7, 8, 9, 10]
    room = pair.submit("first", prompt)
    pair.step()
    for side in (pair.prefill, pair.decode):
        side.submit_pd("again", prompt, room, pair.port)
        finish = side.results["again"].finish
        assert (finish.kind, finish.status_code) == ("abort", 409), finish
        assert f"bootstrap_room {room} is already in use" in finish.message
    pair.run_until_idle()
    assert pair.decode.results["first"].ids == hf_greedy(path, prompt)
    pair.assert_settled()


def test_a_room_given_to_two_pairings_is_a_409_and_the_decode_frees_its_pages_at_once(tiny_model_factory,
                                                                                      pair_factory):
    """A prefill request and a decode request of different prompts, given one room by two pairings:
    the prefill refuses the decode's destination before it writes anything (it holds another prompt's
    page count), so both answer 409 naming the room, and the decode gives its pages back at once
    instead of holding them for the abort grace (its /flush_cache was refused meanwhile, with
    every counter at 0; both answered 500 'page count mismatch' before)."""
    path = tiny_model_factory("llama")
    pair = pair_factory(path, page_size=4, max_total_tokens=2048)
    decode = pair.decode.scheduler
    decode.pd.mgr.abort_grace_s = 60.0  # as over Mooncake: a write may still land in abandoned pages
    free_before = decode.allocator.available_size()
    room = next(pair.rooms)
    pair.prefill.submit_pd("x", workload()[5], room, pair.port)
    pair.decode.submit_pd("y", workload()[1], room, pair.port)
    pair.run_until_idle(timeout_s=30)
    for side, rid in ((pair.prefill, "x"), (pair.decode, "y")):
        finish = side.results[rid].finish
        assert (finish.kind, finish.status_code) == ("abort", 409), finish
        assert f"bootstrap_room {room}" in finish.message and side.results[rid].ids == []
    assert decode.is_idle() and decode.allocator.available_size() == free_before
    pair.assert_settled()


def test_a_second_decode_given_a_paired_room_is_refused_at_once_and_the_first_pairing_goes_on(tiny_model_factory,
                                                                                             pair_factory):
    """Another decode engine sends its destination for a room the prefill has already paired: the
    prefill refuses it (409) without writing to it, so that decode frees its pages at once; the first
    pairing is served as if nothing happened (before, the prefill took the second destination as one
    more and that decode waited for KV until its waiting timeout)."""
    path = tiny_model_factory("llama")
    pair = pair_factory(path, page_size=4, max_total_tokens=2048)
    other = PDSide(path, pair.decode.tokenizer, TransferConfig(), disaggregation_mode="decode", page_size=4,
                   max_total_tokens=2048)
    try:
        other.scheduler.pd.mgr.abort_grace_s = 60.0
        free_before = other.scheduler.allocator.available_size()
        prompt = workload()[5]
        room = pair.submit("x", prompt)
        for _ in range(2):
            pair.step()
        other.submit_pd("y", prompt, room, pair.port)
        deadline = time.monotonic() + 30
        while "y" not in other.results or other.results["y"].finish is None:
            assert time.monotonic() < deadline, "the second decode was never answered"
            other.step()
            pair.step()
        finish = other.results["y"].finish
        assert (finish.kind, finish.status_code) == ("abort", 409) and f"bootstrap_room {room}" in finish.message
        assert other.scheduler.is_idle() and other.scheduler.allocator.available_size() == free_before
        assert other.settled()
        pair.run_until_idle()
        assert pair.decode.results["x"].ids == hf_greedy(path, prompt)
        pair.assert_settled()
    finally:
        other.scheduler.close()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
def test_max_new_tokens_0_runs_the_prefill_only_colocated_and_in_pd(tiny_model_factory, pair_factory, overlap):
    """max_new_tokens 0 (SGLang accepts it: prompt logprobs, cache warming): the prompt is prefilled
    (its input logprobs come back, its KV goes to the radix cache), no token is generated, nothing is
    held afterwards. In PD the prefill still runs and sends the KV; the decode returns no token and
    frees everything (a 400 before, on both)."""
    path = tiny_model_factory("llama")
    prompt = workload()[3]
    ref = SchedulerHarness(path, max_total_tokens=2048, enable_overlap_schedule=overlap)
    ref.submit("full", prompt, return_logprob=True, logprob_start_len=0, max_new_tokens=3)
    ref.submit("zero", prompt, return_logprob=True, logprob_start_len=0, max_new_tokens=0)
    out = ref.run_until_idle()
    zero, full = out["zero"], out["full"]
    assert zero.ids == [] and zero.finish.kind == "length" and zero.after_finish == 0
    assert [t for _, t in zero.input_logprobs] == prompt
    assert [lp for lp, _ in zero.input_logprobs[1:]] == pytest.approx([lp for lp, _ in full.input_logprobs[1:]],
                                                                      abs=1e-5)
    s = ref.scheduler
    assert s.is_idle() and s.check_memory_integrity()
    pair = pair_factory(path, max_total_tokens=2048, enable_overlap_schedule=overlap)
    pair.submit("zero", prompt, return_logprob=True, max_new_tokens=0)
    pair.run_until_idle()
    got = pair.decode.results["zero"]
    assert got.ids == [] and got.finish.kind == "length" and got.output_logprobs == []
    assert [t for _, t in pair.prefill.results["zero"].input_logprobs] == prompt
    assert pair.decode.scheduler.tree_cache.match_prefix(prompt).device_indices.numel() > 0, \
        "the transferred prompt is cached on the decode"
    pair.assert_settled()
