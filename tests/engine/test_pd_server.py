"""PD disaggregation with real processes: a prefill engine and a decode engine (`baton serve`) moving
KV over real Mooncake TCP on 127.0.0.1. A request goes to both, as a PD router sends it; the decode's
answer must equal HF's greedy output. Then the published sglang-router runs in front of the pair."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import sys
import time

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from baton.engine.bench.launcher import EngineProcess, engine_command, free_port
from engine_server import STARTUP_TIMEOUT_S, running_engine, wait_idle_integrity
from test_scheduler_vs_hf import hf_greedy

MAX_NEW = 10
BOOTSTRAP_TIMEOUT_S = 15  # handshake deadline of both engines (SGLang's default is 300 s)
COMMON = ["--disaggregation-transfer-backend", "mooncake", "--disaggregation-protocol", "tcp",
          "--page-size", "4", "--max-total-tokens", "2048"]
PROMPTS = [[(7 * i + 3 * j) % 500 + 6 for j in range(5 + 4 * i)] for i in range(8)]
PROMPTS += [PROMPTS[6][:20] + [11, 12, 13]]  # a radix hit on the prefill


@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    return tiny_model_factory("llama")


@contextlib.contextmanager
def _pair(model_path: str, extra: list[str]):
    """(prefill engine, its bootstrap port, decode engine), started side by side, always stopped;
    `extra` goes to both."""
    bootstrap_port, prefill_port, decode_port = free_port(), free_port(), free_port()
    prefill = EngineProcess(engine_command(model_path, prefill_port, [
        "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap_port),
        "--chunked-prefill-size", "16", *COMMON, *extra]), prefill_port)
    decode = EngineProcess(engine_command(model_path, decode_port, ["--disaggregation-mode", "decode", *COMMON,
                                                                    *extra]), decode_port)
    with _environ(SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT=str(BOOTSTRAP_TIMEOUT_S)), prefill, decode:
        prefill.wait_healthy(STARTUP_TIMEOUT_S, "waiting for the prefill engine")
        decode.wait_healthy(STARTUP_TIMEOUT_S, "waiting for the decode engine")
        yield prefill, bootstrap_port, decode


@pytest.fixture(scope="module")
def pd_pair(model_path):
    with _pair(model_path, []) as pair:
        yield pair


@contextlib.contextmanager
def _environ(**values: str):
    """Set environment variables for the processes started inside (the engines read them at start)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _body(prompt: list[int], bootstrap_port: int, **extra) -> dict:
    return {"input_ids": prompt, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port,
            "bootstrap_room": random.randrange(1 << 63), **extra}


async def _post_both(client: httpx.AsyncClient, prefill: str, decode: str, body: dict) -> tuple:
    return await asyncio.gather(client.post(f"{prefill}/generate", json=body), client.post(f"{decode}/generate", json=body))


def _assert_idle_and_whole(*engines: EngineProcess) -> None:
    for engine in engines:
        info = wait_idle_integrity(engine.base_url, timeout_s=60)
        assert info["integrity_ok"] is True, info


def test_pd_pair_matches_hf(pd_pair, model_path):
    prefill, bootstrap_port, decode = pd_pair

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*[_post_both(c, prefill.base_url, decode.base_url, _body(p, bootstrap_port))
                                          for p in PROMPTS])

    for p, (pre, dec) in zip(PROMPTS, asyncio.run(run())):
        assert pre.status_code == 200 and dec.status_code == 200, (pre.text, dec.text)
        want = hf_greedy(model_path, p, MAX_NEW)
        assert dec.json()["output_ids"] == want
        assert pre.json()["output_ids"] == want[:1], "the prefill answers with the first token"
    info = httpx.get(f"{prefill.base_url}/get_server_info", timeout=10).json()
    assert info["disaggregation_mode"] == "prefill" and info["bootstrap_port"] == bootstrap_port
    assert info["kv_transfer_bytes"] > 0
    _assert_idle_and_whole(prefill, decode)


def test_pd_structured_output_matches_hf_under_the_same_grammar(pd_pair, model_path):
    """The prefill samples the first token under the request's grammar, the decode feeds that token
    to its own matcher and goes on: HF `generate` with xgrammar's logits processor, token for token."""
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from xgrammar.contrib.hf import LogitsProcessor

    prefill, bootstrap_port, decode = pd_pair
    regex = r"(yes|no)-[0-9]{2,4}"
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model.config.vocab_size,
                                              stop_token_ids=[tokenizer.eos_token_id])
    compiled = xgr.GrammarCompiler(info).compile_regex(regex)

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*[_post_both(c, prefill.base_url, decode.base_url, _body(
                p, bootstrap_port, sampling_params={"max_new_tokens": 20, "temperature": 0, "regex": regex}))
                for p in PROMPTS[:4]])

    for p, (pre, dec) in zip(PROMPTS[:4], asyncio.run(run())):
        assert pre.status_code == 200 and dec.status_code == 200, (pre.text, dec.text)
        want = model.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, pad_token_id=0,
                              logits_processor=[LogitsProcessor(compiled)])[0, len(p):].tolist()
        assert dec.json()["output_ids"] == want
        assert re.fullmatch(regex, dec.json()["text"]), dec.json()["text"]
    _assert_idle_and_whole(prefill, decode)


def test_pd_radix_hits_on_both_engines(pd_pair, model_path):
    """A prompt sharing 24 tokens (6 pages) with a finished one: both engines serve the prefix from
    their radix caches (the decode reserves and receives only the pages after it)."""
    prefill, bootstrap_port, decode = pd_pair
    base = [(5 * j) % 400 + 9 for j in range(30)]
    follow = base[:24] + [21, 22, 23, 24, 25]
    for prompt in (base, follow):
        pre, dec = asyncio.run(_post_pair(prefill.base_url, decode.base_url, _body(prompt, bootstrap_port)))
        assert pre.status_code == 200 and dec.status_code == 200, (pre.text, dec.text)
        assert dec.json()["output_ids"] == hf_greedy(model_path, prompt, MAX_NEW)
    assert pre.json()["meta_info"]["cached_tokens"] == 24, "prefill radix hit"
    assert dec.json()["meta_info"]["cached_tokens"] == 24, "decode radix hit"
    _assert_idle_and_whole(prefill, decode)


def test_health_generate_on_both_engines(pd_pair):
    """Probes need no peer: each engine runs a real generation without moving KV."""
    prefill, _, decode = pd_pair
    for engine in (prefill, decode):
        r = httpx.get(f"{engine.base_url}/health_generate", timeout=60)
        assert r.status_code == 200, r.text
    _assert_idle_and_whole(prefill, decode)


def test_pd_batched_completions_carry_one_room_per_prompt(pd_pair):
    """/v1/completions with a prompt list: bootstrap fields as arrays, one per prompt (as routers
    send batches); the texts equal those of single /generate requests through the pair."""
    prefill, bootstrap_port, decode = pd_pair
    prompts = PROMPTS[2:4]
    singles = [asyncio.run(_post_pair(prefill.base_url, decode.base_url, _body(p, bootstrap_port)))[1].json()["text"]
               for p in prompts]
    body = {"prompt": prompts, "max_tokens": MAX_NEW, "temperature": 0, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": bootstrap_port, "bootstrap_room": [random.randrange(1 << 63) for _ in prompts]}
    pre, dec = asyncio.run(_post_pair(prefill.base_url, decode.base_url, body, "/v1/completions"))
    assert pre.status_code == 200 and dec.status_code == 200, (pre.text, dec.text)
    assert [c["text"] for c in sorted(dec.json()["choices"], key=lambda c: c["index"])] == singles
    bad = {**body, "bootstrap_room": body["bootstrap_room"][:1]}
    r = httpx.post(f"{decode.base_url}/v1/completions", json=bad, timeout=30)
    assert r.status_code == 400 and "bootstrap_room has 1 values for 2 prompt(s)" in r.text
    r = httpx.post(f"{decode.base_url}/generate", json=_body(prompts[0], bootstrap_port, data_parallel_rank=1), timeout=30)
    assert r.status_code == 400 and "data_parallel_rank 1 is out of range" in r.text
    _assert_idle_and_whole(prefill, decode)


def test_pd_parallel_sampling_one_room_per_choice(pd_pair):
    """n > 1 through the pair: copy k of the request uses room + k on both engines, so each choice is
    a transfer of its own, and equals the single request with seed + k. A scalar room on a batch fans
    out the same way (request j: room + j)."""
    prefill, bootstrap_port, decode = pd_pair
    pd = {"bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port}
    prompt, sampling = PROMPTS[4], {"max_tokens": MAX_NEW, "temperature": 1.0, "seed": 5, "ignore_eos": True}

    def via_pair(body: dict, route: str = "/v1/completions") -> dict:
        pre, dec = asyncio.run(_post_pair(prefill.base_url, decode.base_url, body, route))
        assert pre.status_code == 200 and dec.status_code == 200, (pre.text, dec.text)
        return dec.json()

    singles = [via_pair({"prompt": prompt, **sampling, "seed": 5 + k, **pd,
                         "bootstrap_room": random.randrange(1 << 62)})["choices"][0]["text"] for k in range(3)]
    room = random.randrange(1 << 62)
    out = via_pair({"prompt": prompt, "n": 3, **sampling, **pd, "bootstrap_room": room})
    assert [c["text"] for c in out["choices"]] == singles and len(set(singles)) > 1
    native = via_pair({"input_ids": [PROMPTS[2], PROMPTS[3]], **pd, "bootstrap_room": random.randrange(1 << 62),
                       "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "n": 2}}, "/generate")
    assert len(native) == 4  # prompt-major: two greedy copies of each prompt, four transfers
    for p, copies in ((PROMPTS[2], native[:2]), (PROMPTS[3], native[2:])):
        one = via_pair(_body(p, bootstrap_port), "/generate")
        assert [c["output_ids"] for c in copies] == [one["output_ids"]] * 2
    # one value per choice (sglang-router's shape for chat with n > 1): taken as given, on every route
    per_choice = {"bootstrap_host": ["127.0.0.1"] * 3, "bootstrap_port": [bootstrap_port] * 3}
    rooms = [random.randrange(1 << 62) for _ in range(3)]
    out = via_pair({"prompt": prompt, "n": 3, **sampling, **per_choice, "bootstrap_room": rooms})
    assert [c["text"] for c in out["choices"]] == singles
    native = via_pair({"input_ids": PROMPTS[2], **per_choice, "bootstrap_room": rooms,
                       "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "n": 3}}, "/generate")
    assert [c["output_ids"] for c in native] == [via_pair(_body(PROMPTS[2], bootstrap_port), "/generate")["output_ids"]] * 3
    chat = {"messages": [{"role": "user", "content": "pick one"}], "n": 3, **sampling, **per_choice}
    out = via_pair({**chat, "bootstrap_room": rooms}, "/v1/chat/completions")
    assert [c["index"] for c in out["choices"]] == [0, 1, 2] and out["usage"]["completion_tokens"] == 3 * MAX_NEW
    _assert_idle_and_whole(prefill, decode)


async def _post_pair(prefill: str, decode: str, body: dict, route: str = "/generate") -> tuple:
    async with httpx.AsyncClient(timeout=120) as client:
        return await asyncio.gather(client.post(prefill + route, json=body), client.post(decode + route, json=body))


def test_pd_answers_carry_the_first_tokens_top_logprobs_on_every_route(pd_pair):
    """The prefill samples the first token and computes its top logprobs; the decode's answer carries
    them (as the prefill's own answer, a colocated engine's, shows them) on /generate, /v1/completions
    and chat. Before: [] / null for the first token on the decode."""
    prefill, bootstrap_port, decode = pd_pair
    pd = {"bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port}

    def first_tops(route: str, body: dict, tops) -> tuple:
        pre, dec = asyncio.run(_post_pair(prefill.base_url, decode.base_url,
                                          {**body, **pd, "bootstrap_room": random.randrange(1 << 62)}, route))
        assert pre.status_code == 200 and dec.status_code == 200, (pre.text, dec.text)
        return tops(pre.json()), tops(dec.json())

    want, got = first_tops("/generate", {**_body(PROMPTS[3], bootstrap_port), "return_logprob": True,
                                         "top_logprobs_num": 2}, lambda o: o["meta_info"]["output_top_logprobs"])
    assert len(got) == MAX_NEW and len(got[0]) == 2 and got[0] == want[0]
    want, got = first_tops("/v1/completions", {"prompt": PROMPTS[3], "max_tokens": 3, "temperature": 0, "logprobs": 2},
                           lambda o: o["choices"][0]["logprobs"]["top_logprobs"])
    assert got[0] is not None and len(got[0]) == 2 and got[0] == want[0]
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, "temperature": 0, "logprobs": True,
            "top_logprobs": 2}
    want, got = first_tops("/v1/chat/completions", chat, lambda o: o["choices"][0]["logprobs"]["content"])
    assert len(got[0]["top_logprobs"]) == 2 and got[0] == want[0]
    _assert_idle_and_whole(prefill, decode)


def test_pd_max_new_tokens_0_prefills_and_the_decode_returns_no_token(pd_pair):
    """max_new_tokens 0 through the pair: the prefill runs (its answer has the input logprobs a router
    merges), the decode answers no token and holds nothing afterwards (a 400 on both before)."""
    prefill, bootstrap_port, decode = pd_pair
    body = {**_body(PROMPTS[4], bootstrap_port), "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 0}}
    pre, dec = asyncio.run(_post_pair(prefill.base_url, decode.base_url, body))
    assert pre.status_code == 200 and dec.status_code == 200, (pre.text, dec.text)
    assert dec.json()["output_ids"] == [] and dec.json()["meta_info"]["finish_reason"]["type"] == "length"
    assert [t for _, t, _ in pre.json()["meta_info"]["input_token_logprobs"]] == PROMPTS[4]
    _assert_idle_and_whole(prefill, decode)


def test_pd_a_room_given_to_two_pairings_is_a_409_and_the_decode_flushes_at_once(pd_pair):
    """The prefill holds room R for one prompt, the decode for another (two pairings gave out one
    room): both answer 409 naming the room, and the decode, whose pages the prefill never wrote, can
    flush its cache at once (before: 500 "page count mismatch", then /flush_cache refused for ~20 s
    while every counter read 0)."""
    prefill, bootstrap_port, decode = pd_pair
    room = random.randrange(1 << 62)
    x = {**_body(PROMPTS[6], bootstrap_port), "bootstrap_room": room}
    y = {**_body(PROMPTS[1], bootstrap_port), "bootstrap_room": room}

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(c.post(f"{prefill.base_url}/generate", json=x),
                                        c.post(f"{decode.base_url}/generate", json=y))

    for r in asyncio.run(run()):
        assert r.status_code == 409 and f"bootstrap_room {room}" in r.json()["error"]["message"], r.text
    wait_idle_integrity(decode.base_url, timeout_s=10)
    r = httpx.post(f"{decode.base_url}/flush_cache", timeout=10)
    assert r.status_code == 200, r.text
    _assert_idle_and_whole(prefill, decode)


def test_pd_streaming_through_decode(pd_pair, model_path):
    prefill, bootstrap_port, decode = pd_pair
    prompt = PROMPTS[5]
    body = _body(prompt, bootstrap_port)

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            async def stream():
                chunks = []
                async with c.stream("POST", f"{decode.base_url}/generate", json={**body, "stream": True}) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            chunks.append(json.loads(line[len("data: "):]))
                return chunks
            return await asyncio.gather(c.post(f"{prefill.base_url}/generate", json=body), stream())

    pre, chunks = asyncio.run(run())
    assert pre.status_code == 200, pre.text
    assert len(chunks) > 1, "tokens should arrive in several chunks"
    assert chunks[-1]["output_ids"] == hf_greedy(model_path, prompt, MAX_NEW)
    _assert_idle_and_whole(prefill, decode)


def test_pd_streams_send_headers_before_their_peer_comes(pd_pair):
    """Either role streams its headers at once while the request waits for a peer that never comes
    (sglang-router waits for both engines' headers before it relays the decode's tokens); past the
    bootstrap timeout the stream ends with an error event."""
    prefill, bootstrap_port, decode = pd_pair
    alone = {prefill: (_body(PROMPTS[1], bootstrap_port), "num_bootstrap_reqs"),  # no decode takes the room
             decode: (_body(PROMPTS[1], free_port()), "num_prealloc_reqs")}  # nobody serves that bootstrap port

    async def one(c: httpx.AsyncClient, engine: EngineProcess) -> tuple[list[str], list[dict]]:
        body, queue = alone[engine]
        req = c.build_request("POST", f"{engine.base_url}/generate", json={**body, "stream": True})
        async with contextlib.aclosing(await c.send(req, stream=True)) as r:
            assert r.status_code == 200
            deadline = time.monotonic() + BOOTSTRAP_TIMEOUT_S / 2  # well before the request can end
            while (await c.get(f"{engine.base_url}/get_server_info")).json()[queue] < 1:
                assert time.monotonic() < deadline, f"the headers came, but the request is not in {queue}"
                await asyncio.sleep(0.05)
            lines = [line async for line in r.aiter_lines() if line]
        return lines, [json.loads(x[6:]) for x in lines if x.startswith("data: ") and x != "data: [DONE]"]

    async def run():
        async with httpx.AsyncClient(timeout=BOOTSTRAP_TIMEOUT_S + 60) as c:
            return await asyncio.gather(one(c, prefill), one(c, decode))

    for lines, events in asyncio.run(run()):
        assert len(events) == 1 and "bootstrap timeout" in events[0]["error"]["message"], lines
    _assert_idle_and_whole(prefill, decode)


def test_pd_requests_without_bootstrap_room_are_rejected(pd_pair):
    prefill, _, decode = pd_pair
    for engine in (prefill, decode):
        r = httpx.post(f"{engine.base_url}/generate", json={"input_ids": PROMPTS[0]}, timeout=60)
        assert r.status_code == 400 and "bootstrap_room" in r.json()["error"]["message"]


def test_pd_decode_gives_up_on_an_unknown_prefill(pd_pair):
    """A bootstrap address nobody serves: the decode times out; the client gets a 500 with the reason,
    and the decode keeps nothing of the request."""
    _, _, decode = pd_pair
    body = {**_body(PROMPTS[1], free_port()), "sampling_params": {"max_new_tokens": 2}}
    r = httpx.post(f"{decode.base_url}/generate", json=body, timeout=BOOTSTRAP_TIMEOUT_S + 60)
    assert r.status_code == 500 and "bootstrap timeout" in r.json()["error"]["message"], r.text
    _assert_idle_and_whole(decode)


@contextlib.contextmanager
def pd_router(*cmd: str, prefill: str, bootstrap_port: int, decode: str, flags: tuple[str, ...] = ()):
    """A PD router process (`cmd` up to its flags) in front of the pair, stopped afterwards."""
    port = free_port()
    argv = [*cmd, *flags, "--pd-disaggregation", "--prefill", prefill, str(bootstrap_port), "--decode", decode,
            "--host", "127.0.0.1", "--port", str(port)]
    router = EngineProcess(argv, port)
    with router:
        router.wait_healthy(120, f"waiting for {cmd[-1]}")
        yield router


def assert_router_serves_pair(base_url: str, model_path: str, prompts: list[list[int]]) -> None:
    """HF's greedy tokens through the router, and with logprobs the prefill's input logprobs merged in
    front of the decode's output logprobs."""
    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*[c.post(f"{base_url}/generate", json={
                "input_ids": p, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}}) for p in prompts])

    for p, r in zip(prompts, asyncio.run(run())):
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == hf_greedy(model_path, p, MAX_NEW)
    r = httpx.post(f"{base_url}/generate", timeout=120, json={
        "input_ids": PROMPTS[3], "return_logprob": True, "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert [t for _, t, _ in meta["input_token_logprobs"]] == PROMPTS[3]
    assert [t for _, t, _ in meta["output_token_logprobs"]] == hf_greedy(model_path, PROMPTS[3], MAX_NEW)


@pytest.fixture(scope="module")
def colocated(model_path):
    """One engine on the pair's model, prefilling in the prefill's chunks: the answers a pair must give."""
    with running_engine(model_path, "--page-size", "4", "--max-total-tokens", "2048",
                        "--chunked-prefill-size", "16") as engine:
        yield engine


# completions with echo and logprobs: a batch of two text prompts, and a token-id prompt scored alone
ECHO_BODIES = [{"prompt": ["the quick brown fox", "jumps over the lazy dog"], "max_tokens": 4, "temperature": 0,
                "echo": True, "logprobs": 2, "ignore_eos": True},
               {"prompt": PROMPTS[3], "max_tokens": 0, "echo": True, "logprobs": 1}]


def _assert_same_completion(got: dict, want: dict) -> None:
    """Two /v1/completions answers: the same texts, tokens and text offsets; logprobs equal within float
    tolerance (the first token's of a prompt null in both). Cached token counts depend on what ran before."""
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [got["usage"][k] for k in counts] == [want["usage"][k] for k in counts]
    assert len(got["choices"]) == len(want["choices"])
    for g, w in zip(got["choices"], want["choices"]):
        assert (g["index"], g["text"], g["finish_reason"]) == (w["index"], w["text"], w["finish_reason"])
        gl, wl = g["logprobs"], w["logprobs"]
        assert gl["tokens"] == wl["tokens"] and gl["text_offset"] == wl["text_offset"]
        assert gl["token_logprobs"][0] is None and gl["top_logprobs"][0] is None
        assert gl["token_logprobs"][1:] == pytest.approx(wl["token_logprobs"][1:], abs=1e-4)
        for g_top, w_top in zip(gl["top_logprobs"][1:], wl["top_logprobs"][1:]):
            assert g_top == pytest.approx(w_top, abs=1e-4)


def test_sglang_router_in_front_of_the_pair(pd_pair, model_path, colocated):
    """The published sglang-router works unchanged against a baton prefill/decode pair."""
    prefill, bootstrap_port, decode = pd_pair
    with pd_router(sys.executable, "-m", "sglang_router.launch_router", prefill=prefill.base_url,
                   bootstrap_port=bootstrap_port, decode=decode.base_url) as router:
        assert_router_serves_pair(router.base_url, model_path, PROMPTS[:4])
        # n = 2 with the one room sglang-router sends: the engines fan it out, one transfer per choice
        model = httpx.get(f"{decode.base_url}/v1/models", timeout=30).json()["data"][0]["id"]
        r = httpx.post(f"{router.base_url}/v1/completions", timeout=120, json={
            "model": model, "prompt": "the pair samples twice", "max_tokens": MAX_NEW, "temperature": 0, "n": 2,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        out = r.json()
        assert [c["index"] for c in out["choices"]] == [0, 1] and out["usage"]["completion_tokens"] == 2 * MAX_NEW
        # chat with n = 2: sglang-router sends one host, port and room per choice
        chat = {"model": model, "messages": [{"role": "user", "content": "the pair chats twice"}],
                "max_tokens": MAX_NEW, "temperature": 0, "n": 2, "ignore_eos": True}
        r = httpx.post(f"{router.base_url}/v1/chat/completions", timeout=120, json=chat)
        assert r.status_code == 200, r.text
        out = r.json()
        assert [c["index"] for c in out["choices"]] == [0, 1] and out["usage"]["completion_tokens"] == 2 * MAX_NEW
        assert out["choices"][0]["message"]["content"] == out["choices"][1]["message"]["content"]  # greedy
        events = _sse_events(f"{router.base_url}/v1/chat/completions", {**chat, "stream": True})
        assert events[-1] == "[DONE]" and not [e for e in events if "error" in e], events
        text = {k: "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1]
                           if e["choices"][0]["index"] == k) for k in (0, 1)}
        assert text == {0: out["choices"][0]["message"]["content"], 1: out["choices"][1]["message"]["content"]}
        # echo with logprobs: sglang-router merges nothing into a completion; the decode's answer has one
        # engine's tokens and text offsets, with null logprobs for the prompt (only the prefill ran it)
        body = {**ECHO_BODIES[0], "model": model, "prompt": "the quick brown fox"}
        got = httpx.post(f"{router.base_url}/v1/completions", timeout=120, json=body)
        want = httpx.post(f"{colocated.base_url}/v1/completions", timeout=120, json=body).json()["choices"][0]
        assert got.status_code == 200, got.text
        choice = got.json()["choices"][0]
        assert choice["text"] == want["text"] and choice["logprobs"]["tokens"] == want["logprobs"]["tokens"]
        assert choice["logprobs"]["text_offset"] == want["logprobs"]["text_offset"]
        prompt_len = len(want["logprobs"]["tokens"]) - body["max_tokens"]
        assert choice["logprobs"]["token_logprobs"][:prompt_len] == [None] * prompt_len
        assert choice["logprobs"]["token_logprobs"][prompt_len:] == pytest.approx(
            want["logprobs"]["token_logprobs"][prompt_len:], abs=1e-4)
    _assert_idle_and_whole(prefill, decode)


def _sse_events(url: str, body: dict) -> list:
    """A stream's data events, parsed ("[DONE]" kept as is); comment lines skipped."""
    events: list = []
    with httpx.Client(timeout=120) as c, c.stream("POST", url, json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[len("data: "):]))
    return events


def test_baton_router_in_front_of_the_pair(pd_pair, model_path):
    """Our router, PD mode, in front of the pair over Mooncake; streaming and the OpenAI client too."""
    import openai

    prefill, bootstrap_port, decode = pd_pair
    with pd_router(sys.executable, "-m", "baton", "router", prefill=prefill.base_url,
                   bootstrap_port=bootstrap_port, decode=decode.base_url) as router:
        assert_router_serves_pair(router.base_url, model_path, PROMPTS)
        client = openai.OpenAI(base_url=f"{router.base_url}/v1", api_key="unused")
        kwargs = dict(model=client.models.list().data[0].id, prompt=PROMPTS[1], max_tokens=MAX_NEW, temperature=0)
        whole = client.completions.create(**kwargs)
        streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
        assert streamed == whole.choices[0].text and whole.usage.completion_tokens == MAX_NEW
        many = client.completions.create(n=3, **kwargs)  # parallel sampling: one transfer per choice
        assert [c.text for c in many.choices] == [whole.choices[0].text] * 3
        assert many.usage.completion_tokens == 3 * MAX_NEW
        # a forced tool call: both engines constrain to the tool's schema (the prefill its first token)
        tools = [{"type": "function", "function": {"name": "pick", "parameters": {
            "type": "object", "additionalProperties": False, "required": ["unit"],
            "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}}}}]
        chat = dict(model=kwargs["model"], messages=[{"role": "user", "content": "pick"}], tools=tools,
                    tool_choice={"type": "function", "function": {"name": "pick"}}, max_tokens=40, temperature=0)
        (call,) = client.chat.completions.create(**chat).choices[0].message.tool_calls
        assert call.function.name == "pick" and set(json.loads(call.function.arguments)) == {"unit"}
        deltas = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **chat) if c.choices]
        (streamed,) = [t for d in deltas for t in (d.tool_calls or [])]
        assert streamed.function.arguments == call.function.arguments
    _assert_idle_and_whole(prefill, decode)


def test_baton_router_returns_echo_logprobs_as_a_colocated_engine(pd_pair, colocated):
    """echo with logprobs through the pair: the prompt's tokens and logprobs (the prefill's), then the
    output's, with the text offsets of one engine. Before, only the output's came back, offsets from 0."""
    prefill, bootstrap_port, decode = pd_pair
    with pd_router(sys.executable, "-m", "baton", "router", prefill=prefill.base_url,
                   bootstrap_port=bootstrap_port, decode=decode.base_url) as router:
        for body in ECHO_BODIES:
            want = httpx.post(f"{colocated.base_url}/v1/completions", json=body, timeout=120)
            got = httpx.post(f"{router.base_url}/v1/completions", json=body, timeout=120)
            assert want.status_code == 200 and got.status_code == 200, (want.text, got.text)
            _assert_same_completion(got.json(), want.json())
    _assert_idle_and_whole(prefill, decode)


def test_pd_metrics_after_transfers(pd_pair, model_path):
    """Both engines export their PD queues and the transfers they made, via /metrics."""
    prefill, bootstrap_port, decode = pd_pair

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            return await _post_both(c, prefill.base_url, decode.base_url, _body(PROMPTS[2], bootstrap_port))

    assert all(r.status_code == 200 for r in asyncio.run(run()))
    _assert_idle_and_whole(prefill, decode)
    for engine, queues in ((prefill, ("bootstrap", "inflight")), (decode, ("prealloc", "transfer"))):
        samples = [s for family in text_string_to_metric_families(httpx.get(f"{engine.base_url}/metrics", timeout=30).text)
                   for s in family.samples]
        have = {s.labels.get("queue") for s in samples if s.name == "baton_pd_queue_requests"}
        assert set(queues) <= have, have
        count = [s.value for s in samples if s.name == "baton_kv_transfer_latency_seconds_count"]
        assert count and count[0] >= 1, count
        names = {s.name for s in samples}
        assert {"baton_kv_transfer_bytes_bucket", "baton_kv_transfer_speed_gb_per_second_bucket"} <= names


@pytest.fixture(scope="module")
def pd_pair_fp8(model_path):
    """A second pair, both engines with a float8 KV cache."""
    with _pair(model_path, ["--kv-cache-dtype", "fp8_e5m2"]) as pair:
        yield pair


def test_pd_pair_moves_a_float8_cache_byte_for_byte(pd_pair_fp8, model_path):
    """With a float8 cache on both sides the decode continues from the prefill's float8 pages: its
    tokens equal a colocated engine's with the same cache and chunking (greedy equality with HF is
    not expected of a float8 cache; equality with colocated shows the pages arrived intact)."""
    from scheduler_harness import SchedulerHarness

    prefill, bootstrap_port, decode = pd_pair_fp8
    for engine in (prefill, decode):
        assert httpx.get(f"{engine.base_url}/get_server_info", timeout=10).json()["kv_cache_dtype"] == "float8_e5m2"
    prompts = PROMPTS[3:7]
    # one at a time on both sides: a chunk boundary decides which keys a chunk reads back from the
    # float8 pool, so the chunking must be the same (a lone request's is deterministic)
    colocated = SchedulerHarness(model_path, page_size=4, max_total_tokens=2048, chunked_prefill_size=16,
                                 kv_cache_dtype="fp8_e5m2", disable_overlap_schedule=True)
    want = {}
    for i, p in enumerate(prompts):
        pre, dec = asyncio.run(_post_pair(prefill.base_url, decode.base_url, _body(p, bootstrap_port)))
        assert pre.status_code == 200 and dec.status_code == 200, (pre.text, dec.text)
        colocated.submit(str(i), p, max_new_tokens=MAX_NEW)
        want = colocated.run_until_idle()
        assert dec.json()["output_ids"] == want[str(i)].ids, f"prompt {i}"
    assert sum(want[str(i)].ids != hf_greedy(model_path, p, MAX_NEW) for i, p in enumerate(prompts)) >= 1, \
        "the float8 cache should change some greedy continuation of this model"
    _assert_idle_and_whole(prefill, decode)


def test_sglang_bench_serving_through_the_baton_router_in_front_of_the_pair(pd_pair, model_path, tmp_path):
    """The field's benchmark (sglang.bench_serving) runs to its end against a PD pair through our
    router and every request completes; it reads internal_states from /get_server_info, which the
    router passes through from a worker. (Through sglang-router it cannot: that router answers
    /get_server_info with its own counters, and bench_serving fails at its end on any engines.)"""
    from test_sglang_bench import NUM_PROMPTS, run_bench_serving

    prefill, bootstrap_port, decode = pd_pair
    with pd_router(sys.executable, "-m", "baton", "router", prefill=prefill.base_url,
                   bootstrap_port=bootstrap_port, decode=decode.base_url) as router:
        result = run_bench_serving(router.base_url, model_path, str(tmp_path / "bench.jsonl"))
    assert result["completed"] == NUM_PROMPTS and result["total_output_tokens"] == NUM_PROMPTS * 8, result
    _assert_idle_and_whole(prefill, decode)
