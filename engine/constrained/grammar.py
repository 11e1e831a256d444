"""Structured output: a request's grammar (a JSON schema, a regex or an EBNF grammar), compiled by
xgrammar into a token-level matcher, as SGLang's default grammar backend does.

Per request, a `Grammar` holds the matcher and a one-row token bitmask. Before a batch that holds
such a request is launched, the scheduler fills the row from the matcher's state (which tokens may
come next); the sampler sets every other token's logit to -inf; after the step, the scheduler feeds
the sampled token to the matcher. A grammar that has reached its end accepts only a stop token, and
a matcher that accepts the stop token ends the request.

Compilation runs on a background thread, as SGLang's: the request waits in the scheduler's grammar
queue (scheduler/grammar_queue.py) while the batches already running go on. xgrammar releases the
GIL while it compiles (9-20 ms for a JSON schema, ~120 ms for a regex over a 50k vocabulary on this
VM). Compiled grammars are kept per (kind, text), so a repeated grammar costs only its matcher; the
tokenizer's preprocessing for xgrammar runs on the same thread when the backend is made.
"""
from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Optional

from baton.engine.sampling.sampling_params import GRAMMAR_KINDS

if TYPE_CHECKING:
    import torch


class GrammarError(ValueError):
    """A grammar the client sent cannot be compiled (400)."""


class Grammar:
    """One request's matcher and its bitmask row ([1, ceil(vocab / 32)] int32, a set bit = allowed).

    `reasoning_end` (a token id): the output starts with reasoning, which the grammar does not
    constrain; it applies from the token after that one (SGLang's reasoner grammar)."""

    def __init__(self, matcher: Any, bitmask: torch.Tensor, reasoning_end: Optional[int] = None) -> None:
        self.matcher = matcher
        self.bitmask = bitmask
        self.reasoning_end = reasoning_end

    @property
    def active(self) -> bool:
        return self.reasoning_end is None

    def note_reasoning_token(self, token_id: int) -> None:
        if token_id == self.reasoning_end:
            self.reasoning_end = None

    def fill(self) -> None:
        self.matcher.fill_next_token_bitmask(self.bitmask, 0)

    def accept(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()


class GrammarBackend:
    """Compiles grammars for one tokenizer and model vocabulary, on one background thread."""

    CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped)

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], any_whitespace: bool = True) -> None:
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, sorted(stop_token_ids)
        self.any_whitespace = any_whitespace
        self._compiler: Any = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._compiled: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._prepared = self._pool.submit(self._get_compiler)  # the tokenizer's preprocessing, before any request

    def wait_prepared(self, timeout_s: float = 300.0) -> None:
        """Until the background preparation (importing xgrammar, indexing the vocabulary) is over.
        It holds the GIL for much of its time (0.45 s for a 49k vocabulary on a 2-core VM): a
        scheduler that served meanwhile ran its first decode steps up to 5x slower. A failure is
        left for the first structured request to report."""
        try:
            self._prepared.result(timeout=timeout_s)
        except Exception:  # noqa: BLE001 - surfaces again, as a request's error, in _compile
            pass

    def submit(self, kind: str, spec: str) -> Future:
        """A future of the compiled grammar (GrammarError for a bad one); done already when cached."""
        key = (kind, spec)
        future = self._compiled.get(key)
        if future is None:
            future = self._compiled[key] = self._pool.submit(self._compile, kind, spec)
            if len(self._compiled) > self.CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return future

    def grammar(self, compiled: Any, reasoning_end: Optional[int] = None) -> Grammar:
        """A request's own matcher over a compiled grammar (cheap; on the scheduler thread)."""
        import xgrammar as xgr

        return Grammar(xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, self.vocab_size), reasoning_end)

    def compile_now(self, kind: str, spec: str) -> Grammar:
        """Compile and wait (tests and tools; the scheduler goes through submit)."""
        return self.grammar(self.submit(kind, spec).result())

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, kind: str, spec: str) -> Any:
        compiler = self._get_compiler()
        try:
            if kind == "json_schema":
                return compiler.compile_json_schema(spec, any_whitespace=self.any_whitespace)
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "ebnf":
                return compiler.compile_grammar(spec)
            if kind == "structural_tag":
                return compiler.compile_structural_tag(spec)
        except Exception as e:  # noqa: BLE001 - xgrammar reports bad grammars as RuntimeError and others
            raise GrammarError(f"invalid {kind}: {_first_line(e)}") from None
        raise GrammarError(f"unknown grammar kind {kind!r}")

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        return self._compiler


def grammar_spec(params: Any) -> Optional[tuple[str, str]]:
    """(kind, text) of the one grammar field a request sets, or None."""
    for kind in GRAMMAR_KINDS:
        value = getattr(params, kind, None)
        if value is not None:
            return kind, value
    return None


def apply_bitmasks(logits: torch.Tensor, rows: list[int], grammars: list[Grammar]) -> None:
    """Disallowed tokens of each grammar row to -inf, in place (`logits`: [bs, vocab] float32)."""
    import xgrammar as xgr

    for row, grammar in zip(rows, grammars):
        xgr.apply_token_bitmask_inplace(logits[row:row + 1], grammar.bitmask.to(logits.device, non_blocking=True))


def _first_line(e: Exception) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300]
