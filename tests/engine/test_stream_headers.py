"""A stream's HTTP headers go out at once, before its first output (sglang-router waits for both PD
engines' headers before it relays anything), and with BATON_SSE_KEEPALIVE_S a silent stream gets SSE
keep-alive comments. Here the first output waits behind another request: the engine runs one request
at a time (--max-running-requests 1) and a long one holds the slot until it is aborted."""
from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import pytest

from engine_server import running_engine, wait_idle_integrity

KEEPALIVE_S = "0.3"
STREAMS = {
    "/generate": {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}},
    "/v1/completions": {"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True, "n": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True},
}


@pytest.fixture(scope="module")
def engine(tiny_model_factory):
    saved = os.environ.get("BATON_SSE_KEEPALIVE_S")
    os.environ["BATON_SSE_KEEPALIVE_S"] = KEEPALIVE_S  # the engine reads it at start
    try:
        with running_engine(tiny_model_factory("llama", max_position_embeddings=16384), "--max-running-requests",
                            "1", "--max-total-tokens", "40000") as eng:
            yield eng
    finally:
        if saved is None:
            os.environ.pop("BATON_SSE_KEEPALIVE_S", None)
        else:
            os.environ["BATON_SSE_KEEPALIVE_S"] = saved


async def _until(c: httpx.AsyncClient, base: str, key: str, at_least: int) -> dict:
    deadline = time.monotonic() + 60
    while True:
        info = (await c.get(f"{base}/get_server_info")).json()
        if info.get(key, 0) >= at_least:
            return info
        assert time.monotonic() < deadline, f"{key} never reached {at_least}: {info}"
        await asyncio.sleep(0.05)


def test_headers_and_keepalives_before_the_first_output(engine):
    base = engine.base_url

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            blocker = asyncio.create_task(c.post(f"{base}/generate", json={
                "input_ids": [9, 10, 11], "rid": "blocker",
                "sampling_params": {"max_new_tokens": 12000, "ignore_eos": True}}))
            await _until(c, base, "num_running_reqs", 1)
            opened = []
            for route, body in STREAMS.items():
                # headers must come while the blocker still runs (it would take minutes to end)
                req = c.build_request("POST", f"{base}{route}", json={**body, "stream": True},
                                      timeout=httpx.Timeout(120, read=60))
                opened.append((route, await c.send(req, stream=True)))
                assert not blocker.done(), f"{route}: the headers came only after the request ahead had ended"
            info = await _until(c, base, "num_waiting_reqs", 1)
            assert not blocker.done() and info["num_running_reqs"] == 1
            assert [r.status_code for _, r in opened] == [200] * 3
            assert all(r.headers["content-type"].startswith("text/event-stream") for _, r in opened)
            lines = {route: r.aiter_lines() for route, r in opened}
            for route, it in lines.items():  # nothing produced yet: keep-alive comments, no output event
                before = []
                while (line := await anext(it)) != ": keep-alive":
                    before += [json.loads(line[6:])] if line.startswith("data: ") else []
                # chat opens each choice with its role at once
                assert all(e["choices"][0]["delta"] == {"role": "assistant", "content": ""} for e in before) \
                    if route == "/v1/chat/completions" else before == [], (route, before)
            await c.post(f"{base}/abort_request", json={"rid": "blocker"})
            events = {}
            for route, it in lines.items():
                events[route] = [json.loads(line[6:]) if line != "data: [DONE]" else "DONE"
                                 async for line in it if line.startswith("data: ")]
            for _, r in opened:
                await r.aclose()
            await blocker
            return events

    events = asyncio.run(run())
    for route, evs in events.items():
        assert evs[-1] == "DONE" and not [e for e in evs if "error" in e], (route, evs)
    assert events["/generate"][-2]["meta_info"]["completion_tokens"] == 4
    assert sorted(e["choices"][0]["index"] for e in events["/v1/completions"][:-1]
                  if e["choices"][0]["finish_reason"]) == [0, 1]
    assert wait_idle_integrity(base)["integrity_ok"] is True


def test_a_refusal_before_the_scheduler_is_still_a_status_code(engine):
    r = httpx.post(f"{engine.base_url}/v1/completions", json={"prompt": "", "stream": True}, timeout=60)
    assert r.status_code == 400 and "empty" in r.json()["error"]["message"]
    r = httpx.post(f"{engine.base_url}/generate", json={"input_ids": [1, 2], "stream": True,
                                                        "sampling_params": {"max_new_tokens": -1}}, timeout=60)
    assert r.status_code == 400, r.text


def test_a_refusal_by_the_scheduler_is_an_error_event(engine):
    """Found once the headers are out (here: a grammar the scheduler cannot compile): the stream carries
    the error and ends, and nothing is left behind."""
    with httpx.Client(timeout=60) as c, c.stream("POST", f"{engine.base_url}/v1/completions", json={
            "prompt": "hi", "stream": True, "regex": "(unclosed"}) as r:
        assert r.status_code == 200
        data = [line for line in r.iter_lines() if line.startswith("data: ")]
    error = json.loads(data[0][6:])["error"]
    assert error["code"] == 400 and "invalid regex" in error["message"].lower(), data
    assert wait_idle_integrity(engine.base_url)["integrity_ok"] is True
