"""Tool-call and reasoning parsers (names as SGLang's --tool-call-parser / --reasoning-parser)."""
from __future__ import annotations

from typing import Optional

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


# What a chat template writes when it shows the model its tools, per tool-call format (checked in
# this order): Qwen2.5/Qwen3 and Hermes wrap calls in <tool_call>; Llama 3.1-3.3 ask for
# {"name", "parameters"} JSON (3.1 also has <|python_tag|>); Mistral's [TOOL_CALLS]; Llama 3.2/4's
# pythonic list.
_TEMPLATE_MARKERS = (("qwen25", ("<tool_call>",)),
                     ("llama3", ("<|python_tag|>", '"parameters": dictionary of argument name')),
                     ("mistral", ("[TOOL_CALLS]",)),
                     ("pythonic", ("[func_name1(",)))
# the families whose parser is picked from the template when --tool-call-parser is not given
AUTO_TOOL_PARSERS = ("qwen25", "llama3")


def template_tool_parser(chat_template: Optional[str]) -> Optional[str]:
    """The tool-call parser whose format the chat template writes, or None (no template, or no
    format known here)."""
    if not isinstance(chat_template, str):  # a tokenizer may keep several templates in a dict
        chat_template = "\n".join(chat_template.values()) if isinstance(chat_template, dict) else ""
    return next((name for name, markers in _TEMPLATE_MARKERS if any(m in chat_template for m in markers)), None)


# The tool-call formats xgrammar can constrain natively (its builtin structural tags): a call in the
# model's own format whose arguments follow the tool's schema.
_STRUCTURAL_TAG_MODELS = {"qwen25": "qwen_3", "qwen": "qwen_3", "hermes": "qwen_3"}


def structural_tag_model(name: Optional[str]) -> Optional[str]:
    """xgrammar's model key for a tool-call parser, or None (no native constraint for its format)."""
    return _STRUCTURAL_TAG_MODELS.get(name) if name else None


def reasoning_forced(name: str) -> bool:
    """Whether the output starts inside the reasoning block whatever the request asks (the
    template always opens it)."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; one of {REASONING_PARSERS}")
    return name == "deepseek-r1"
