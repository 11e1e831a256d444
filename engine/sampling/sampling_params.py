"""Per-request sampling parameters, validated where they are built (bad values -> 400)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional

_GREEDY_EPS = 1e-6
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: [-100, 100]
MAX_LOGIT_BIAS_ENTRIES = 1024
# structured output: a request sets at most one (structural_tag: xgrammar's, as SGLang's extra)
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")


class SamplingParamsError(ValueError):
    """A sampling value a client sent is out of range; the HTTP layer answers 400."""


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: Optional[int] = None
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    logit_bias: Optional[dict[Any, Any]] = None  # token id (int or its string, as JSON keys are) -> bias
    # structured output (engine/constrained): at most one; json_schema and structural_tag as text
    # (an object is dumped)
    json_schema: Optional[Any] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    structural_tag: Optional[Any] = None

    def __post_init__(self) -> None:
        _check_types(self)  # before anything compares them: a client's "x" or [] is a 400, never a crash
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if 0 <= self.temperature < _GREEDY_EPS:  # temperature 0 means greedy
            self.temperature, self.top_k = 1.0, 1

    def verify(self, vocab_size: int) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise SamplingParamsError(msg)

        _check_types(self)  # again: a caller may have set a field since
        need(self.max_new_tokens >= 0, "max_new_tokens must be an integer >= 0 (0: the prefill only)")
        need(0 <= self.min_new_tokens <= self.max_new_tokens, "min_new_tokens must be in [0, max_new_tokens]")
        need(self.temperature >= 0.0, "temperature must be >= 0")
        need(0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]")
        need(self.top_k == -1 or self.top_k >= 1, "top_k must be -1 (disabled) or >= 1")
        need(0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]")
        need(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty must be in (0, 2]")
        need(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]")
        need(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]")
        need(self.n == 1, "a request samples one sequence: n > 1 is expanded into n requests before this")
        need(all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings")
        need(len(self.stop) <= 16, "at most 16 stop strings")
        need(all(isinstance(t, int) and 0 <= t < vocab_size for t in self.stop_token_ids), "stop_token_ids out of vocabulary")
        if self.top_k != -1:
            self.top_k = min(self.top_k, vocab_size)
        self.logit_bias = _logit_bias(self.logit_bias, vocab_size)
        grammars = [k for k in GRAMMAR_KINDS if getattr(self, k) is not None]
        need(len(grammars) <= 1, f"at most one of {', '.join(GRAMMAR_KINDS)}; got {', '.join(grammars)}")
        for kind in ("json_schema", "structural_tag"):
            value = getattr(self, kind)
            if value is not None and not isinstance(value, str):
                need(isinstance(value, dict), f"{kind} must be a JSON object or its text")
                setattr(self, kind, json.dumps(value))
        need(all(isinstance(getattr(self, k), (str, type(None))) for k in ("regex", "ebnf")),
             "regex and ebnf must be strings")

    @property
    def is_greedy(self) -> bool:
        return self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


_INTS = ("max_new_tokens", "min_new_tokens", "top_k", "n")
_NUMBERS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
_BOOLS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")
SEED_RANGE = (-(1 << 63), 1 << 64)  # what a torch generator takes (vLLM's range)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _shown(v: Any) -> str:
    """A client's value in an error message, cut short (a body may be megabytes)."""
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_types(p: SamplingParams) -> None:
    """Each field has its type (JSON's: an integer is not 1.0 or true, a number is finite), so the range
    checks, the scheduler and the samplers never meet a value of another type."""
    for name in _INTS:
        if not _is_int(getattr(p, name)):
            raise SamplingParamsError(f"{name} must be an integer, got {_shown(getattr(p, name))}")
    for name in _NUMBERS:
        v = getattr(p, name)
        if not (_is_int(v) or isinstance(v, float)) or not math.isfinite(v):
            raise SamplingParamsError(f"{name} must be a finite number, got {_shown(v)}")
    for name in _BOOLS:
        if not isinstance(getattr(p, name), bool):
            raise SamplingParamsError(f"{name} must be true or false, got {_shown(getattr(p, name))}")
    if p.seed is not None and not (_is_int(p.seed) and SEED_RANGE[0] <= p.seed < SEED_RANGE[1]):
        raise SamplingParamsError(f"seed must be an integer in [-2^63, 2^64), got {_shown(p.seed)}")
    if p.stop is not None and not isinstance(p.stop, (str, list, tuple)):
        raise SamplingParamsError(f"stop must be a string or a list of strings, got {_shown(p.stop)}")
    if p.stop_token_ids is not None and not (isinstance(p.stop_token_ids, (list, tuple))
                                             and all(_is_int(t) for t in p.stop_token_ids)):
        raise SamplingParamsError(f"stop_token_ids must be a list of token ids, got {_shown(p.stop_token_ids)}")


def _logit_bias(value: Any, vocab_size: int) -> Optional[dict[int, float]]:
    """OpenAI's `logit_bias` ({"token id": bias}) as {int: float}; None when empty."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise SamplingParamsError("logit_bias must map token ids to numbers")
    bias: dict[int, float] = {}
    for key, v in value.items():
        try:
            tid = int(key)
        except (TypeError, ValueError):
            raise SamplingParamsError(f"logit_bias key {_shown(key)} is not a token id") from None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise SamplingParamsError(f"logit_bias value for token {key} must be a number")
        if not 0 <= tid < vocab_size:
            raise SamplingParamsError(f"logit_bias token id {tid} is out of vocabulary (size {vocab_size})")
        if not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:  # NaN fails this too
            raise SamplingParamsError(f"logit_bias values must be in [-100, 100], got {v} for token {tid}")
        bias[tid] = float(v)
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise SamplingParamsError(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES}")
    return bias or None
