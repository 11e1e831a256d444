"""The tool-call parser contract (ToolParser) and its streaming driver (ToolStream).

What a model writes besides its answer is parsed out of the generated text: tool calls (each model
family has its own text format) and reasoning (a `<think>` block). Both run in the HTTP process on
the detokenized text, never in the scheduler.

Contract of a tool-call format (`ToolParser`):
- `markers` begin a block of tool-call text; with `anywhere` False a block is only recognised at
  the start of the output (after whitespace), e.g. Llama 3's bare JSON.
- `block_end(text)` (text starts at a marker): the length of the first whole block, or None while
  it is not complete; a format whose block runs to the end of the output always answers None.
- `parse_block(block)`: the calls a whole block holds, or None when it is not valid tool-call text
  (the block is then the model's content, as SGLang and vLLM return it).

`ToolStream` drives any format over deltas. Streaming and one-shot parsing are the same code (one
feed, then finish), so a stream's content and calls always add up to the whole answer's.
"""
from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def call_from(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> Optional[ToolCall]:
    """{"name": ..., "arguments": {...}} (or "parameters", Llama's key) -> ToolCall; None if not one.
    Arguments given as JSON text are accepted when the text is a JSON object."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolParser(ABC):
    markers: tuple[str, ...] = ()
    anywhere: bool = True
    # False where a marker is a special token that detokenization would otherwise drop
    skip_special_tokens: bool = True

    @abstractmethod
    def block_end(self, text: str) -> Optional[int]:
        ...

    @abstractmethod
    def parse_block(self, block: str) -> Optional[list[ToolCall]]:
        ...


class Parsed(NamedTuple):
    content: str
    calls: list[ToolCall]


class ToolStream:
    """One choice's tool-call parsing over text deltas. `known` (the request's tool names) rejects a
    call of an unknown function: its block stays content. `max_calls` 1 keeps only the first call
    (parallel_tool_calls false)."""

    def __init__(self, parser: ToolParser, known: Callable[[str], bool], max_calls: Optional[int] = None) -> None:
        self.parser, self.known, self.max_calls = parser, known, max_calls
        self.buf, self.in_block, self.seen_text, self.n_calls = "", False, False, 0

    def feed(self, delta: str) -> Parsed:
        self.buf += delta
        content, calls = [], []
        while True:
            if not self.in_block:
                start = self._find_start()
                if start < 0:
                    keep = self._hold_back()
                    self._emit(content, self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    return Parsed("".join(content), calls)
                self._emit(content, self.buf[:start])
                self.buf, self.in_block = self.buf[start:], True
            end = self.parser.block_end(self.buf)
            if end is None:
                return Parsed("".join(content), calls)
            block, self.buf, self.in_block = self.buf[:end], self.buf[end:], False
            self._take(block, content, calls)

    def finish(self) -> Parsed:
        """The end of the output: a block still open is parsed as it stands."""
        content, calls = [], []
        if self.in_block:
            self._take(self.buf, content, calls)
        else:
            self._emit(content, self.buf)
        self.buf, self.in_block = "", False
        return Parsed("".join(content), calls)

    def _take(self, block: str, content: list[str], calls: list[ToolCall]) -> None:
        parsed = self.parser.parse_block(block)
        if parsed is None or not parsed or not all(self.known(c.name) for c in parsed):
            self._emit(content, block)
            return
        for call in parsed:
            if self.max_calls is None or self.n_calls < self.max_calls:
                calls.append(call)
                self.n_calls += 1

    def _emit(self, content: list[str], text: str) -> None:
        if text:
            content.append(text)
            self.seen_text = self.seen_text or bool(text.strip())

    def _find_start(self) -> int:
        if self.parser.anywhere:
            hits = [i for i in (self.buf.find(m) for m in self.parser.markers) if i >= 0]
            return min(hits, default=-1)
        if self.seen_text:
            return -1
        body = self.buf.lstrip()  # leading whitespace goes with the block
        return 0 if any(body.startswith(m) for m in self.parser.markers) else -1

    def _hold_back(self) -> int:
        """How much of the buffer's end might still become a marker (kept until the next delta)."""
        if not self.parser.anywhere:
            body = self.buf.lstrip()
            maybe = not self.seen_text and any(m.startswith(body) for m in self.parser.markers)
            return len(self.buf) if maybe else 0
        return max(partial_marker(self.buf, m) for m in self.parser.markers)


def partial_marker(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `marker` (0 if none): text
    held back while streaming, since the next delta may complete the marker."""
    return next((k for k in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:k])), 0)


def parse_whole(parser: ToolParser, text: str, known: Callable[[str], bool],
                max_calls: Optional[int] = None) -> Parsed:
    stream = ToolStream(parser, known, max_calls)
    head, tail = stream.feed(text), stream.finish()
    return Parsed(head.content + tail.content, head.calls + tail.calls)
