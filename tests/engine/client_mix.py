"""Client kinds the chaos tests share (`test_server_chaos.py`: one engine; `test_pd_chaos.py`: a PD
pair behind the router). Each call returns the outcome it saw, for the test's tally, and asserts
the status its kind allows. `run_clients` runs a plan drawn up front, every client under a deadline."""
from __future__ import annotations

import asyncio
import json
import random
from typing import Awaitable, Callable

import httpx

STREAM_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")
# (route, body, status): each must get its status and a JSON error, and change nothing
BAD_REQUESTS = [
    ("/v1/completions", b"{not json", 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400),
    ("/generate", {"input_ids": [1, 2, 10**9]}, 400),
    ("/v1/completions", {"prompt": [6] * 5000, "max_tokens": 4}, 400),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400),
]


async def dropped_stream(c: httpx.AsyncClient, base: str, rng: random.Random, prompts: list[list[int]],
                         seed: int) -> str:
    """A stream on a random route, read for 0-6 events, then the connection is closed: the server
    must abort the request."""
    route, keep = rng.choice(STREAM_ROUTES), rng.randint(0, 6)
    body = {"/generate": {"input_ids": rng.choice(prompts), "stream": True,
                          "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}},
            "/v1/completions": {"prompt": rng.choice(prompts), "max_tokens": 200, "stream": True,
                                "ignore_eos": True, "temperature": 0.8, "seed": seed},
            "/v1/chat/completions": {"messages": [{"role": "user", "content": "tell me more " * rng.randint(1, 8)}],
                                     "max_tokens": 200, "stream": True, "ignore_eos": True,
                                     "frequency_penalty": 0.5, "presence_penalty": 0.5}}[route]
    async with c.stream("POST", f"{base}{route}", json=body) as r:
        assert r.status_code == 200
        seen = 0
        async for line in r.aiter_lines():
            seen += line.startswith("data:")
            if seen > keep:
                break  # leaving the block closes the connection
    return "dropped"


async def sampled_n(c: httpx.AsyncClient, base: str, rng: random.Random, prompts: list[list[int]]) -> str:
    """n = 2-4 sampled completions of one prompt, in one response."""
    n = rng.randint(2, 4)
    r = await c.post(f"{base}/v1/completions", json={"prompt": rng.choice(prompts), "max_tokens": rng.randint(1, 30),
                                                     "n": n, "temperature": 1.0, "top_p": 0.9, "top_k": 20,
                                                     "ignore_eos": True})
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["choices"]) == n and all(ch["finish_reason"] == "length" for ch in out["choices"])
    return "n"


async def bad(c: httpx.AsyncClient, base: str, rng: random.Random, cases=BAD_REQUESTS) -> str:
    route, body, status = rng.choice(cases)
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = await c.post(f"{base}{route}", **kwargs)
    assert r.status_code == status, r.text
    assert json.loads(r.text)["error"]["code"] == status, r.text
    return "bad"


def run_clients(plan: list[Callable[[httpx.AsyncClient, int], Awaitable[None]]], starts: list[float],
                timeout_s: float) -> list[BaseException]:
    """Client i waits starts[i] s, then runs plan[i] with a client of its own; returns what failed.
    Reaching `timeout_s` (far above a healthy answer) means a hang."""
    async def client(i: int) -> None:
        await asyncio.sleep(starts[i])
        async with httpx.AsyncClient(timeout=timeout_s) as c:
            await asyncio.wait_for(plan[i](c, i), timeout_s)

    async def run_all() -> list:
        return await asyncio.gather(*[client(i) for i in range(len(plan))], return_exceptions=True)

    return [e for e in asyncio.run(run_all()) if e is not None]
