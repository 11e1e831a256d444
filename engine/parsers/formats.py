"""The tool-call text formats of the model families we serve (Qwen/Hermes, Llama 3, Mistral, pythonic).

Names as SGLang's --tool-call-parser:

- `qwen25` (aliases `hermes`, `qwen`): Qwen2.5 / Qwen3 and Hermes templates,
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call, anywhere.
- `llama3`: Llama 3.1-3.3 JSON, `{"name": ..., "parameters": {...}}` at the start of the output,
  optionally after `<|python_tag|>`, several separated by `;`.
- `mistral`: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` to the end of the output.
- `pythonic`: Llama 4 / Llama 3.2 style `[get_weather(city="Paris"), ...]` at the start of the
  output; arguments must be Python literals.
"""
from __future__ import annotations

import ast
import json
from typing import Any, Optional

from baton.engine.parsers.base import ToolCall, ToolParser, call_from


def _json_values(text: str, sep: str = "") -> Optional[list[Any]]:
    """Consecutive JSON values in `text` (optionally separated by `sep`); None unless all of it parses."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or (sep and text[i] == sep)):
            i += 1
        if i == len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)


def _calls(objs: Optional[list[Any]]) -> Optional[list[ToolCall]]:
    if not objs:
        return None
    calls = [call_from(o) for o in objs]
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


class HermesParser(ToolParser):
    markers = ("<tool_call>",)
    end = "</tool_call>"

    def block_end(self, text: str) -> Optional[int]:
        i = text.find(self.end)
        return None if i < 0 else i + len(self.end)

    def parse_block(self, block: str) -> Optional[list[ToolCall]]:
        inner = block[len(self.markers[0]):]
        inner = inner[:-len(self.end)] if inner.endswith(self.end) else inner
        return _calls(_json_values(inner))


class Llama3Parser(ToolParser):
    markers = ("<|python_tag|>", "{")
    anywhere = False
    skip_special_tokens = False  # <|python_tag|> is a special token

    def block_end(self, text: str) -> Optional[int]:
        return None

    def parse_block(self, block: str) -> Optional[list[ToolCall]]:
        body = block.strip()
        body = body[len("<|python_tag|>"):] if body.startswith("<|python_tag|>") else body
        return _calls(_json_values(body, sep=";"))


class MistralParser(ToolParser):
    markers = ("[TOOL_CALLS]",)
    skip_special_tokens = False  # [TOOL_CALLS] is a special token

    def block_end(self, text: str) -> Optional[int]:
        return None

    def parse_block(self, block: str) -> Optional[list[ToolCall]]:
        values = _json_values(block[len(self.markers[0]):])
        if not values:
            return None
        flat = [o for v in values for o in (v if isinstance(v, list) else [v])]
        return _calls(flat)


class PythonicParser(ToolParser):
    markers = ("[",)
    anywhere = False

    def block_end(self, text: str) -> Optional[int]:
        return None

    def parse_block(self, block: str) -> Optional[list[ToolCall]]:
        try:
            tree = ast.parse(block.strip(), mode="eval").body
        except SyntaxError:
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args):
                return None
            try:
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
            except ValueError:
                return None
            if len(args) != len(node.keywords):
                return None
            calls.append(ToolCall(node.func.id, json.dumps(args, ensure_ascii=False)))
        return calls
