"""Sessions over HTTP, as SGLang's clients use them: /open_session returns the id, /generate takes
`session_params`, /close_session gives everything back (/get_server_info integrity_ok); outputs equal
HF on the concatenated tokens and a turn's history comes from the cache (meta_info.cached_tokens);
every bad request is a 4xx."""
from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from engine_server import running_engine, wait_idle_integrity
from test_scheduler_vs_hf import hf_greedy

MAX_NEW = 6


@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def engine(model_path):
    # the overlap loop and page size 4: a finished turn's release waits a result, and a hold is whole pages
    with running_engine(model_path, "--enable-overlap-schedule", "--page-size", "4", "--max-total-tokens", "2048",
                        "--chunked-prefill-size", "32") as eng:
        yield eng


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(6, 500) for _ in range(n)]


def _gen(base: str, ids: list[int], **session) -> httpx.Response:
    return httpx.post(f"{base}/generate", timeout=120, json={
        "input_ids": ids, "session_params": session,
        "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}})


def _open(base: str, **body) -> httpx.Response:
    return httpx.post(f"{base}/open_session", json={"capacity_of_str_len": 1000, **body}, timeout=30)


def test_three_turns_equal_hf_and_reuse_the_history(engine, model_path):
    base = engine.base_url
    r = _open(base)
    assert r.status_code == 200, r.text
    sid = r.json()
    assert isinstance(sid, str) and sid
    history: list[int] = []
    rid = None
    for i, n in enumerate((21, 6, 4)):
        new = _ids(i, n)
        r = _gen(base, new, id=sid, rid=rid)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["output_ids"] == hf_greedy(model_path, history + new, MAX_NEW, ignore_eos=True), i
        meta = body["meta_info"]
        assert meta["prompt_tokens"] == len(history) + n
        if i:  # the whole history but what the last step never fed, in whole pages
            assert meta["cached_tokens"] >= (len(history) - 1) // 4 * 4, meta
        history += new + body["output_ids"]
        rid = meta["id"]
    info = wait_idle_integrity(base)
    assert info["integrity_ok"] and info["num_sessions"] == 1 and info["session_held_tokens"] > 0
    assert httpx.post(f"{base}/close_session", json={"session_id": sid}, timeout=30).status_code == 200
    info = wait_idle_integrity(base)
    assert info["integrity_ok"] and info["num_sessions"] == 0 and info["session_held_tokens"] == 0


def test_branch_with_replace_and_offset_and_a_streamed_turn(engine, model_path):
    base = engine.base_url
    sid = _open(base, session_id="branchy").json()
    assert sid == "branchy"
    a = _ids(7, 17)
    out_a = _gen(base, a, id=sid, rid=None).json()
    _gen(base, [8, 9], id=sid, rid=out_a["meta_info"]["id"])
    r = _gen(base, [10, 11], id=sid, rid=out_a["meta_info"]["id"], offset=12, replace=True)
    history = (a + out_a["output_ids"])[:12]
    assert r.json()["output_ids"] == hf_greedy(model_path, history + [10, 11], MAX_NEW, ignore_eos=True)
    assert r.json()["meta_info"]["cached_tokens"] == 12
    body = {"input_ids": [12], "stream": True, "session_params": {"id": sid, "rid": r.json()["meta_info"]["id"]},
            "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}}
    with httpx.stream("POST", f"{base}/generate", json=body, timeout=120) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    last = json.loads(events[-1])
    full = history + [10, 11] + r.json()["output_ids"] + [12]
    assert last["output_ids"] == hf_greedy(model_path, full, MAX_NEW, ignore_eos=True)
    assert httpx.post(f"{base}/close_session", json={"session_id": sid}, timeout=30).status_code == 200
    assert wait_idle_integrity(base)["integrity_ok"]


def test_concurrent_sessions(engine, model_path):
    base = engine.base_url
    sids = [_open(base).json() for _ in range(3)]

    async def conversation(client: httpx.AsyncClient, k: int, sid: str) -> None:
        history, rid = [], None
        for t in range(3):
            new = _ids(50 * k + t, 12 if t == 0 else 3)
            r = await client.post(f"{base}/generate", json={
                "input_ids": new, "session_params": {"id": sid, "rid": rid},
                "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}})
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["output_ids"] == hf_greedy(model_path, history + new, MAX_NEW, ignore_eos=True), (k, t)
            history, rid = history + new + out["output_ids"], out["meta_info"]["id"]

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            await asyncio.gather(*[conversation(client, k, sid) for k, sid in enumerate(sids)])
            for sid in sids:
                assert (await client.post(f"{base}/close_session", json={"session_id": sid})).status_code == 200

    asyncio.run(run())
    info = wait_idle_integrity(base)
    assert info["integrity_ok"] and info["num_sessions"] == 0


def test_bad_session_requests_are_4xx(engine):
    base = engine.base_url
    sid = _open(base).json()
    first = _gen(base, [5, 6, 7], id=sid).json()["meta_info"]["id"]
    cases = [
        (_open(base, session_id=sid), 400, "already open"),
        (httpx.post(f"{base}/open_session", json={"session_id": "x"}, timeout=30), 400, "capacity_of_str_len"),
        (httpx.post(f"{base}/close_session", json={"session_id": "nope"}, timeout=30), 404, "not open"),
        (_gen(base, [5], id="nope"), 404, "not open"),
        (_gen(base, [5], id=sid, rid="ghost"), 404, "not in session"),
        (_gen(base, [5], id=sid, rid=first, offset=999), 400, "out of range"),
        (_gen(base, [5], id=sid, rid=first, offset="3"), 400, "session_params.offset"),
        (_gen(base, [5], rid=first), 400, "session's id"),
        (httpx.post(f"{base}/generate", json={"input_ids": [5], "session_params": "s"}, timeout=30), 400,
         "session_params"),
    ]
    for i, (r, status, words) in enumerate(cases):
        assert r.status_code == status and words in r.text, (i, r.status_code, r.text)
    assert httpx.post(f"{base}/close_session", json={"session_id": sid}, timeout=30).status_code == 200
    r = _gen(base, [5], id=sid, rid=first)
    assert r.status_code == 404 and "not open" in r.text
    assert wait_idle_integrity(base)["integrity_ok"]
