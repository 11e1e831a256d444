"""Data parallelism (--dp-size): one HTTP server and detokenizer in front of several scheduler
processes, each a full replica with its own KV pool and radix cache. Unit tests of the rank choice,
the gathering of control answers and the merged server info; then a served engine with two ranks:
HF-equal greedy outputs, round robin and pinned ranks (seen through each replica's own radix cache),
flush and abort on every rank, per-rank metrics, nothing leaked."""
from __future__ import annotations

import asyncio
import os

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from baton.engine.io_struct import FlushCacheOut, GetServerInfoOut
from baton.engine.metrics import EngineMetrics
from baton.engine.sampling.sampling_params import SamplingParams
from baton.engine.server_args import ServerArgs
from baton.engine.tokenizer_manager import GenerateInput, TokenizerManager, merge_server_infos
from baton.engine.utils.cpu_affinity import rank_cpus


def _tm(dp: int, method: str = "round_robin") -> TokenizerManager:
    return TokenizerManager(None, [f"ipc://unused-{i}" for i in range(dp)], "", EngineMetrics("m", "colocated"),
                            vocab_size=100, context_len=64, load_balance_method=method)


def _input(**kw) -> GenerateInput:
    return GenerateInput(SamplingParams(), input_ids=[1, 2], **kw)


def test_rank_choice():
    tm = _tm(3)
    assert [tm.pick_rank(_input()) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert tm.pick_rank(_input(data_parallel_rank=2)) == 2  # pinned
    assert tm.pick_rank(_input(bootstrap_room=10)) == 1  # PD: room % dp_size
    assert tm.pick_rank(_input(bootstrap_room=10, data_parallel_rank=2)) == 2  # a decode takes the pinned rank
    prefill = TokenizerManager(None, ["a", "b", "c"], "", EngineMetrics("m", "prefill"), vocab_size=100,
                               context_len=64, disaggregation_mode="prefill")
    # a prefill takes the room's rank, where the decode looks for the KV
    assert prefill.pick_rank(_input(bootstrap_room=10, data_parallel_rank=2)) == 1
    assert _tm(1).pick_rank(_input()) == 0
    sq = _tm(3, "shortest_queue")
    sq.in_flight = [2, 0, 1]
    assert sq.pick_rank(_input()) == 1
    sq.in_flight = [1, 1, 1]  # ties rotate
    assert {sq.pick_rank(_input()) for _ in range(3)} == {0, 1, 2}


def test_concurrent_control_calls_each_get_one_answer_per_rank():
    async def run():
        tm = _tm(2)

        async def broadcast(msg):
            pass

        tm._broadcast = broadcast
        first = asyncio.create_task(tm._control(object(), GetServerInfoOut))
        second = asyncio.create_task(tm._control(object(), GetServerInfoOut))
        await asyncio.sleep(0)
        # each rank answers in the order it was asked; the ranks interleave
        for rank, call in ((0, "a"), (0, "b"), (1, "a"), (1, "b")):
            tm._deliver(GetServerInfoOut({"dp_rank": rank, "call": call}, rank))
        return await first, await second

    first, second = asyncio.run(run())
    assert [(i.info["dp_rank"], i.info["call"]) for i in first] == [(0, "a"), (1, "a")]
    assert [(i.info["dp_rank"], i.info["call"]) for i in second] == [(0, "b"), (1, "b")]


def test_flush_reports_the_first_refusal():
    async def run(outs):
        tm = _tm(2)

        async def broadcast(msg):
            for out in outs:
                tm._deliver(out)

        tm._broadcast = broadcast
        return await tm.flush_cache()

    assert asyncio.run(run([FlushCacheOut(True, "", 0), FlushCacheOut(True, "", 1)])).success
    refused = asyncio.run(run([FlushCacheOut(True, "", 0), FlushCacheOut(False, "busy", 1)]))
    assert not refused.success and refused.message == "busy"


def test_merged_server_info():
    infos = [{"dp_rank": 0, "num_running_reqs": 2, "max_total_num_tokens": 100, "token_usage": 0.5,
              "cache_hit_rate": 0.2, "integrity_ok": True, "page_size": 1},
             {"dp_rank": 1, "num_running_reqs": 3, "max_total_num_tokens": 100, "token_usage": 0.1,
              "cache_hit_rate": 0.0, "integrity_ok": None, "page_size": 1}]
    merged = merge_server_infos(infos)
    assert merged["num_running_reqs"] == 5 and merged["max_total_num_tokens"] == 200
    assert merged["token_usage"] == pytest.approx(0.3) and merged["cache_hit_rate"] == pytest.approx(0.1)
    assert merged["integrity_ok"] is None  # rank 1 was busy: not checked
    assert merged["internal_states"] == infos and merged["page_size"] == 1
    infos[1]["integrity_ok"] = False
    assert merge_server_infos(infos)["integrity_ok"] is False
    assert merge_server_infos(infos[:1]) == {**infos[0], "internal_states": infos[:1]}  # one rank: there too


def test_server_info_keeps_the_metrics_samples_out():
    """The samples lists feed /metrics (each scrape reads the ranks' raw infos); /get_server_info
    leaves them out, on every rank's entry too."""
    info = {"dp_rank": 0, "num_running_reqs": 0, "queue_time_samples": [(i, 0.1) for i in range(4096)],
            "transfer_samples": [(1, 4096, 0.01)]}
    for merged in (merge_server_infos([info]), merge_server_infos([info, {**info, "dp_rank": 1}])):
        assert not [k for k in (*merged, *(k for s in merged["internal_states"] for k in s)) if k.endswith("_samples")]
        assert [s["dp_rank"] for s in merged["internal_states"]] == list(range(len(merged["internal_states"])))


def test_rank_cpus():
    cpus = (0, 1, 2, 3, 4)
    assert [rank_cpus(cpus, r, 2) for r in range(2)] == [(0, 1, 2), (3, 4)]
    assert [rank_cpus(cpus, r, 1) for r in range(1)] == [cpus]
    assert [rank_cpus((0, 1), r, 3) for r in range(3)] == [(0,), (1,), (0,)]  # fewer CPUs than ranks: shared


def test_server_args():
    assert ServerArgs(model_path="m", dp_size=2, load_balance_method="shortest_queue").dp_size == 2
    with pytest.raises(ValueError, match="--dp-size must be >= 1"):
        ServerArgs(model_path="m", dp_size=0)
    with pytest.raises(ValueError, match="--load-balance-method"):
        ServerArgs(model_path="m", dp_size=2, load_balance_method="least_tokens")
    with pytest.raises(ValueError, match="needs a fixed --disaggregation-bootstrap-port"):
        ServerArgs(model_path="m", dp_size=2, disaggregation_mode="prefill", disaggregation_bootstrap_port=0)


# ---------------------------------------------------------------------------- a served engine, 2 ranks

@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    # a context longer than the pool: a request asked for 1000 tokens still runs when it is aborted
    return tiny_model_factory("qwen3", max_position_embeddings=4096)


@pytest.fixture(scope="module")
def engine(model_path):
    from engine_server import running_engine

    with running_engine(model_path, "--dp-size", "2", "--max-total-tokens", "1024", "--page-size", "4") as eng:
        yield eng


@pytest.fixture(scope="module")
def hf(model_path):
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def _generate(base: str, ids: list[int], n: int = 4, **extra) -> dict:
    r = httpx.post(f"{base}/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0},
                                             **extra}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_two_replicas_serve_hf_equal_greedy_outputs(engine, hf):
    from engine_server import greedy_concurrently, wait_idle_integrity

    prompts = [[(11 * i + 5 * j) % 480 + 7 for j in range(4 + 3 * i)] for i in range(12)]

    for p, out in zip(prompts, greedy_concurrently(engine.base_url, prompts, 8)):
        assert out == hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):].tolist()
    info = wait_idle_integrity(engine.base_url)
    assert info["integrity_ok"] is True and info["dp_size"] == 2
    ranks = info["internal_states"]
    assert [s["dp_rank"] for s in ranks] == [0, 1]
    assert len({s["scheduler_pid"] for s in ranks}) == 2  # two processes
    assert all(s["integrity_ok"] is True for s in ranks)
    if len(os.sched_getaffinity(0)) >= 2:  # each replica sized its thread pool to its share of the CPUs
        assert all(s["torch_threads"] == len(os.sched_getaffinity(0)) // 2 for s in ranks)


def test_round_robin_and_pinned_ranks_use_their_own_radix_cache(engine):
    from engine_server import wait_idle_integrity

    base = engine.base_url
    assert httpx.post(f"{base}/flush_cache", timeout=30).status_code == 200
    prompt = [31, 32, 33, 34, 35, 36, 37, 38, 39]
    # one at a time: the first two go to different replicas, so neither finds the prompt cached
    cached = [_generate(base, prompt)["meta_info"]["cached_tokens"] for _ in range(4)]
    assert cached[:2] == [0, 0] and min(cached[2:]) > 0, cached
    other = [41, 42, 43, 44, 45, 46, 47, 48, 49]
    assert _generate(base, other, data_parallel_rank=1)["meta_info"]["cached_tokens"] == 0
    assert _generate(base, other, data_parallel_rank=0)["meta_info"]["cached_tokens"] == 0  # not on rank 0
    assert _generate(base, other, data_parallel_rank=1)["meta_info"]["cached_tokens"] > 0
    # flush reaches every rank
    wait_idle_integrity(base)
    assert httpx.post(f"{base}/flush_cache", timeout=30).status_code == 200
    assert _generate(base, other, data_parallel_rank=1)["meta_info"]["cached_tokens"] == 0
    r = httpx.post(f"{base}/generate", json={"input_ids": other, "data_parallel_rank": 2}, timeout=30)
    assert r.status_code == 400 and "2 data-parallel rank(s)" in r.text


def test_abort_reaches_the_rank_that_runs_the_request(engine):
    from engine_server import wait_idle_integrity

    async def run():
        async with httpx.AsyncClient(timeout=60) as c:
            task = asyncio.create_task(c.post(f"{engine.base_url}/generate", json={
                "input_ids": [5, 6, 7, 8], "rid": "dp-abort", "data_parallel_rank": 1,
                "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}))
            for _ in range(200):  # until rank 1 runs it (a fixed sleep let a fast machine finish it first)
                info = (await c.get(f"{engine.base_url}/get_server_info")).json()
                if info["internal_states"][1]["num_running_reqs"]:
                    break
                await asyncio.sleep(0.005)
            r = await c.post(f"{engine.base_url}/abort_request", json={"rid": "dp-abort"})
            assert r.status_code == 200
            return await task

    resp = asyncio.run(run())  # the scheduler's abort, answered as the client's (499)
    assert resp.status_code == 499 and "aborted by request" in resp.text, resp.text
    info = wait_idle_integrity(engine.base_url)
    assert info["integrity_ok"] is True and info["num_running_reqs"] == 0


def test_metrics_carry_every_rank(engine):
    text = httpx.get(f"{engine.base_url}/metrics", timeout=30).text
    for rank in ("0", "1"):
        assert f'baton_num_running_requests{{dp_rank="{rank}"' in text
        assert f'baton_max_total_tokens{{dp_rank="{rank}"' in text


def test_dp_aware_router_pins_ranks_of_a_real_engine(engine):
    """Our router with --dp-aware reads dp_size 2 from the engine's /get_server_info and routes to
    (engine, rank) targets, pinning each with data_parallel_rank. Its cache-aware policy sends a
    repeated prompt to the rank that saw it, so every repeat hits that replica's radix cache; the
    engine's own round robin would have sent the second one to the other, cold replica."""
    import sys

    from baton.engine.bench.launcher import EngineProcess, free_port

    port = free_port()
    argv = [sys.executable, "-m", "baton", "router", "--worker-urls", engine.base_url, "--dp-aware",
            "--policy", "cache_aware", "--host", "127.0.0.1", "--port", str(port)]
    assert httpx.post(f"{engine.base_url}/flush_cache", timeout=30).status_code == 200
    with EngineProcess(argv, port) as router:
        router.wait_healthy(120, "waiting for the router")
        prompt = [51, 52, 53, 54, 55, 56, 57, 58, 59]
        cached = [_generate(router.base_url, prompt)["meta_info"]["cached_tokens"] for _ in range(4)]
        assert cached[0] == 0 and min(cached[1:]) > 0, cached
        metrics = httpx.get(f"{router.base_url}/metrics", timeout=10).text
        for rank in ("0", "1"):  # one target per rank
            assert f'dp_rank="{rank}"' in metrics and "baton_router_dp_rank_in_flight" in metrics


def test_a_killed_rank_fails_every_request_in_flight_and_the_server_exits(tiny_model_factory):
    """One replica gone is an engine that can no longer serve what it promised (pinned ranks, its
    share of the load): as with one scheduler, requests in flight on any rank end with a 503 and
    the server exits, so that its pod restarts."""
    import signal

    from engine_server import running_engine

    # a context long enough that the request still runs when the rank dies (~10 s of decoding)
    with running_engine(tiny_model_factory("llama", max_position_embeddings=8192), "--dp-size", "2",
                        "--max-total-tokens", "8192") as eng:
        ranks = httpx.get(f"{eng.base_url}/get_server_info", timeout=30).json()["internal_states"]

        async def run():
            async with httpx.AsyncClient(timeout=120) as c:
                task = asyncio.create_task(c.post(f"{eng.base_url}/generate", json={
                    "input_ids": [5, 6, 7], "data_parallel_rank": 0,
                    "sampling_params": {"max_new_tokens": 8000, "ignore_eos": True}}))
                await asyncio.sleep(0.5)
                os.kill(ranks[1]["scheduler_pid"], signal.SIGKILL)
                return await task

        resp = asyncio.run(run())
        assert resp.status_code == 503 and "DP rank 1" in resp.text, resp.text
        code = eng.wait_exit(timeout_s=60)
        log = eng.log_tail(200)
        assert code == 1, f"exit code {code}\n{log}"
        assert "the scheduler (DP rank 1) process was killed by SIGKILL" in log, log


def test_pd_with_dp_ranks_on_both_sides_matches_hf(tiny_model_factory):
    """A prefill and a decode engine with 2 DP ranks each, over real Mooncake TCP: each prefill rank
    registers with rank 0's bootstrap server; room R's prefill runs on rank R % 2, and the decode
    rank that gets it finds that rank through the bootstrap server. Then our router in DP-aware mode
    in front: it pins ranks (the prefill's encoded in the room), and n = 2 fans the room out over
    both prefill ranks."""
    import random
    import sys

    from test_pd_server import MAX_NEW, PROMPTS, _assert_idle_and_whole, _body, _pair, _post_both, pd_router
    from test_scheduler_vs_hf import hf_greedy

    model_path = tiny_model_factory("llama")
    with _pair(model_path, ["--dp-size", "2"]) as (prefill, bootstrap_port, decode):
        bodies = [_body(p, bootstrap_port, bootstrap_room=2 * random.randrange(1 << 61) + i % 2)
                  for i, p in enumerate(PROMPTS)]

        async def run():
            async with httpx.AsyncClient(timeout=120) as c:
                return await asyncio.gather(*[_post_both(c, prefill.base_url, decode.base_url, b) for b in bodies])

        for p, (pre, dec) in zip(PROMPTS, asyncio.run(run())):
            assert pre.status_code == 200 and dec.status_code == 200, (pre.text, dec.text)
            assert dec.json()["output_ids"] == hf_greedy(model_path, p, MAX_NEW)
        ranks = httpx.get(f"{prefill.base_url}/get_server_info", timeout=10).json()["internal_states"]
        assert [r["dp_rank"] for r in ranks] == [0, 1] and all(r["kv_transfer_bytes"] > 0 for r in ranks), ranks
        sessions = httpx.get(f"http://127.0.0.1:{bootstrap_port}/health", timeout=10).json()["sessions"]
        assert sorted(sessions) == ["0", "1"] and len(set(sessions.values())) == 2
        _assert_idle_and_whole(prefill, decode)

        with pd_router(sys.executable, "-m", "baton", "router", prefill=prefill.base_url,
                       bootstrap_port=bootstrap_port, decode=decode.base_url,
                       flags=("--dp-aware", "--policy", "round_robin")) as router:
            rs = [httpx.post(f"{router.base_url}/generate", timeout=120, json={
                "input_ids": p, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}}) for p in PROMPTS[:4]]
            for p, r in zip(PROMPTS, rs):
                assert r.status_code == 200, r.text
                assert r.json()["output_ids"] == hf_greedy(model_path, p, MAX_NEW)
            r = httpx.post(f"{router.base_url}/generate", timeout=120, json={
                "input_ids": PROMPTS[2], "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "n": 2}})
            assert r.status_code == 200, r.text
            assert [o["output_ids"] for o in r.json()] == [hf_greedy(model_path, PROMPTS[2], MAX_NEW)] * 2
        _assert_idle_and_whole(prefill, decode)
