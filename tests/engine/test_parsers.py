"""Tool-call formats and the reasoning split (engine/parsers), and the chat request's tool plan
(entrypoints/chat_tools.py): whole answers, and the same answers streamed in every split."""
from __future__ import annotations

import json
import random

import pytest

from baton.engine.entrypoints.chat_tools import ChoiceParser, plan_tools, template_messages
from baton.engine.entrypoints.protocol import ChatCompletionRequest
from baton.engine.parsers import make_tool_parser
from baton.engine.parsers.base import ToolStream, parse_whole
from baton.engine.parsers.reasoning import ReasoningStream
from baton.engine.tokenizer_manager import RequestError

KNOWN = {"get_weather", "add"}.__contains__

# (parser, output, expected content, expected [(name, arguments)])
CASES = [
    ("qwen25", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.\n", [("get_weather", {"city": "Paris"})]),
    ("qwen25", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>\n'
               '{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>',
     "\n", [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"})]),
    ("hermes", "No tools needed: 1 < 2 and <tool is not a tag.", "No tools needed: 1 < 2 and <tool is not a tag.", []),
    ("qwen25", '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa', '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa', []),
    ("qwen25", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> done',
     '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> done', []),  # unknown function: content
    ("qwen25", "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}', "", [("get_weather", {"city": "Rome"})]),
    ("llama3", ' {"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "add", "parameters": {"a": 3, "b": 4}}',
     "", [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]),
    ("llama3", 'The answer is {"name": "add"}', 'The answer is {"name": "add"}', []),  # not at the start
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Lyon"}}]', "Sure. ",
     [("get_weather", {"city": "Lyon"})]),
    ("pythonic", '[get_weather(city="Nice"), add(a=1, b=-2.5)]', "",
     [("get_weather", {"city": "Nice"}), ("add", {"a": 1, "b": -2.5})]),
    ("pythonic", "[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
    ("pythonic", "[get_weather(city=os.environ)]", "[get_weather(city=os.environ)]", []),  # not a literal
]


def _summary(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_whole_output(name, text, content, calls):
    parsed = parse_whole(make_tool_parser(name), text, KNOWN)
    assert parsed.content == content
    assert _summary(parsed.calls) == calls


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_streamed_in_any_split_equals_whole(name, text, content, calls):
    rng = random.Random(len(text))
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for _ in range(30):  # and random chunkings of 1-6 characters
        cuts, i = [], 0
        while i < len(text):
            step = rng.randint(1, 6)
            cuts.append(text[i:i + step])
            i += step
        splits.append(cuts)
    for pieces in splits:
        stream = ToolStream(make_tool_parser(name), KNOWN)
        got_content, got_calls = "", []
        for piece in pieces:
            part = stream.feed(piece)
            got_content += part.content
            got_calls += part.calls
        tail = stream.finish()
        assert got_content + tail.content == content, pieces
        assert _summary(got_calls + tail.calls) == calls, pieces


def test_content_is_not_held_back_longer_than_a_marker_could_be():
    stream = ToolStream(make_tool_parser("qwen25"), KNOWN)
    assert stream.feed("Hello wor").content == "Hello wor"
    assert stream.feed("ld <tool").content == "ld "  # "<tool" may begin <tool_call>
    assert stream.feed("box>").content == "<toolbox>"


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call><tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
    parsed = parse_whole(make_tool_parser("qwen25"), text, KNOWN, max_calls=1)
    assert _summary(parsed.calls) == [("add", {"a": 1})]


@pytest.mark.parametrize("forced,text,reasoning,content", [
    (False, "<think>\nsun is a star\n</think>\n\nIt is hot.", "\nsun is a star\n", "It is hot."),
    (False, "It is hot.", "", "It is hot."),
    (False, "<think>still thinking", "still thinking", ""),
    (False, "<thi", "", "<thi"),
    (False, "  <think>a</think>b", "a", "b"),
    (True, "a plan\n</think>\n\nanswer", "a plan\n", "answer"),
    (True, "<think>a plan</think>answer", "a plan", "answer"),
    (True, "never closed", "never closed", ""),
    (False, "<think></think>", "", ""),
])
def test_reasoning_split_whole_and_streamed(forced, text, reasoning, content):
    for i in range(len(text) + 1):
        for pieces in ([text[:i], text[i:]], list(text)):
            s = ReasoningStream(forced)
            parts = [s.feed(p) for p in pieces] + [s.finish()]
            assert "".join(p.reasoning for p in parts) == reasoning, pieces
            assert "".join(p.content for p in parts) == content, pieces


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "add"}}]


def _req(**kw):
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **kw})


def test_tool_plan_modes():
    assert plan_tools(_req(), None) is None
    auto = plan_tools(_req(tools=TOOLS), "qwen25")
    assert auto.mode == "auto" and auto.schema is None and auto.known("add") and not auto.known("x")
    req = plan_tools(_req(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), None)
    assert req.mode == "required" and req.schema["minItems"] == 1 and req.schema["maxItems"] == 1
    assert [i["properties"]["name"]["enum"] for i in req.schema["items"]["anyOf"]] == [["get_weather"], ["add"]]
    named = plan_tools(_req(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}), None)
    assert named.mode == "named" and named.schema == TOOLS[0]["function"]["parameters"]
    assert plan_tools(_req(tools=TOOLS, tool_choice="none"), None).mode == "none"


@pytest.mark.parametrize("kw,parser,needle", [
    (dict(tools=TOOLS), None, "--tool-call-parser"),
    (dict(tool_choice="required"), "qwen25", "needs tools"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), None, "not among"),
    (dict(tools=TOOLS + TOOLS[:1]), "qwen25", "duplicate"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), None, "cannot be combined"),
    (dict(tools=TOOLS, tool_choice="required", regex="a+"), None, "cannot be combined"),
])
def test_tool_plan_errors(kw, parser, needle):
    with pytest.raises(RequestError) as e:
        plan_tools(_req(**kw), parser)
    assert e.value.status == 400 and needle in e.value.message


# what real chat templates write when they show a model its tools (excerpts)
QWEN25_TEMPLATE = ('{%- if tools %}{{- "# Tools\\n\\nYou may call one or more functions to assist with the user query." }}'
                   '{{- "For each function call, return a json object with function name and arguments within '
                   '<tool_call></tool_call> XML tags:\\n<tool_call>\\n" }}{%- endif %}')
LLAMA31_TEMPLATE = ('{%- if builtin_tools is defined or tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}'
                    '{{- "<|python_tag|>" + tool_call.name + ".call(" }}')
LLAMA32_TEMPLATE = ('{{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name '
                    'and its value}.\' }}')
MISTRAL_TEMPLATE = "{%- if message.tool_calls %}{{- '[TOOL_CALLS][' }}{%- endif %}"
PLAIN_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


@pytest.mark.parametrize("template,fits,picked", [
    (QWEN25_TEMPLATE, "qwen25", "qwen25"), (LLAMA31_TEMPLATE, "llama3", "llama3"),
    (LLAMA32_TEMPLATE, "llama3", "llama3"), (MISTRAL_TEMPLATE, "mistral", None), (PLAIN_TEMPLATE, None, None),
    (None, None, None), ({"default": QWEN25_TEMPLATE, "rag": PLAIN_TEMPLATE}, "qwen25", "qwen25"),
], ids=["qwen25", "llama31", "llama32", "mistral", "no-tools", "no-template", "named-templates"])
def test_the_tool_call_parser_comes_from_the_chat_template_for_qwen_and_llama(template, fits, picked):
    """Without --tool-call-parser a server takes the parser of its chat template's format where the
    model is of a family whose format is known (Qwen, Llama); the flag always wins."""
    from types import SimpleNamespace

    from baton.engine.entrypoints.http_common import ApiContext
    from baton.engine.parsers import template_tool_parser
    from baton.engine.server_args import ServerArgs

    assert template_tool_parser(template) == fits
    tm = SimpleNamespace(tokenizer=SimpleNamespace(chat_template=template))
    assert ApiContext(ServerArgs(model_path="m"), tm, {}).tool_call_parser == picked
    assert ApiContext(ServerArgs(model_path="m", tool_call_parser="hermes"), tm, {}).tool_call_parser == "hermes"


@pytest.mark.parametrize("template_format,needle", [
    ("mistral", "writes calls in the mistral format: start it with --tool-call-parser mistral"),
    (None, "shows no tool-call format known here; start it with the --tool-call-parser of the model's format"),
])
def test_tools_without_a_parser_are_a_400_that_names_the_flag_and_the_fitting_parser(template_format, needle):
    with pytest.raises(RequestError) as e:
        plan_tools(_req(tools=TOOLS), None, template_format=template_format)
    assert e.value.status == 400 and needle in e.value.message and 'tool_choice "auto"' in e.value.message


def test_required_and_named_outputs_become_calls():
    plan = plan_tools(_req(tools=TOOLS, tool_choice="required"), None)
    p = ChoiceParser(plan, None, None)
    out = p.whole('[{"name": "get_weather", "parameters": {"city": "Bern"}}, {"name": "add", "parameters": {}}]')
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]), c["index"]) for c in out["tool_calls"]] == \
        [("get_weather", {"city": "Bern"}, 0), ("add", {}, 1)]
    assert out["content"] == "" and p.finish_reason("stop") == "tool_calls" and p.finish_reason("length") == "length"
    cut = ChoiceParser(plan, None, None).whole('[{"name": "get_wea')  # cut short by max_tokens
    assert cut["tool_calls"] == [] and cut["content"] == '[{"name": "get_wea'
    named = ChoiceParser(plan_tools(_req(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}}),
                                    None), None, None)
    out = named.whole('{"a": 1}')
    assert out["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1}'}
    assert named.finish_reason("stop") == "stop"  # a forced call, as OpenAI reports it


def test_reasoning_then_tool_calls_streamed():
    text = '<think>need weather</think>\n\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    plan = plan_tools(_req(tools=TOOLS), "qwen25")
    p = ChoiceParser(plan, "qwen25", "qwen3")
    deltas = [p.feed(ch) for ch in text] + [p.finish()]
    assert "".join(d["reasoning_content"] for d in deltas) == "need weather"
    assert "".join(d["content"] for d in deltas) == ""
    calls = [c for d in deltas for c in d["tool_calls"]]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")


def test_earlier_tool_calls_reach_the_template_as_objects():
    msgs = template_messages([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "1"}])
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert msgs[1] == {"role": "tool", "tool_call_id": "call_1", "content": "1"}


def test_a_known_format_is_constrained_in_the_models_own_syntax():
    """qwen25 (xgrammar's qwen_3 structural tag): required, named and strict auto become a structural
    tag that begins each call as the format does and holds the tool's schema; without strict, auto
    stays free; a format xgrammar lacks (mistral) falls back to the JSON forms."""
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
    for kw in (dict(tools=TOOLS, tool_choice="required"),
               dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}),
               dict(tools=strict)):
        plan = plan_tools(_req(**kw), "qwen25")
        assert plan.schema is None and plan.structural_tag is not None, kw
        text = json.dumps(plan.structural_tag)
        assert '<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": ' in text
        assert json.dumps(TOOLS[0]["function"]["parameters"]) in text
    assert plan_tools(_req(tools=TOOLS), "qwen25").structural_tag is None
    assert plan_tools(_req(tools=TOOLS, tool_choice="required"), "mistral").schema["type"] == "array"
    with pytest.raises(RequestError, match="strict tools"):
        plan_tools(_req(tools=strict, regex="a+"), "qwen25")
    p = ChoiceParser(plan_tools(_req(tools=TOOLS, tool_choice="required"), "qwen25"), "qwen25", None)
    out = p.whole('Sure.<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>')
    assert out["content"] == "Sure." and out["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1}'}
