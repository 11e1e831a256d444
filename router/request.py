"""Parse and check one inference request: 400 with a message for bad input, never an exception
that escapes. Also extracts what routing needs: stream flag, batch size, routing text, session."""
from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from aiohttp import web


class Route(str, enum.Enum):
    GENERATE = "/generate"
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"
    # embeddings: one prefill per input, no decode (colocated workers only)
    EMBEDDINGS = "/v1/embeddings"
    ENCODE = "/encode"
    CLASSIFY = "/classify"

    @property
    def embeds(self) -> bool:
        return self in _EMBEDDING_ROUTES


class BadRequest(ValueError):
    """The client's fault: answered with 400 and this message."""


class BodyTimeout(Exception):
    """The client did not send its whole body in time: answered with 408."""


async def read_body(request: "web.Request", timeout: float) -> bytes:
    """The request's body, all of it within `timeout` seconds (0: no limit), else BodyTimeout: a client
    that stalls mid-body would hold its connection and handler for good. Past the app's
    client_max_size aiohttp raises HTTPRequestEntityTooLarge as the body arrives."""
    try:
        async with asyncio.timeout(timeout or None):
            return await request.read()
    except TimeoutError:
        raise BodyTimeout(f"request body not received within {timeout:g} s") from None


def parse_object(raw: bytes) -> dict[str, Any]:
    """A control route's body: a JSON object, {} when empty; BadRequest for anything else."""
    try:
        body = orjson.loads(raw) if raw.strip() else {}
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


@dataclass(slots=True)
class ParsedRequest:
    route: Route
    raw: bytes  # the body as received: forwarded unchanged when nothing is injected
    body: dict[str, Any]
    stream: bool
    batch_size: int | None  # None: one request; n: a batch (bootstrap fields become arrays)
    # the answer carries the prompt's logprobs, which only a PD prefill computes: /generate's
    # return_logprob, or a whole completion's echo with logprobs (a stream does not echo)
    return_logprob: bool
    session_id: str | None = None  # the session its session_params continue: pinned to one worker
    path: str = ""  # route.value, kept as a plain string for the hot path (set in __post_init__)

    def __post_init__(self) -> None:
        self.path = self.route.value


def parse_request(route: Route, raw: bytes) -> ParsedRequest:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        stream = _optional(body, "stream", bool, False)
    for key in _TYPED.intersection(body):
        _check_typed(body, key)
    batch_size = _CHECKS[route](body)
    session = _session_id(body.get("session_params")) if route is Route.GENERATE else None
    return ParsedRequest(route, raw, body, stream, batch_size, _returns_prompt_logprobs(route, body, stream), session)


def routing_text(req: ParsedRequest) -> str:
    """The text the cache-aware policy keys on (the first item of a batch). Token ids map to
    characters one to one, so the prefix tree works on them unchanged."""
    body = req.body
    if req.route is Route.CHAT:
        return "".join(_message_text(m) for m in body["messages"])
    key = _PROMPT_KEYS.get(req.route)
    value = body.get(key) if key else body.get("text", body.get("input_ids"))
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(chr(t) for t in value if isinstance(t, int) and 0 <= t < 0x110000)
    return ""


def _check_chat(body: dict) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' is required and must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise BadRequest(f"messages[{i}].content must be a string, a list of parts or null")
    return None


def _check_completions(body: dict) -> int | None:
    if "prompt" not in body:
        raise BadRequest("'prompt' is required")
    return _batch_of(body["prompt"], "prompt")


def _check_generate(body: dict) -> int | None:
    present = [k for k in ("text", "input_ids", "input_embeds") if body.get(k) is not None]
    if not present:
        raise BadRequest("one of 'text', 'input_ids' or 'input_embeds' is required")
    if len(present) > 1:
        raise BadRequest(f"give only one of {present}")
    params = body.get("sampling_params")
    if params is not None and not isinstance(params, (dict, list)):
        raise BadRequest("'sampling_params' must be an object (or a list of objects for a batch)")
    if present[0] == "input_embeds":
        return None
    return _batch_of(body[present[0]], present[0])


def _check_embeddings(body: dict) -> int | None:
    if "input" not in body:
        raise BadRequest("'input' is required")
    return _batch_of(body["input"], "input")


def _check_encode(body: dict) -> int | None:
    present = [k for k in ("text", "input_ids") if body.get(k) is not None]
    if len(present) != 1:
        raise BadRequest("give one of 'text' or 'input_ids'")
    return _batch_of(body[present[0]], present[0])


def _session_id(params: Any) -> str | None:
    """The session a /generate continues (its session_params' id; a batch's must all name the same one,
    since one worker holds a session), or None."""
    items = params if isinstance(params, list) else [params]
    ids = {p.get("id") for p in items if isinstance(p, dict)} - {None}
    if not ids:
        return None
    if len(ids) > 1 or not all(isinstance(i, str) for i in ids):
        raise BadRequest("through the router, session_params name one session (a string 'id') per request")
    return ids.pop()


def _batch_of(value: Any, name: str) -> int | None:
    """str / [int]: one request; [str] / [[int]]: a batch of len(value)."""
    if isinstance(value, str):
        return None
    if not isinstance(value, list) or not value:
        raise BadRequest(f"'{name}' must be a string, a list of token ids or a non-empty list of those")
    first = value[0]
    if isinstance(first, int) and not isinstance(first, bool):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise BadRequest(f"'{name}' mixes token ids with other values")
        return None
    if all(isinstance(v, str) for v in value):
        return len(value)
    if all(isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v) for v in value):
        return len(value)
    raise BadRequest(f"'{name}' must be a string, a list of strings, token ids or lists of token ids")


_INT_KEYS = ("max_tokens", "max_completion_tokens", "n")
_TYPED = frozenset(("model", "temperature") + _INT_KEYS)


def _check_typed(body: dict, key: str) -> None:
    """Type checks of common optional fields, only for the fields present."""
    if key == "model":
        _optional(body, key, str, None)
    elif key == "temperature":
        value = body[key]
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise BadRequest("'temperature' must be a number")
    else:
        value = _optional(body, key, int, None)
        if value is not None and value < 0:
            raise BadRequest(f"'{key}' must be >= 0")


_CHECKS = {Route.CHAT: _check_chat, Route.COMPLETIONS: _check_completions, Route.GENERATE: _check_generate,
           Route.EMBEDDINGS: _check_embeddings, Route.ENCODE: _check_encode, Route.CLASSIFY: _check_encode}
_EMBEDDING_ROUTES = frozenset({Route.EMBEDDINGS, Route.ENCODE, Route.CLASSIFY})
_PROMPT_KEYS = {Route.COMPLETIONS: "prompt", Route.EMBEDDINGS: "input"}


def _optional(body: dict, key: str, kind: type, default: Any) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise BadRequest(f"'{key}' must be of type {kind.__name__}")
    return value


def _returns_prompt_logprobs(route: Route, body: dict, stream: bool) -> bool:
    if route is Route.GENERATE:
        return _truthy(body.get("return_logprob"))
    return route is Route.COMPLETIONS and not stream and bool(body.get("echo")) and body.get("logprobs") is not None


def _truthy(value: Any) -> bool:
    return any(bool(v) for v in value) if isinstance(value, list) else bool(value)


def _message_text(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""
