"""OpenAI `n` (parallel sampling) on a real engine: n choices per prompt, in OpenAI's order, each
equal to the single request it stands for (greedy: the same text; seeded: the request with seed + k);
the prompt counted once in usage and computed once (radix hits); streaming interleaves the choices
by index; a client leaving mid-stream aborts every choice and leaks nothing."""
from __future__ import annotations

import json
import time
from collections import defaultdict

import httpx
import pytest

from engine_server import running_engine, wait_idle_integrity

MAX_LONG = 12000  # tokens per choice: seconds of decoding, far more than an abort takes to arrive


@pytest.fixture(scope="module")
def engine(tiny_model_factory):
    # a long context and a pool to match: the abort tests' streams cannot end on their own before the abort
    with running_engine(tiny_model_factory("llama", max_position_embeddings=16384),
                        "--max-total-tokens", "40000") as eng:
        yield eng


def _post(engine, route: str, body: dict) -> dict:
    r = httpx.post(f"{engine.base_url}{route}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _single(engine, prompt: str, **kw) -> dict:
    return _post(engine, "/v1/completions", {"prompt": prompt, "max_tokens": 12, **kw})["choices"][0]


def _cached_tokens_total(engine) -> float:
    text = httpx.get(f"{engine.base_url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("baton_cached_tokens_total"))


def _stream_events(engine, route: str, body: dict) -> list[dict]:
    events = []
    with httpx.Client(timeout=120) as c, c.stream("POST", f"{engine.base_url}{route}", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
            elif line == "data: [DONE]":
                events.append("DONE")
    return events


def test_greedy_choices_equal_the_single_request_and_prompts_keep_openai_order(engine):
    prompts = ["the quick brown fox", "a b c d e f"]
    out = _post(engine, "/v1/completions", {"prompt": prompts, "n": 3, "max_tokens": 12, "temperature": 0})
    assert [c["index"] for c in out["choices"]] == list(range(6))
    for k, choice in enumerate(out["choices"]):  # choice k is copy k % 3 of prompt k // 3
        assert choice["text"] == _single(engine, prompts[k // 3], temperature=0)["text"]
    single = _post(engine, "/v1/completions", {"prompt": prompts[0], "max_tokens": 12, "temperature": 0})
    per_prompt = single["usage"]["prompt_tokens"]
    usage = out["usage"]
    completion = sum(c["usage"]["completion_tokens"] for c in
                     [_post(engine, "/v1/completions", {"prompt": p, "max_tokens": 12, "temperature": 0}) for p in prompts])
    assert usage["completion_tokens"] == 3 * completion
    assert per_prompt < usage["prompt_tokens"] < 3 * per_prompt  # each prompt once, not n times
    assert wait_idle_integrity(engine.base_url)["integrity_ok"] is True


def test_seeded_choices_are_the_requests_with_seed_plus_k(engine):
    body = {"prompt": "once upon a time", "n": 4, "max_tokens": 12, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    out = _post(engine, "/v1/completions", body)
    texts = [c["text"] for c in out["choices"]]
    assert texts == [_single(engine, body["prompt"], temperature=1.0, seed=7 + k, ignore_eos=True)["text"]
                     for k in range(4)]
    assert len(set(texts)) > 1, "the copies sampled the same text: their seeds did not differ"
    assert [c["text"] for c in _post(engine, "/v1/completions", body)["choices"]] == texts  # reproducible
    # the copies share the prompt: all but the one that computed it read it from the radix cache
    fresh = {**body, "prompt": "an entirely new prompt nobody sent before", "seed": 1}
    before = _cached_tokens_total(engine)
    usage = _post(engine, "/v1/completions", fresh)["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0  # counted on the first copy, as the prompt
    prompt = usage["prompt_tokens"]
    assert _cached_tokens_total(engine) - before == 3 * (prompt - 1), (prompt, _cached_tokens_total(engine) - before)
    info = wait_idle_integrity(engine.base_url)
    assert info["integrity_ok"] is True


def test_chat_n(engine):
    body = {"messages": [{"role": "user", "content": "hello"}], "n": 2, "max_tokens": 8, "temperature": 0}
    out = _post(engine, "/v1/chat/completions", body)
    one = _post(engine, "/v1/chat/completions", {**body, "n": 1})
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert all(c["message"]["content"] == one["choices"][0]["message"]["content"] for c in out["choices"])
    assert out["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert out["usage"]["completion_tokens"] == 2 * one["usage"]["completion_tokens"]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streamed_choices_add_up_to_the_whole_ones(engine, chat):
    sampling = {"n": 3, "max_tokens": 10, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    if chat:
        route, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "tell me"}], **sampling}
    else:
        route, body = "/v1/completions", {"prompt": "tell me a story", **sampling}
    whole = _post(engine, route, body)
    events = _stream_events(engine, route, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "DONE"
    text, finishes, roles = defaultdict(str), defaultdict(list), defaultdict(int)
    for ev in events[:-2]:
        (choice,) = ev["choices"]
        k = choice["index"]
        if chat:
            roles[k] += choice["delta"].get("role") == "assistant"
            text[k] += choice["delta"].get("content") or ""
        else:
            text[k] += choice["text"]
        if choice["finish_reason"] is not None:
            finishes[k].append(choice["finish_reason"])
    expected = [c["message"]["content"] if chat else c["text"] for c in whole["choices"]]
    assert [text[k] for k in range(3)] == expected
    assert {k: v for k, v in finishes.items()} == {k: ["length"] for k in range(3)}
    if chat:
        assert dict(roles) == {0: 1, 1: 1, 2: 1}
    usage = events[-2]["usage"]
    assert events[-2]["choices"] == [] and usage["completion_tokens"] == 30
    assert usage["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    assert wait_idle_integrity(engine.base_url)["integrity_ok"] is True


def test_leaving_mid_stream_aborts_every_choice(engine):
    body = {"prompt": "stream forever", "n": 3, "max_tokens": MAX_LONG, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", f"{engine.base_url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        seen = set()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen.add(json.loads(line[6:])["choices"][0]["index"])
            if len(seen) == 3:
                break
    info = wait_idle_integrity(engine.base_url, timeout_s=60)
    assert info["integrity_ok"] is True and info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0


def test_a_refused_copy_refuses_the_request(engine):
    # temperature is checked per copy when it is tokenized: the whole request fails, nothing is left running
    r = httpx.post(f"{engine.base_url}/v1/completions", json={"prompt": "hi", "n": 3, "top_p": 0, "stream": True},
                   timeout=60)
    assert r.status_code == 400 and "top_p" in r.json()["error"]["message"]
    info = wait_idle_integrity(engine.base_url)
    assert info["integrity_ok"] is True and info["num_running_reqs"] == 0


def test_native_generate_n(engine):
    """SGLang's /generate with sampling_params.n: a list of n outputs per prompt, prompt-major."""
    sp = {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 3, "n": 3, "ignore_eos": True}
    outs = _post(engine, "/generate", {"text": "native copies", "sampling_params": sp})
    assert isinstance(outs, list) and len(outs) == 3
    singles = [_post(engine, "/generate", {"text": "native copies", "sampling_params": {**sp, "n": 1,
                                                                                          "sampling_seed": 3 + k}})
               for k in range(3)]
    assert [o["output_ids"] for o in outs] == [s["output_ids"] for s in singles]
    assert len({tuple(o["output_ids"]) for o in outs}) > 1
    batch = _post(engine, "/generate", {"text": ["p one", "p two"],
                                        "sampling_params": {"max_new_tokens": 4, "temperature": 0, "n": 2}})
    assert len(batch) == 4
    firsts = [_post(engine, "/generate", {"text": t, "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
              for t in ("p one", "p two")]
    assert [b["output_ids"] for b in batch] == [firsts[0]["output_ids"]] * 2 + [firsts[1]["output_ids"]] * 2
    assert wait_idle_integrity(engine.base_url)["integrity_ok"] is True


def test_abort_request_by_rid_ends_every_choice(engine):
    """/abort_request with the client's rid (what a router sends) ends all n copies (rid-0, rid-1, ...)."""
    import threading

    body = {"prompt": "abort us all", "n": 3, "max_tokens": MAX_LONG, "ignore_eos": True, "stream": True,
            "rid": "par-7"}
    events: list = []

    def stream():
        with httpx.Client(timeout=120) as c, c.stream("POST", f"{engine.base_url}/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))

    t = threading.Thread(target=stream)
    t.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(events) < 6:  # all three choices under way
        time.sleep(0.02)
    r = httpx.post(f"{engine.base_url}/abort_request", json={"rid": "par-7"}, timeout=30)
    assert r.status_code == 200
    t.join(timeout=60)
    assert not t.is_alive(), "the stream did not end after the abort"
    assert any("error" in e for e in events), "no abort reached the client"
    assert sum(1 for e in events for c in e.get("choices", [])) < 3 * MAX_LONG
    assert {c["index"] for e in events for c in e.get("choices", [])} == {0, 1, 2}
    info = wait_idle_integrity(engine.base_url, timeout_s=60)
    assert info["integrity_ok"] is True and info["num_running_reqs"] == 0


def test_streaming_several_prompts_with_n(engine):
    """A prompt list streams too: choice k is copy k % n of prompt k // n, as in the whole response."""
    body = {"prompt": ["first prompt", "second prompt here"], "n": 2, "max_tokens": 6, "temperature": 1.0,
            "seed": 21, "ignore_eos": True}
    whole = _post(engine, "/v1/completions", body)
    events = _stream_events(engine, "/v1/completions", {**body, "stream": True,
                                                         "stream_options": {"include_usage": True}})
    text = defaultdict(str)
    for ev in events[:-2]:
        (choice,) = ev["choices"]
        text[choice["index"]] += choice["text"]
    assert [text[k] for k in range(4)] == [c["text"] for c in whole["choices"]]
    usage = events[-2]["usage"]  # each prompt counted once, four choices' tokens (the cache differs: warm now)
    assert {k: usage[k] for k in ("prompt_tokens", "completion_tokens")} == \
        {k: whole["usage"][k] for k in ("prompt_tokens", "completion_tokens")}
    assert whole["usage"]["completion_tokens"] == 4 * 6
    assert wait_idle_integrity(engine.base_url)["integrity_ok"] is True
