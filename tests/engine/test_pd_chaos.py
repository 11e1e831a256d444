"""A prefill/decode pair (real processes, KV over Mooncake TCP) behind the baton router, under a random
mix of clients at once: greedy requests, clients that hang up before the answer, streams dropped
after a few chunks on every route, n > 1, bad requests; KV pools so small that requests queue for
memory on both sides (the prefill's bootstrap queue, the decode's prealloc queue). Every
call returns with the status its kind allows; greedy requests left alone produce HF's tokens; at the
end both engines are idle with nothing leaked (no KV page, request row or PD queue entry), the
router holds nothing in flight, and the three still serve."""
from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_pd_server import _assert_idle_and_whole, _pair, pd_router
from test_scheduler_fuzz import REF_LEN, reference

CALL_TIMEOUT_S = 180  # per call: far above a healthy answer on this VM, so reaching it means a hang


@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module", params=[[], ["--enable-overlap-schedule"]], ids=["plain", "overlap"])
def stack(model_path, request):
    """Both engines on the CPU default loop, then both on the overlap loop; pools of 384 tokens for up
    to 8 running requests of up to 60 + 200 tokens."""
    args = ["--max-total-tokens", "384", "--max-running-requests", "8", *request.param]
    with _pair(model_path, args) as (prefill, port, decode):
        with pd_router(sys.executable, "-m", "baton", "router", prefill=prefill.base_url, bootstrap_port=port,
                       decode=decode.base_url) as router:
            yield prefill, decode, router


def _router_in_flight(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return {f"{s.name}{sorted(s.labels.items())}": s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name in ("baton_router_in_flight_requests", "baton_router_worker_in_flight")}


def _wait_router_drained(base_url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        gauges = _router_in_flight(base_url)
        if gauges and not any(gauges.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"router still has requests in flight: {gauges}")
        time.sleep(0.1)


@pytest.mark.parametrize("seed", [int(x) for x in os.environ.get("PD_CHAOS_SEEDS", "0,1").split(",")])
def test_random_client_mix_through_the_router_never_hangs_or_leaks(stack, model_path, seed):
    prefill, decode, router = stack
    base = router.base_url
    rng = random.Random(seed)
    prompts = [[rng.randrange(6, 500) for _ in range(rng.randint(2, 60))] for _ in range(10)]
    greedy: dict[int, tuple[list[int], int, list[int]]] = {}  # client -> (prompt, n, output ids)
    outcomes: list[str] = []

    async def generate(c: httpx.AsyncClient, i: int) -> None:
        prompt, n = rng.choice(prompts), rng.randint(1, REF_LEN)
        r = await c.post(f"{base}/generate", json={"input_ids": prompt, "sampling_params": {
            "max_new_tokens": n, "temperature": 0, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        greedy[i] = (prompt, n, out["output_ids"])
        outcomes.append("greedy")

    async def hang_up(c: httpx.AsyncClient, i: int) -> None:
        """A non-streaming client gone before its answer: the router must abort both sides."""
        body = {"input_ids": rng.choice(prompts), "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
        try:
            await asyncio.wait_for(c.post(f"{base}/generate", json=body), rng.uniform(0.05, 1.5))
            outcomes.append("hang-up-late")  # it finished first: allowed, but rare with 200 tokens
        except asyncio.TimeoutError:
            outcomes.append("hang-up")

    async def dropped_stream(c: httpx.AsyncClient, i: int) -> None:
        route = rng.choice(["/generate", "/v1/completions", "/v1/chat/completions"])
        keep = rng.randint(0, 6)
        body = {"/generate": {"input_ids": rng.choice(prompts), "stream": True,
                              "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}},
                "/v1/completions": {"prompt": rng.choice(prompts), "max_tokens": 200, "stream": True,
                                    "ignore_eos": True, "temperature": 0.8, "seed": i},
                "/v1/chat/completions": {"messages": [{"role": "user", "content": "tell me more " * rng.randint(1, 8)}],
                                         "max_tokens": 200, "stream": True, "ignore_eos": True,
                                         "presence_penalty": 0.5}}[route]
        async with c.stream("POST", f"{base}{route}", json=body) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data:")
                if seen > keep:
                    break  # leaving the block closes the connection
        outcomes.append("dropped")

    async def sampled_n(c: httpx.AsyncClient, i: int) -> None:
        n = rng.randint(2, 3)
        r = await c.post(f"{base}/v1/completions", json={"prompt": rng.choice(prompts), "max_tokens": rng.randint(1, 20),
                                                         "n": n, "temperature": 1.0, "top_k": 20, "ignore_eos": True})
        assert r.status_code == 200, r.text
        out = r.json()
        assert len(out["choices"]) == n and all(ch["finish_reason"] == "length" for ch in out["choices"])
        outcomes.append("n")

    async def bad(c: httpx.AsyncClient, i: int) -> None:
        route, body, status = rng.choice([
            ("/v1/completions", b"{not json", 400),
            ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400),
            ("/generate", {"input_ids": [1, 2, 10**9]}, 400),
            ("/v1/completions", {"prompt": [6] * 5000, "max_tokens": 4}, 400),
            ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400),
        ])
        kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
        r = await c.post(f"{base}{route}", **kwargs)
        assert r.status_code == status, r.text
        assert "error" in json.loads(r.text), r.text
        outcomes.append("bad")

    # who does what, and when, drawn up front (the draws inside the calls depend on timing)
    plan = [generate] * 16 + [hang_up] * 6 + [dropped_stream] * 8 + [sampled_n] * 4 + [bad] * 4
    rng.shuffle(plan)
    starts = [rng.uniform(0, 2.0) for _ in plan]

    async def client(i: int) -> None:
        await asyncio.sleep(starts[i])
        async with httpx.AsyncClient(timeout=CALL_TIMEOUT_S) as c:
            await asyncio.wait_for(plan[i](c, i), CALL_TIMEOUT_S)

    async def run_all() -> list:
        return await asyncio.gather(*[client(i) for i in range(len(plan))], return_exceptions=True)

    errors = [e for e in asyncio.run(run_all()) if e is not None]
    assert not errors, (f"{len(errors)} calls failed:\n" + "\n".join(repr(e)[:300] for e in errors) + "\n"
                        + "\n".join(p.log_tail(80) for p in (router, prefill, decode)))
    assert outcomes.count("dropped") == 8 and outcomes.count("bad") == 4 and outcomes.count("n") == 4, outcomes
    assert outcomes.count("greedy") == 16, outcomes

    _wait_router_drained(base)
    _assert_idle_and_whole(prefill, decode)
    for engine, queues in ((prefill, ("num_bootstrap_reqs", "num_inflight_reqs")),
                           (decode, ("num_prealloc_reqs", "num_transfer_reqs"))):
        info = httpx.get(f"{engine.base_url}/get_server_info", timeout=10).json()
        held = {q: info[q] for q in ("num_running_reqs", "num_waiting_reqs", *queues)}
        assert not any(held.values()), held
        print(f"\nseed {seed}, {info['disaggregation_mode']}: {info['retractions']} retractions")
    aborts = [s.value for family in text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=10).text)
              for s in family.samples if s.name == "baton_router_aborts_total"]
    print(f"seed {seed}: {sum(aborts):.0f} aborts from the router; {sorted(outcomes)}")
    print("".join(line for line in router.log_tail(10_000).splitlines(keepends=True) if "retrying" in line))
    for i, (prompt, n, ids) in greedy.items():  # HF's greedy tokens, EOS ignored as the requests do
        assert ids == reference(model_path, prompt)[:n], f"client {i} differs from HF"
    r = httpx.post(f"{base}/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}},
                   timeout=60)
    assert r.status_code == 200, "the pair should still serve through the router"
