"""The HTTP API of a real engine process: HF-equal greedy outputs under concurrency, OpenAI client,
streaming, every bad-input case (clear error, right status, server keeps serving, nothing leaks),
client disconnects, queue limit (503) and API key (401)."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import re

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from baton_testing.raw_http import read_until_closed, send_body_until_answered, talk
from engine_server import running_engine, wait_idle_integrity

from baton.engine.sampling.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    # a 2k context: a request for 1000 tokens runs its full length (~0.5 s even on a fast VM), so a
    # client that hangs up mid-request really does (512 capped it at ~0.25 s, and it finished first)
    return tiny_model_factory("qwen3", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def engine(model_path):
    # small chunk + page size 4 so the API path also exercises chunking and paging
    # the overlap loop on CPU here; the other engines in this file use the CPU default (plain loop);
    # mixed chunked prefill on, so the API path also runs decode steps inside prefill batches
    with running_engine(model_path, "--enable-overlap-schedule", "--enable-mixed-chunk",
                        "--chunked-prefill-size", "16", "--page-size", "4",
                        "--max-total-tokens", "2048", "--max-queued-requests", "64",
                        "--request-read-timeout", "3") as eng:
        yield eng


@pytest.fixture(scope="module")
def hf(model_path):
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    return hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()


async def _generate(client: httpx.AsyncClient, base: str, ids: list[int], n: int) -> dict:
    r = await client.post(f"{base}/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0}})
    assert r.status_code == 200, r.text
    return r.json()


def test_concurrent_generate_matches_hf(engine, hf):
    prompts = [[(7 * i + 3 * j) % 500 + 6 for j in range(5 + 3 * i)] for i in range(16)]
    prompts += [prompts[10][:24] + [11, 12, 13]]  # radix hit through the API

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*[_generate(c, engine.base_url, p, 10) for p in prompts])

    outs = asyncio.run(run())
    for p, out in zip(prompts, outs):
        assert out["output_ids"] == hf_greedy(hf, p, 10)
        assert out["meta_info"]["prompt_tokens"] == len(p)
        assert out["meta_info"]["finish_reason"]["type"] in ("length", "stop")
    info = wait_idle_integrity(engine.base_url)
    assert info["integrity_ok"] is True
    # 17 prompts through 16-token chunks: later prefill batches carried the earlier requests' decodes
    assert info["mixed_decode_tokens"] > 0
    metrics = httpx.get(f"{engine.base_url}/metrics").text
    [line] = [ln for ln in metrics.splitlines() if ln.startswith("baton_mixed_decode_tokens_total{")]
    assert float(line.rsplit(" ", 1)[1]) == info["mixed_decode_tokens"]


def test_openai_client_chat_and_completion(engine, model_path, hf):
    client = openai.OpenAI(base_url=f"{engine.base_url}/v1", api_key="unused")
    tok = AutoTokenizer.from_pretrained(model_path)
    messages = [{"role": "user", "content": "hello there"}]
    chat = client.chat.completions.create(model="ignored-if-empty" if False else client.models.list().data[0].id,
                                          messages=messages, max_tokens=8, temperature=0)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    expected = hf_greedy(hf, list(ids), 8)
    assert chat.choices[0].message.content == tok.decode(expected, skip_special_tokens=True)
    assert chat.usage.prompt_tokens == len(ids) and chat.usage.completion_tokens == len(expected)
    # streaming: the deltas concatenate to the same text; usage arrives in the last chunk
    stream = client.chat.completions.create(model=chat.model, messages=messages, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == len(expected)
    comp = client.completions.create(model=chat.model, prompt="the quick brown fox", max_tokens=6, temperature=0,
                                     logprobs=2)
    assert comp.choices[0].finish_reason in ("length", "stop")
    assert len(comp.choices[0].logprobs.token_logprobs) == comp.usage.completion_tokens
    assert all(len(t) <= 2 for t in comp.choices[0].logprobs.top_logprobs)


def test_completion_text_offsets(engine):
    """text_offset: where each token starts in the choice's text (after an echoed prompt), continued
    across a stream's chunks."""
    client = openai.OpenAI(base_url=f"{engine.base_url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    body = dict(model=model, prompt="the quick brown fox", max_tokens=6, temperature=0, logprobs=1,
                extra_body={"ignore_eos": True})

    def starts(tokens: list[str], base: int) -> list[int]:
        return [base + len("".join(tokens[:i])) for i in range(len(tokens))]

    lp = client.completions.create(**body).choices[0].logprobs
    assert len(lp.tokens) == 6 and lp.text_offset == starts(lp.tokens, 0)
    # echo: the prompt's tokens first (nothing predicts the first), then the output's, offsets from 0
    echoed = client.completions.create(echo=True, **body).choices[0]
    lp = echoed.logprobs
    assert "".join(lp.tokens[:-6]) == body["prompt"] and lp.tokens[-6:] == [t for t in lp.tokens[-6:]]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None for v in lp.token_logprobs[1:]) and all(len(t) == 1 for t in lp.top_logprobs[1:])
    assert lp.text_offset == starts(lp.tokens, 0) and echoed.text == "".join(lp.tokens)
    chunks = [c.choices[0].logprobs for c in client.completions.create(stream=True, **body) if c.choices]
    tokens = [t for c in chunks if c for t in c.tokens]
    assert [o for c in chunks if c for o in c.text_offset] == starts(tokens, 0) and len(tokens) == 6


def test_chat_text_parts_and_logit_bias_through_the_openai_client(engine, model_path, hf):
    client = openai.OpenAI(base_url=f"{engine.base_url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    # OpenAI content parts reach a text-only chat template as one string (text parts joined by newlines)
    as_text = client.chat.completions.create(model=model, max_tokens=6, temperature=0, messages=[
        {"role": "user", "content": "hello\nthere"}])
    as_parts = client.chat.completions.create(model=model, max_tokens=6, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]}])
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    assert as_parts.usage.prompt_tokens == as_text.usage.prompt_tokens
    # logit_bias: HF generate with the same single-token sequence_bias, greedy
    prompt = [11, 12, 13, 14, 15]
    plain = hf_greedy(hf, prompt, 6)
    bias = {plain[0]: -100.0, plain[3]: 5.0}
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                           sequence_bias={(t,): b for t, b in bias.items()})[0, len(prompt):].tolist()
    assert expected != plain
    comp = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0,
                                     logit_bias={str(t): b for t, b in bias.items()})
    tok = AutoTokenizer.from_pretrained(model_path)
    assert comp.choices[0].text == tok.decode(expected, skip_special_tokens=True)
    assert wait_idle_integrity(engine.base_url)["integrity_ok"] is True


def test_structured_output_through_the_openai_client(engine):
    """response_format json_schema (whole and streamed), json_object, and SGLang's regex extra."""
    client = openai.OpenAI(base_url=f"{engine.base_url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    schema = {"type": "object", "additionalProperties": False, "required": ["ok", "tag"],
              "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green", "blue"]}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    messages = [{"role": "user", "content": "answer in JSON"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=200, temperature=0,
                                          response_format=fmt)
    assert chat.choices[0].finish_reason == "stop", chat
    obj = json.loads(chat.choices[0].message.content)
    assert set(obj) == {"ok", "tag"} and isinstance(obj["ok"], bool) and obj["tag"] in ("red", "green", "blue")
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=200, temperature=0,
                                            response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat.choices[0].message.content
    loose = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                           response_format={"type": "json_object"})
    assert loose.choices[0].message.content.lstrip().startswith("{"), loose
    comp = client.completions.create(model=model, prompt="code:", max_tokens=20, temperature=0.8, seed=3,
                                     extra_body={"regex": "(yes|no)-[0-9]{2,4}"})
    assert comp.choices[0].finish_reason == "stop" and re.fullmatch("(yes|no)-[0-9]{2,4}", comp.choices[0].text)
    assert wait_idle_integrity(engine.base_url)["integrity_ok"] is True


def test_required_tool_choice_without_a_parser_is_a_json_array_equal_to_hf(engine, hf, model_path):
    """No --tool-call-parser here: tool_choice required constrains the output to a JSON array of
    {"name", "parameters"} (vLLM's form), parsed into calls; tokens equal HF under that schema."""
    import xgrammar as xgr
    from xgrammar.contrib.hf import LogitsProcessor

    from baton.engine.entrypoints.chat_tools import plan_tools
    from baton.engine.entrypoints.protocol import ChatCompletionRequest

    tools = [{"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["n"],
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}}}]
    body = {"messages": [{"role": "user", "content": "pick"}], "tools": tools, "tool_choice": "required"}
    tok = AutoTokenizer.from_pretrained(model_path)
    # the schema allows free whitespace, and this random model would write nothing else: bias it away
    blank = {t: -100.0 for t in range(hf.config.vocab_size) if tok.decode([t]) and not tok.decode([t]).strip()}
    client = openai.OpenAI(base_url=f"{engine.base_url}/v1", api_key="unused")
    resp = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=60, temperature=0,
                                          logit_bias={str(t): b for t, b in blank.items()}, **body)
    schema = plan_tools(ChatCompletionRequest.model_validate(body), None).schema
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=hf.config.vocab_size,
                                              stop_token_ids=[hf.generation_config.eos_token_id])
    ids = tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "input_ids") or isinstance(ids, dict) else ids)
    out = hf.generate(torch.tensor([ids]), max_new_tokens=60, do_sample=False, pad_token_id=0,
                      sequence_bias={(t,): b for t, b in blank.items()}, logits_processor=[
        LogitsProcessor(xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema)))])[0, len(ids):].tolist()
    expected = json.loads(tok.decode(out, skip_special_tokens=True))
    c = resp.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None, c
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == \
        [(e["name"], e["parameters"]) for e in expected]
    assert resp.usage.completion_tokens == len(out)


def test_max_tokens_0_scores_the_prompt_only(engine, model_path, hf):
    """max_tokens 0 (SGLang's and OpenAI's prompt scoring, cache warming): the prompt is prefilled, no
    token generated; with echo and logprobs the prompt's own logprobs come back (HF's), as OpenAI
    answers; /generate max_new_tokens 0 likewise. Both were a 400."""
    tok = AutoTokenizer.from_pretrained(model_path)
    prompt = "the quick brown fox jumps"
    ids = tok(prompt)["input_ids"]
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    want = [float(want[i - 1, t]) for i, t in enumerate(ids) if i > 0]
    r = httpx.post(f"{engine.base_url}/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1, "model": "any-name"})
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] == len(ids)
    lp = choice["logprobs"]
    assert lp["tokens"] == [tok.decode([t]) for t in ids] and lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-4)
    r = httpx.post(f"{engine.base_url}/generate", timeout=60, json={
        "input_ids": ids, "return_logprob": True, "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 0}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"
    assert [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]] == pytest.approx(want, abs=1e-4)
    assert wait_idle_integrity(engine.base_url)["integrity_ok"] is True


def test_any_model_name_is_served_and_a_default_max_tokens_fits_the_context(engine):
    """A client's `model` is whatever its configuration says: any name is served, as SGLang does (a 404
    before). A max_tokens the client did not send (completions' default 16) is cut to what the context
    leaves, never a 400."""
    served = httpx.get(f"{engine.base_url}/v1/models").json()["data"][0]["id"]
    for route, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})):
        r = httpx.post(f"{engine.base_url}{route}", timeout=60, json={**body, "model": "gpt-4o"})
        assert r.status_code == 200 and r.json()["model"] == served, r.text
    prompt = [(7 * j) % 400 + 6 for j in range(2040)]
    r = httpx.post(f"{engine.base_url}/v1/completions", timeout=120, json={"prompt": prompt, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8


BAD_REQUESTS = [
    ("/v1/completions", b"{not json", 400, "malformed JSON"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "", "max_tokens": 4}, 400, "empty"),
    ("/v1/completions", {"prompt": [], "max_tokens": 4}, 400, "empty"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": 0}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n must be between 1 and 128"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 129}, 400, "n must be"),
    ("/generate", {"text": "hi", "sampling_params": {"n": 0}}, 400, "n must be between 1 and 128"),
    ("/generate", {"text": "hi", "sampling_params": {"n": "2"}}, 400, "sampling_params.n must be an integer"),
    ("/generate", {"text": "hi", "sampling_params": {"n": 2}, "stream": True}, 400, "n > 1"),
    ("/v1/completions", {"prompt": 42}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x " * 3000, "max_tokens": 4}, 400, "context length"),
    # a prompt and max_tokens past the context: a 400, as OpenAI and SGLang answer (it was cut silently)
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1e12}, 400, "ask for at most"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2048}, 400, "context length is 2048 tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}, 400,
     "ask for at most"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5000}, 400,
     "ask for at most"),
    ("/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2046}}, 400,
     "3 in the prompt and 2046 to generate; ask for at most 2045"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/generate", {"text": "hi", "stream": 1}, 400, "stream"),
    ("/generate", {"sampling_params": {"max_new_tokens": 3}}, 400, "text or input_ids"),
    ("/generate", {"input_ids": [1, 2, 10**9]}, 400, "vocabulary"),
    ("/generate", {"text": "hi", "sampling_params": {"no_such_param": 1}}, 400, "sampling_params"),
    ("/generate", [1, 2, 3], 400, "JSON object"),
    # OpenAI features this server lacks: a 400 that names them, never an answer without them
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "yaml"}}, 400, "response_format type 'yaml'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     400, "json_schema.schema"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
     400, "invalid json_schema"),
    ("/v1/completions", {"prompt": "hi", "regex": "(unclosed"}, 400, "invalid regex"),
    ("/generate", {"text": "hi", "sampling_params": {"ebnf": "root ::= nothing_defined"}}, 400, "invalid ebnf"),
    ("/generate", {"text": "hi", "sampling_params": {"regex": "a", "ebnf": "root ::= \"a\""}}, 400, "at most one"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {}}}]}, 400,
     "chat template shows no tool-call format known here; start it with the --tool-call-parser"),
    ("/v1/completions", {"prompt": "hi", "suffix": "bye"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     400, "image input needs a vision-language model"),
    ("/generate", {"text": "what is this?", "image_data": "data:image/png;base64,AA=="}, 400,
     "image input needs a vision-language model"),
    ("/v1/completions", {"prompt": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]},
     400, "completion prompt of content parts"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, 400,
     "content part of type None is not supported"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"999999": 5}}, 400, "out of vocabulary"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"7": 101}}, 400, "[-100, 100]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"abc": 1}},
     400, "not a token id"),
    ("/generate", {"text": "hi", "sampling_params": {"logit_bias": {"7": "much"}}}, 400, "must be a number"),
    # a value of the wrong type: a 400 naming the field (a float seed used to stop the whole engine)
    ("/generate", {"text": "hi", "sampling_params": {"seed": 1e308}}, 400, "seed must be an integer"),
    ("/v1/completions", {"prompt": "hi", "seed": 1e308}, 400, "seed"),
    ("/generate", {"text": "hi", "sampling_params": {"top_k": "x"}}, 400, "top_k must be an integer"),
    ("/generate", {"text": "hi", "sampling_params": {"repetition_penalty": None}}, 400,
     "repetition_penalty must be a finite number"),
    ("/generate", {"text": "hi", "top_logprobs_num": [1, 2]}, 400, "top_logprobs_num is a list"),
    ("/generate", {"text": ["a", "b"], "rid": ["x"]}, 400, "rid has 1 values for 2 prompts"),
    ("/generate", {"text": "hi", "bootstrap_room": -1}, 400, "bootstrap_room must be in [0, 2^63)"),
    ("/v1/completions", {"prompt": "hi", "bootstrap_room": 2**63}, 400, "bootstrap_room must be in [0, 2^63)"),
    ("/generate", {"text": "hi", "bootstrap_port": 70000}, 400, "bootstrap_port must be a TCP port"),
]


@pytest.mark.parametrize("route,body,status,needle", BAD_REQUESTS, ids=[f"{r}-{i}" for i, (r, *_rest) in enumerate(BAD_REQUESTS)])
def test_bad_input_gets_clear_error(engine, route, body, status, needle):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{engine.base_url}{route}", timeout=60, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle.lower() in err["message"].lower() and err["code"] == status
    # the engine keeps serving and nothing leaked
    ok = httpx.post(f"{engine.base_url}/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}, timeout=60)
    assert ok.status_code == 200
    assert wait_idle_integrity(engine.base_url)["integrity_ok"] is True


WRONG_VALUES = [None, -1, 2**64, 1e308, "x", "", [], [1, "a"], {}, {"a": 1}, True, 3.5]


def test_every_sampling_field_refuses_every_wrong_value_without_a_5xx(engine):
    """Each field of SamplingParams (read from the dataclass, so a new field is covered too) with values
    of every JSON type through /generate: an answer (200 for a value that fits, else 400 with an error
    body), never a 5xx or a dropped connection; the engine then serves and holds nothing."""
    fields = [f.name for f in dataclasses.fields(SamplingParams)]
    with httpx.Client(base_url=engine.base_url, timeout=60) as c:
        for name in fields:
            for value in WRONG_VALUES:
                params = {"max_new_tokens": 1, name: value}
                r = c.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": params})
                assert r.status_code in (200, 400), (params, r.status_code, r.text)
                assert r.status_code == 200 or r.json()["error"]["code"] == 400, (params, r.text)
        ok = c.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}})
        assert ok.status_code == 200
    assert wait_idle_integrity(engine.base_url)["integrity_ok"] is True


def test_body_size_limit(engine):
    r = httpx.post(f"{engine.base_url}/v1/completions", content=b" " * (17 * 1024 * 1024),
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413


def test_a_chunked_body_past_the_limit_is_refused_as_it_arrives(engine):
    """A chunked body has no Content-Length for the guard to check: the engine counts it as it arrives
    and answers 413 once it passes --max-request-bytes (16 MiB), without waiting for (or buffering)
    the rest; this body never ends. The engine keeps serving."""
    port = int(engine.base_url.rsplit(":", 1)[1])
    head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunk = b"%x\r\n%s\r\n" % (1 << 20, b" " * (1 << 20))
    status, sent = send_body_until_answered(port, head, [chunk] * 40, wait_s=20)
    assert status == b"HTTP/1.1 413 Request Entity Too Large", (status, sent)  # the body never ends
    assert wait_idle_integrity(engine.base_url)["integrity_ok"] is True


def test_a_body_not_sent_in_time_is_a_408(engine):
    """A client that stops mid-body (Content-Length promises more than it sends) gets 408 after
    --request-read-timeout (3 s here) instead of holding its connection for good."""
    port = int(engine.base_url.rsplit(":", 1)[1])
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n")
    status, _ = send_body_until_answered(port, head, [b'{"prompt": "a'], wait_s=30)
    assert status == b"HTTP/1.1 408 Request Timeout", status
    assert wait_idle_integrity(engine.base_url)["integrity_ok"] is True


def test_a_connection_that_does_not_send_its_head_in_time_is_closed(engine):
    """uvicorn waits for a request's head as long as the client likes (slowloris); the engine closes a
    connection whose head has not all come within --request-read-timeout (3 s here) of the connection
    (nothing sent, half a head) or of the last response (a keep-alive connection whose next head stalls).
    Pipelined requests and a keep-alive connection's prompt next request are served."""
    import socket
    import time

    port = int(engine.base_url.rsplit(":", 1)[1])
    ask = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    for first in (b"", b"POST /generate HTTP/1.1\r\nHost: x\r\n"):
        took, _ = talk(port, [first], wait_s=30)
        assert 2.0 < took < 15, (first, took)
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(ask + ask)  # pipelined
        s.settimeout(10)
        got = b""
        while got.count(b"HTTP/1.1 200") < 2:
            got += s.recv(4096)
        time.sleep(1)
        s.sendall(ask)  # the next request on the connection, in time
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
        start = time.monotonic()
        s.sendall(b"GET /health HTTP/1.1\r\n")  # and a head that stalls
        read_until_closed(s, 30)
        took = time.monotonic() - start
        assert 2.0 < took < 15, took
    assert wait_idle_integrity(engine.base_url)["integrity_ok"] is True


def test_client_disconnect_aborts_and_frees(engine):
    """Close a stream after the first chunks: the request must be aborted, its memory freed."""
    body = {"input_ids": list(range(6, 40)), "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}, "stream": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", f"{engine.base_url}/generate", json=body) as r:
            assert r.status_code == 200
            for i, line in enumerate(r.iter_lines()):
                if i >= 3:
                    break
    info = wait_idle_integrity(engine.base_url, timeout_s=60)
    assert info["integrity_ok"] is True and info["num_running_reqs"] == 0


@pytest.mark.parametrize("route,body", [
    ("/generate", {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}),
    ("/v1/completions", {"prompt": [5, 6, 7, 8], "max_tokens": 1000, "ignore_eos": True, "n": 2}),
], ids=["generate", "completions-n2"])
def test_a_whole_response_client_that_hangs_up_is_aborted_quietly(engine, route, body):
    """A non-streaming client gone before its answer: its request (every copy of n) is aborted and
    freed, and the server logs no traceback for it."""
    async def hang_up():
        async with httpx.AsyncClient(timeout=60) as c:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(c.post(f"{engine.base_url}{route}", json=body), 0.25)

    before = engine.log_tail(10_000).count("\n")
    asyncio.run(hang_up())
    info = wait_idle_integrity(engine.base_url, timeout_s=60)
    assert info["integrity_ok"] is True and info["num_running_reqs"] == 0
    new_lines = engine.log_tail(10_000).splitlines()[before:]
    assert not [line for line in new_lines if "Traceback" in line or "Exception in ASGI" in line], new_lines


def test_abort_request_endpoint(engine):
    async def run():
        async with httpx.AsyncClient(timeout=60) as c:
            task = asyncio.create_task(c.post(f"{engine.base_url}/generate", json={
                "input_ids": [5, 6, 7, 8], "rid": "to-abort",
                "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}))
            await asyncio.sleep(0.3)
            r = await c.post(f"{engine.base_url}/abort_request", json={"rid": "to-abort"})
            assert r.status_code == 200
            return await task

    resp = asyncio.run(run())
    assert resp.status_code == 499 or resp.json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert wait_idle_integrity(engine.base_url)["integrity_ok"] is True


def test_health_metrics_models_flush(engine):
    base = engine.base_url
    assert httpx.get(f"{base}/health").status_code == 200
    assert httpx.get(f"{base}/health_generate", timeout=60).status_code == 200
    models = httpx.get(f"{base}/v1/models").json()
    assert models["data"][0]["id"] == "qwen3" or models["data"][0]["root"]
    assert httpx.get(f"{base}/get_model_info").json()["is_generation"] is True
    metrics = httpx.get(f"{base}/metrics").text
    for name in ("baton_time_to_first_token_seconds_bucket", "baton_generation_tokens_total",
                 "baton_num_running_requests", "baton_token_usage", "baton_cache_hit_rate"):
        assert name in metrics
    wait_idle_integrity(base)
    assert httpx.post(f"{base}/flush_cache").status_code == 200
    info = wait_idle_integrity(base)
    assert info["integrity_ok"] is True
    # SGLang's shape with one DP rank too (sglang.bench_serving reads it); /metrics' samples stay out
    assert [s["dp_rank"] for s in info["internal_states"]] == [0] and info["internal_states"][0]["integrity_ok"]
    assert not [k for k in (*info, *info["internal_states"][0]) if k.endswith("_samples")], sorted(info)
    # the HTTP process told the scheduler, once start-up was over, to freeze its start-up objects
    assert info["gc_frozen_objects"] > 10_000
    # start-up phases: every one timed, none negative, together within the scheduler's total
    startup = info["startup_s"]
    phases = {"load_weights", "kv_pool", "cuda_graphs", "compile", "tokenizer", "spawn", "grammar"}
    assert set(startup) == phases | {"total"} and all(v >= 0 for v in startup.values())
    assert startup["load_weights"] > 0 and startup["spawn"] > 0.1 and sum(startup[k] for k in phases) <= startup["total"] + 1e-3


def test_queue_limit_returns_503(model_path):
    with running_engine(model_path, "--max-queued-requests", "1", "--max-running-requests", "1") as eng:
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 60, "ignore_eos": True}}

        async def run():
            async with httpx.AsyncClient(timeout=120) as c:
                return await asyncio.gather(*[c.post(f"{eng.base_url}/generate", json=body) for _ in range(8)])

        codes = sorted(r.status_code for r in asyncio.run(run()))
        assert 200 in codes and 503 in codes, codes
        assert wait_idle_integrity(eng.base_url)["integrity_ok"] is True


def test_api_key(model_path):
    with running_engine(model_path, api_key="s3cret") as eng:
        base = eng.base_url
        assert httpx.get(f"{base}/health").status_code == 200  # probes need no key
        body = {"prompt": "hi", "max_tokens": 2}
        assert httpx.post(f"{base}/v1/completions", json=body).status_code == 401
        assert httpx.post(f"{base}/v1/completions", json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
        r = httpx.post(f"{base}/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"}, timeout=60)
        assert r.status_code == 200
        log = open(eng.log_path).read()
        assert "s3cret" not in log, "the API key must never be logged"


def test_strict_model_name_and_auto_truncate(model_path):
    """--strict-model-name: a `model` other than the server's is a 404. --allow-auto-truncate (SGLang's):
    a prompt past the context is cut to its first tokens and max_tokens to what is left, as before."""
    with running_engine(model_path, "--strict-model-name", "--allow-auto-truncate", "--max-total-tokens", "2048",
                        "--context-length", "64") as eng:
        base = eng.base_url
        r = httpx.post(f"{base}/v1/completions", timeout=60, json={"prompt": "hi", "max_tokens": 2, "model": "gpt-4o"})
        assert r.status_code == 404 and "does not exist" in r.json()["error"]["message"], r.text
        served = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        r = httpx.post(f"{base}/v1/completions", timeout=60, json={"prompt": "hi", "max_tokens": 2, "model": served})
        assert r.status_code == 200, r.text
        r = httpx.post(f"{base}/generate", timeout=60, json={
            "input_ids": list(range(5, 65)), "sampling_params": {"max_new_tokens": 100, "ignore_eos": True}})
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4, r.text
        r = httpx.post(f"{base}/generate", timeout=60, json={
            "input_ids": list(range(5, 105)), "sampling_params": {"max_new_tokens": 100, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        assert (r.json()["meta_info"]["prompt_tokens"], r.json()["meta_info"]["completion_tokens"]) == (63, 1)
        assert wait_idle_integrity(base)["integrity_ok"] is True


@pytest.mark.parametrize("path, body", [("/v1/embeddings", {"input": "hi"}), ("/encode", {"text": "hi"}),
                                        ("/classify", {"input_ids": [5, 6]})])
def test_embedding_routes_are_refused_on_a_generation_engine(engine, path, body):
    r = httpx.post(f"{engine.base_url}{path}", json=body, timeout=30)
    assert r.status_code == 400 and "--is-embedding" in r.json()["error"]["message"], r.text
