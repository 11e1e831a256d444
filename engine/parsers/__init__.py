"""Tool-call and reasoning parsers (names as SGLang's --tool-call-parser / --reasoning-parser)."""
from __future__ import annotations

from baton.engine.parsers.base import ToolParser

TOOL_PARSERS = ("qwen25", "qwen", "hermes", "llama3", "mistral", "pythonic")
REASONING_PARSERS = ("qwen3", "deepseek-r1")


def make_tool_parser(name: str) -> ToolParser:
    from baton.engine.parsers import formats

    classes = {"qwen25": formats.HermesParser, "qwen": formats.HermesParser, "hermes": formats.HermesParser,
               "llama3": formats.Llama3Parser, "mistral": formats.MistralParser,
               "pythonic": formats.PythonicParser}
    if name not in classes:
        raise ValueError(f"unknown tool-call parser {name!r}; one of {TOOL_PARSERS}")
    return classes[name]()


def reasoning_forced(name: str) -> bool:
    """Whether the output starts inside the reasoning block whatever the request asks (the
    template always opens it)."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; one of {REASONING_PARSERS}")
    return name == "deepseek-r1"
