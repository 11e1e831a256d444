"""Tool calling and reasoning on /v1/chat/completions, as OpenAI defines it and SGLang / vLLM serve it.

tool_choice (default "auto" when tools are given):
- "none": the template still sees the tools; the output is plain content;
- "auto": the output is parsed with the server's --tool-call-parser (the model's own format), which
  for Qwen and Llama is picked from the chat template when the flag is absent (ApiContext); a
  request needs one (400 otherwise, as vLLM answers, naming the flag and the parser of the
  template's format where one is known). When a tool is `strict` and xgrammar knows the
  format (a structural tag: Qwen/Hermes), text stays free until the model opens a call, and the
  call is then constrained to a tool's name and schema, so it always parses;
- "required" / {"type": "function", "function": {"name": F}}: decoding is constrained (xgrammar).
  In the model's own format when xgrammar knows it (at least one call of the tools / a call of F),
  parsed by the format's parser; otherwise to a JSON array of {"name", "parameters"} of the tools /
  to F's parameters schema (the output is then F's arguments), as vLLM does.
With --reasoning-parser, the `<think>` block becomes `reasoning_content` first; the rest is then
content (and tool calls). A constraint (required, a named function, response_format) applies after
the reasoning when the model reasons (`reasons`): the scheduler starts the grammar after `</think>`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Optional

from baton.engine.entrypoints.protocol import ChatCompletionRequest, NamedToolChoice
from baton.engine.parsers import TOOL_PARSERS, make_tool_parser, reasoning_forced, structural_tag_model
from baton.engine.parsers.base import Parsed, ToolCall, ToolStream, call_from
from baton.engine.parsers.reasoning import ReasoningStream
from baton.engine.sampling.sampling_params import GRAMMAR_KINDS
from baton.engine.tokenizer_manager import RequestError

_NO_ARGS = {"type": "object", "properties": {}}
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "tokenize", "conversation"})


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request treats its tools."""

    tools: list[dict[str, Any]]  # for the chat template, OpenAI's shape
    mode: str  # none | auto | required | named
    named: Optional[str] = None
    max_calls: Optional[int] = None  # 1 when parallel_tool_calls is false
    # the constraint: a JSON schema (required / named without a model format; the output is JSON,
    # not the model's format) or an xgrammar structural tag of the model's format
    schema: Optional[dict[str, Any]] = None
    structural_tag: Optional[dict[str, Any]] = None

    def known(self, name: str) -> bool:
        return any(t["function"]["name"] == name for t in self.tools)


def plan_tools(req: ChatCompletionRequest, tool_parser: Optional[str], compact_json: bool = False,
               template_format: Optional[str] = None) -> Optional[ToolPlan]:
    """`compact_json`: the server's --constrained-json-disable-any-whitespace (no free whitespace in
    constrained arguments); `template_format`: the parser of the chat template's tool-call format
    (named in the 400 of a request that needs a parser the server was not given)."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise RequestError("tool_choice needs tools", 400)
        return None
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise RequestError("tools have duplicate function names", 400)
    max_calls = None if req.parallel_tool_calls else 1
    mode = "auto" if choice is None else choice if isinstance(choice, str) else "named"
    tag_model = structural_tag_model(tool_parser)
    strict = mode == "auto" and tag_model is not None and any(t["function"].get("strict") for t in tools)
    if (mode in ("required", "named") or strict) and any(getattr(req, k) is not None
                                                         for k in (*GRAMMAR_KINDS, "response_format")):
        what = "strict tools" if strict else f"tool_choice {mode!r}"
        raise RequestError(f"{what} constrain the output itself; this cannot be combined with "
                           "response_format or json_schema / regex / ebnf / structural_tag", 400)
    if mode == "auto" and tool_parser is None:
        raise RequestError(_no_parser_message(template_format), 400)
    if mode == "named":
        assert isinstance(choice, NamedToolChoice)
        if choice.function.name not in names:
            raise RequestError(f"tool_choice names {choice.function.name!r}, which is not among the tools", 400)
        max_calls = 1
    if tag_model is not None and (mode in ("required", "named") or strict):
        tag = _structural_tag(tag_model, tools, choice.model_dump() if mode == "named" else mode, max_calls,
                              compact_json)
        return ToolPlan(tools, mode, choice.function.name if mode == "named" else None, max_calls,
                        structural_tag=tag)
    if mode == "named":
        fn = next(t["function"] for t in tools if t["function"]["name"] == choice.function.name)
        return ToolPlan(tools, mode, fn["name"], 1, fn.get("parameters") or _NO_ARGS)
    schema = None
    if mode == "required":
        items = [{"type": "object", "required": ["name", "parameters"],
                  "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                 "parameters": t["function"].get("parameters") or _NO_ARGS}} for t in tools]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if max_calls == 1:
            schema["maxItems"] = 1
    return ToolPlan(tools, mode, None, max_calls, schema)


def _no_parser_message(template_format: Optional[str]) -> str:
    fits = (f"this model's chat template writes calls in the {template_format} format: start it with "
            f"--tool-call-parser {template_format}" if template_format is not None else
            "this model's chat template shows no tool-call format known here; start it with the "
            f"--tool-call-parser of the model's format (one of {', '.join(TOOL_PARSERS)})")
    return (f'tools with tool_choice "auto" (the default) need the server\'s --tool-call-parser: {fits}; '
            'or send tool_choice "required", a named function, or "none"')


def _structural_tag(model: str, tools: list[dict[str, Any]], tool_choice: Any, max_calls: Optional[int],
                    compact_json: bool) -> dict[str, Any]:
    """xgrammar's structural tag for calls in `model`'s format. Reasoning is left out: the scheduler
    starts a grammar after the reasoning (require_reasoning)."""
    import xgrammar as xgr

    with_params = [{**t, "function": {**t["function"], "parameters": t["function"].get("parameters") or _NO_ARGS}}
                   for t in tools]
    tag = xgr.get_model_structural_tag(model, tools=with_params, tool_choice=tool_choice, reasoning=False,
                                       parallel_tool_calls=max_calls is None,
                                       max_whitespace_cnt=1 if compact_json else None)  # 0 is refused
    tag = json.loads(tag.model_dump_json())
    fmt = tag["format"]
    if tool_choice == "required" and fmt.get("type") == "triggered_tags":
        # xgrammar's "required" lets free text run before the first call, which a small model fills
        # until max_tokens (SmolLM2 did); as vLLM's and OpenAI's required: the answer is calls only
        tag["format"] = {"type": "tags_with_separator", "tags": fmt["tags"], "separator": "\n",
                         "at_least_one": True, "stop_after_first": fmt.get("stop_after_first", False)}
    return tag


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Earlier tool calls as chat templates read them: arguments as an object, not JSON text (Qwen's
    and Llama's templates serialize them again)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [_call_for_template(c) for c in calls]}
        out.append(m)
    return out


def _call_for_template(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**fn, "arguments": args}}


def reasons(reasoning_parser: Optional[str], kwargs: dict[str, Any]) -> bool:
    """Whether the answer starts with reasoning: a model with a reasoning parser, unless the
    template was told not to think (Qwen3's enable_thinking false). Then everything up to
    `</think>` is reasoning (a leading `<think>` dropped), and a grammar starts after it."""
    if reasoning_parser is None:
        return False
    return reasoning_forced(reasoning_parser) or kwargs.get("enable_thinking", True) is not False


def template_kwargs(req: ChatCompletionRequest) -> dict[str, Any]:
    kwargs = dict(req.chat_template_kwargs or {})
    if clash := _RESERVED_TEMPLATE_KWARGS & set(kwargs):
        raise RequestError(f"chat_template_kwargs cannot set {sorted(clash)}", 400)
    return kwargs


class _Constrained:
    """required / named: the whole output is JSON the grammar made; parsed once it has ended."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan, self.buf = plan, ""

    def feed(self, delta: str) -> Parsed:
        self.buf += delta
        return Parsed("", [])

    def finish(self) -> Parsed:
        text, self.buf = self.buf, ""
        try:
            value = json.loads(text)
        except ValueError:  # cut short (length): not a call; the client sees the text
            return Parsed(text, [])
        if self.plan.mode == "named":
            return Parsed("", [ToolCall(self.plan.named, json.dumps(value, ensure_ascii=False))])
        calls = [call_from(v, ("parameters", "arguments")) for v in value] if isinstance(value, list) else [None]
        if not calls or any(c is None or not self.plan.known(c.name) for c in calls):
            return Parsed(text, [])
        return Parsed("", calls[: self.plan.max_calls])


class ChoiceParser:
    """One choice's output split into reasoning, content and tool calls, over deltas or whole."""

    def __init__(self, plan: Optional[ToolPlan], tool_parser: Optional[str], reasoning_parser: Optional[str],
                 thinking: bool = False) -> None:
        """`thinking`: the answer starts inside the reasoning block (`reasons`), else a block is
        recognised only when the answer opens one."""
        self.reasoning = ReasoningStream(thinking) if reasoning_parser else None
        self.tools: Any = None
        if plan is not None and plan.schema is not None:  # JSON the grammar made, not the model's format
            self.tools = _Constrained(plan)
        elif plan is not None and plan.mode != "none":
            self.tools = ToolStream(make_tool_parser(tool_parser), plan.known, plan.max_calls)
        self.named = plan is not None and plan.mode == "named"
        self.n_calls = 0

    def feed(self, delta: str) -> dict[str, Any]:
        return self._fields(*(self.reasoning.feed(delta) if self.reasoning else ("", delta)), final=False)

    def finish(self) -> dict[str, Any]:
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        return self._fields(reasoning, content, final=True)

    def whole(self, text: str) -> dict[str, Any]:
        head, tail = self.feed(text), self.finish()
        return {"reasoning_content": head["reasoning_content"] + tail["reasoning_content"],
                "content": head["content"] + tail["content"], "tool_calls": head["tool_calls"] + tail["tool_calls"]}

    def finish_reason(self, reason: Optional[str]) -> Optional[str]:
        """OpenAI's "tool_calls" when the model called a tool (a forced named call stays "stop")."""
        return "tool_calls" if reason == "stop" and self.n_calls and not self.named else reason

    def _fields(self, reasoning: str, content: str, final: bool) -> dict[str, Any]:
        calls: list[ToolCall] = []
        if self.tools is not None:
            parsed = self.tools.feed(content)
            if final:
                rest = self.tools.finish()
                parsed = Parsed(parsed.content + rest.content, parsed.calls + rest.calls)
            content, calls = parsed
        out = [dict(call.openai(), index=self.n_calls + i) for i, call in enumerate(calls)]
        self.n_calls += len(calls)
        return {"reasoning_content": reasoning, "content": content, "tool_calls": out}


def choice_parser_factory(plan: Optional[ToolPlan], req: ChatCompletionRequest, tool_parser: Optional[str],
                          reasoning_parser: Optional[str], thinking: bool) -> Optional[Callable[[], ChoiceParser]]:
    """A parser per choice, or None when the output is plain content (no tools, no reasoning split)."""
    reasoning = reasoning_parser if req.separate_reasoning else None
    if reasoning is None and (plan is None or plan.mode == "none"):
        return None
    return lambda: ChoiceParser(plan, tool_parser, reasoning, thinking)


def message(fields: dict[str, Any], with_reasoning: bool) -> dict[str, Any]:
    """The assistant message of a whole response."""
    content = fields["content"]
    msg: dict[str, Any] = {"role": "assistant", "content": None if fields["tool_calls"] and not content.strip()
                           else content}
    if fields["tool_calls"]:
        msg["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in fields["tool_calls"]]
    if with_reasoning:
        msg["reasoning_content"] = fields["reasoning_content"] or None
    return msg


def delta(fields: dict[str, Any]) -> dict[str, Any]:
    """A stream chunk's delta: only what this step added."""
    out: dict[str, Any] = {}
    if fields["reasoning_content"]:
        out["reasoning_content"] = fields["reasoning_content"]
    if fields["content"]:
        out["content"] = fields["content"]
    if fields["tool_calls"]:
        out["tool_calls"] = fields["tool_calls"]
    return out
