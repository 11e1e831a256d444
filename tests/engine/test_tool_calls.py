"""Tool calling and reasoning through a real engine process and the OpenAI client: a Qwen-style chat
template given with --chat-template, --reasoning-parser qwen3, and no --tool-call-parser: the engine
picks qwen25 from the template's <tool_call> format, as for a real Qwen checkpoint.

A random tiny model never writes a tool call of its own accord, so each call here is either forced by
tool_choice (the engine constrains decoding to the tool's schema: tokens equal HF `generate` with
xgrammar's logits processor on the same prompt and schema) or steered by a regex in the request
(tool_choice auto: the model's text goes through the parser, whole and streamed)."""
from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine_server import running_engine, wait_idle_integrity

TEMPLATE = r"""
{%- if tools %}<|im_start|>system
Tools:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one with <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{%- for tc in m.tool_calls %}
<tool_call>{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""

TOOLS = [{"type": "function", "function": {
             "name": "get_weather", "description": "the weather in a city",
             "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                            "properties": {"city": {"type": "string", "maxLength": 8},
                                           "unit": {"enum": ["c", "f"]}}}}},
         {"type": "function", "function": {
             "name": "add", "parameters": {"type": "object", "additionalProperties": False, "required": ["a"],
                                           "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}}}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL_REGEX = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,6}", "unit": "c"\}\}</tool_call>'


@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    # the tools make long prompts; <think> and </think> are one token each, as in Qwen3's vocabulary
    return tiny_model_factory("qwen3", max_position_embeddings=2048, extra_tokens=("<think>", "</think>", "<tool_call>", "</tool_call>"))


@pytest.fixture(scope="module")
def engine(model_path, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "tools.jinja"
    template.write_text(TEMPLATE)
    with running_engine(model_path, "--chat-template", str(template),
                        "--reasoning-parser", "qwen3", "--constrained-json-disable-any-whitespace") as eng:
        eng.template = TEMPLATE
        yield eng


@pytest.fixture(scope="module")
def client(engine):
    return openai.OpenAI(base_url=f"{engine.base_url}/v1", api_key="unused")


@pytest.fixture(scope="module")
def hf(model_path):
    tok = AutoTokenizer.from_pretrained(model_path)
    tok.chat_template = TEMPLATE
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval(), tok


NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}  # the grammar applies from the first token


def _compiler(hf):
    import xgrammar as xgr

    model, tok = hf
    eos = model.generation_config.eos_token_id
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=model.config.vocab_size,
                                              stop_token_ids=[eos] if isinstance(eos, int) else sorted(eos))
    return xgr.GrammarCompiler(info)


def _compiled_schema(hf, schema):
    return _compiler(hf).compile_json_schema(json.dumps(schema), any_whitespace=False)


def _prompt(hf, messages, **kwargs) -> list[int]:
    ids = hf[1].apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=True, **kwargs)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)


def _plan(**kw):
    """The server's plan for a request (qwen25 format, compact JSON, as the engine here runs)."""
    from baton.engine.entrypoints.chat_tools import plan_tools
    from baton.engine.entrypoints.protocol import ChatCompletionRequest

    return plan_tools(ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": TOOLS, **kw}),
                      "qwen25", True)


def _hf_tag(hf, tag: dict, max_new_tokens: int, bias=None, **template_kwargs) -> list[int]:
    """HF greedy under xgrammar's processor on a structural tag (and a sequence bias)."""
    from xgrammar.contrib.hf import LogitsProcessor

    ids = _prompt(hf, MESSAGES, **template_kwargs)
    compiled = _compiler(hf).compile_structural_tag(json.dumps(tag))
    out = hf[0].generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                         logits_processor=[LogitsProcessor(compiled)],
                         sequence_bias={(t,): b for t, b in (bias or {}).items()} or None)
    return out[0, len(ids):].tolist()


def _calls_in(hf, ids: list[int], content: str = "") -> list[tuple[str, dict]]:
    """The calls in an HF output of the qwen25 format; the text around them must be `content`."""
    from baton.engine.parsers import make_tool_parser
    from baton.engine.parsers.base import parse_whole

    parsed = parse_whole(make_tool_parser("qwen25"), hf[1].decode(ids, skip_special_tokens=True),
                         {"get_weather", "add"}.__contains__)
    assert parsed.content.strip() == (content or "").strip(), parsed
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


def _check_weather(args: dict) -> None:
    assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f") and len(args["city"]) <= 8, args


def test_named_tool_choice_is_a_call_in_the_models_format_equal_to_hf(client, hf):
    """With a format xgrammar knows (qwen25), a named tool_choice constrains the model to write that
    call in its own format: tokens equal HF under the same structural tag."""
    model = client.models.list().data[0].id
    choice = {"type": "function", "function": {"name": "get_weather"}}
    resp = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                          max_tokens=120, temperature=0, extra_body=NO_THINKING)
    expected = _hf_tag(hf, _plan(tool_choice=choice).structural_tag, 120, enable_thinking=False)
    ((name, args),) = _calls_in(hf, expected)
    c = resp.choices[0]
    assert c.finish_reason == "stop" and c.message.content is None, c  # a forced call reports "stop", as OpenAI
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == name == "get_weather"
    assert json.loads(call.function.arguments) == args
    _check_weather(args)
    assert resp.usage.completion_tokens == len(expected)


def test_required_tool_choice_equals_hf_and_streams_the_same(client, hf):
    model = client.models.list().data[0].id
    # one call: the grammar ends after it (else a random model starts another one)
    one = dict(tool_choice="required", parallel_tool_calls=False)
    resp = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=160, temperature=0,
                                          extra_body=NO_THINKING, **one)
    c = resp.choices[0]
    expected = _calls_in(hf, _hf_tag(hf, _plan(**one).structural_tag, 160, enable_thinking=False))
    assert c.finish_reason == "tool_calls" and c.message.content is None, c  # calls only
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == expected
    assert expected, "at least one call"
    stream = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=160, temperature=0,
                                            stream=True, extra_body=NO_THINKING, **one)
    deltas = [ch.choices[0] for ch in stream if ch.choices]
    streamed = [t for d in deltas for t in (d.delta.tool_calls or [])]
    assert [(t.index, t.function.name, t.function.arguments) for t in streamed] == \
        [(i, t.function.name, t.function.arguments) for i, t in enumerate(c.message.tool_calls)]
    assert deltas[-1].finish_reason == "tool_calls"


def test_strict_tools_make_an_auto_call_parse(client, hf):
    """tool_choice auto: a bias makes the random model open a call (<tool_call>). Without strict the
    rest is its own noise and stays content; with a strict tool, the call is constrained to a tool's
    name and schema (equal to HF under the same structural tag) and parses."""
    model = client.models.list().data[0].id
    opener = hf[1].convert_tokens_to_ids("<tool_call>")
    kw = dict(model=model, messages=MESSAGES, max_tokens=80, temperature=0, parallel_tool_calls=False,
              logit_bias={str(opener): 100}, extra_body=NO_THINKING)
    loose = client.chat.completions.create(tools=TOOLS, **kw).choices[0]
    assert not loose.message.tool_calls and loose.message.content.startswith("<tool_call>"), loose
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
    c = client.chat.completions.create(tools=strict, **kw).choices[0]
    plan = _plan(tools=strict, parallel_tool_calls=False)
    assert plan.structural_tag is not None and plan.schema is None
    expected = _calls_in(hf, _hf_tag(hf, plan.structural_tag, 80, {opener: 100.0}, enable_thinking=False))
    assert c.finish_reason == "tool_calls" and c.message.content is None, c
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == expected
    assert len(expected) == 1


def test_auto_tool_call_parsed_from_the_models_text_whole_and_streamed(client):
    """tool_choice auto: the model's own <tool_call> text (steered here by a regex) becomes a call;
    the reasoning block before it becomes reasoning_content."""
    model = client.models.list().data[0].id
    steer = {"regex": r"<think>[a-z ]{1,12}</think>\n" + CALL_REGEX, **NO_THINKING}  # the regex writes the block
    resp = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=150,
                                          temperature=0, extra_body=steer)
    c = resp.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None, c
    assert re.fullmatch("[a-z ]{1,12}", c.message.reasoning_content), c.message
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert re.fullmatch("[a-z]{1,6}", args["city"]) and args["unit"] == "c"
    stream = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=150,
                                            temperature=0, extra_body=steer, stream=True)
    deltas = [ch.choices[0] for ch in stream if ch.choices]
    assert "".join(getattr(d.delta, "reasoning_content", None) or "" for d in deltas) == c.message.reasoning_content
    assert "".join(d.delta.content or "" for d in deltas) == ""
    (streamed,) = [t for d in deltas for t in (d.delta.tool_calls or [])]
    assert (streamed.index, streamed.function.name, streamed.function.arguments) == (0, "get_weather",
                                                                                     call.function.arguments)
    assert deltas[-1].finish_reason == "tool_calls"


class _AfterThink:
    """HF's side of a grammar that waits for the reasoning: logit_bias throughout, and xgrammar's HF
    processor from the token after </think> on (it takes everything before as its prompt)."""

    def __init__(self, compiled, think_end: int, bias: dict[int, float], prompt_len: int) -> None:
        self.compiled, self.think_end, self.bias, self.prompt_len = compiled, think_end, bias, prompt_len
        self.inner = None

    def __call__(self, input_ids, scores):
        from xgrammar.contrib.hf import LogitsProcessor

        for t, b in self.bias.items():
            scores[:, t] += b
        if self.inner is None and self.think_end in input_ids[0, self.prompt_len:].tolist():
            self.inner = LogitsProcessor(self.compiled)
        return scores if self.inner is None else self.inner(input_ids, scores)


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok"], "properties": {"ok": {"type": "boolean"}}}


def test_a_grammar_applies_after_the_reasoning(engine, client, hf):
    """A model that reasons (qwen3 parser, thinking on) writes its <think> block freely; the JSON
    schema applies from the token after </think>: tokens equal HF with the same rule, and the chat
    answer is reasoning_content plus JSON content. A bias makes the random model close the block."""
    model, tok = hf
    think_end = tok.convert_tokens_to_ids("</think>")
    ids = _prompt(hf, MESSAGES)
    for strength in (1.0, 1.5, 2.0, 2.5, 3.0, 4.0):  # the first that closes the block after some reasoning
        bias = {think_end: strength}
        proc = _AfterThink(_compiled_schema(hf, SCHEMA), think_end, bias, len(ids))
        want = model.generate(torch.tensor([ids]), max_new_tokens=60, do_sample=False, pad_token_id=0,
                              logits_processor=[proc])[0, len(ids):].tolist()
        if think_end in want[1:40]:
            break
    assert think_end in want and want.index(think_end) > 0, want  # some reasoning, then the end
    r = httpx.post(f"{engine.base_url}/generate", timeout=60, json={
        "input_ids": ids, "require_reasoning": True,
        "sampling_params": {"max_new_tokens": 60, "temperature": 0, "json_schema": json.dumps(SCHEMA),
                            "logit_bias": {str(t): b for t, b in bias.items()}}})
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == want
    resp = client.chat.completions.create(model=client.models.list().data[0].id, messages=MESSAGES, tools=TOOLS,
                                          tool_choice="none", max_tokens=60, temperature=0,
                                          logit_bias={str(t): b for t, b in bias.items()},
                                          response_format={"type": "json_schema",
                                                           "json_schema": {"name": "a", "schema": SCHEMA}})
    c = resp.choices[0]
    assert c.finish_reason == "stop" and resp.usage.completion_tokens == len(want), c
    text = tok.decode(want, skip_special_tokens=True)
    reasoning, answer = text.split("</think>", 1)
    assert c.message.reasoning_content == reasoning.removeprefix("<think>") and c.message.content == answer.lstrip()
    assert set(json.loads(c.message.content)) == {"ok"}


def test_plain_text_with_tools_stays_content(client):
    """tool_choice auto, and the model writes no call: its text is the content, as without tools."""
    model = client.models.list().data[0].id
    resp = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=12,
                                          temperature=0, extra_body={"regex": "[a-z]{4} [a-z]{4}", **NO_THINKING})
    c = resp.choices[0]
    assert c.finish_reason == "stop" and not c.message.tool_calls and re.fullmatch("[a-z]{4} [a-z]{4}", c.message.content)
    assert c.message.reasoning_content is None


def test_tool_turns_and_template_kwargs_reach_the_template(client, hf, engine):
    model = client.models.list().data[0].id
    turns = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 7}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "7"}]
    tok = hf[1]
    want = tok.apply_chat_template([{**m, "tool_calls": [{**t, "function": {"name": "add", "arguments": {"a": 7}}}
                                                         for t in m["tool_calls"]]} if m.get("tool_calls") else m
                                    for m in turns], tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert '"arguments": {"a": 7}' in want
    resp = client.chat.completions.create(model=model, messages=turns, tools=TOOLS, max_tokens=2, temperature=0)
    assert resp.usage.prompt_tokens == len(tok(want)["input_ids"])
    off = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, temperature=0,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    on = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, temperature=0)
    assert off.usage.prompt_tokens == on.usage.prompt_tokens + len(tok("<think>\n\n</think>\n\n")["input_ids"])
    assert wait_idle_integrity(engine.base_url)["integrity_ok"] is True


BAD = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "use tools"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
]


@pytest.mark.parametrize("extra,needle", BAD)
def test_bad_tool_requests_get_400(engine, extra, needle):
    r = httpx.post(f"{engine.base_url}/v1/chat/completions", timeout=30,
                   json={"messages": MESSAGES, "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"], r.text


def test_tools_on_completions_get_400_and_nothing_leaks(engine):
    r = httpx.post(f"{engine.base_url}/v1/completions", timeout=30, json={"prompt": "hi", "tools": TOOLS})
    assert r.status_code == 400 and "chat" in r.json()["error"]["message"], r.text
    assert wait_idle_integrity(engine.base_url)["integrity_ok"] is True


# SmolLM2's template style: content joined with +, so a turn without content must still be a string
CONCAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                   "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def concat_engine(model_path, tmp_path_factory):
    template = tmp_path_factory.mktemp("concat") / "concat.jinja"
    template.write_text(CONCAT_TEMPLATE)
    with running_engine(model_path, "--chat-template", str(template)) as eng:
        yield eng


def test_the_parser_is_picked_from_the_template_and_a_template_without_one_names_the_flag(engine, concat_engine):
    """The Qwen-style template writes <tool_call>: the engine runs qwen25 without the flag (the tests
    above parse its calls). A template that shows no tool-call format: tools with the default
    tool_choice are a 400 that names --tool-call-parser; tool_choice none is served."""
    assert httpx.get(f"{engine.base_url}/get_server_info", timeout=30).json()["tool_call_parser"] == "qwen25"
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 2}
    r = httpx.post(f"{concat_engine.base_url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and "--tool-call-parser" in r.json()["error"]["message"], r.text
    assert "shows no tool-call format known here" in r.json()["error"]["message"]
    r = httpx.post(f"{concat_engine.base_url}/v1/chat/completions", json={**body, "tool_choice": "none"}, timeout=30)
    assert r.status_code == 200, r.text


def test_an_sdk_assistant_turn_with_null_content_is_empty_text(concat_engine, hf):
    """The OpenAI SDK's own message of a tool-calling answer (content None) sent back in the next turn,
    as an agent loop does: the template sees "" (OpenAI's null), not a missing field or None."""
    from openai.types.chat import ChatCompletionMessage

    called = ChatCompletionMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 7}'}}]})
    assert called.content is None
    turns = [*MESSAGES, called, {"role": "tool", "tool_call_id": "call_1", "content": "7"}]
    client = openai.OpenAI(base_url=f"{concat_engine.base_url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    resp = client.chat.completions.create(model=model, messages=turns, max_tokens=2, temperature=0)
    want = hf[1].apply_chat_template([*MESSAGES, {"role": "assistant", "content": ""}, turns[2]],
                                     chat_template=CONCAT_TEMPLATE, add_generation_prompt=True, tokenize=False)
    assert resp.usage.prompt_tokens == len(hf[1](want)["input_ids"])
