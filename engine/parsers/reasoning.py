"""Reasoning text (`<think> ... </think>`) split from the answer, as SGLang's --reasoning-parser.


- `qwen3`: with thinking on (the template's default) the output is reasoning until `</think>`, as
  with `deepseek-r1`; with `enable_thinking` false, only a block the output itself opens;
- `deepseek-r1`: the chat template already opened the block, so the output is reasoning until
  `</think>` whatever the request says.
In both, a leading `<think>` is dropped, and an output that never closes the block is all reasoning
(entrypoints/chat_tools.reasons decides, per request).

Whitespace between `</think>` and the answer is dropped.
"""
from __future__ import annotations

from typing import NamedTuple

from baton.engine.parsers.base import partial_marker

THINK_START, THINK_END = "<think>", "</think>"


class Split(NamedTuple):
    reasoning: str
    content: str


class ReasoningStream:
    """One choice's split over text deltas (a whole answer: one feed, then finish)."""

    def __init__(self, forced: bool) -> None:
        self.state = "open" if forced else "detect"  # detect -> open/content; open -> content
        self.lead = True  # a leading <think> may still come (dropped)
        self.strip_next = False  # whitespace right after </think>
        self.buf = ""

    def feed(self, delta: str) -> Split:
        self.buf += delta
        reasoning, content = "", ""
        while True:
            if self.lead:
                body = self.buf.lstrip()
                if THINK_START.startswith(body) and len(body) < len(THINK_START):
                    return Split(reasoning, content)  # could still become <think>
                self.lead = False
                if body.startswith(THINK_START):
                    self.buf, self.state = body[len(THINK_START):], "open"
                elif self.state == "detect":
                    self.state = "content"
            if self.state == "open":
                i = self.buf.find(THINK_END)
                if i < 0:
                    keep = partial_marker(self.buf, THINK_END)
                    reasoning += self.buf[:len(self.buf) - keep]
                    self.buf = self.buf[len(self.buf) - keep:]
                    return Split(reasoning, content)
                reasoning += self.buf[:i]
                self.buf, self.state, self.strip_next = self.buf[i + len(THINK_END):], "content", True
            if self.strip_next:
                self.buf = self.buf.lstrip()
                if not self.buf:
                    return Split(reasoning, content)
                self.strip_next = False
            content += self.buf
            self.buf = ""
            return Split(reasoning, content)

    def finish(self) -> Split:
        rest, self.buf = self.buf, ""
        if self.state == "open":
            return Split(rest, "")
        if self.lead and self.state == "detect":  # the whole output is a prefix of <think>
            return Split("", rest)
        return Split("", "" if self.strip_next else rest)
