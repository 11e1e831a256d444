"""Between the client and a worker: errors as the client sees them, body injection, the control-plane
HTTP client, and relaying a worker's response (whole, or streamed through chunk by chunk)."""
from __future__ import annotations

import asyncio
from typing import Any, Callable, NamedTuple

import aiohttp
import orjson
from aiohttp import web

from baton.router.retry import is_retryable_status
from baton.router.upstream import UpstreamResponse

JSON = "application/json"
FORWARDED_HEADERS = ("authorization", "x-request-id", "traceparent", "tracestate")
TRANSPORT_ERRORS = (OSError, aiohttp.ClientError, asyncio.TimeoutError)  # UpstreamError is an OSError


class ClientGone(Exception):
    """The client closed its connection while we were writing to it."""


class Failure(NamedTuple):
    """An attempt that failed before anything was sent to the client."""

    status: int
    body: bytes
    content_type: str
    retryable: bool
    reason: str  # metrics label: "status_503", "transport", ...


def error_body(message: str, status: int, kind: str = "router_error") -> bytes:
    return orjson.dumps({"error": {"message": message, "type": kind, "code": status}})


def error_response(status: int, message: str) -> web.Response:
    """The router's own error answer: the client's fault below 500 (invalid_request_error), else the router's."""
    kind = "invalid_request_error" if status < 500 else "router_error"
    return web.Response(status=status, body=error_body(message, status, kind), headers={"Content-Type": JSON})


def transport_failure(url: str, exc: BaseException) -> Failure:
    message = f"worker {url} failed: {type(exc).__name__}: {exc}"
    return Failure(502, error_body(message, 502), JSON, True, "transport")


DRAINING = "draining"  # an engine's error type when it refuses work because it is leaving service
WORKER_AUTH = "worker_auth"  # a worker refused the router's credentials: the router's configuration, not the worker
ABORTED = "aborted"  # a PD prefill answered its request aborted (told to: a pause, an update): its KV never comes


async def status_failure(url: str, resp: UpstreamResponse) -> Failure:
    body = await resp.read()
    if resp.status == 401:  # passed on as is, the client would take it for a refusal of its own key
        message = (f"worker {url} refused the router's credentials (401: {_error_message(body)}); give the router "
                   "the engines' API key: --engine-api-key or $BATON_ENGINE_API_KEY")
        return Failure(502, error_body(message, 502), JSON, False, WORKER_AUTH)
    reason = DRAINING if resp.status == 503 and _error_type(body) == DRAINING else f"status_{resp.status}"
    return Failure(resp.status, body, resp.content_type, is_retryable_status(resp.status), reason)


def _error(body: bytes) -> dict[str, Any]:
    try:
        error = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return {}
    return error if isinstance(error, dict) else {}


def _error_type(body: bytes) -> str | None:
    return _error(body).get("type")


def _error_message(body: bytes) -> str:
    return str(_error(body).get("message") or body[:200].decode(errors="replace"))


def stream_refusal(body: bytes) -> Failure | None:
    """The failure inside a whole streamed answer: an engine sends a stream's headers at once, so a
    refusal by its scheduler (a full queue, a failed KV handshake) comes as an error event in a 200
    stream. None when the stream holds no error event."""
    for line in body.split(b"\n"):
        if line.startswith(b'data: {"error"'):
            try:
                error = orjson.loads(line[len(b"data: "):])["error"]
                status = int(error.get("code") or 500) if isinstance(error, dict) else 500
            except (orjson.JSONDecodeError, TypeError, ValueError):
                error, status = {"message": line.decode(errors="replace")}, 500
            status = status if 400 <= status <= 599 else 500
            return Failure(status, orjson.dumps({"error": error}), JSON, is_retryable_status(status), f"status_{status}")
    return None


def inject(raw: bytes, body: dict[str, Any], fields: dict[str, Any]) -> bytes:
    """`raw` with `fields` added. Splices the bytes (no re-serialization of a long prompt) unless a
    field is already in the body, in which case ours replace the client's."""
    if any(k in body for k in fields):
        return orjson.dumps({**body, **fields})
    end = raw.rindex(b"}")
    extra = orjson.dumps(fields)[1:-1]
    return raw[:end] + (b"," if body else b"") + extra + b"}"


def new_client(engine_api_key: str | None = None, connect_timeout: float = 10.0) -> aiohttp.ClientSession:
    """The control-plane client (health, info, aborts; inference with --upstream-client aiohttp). With the
    engines' key, every call it makes carries it."""
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=60)
    return aiohttp.ClientSession(
        connector=connector, cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout),
        skip_auto_headers=("User-Agent",), headers=_engine_auth(engine_api_key),
    )


def forward_headers(request: web.BaseRequest, engine_api_key: str | None = None) -> dict[str, str]:
    """The client's headers a worker gets. With the engines' key the router's own credentials replace the
    client's: a client key never reaches an engine, and the engines' key never depends on a client."""
    headers = {}
    for name in FORWARDED_HEADERS:
        value = request.headers.get(name)
        # printable ASCII only: other bytes (kept by aiohttp as surrogates) are no id or key a worker reads
        if value is not None and value.isascii() and value.isprintable():
            headers[name] = value
    return {**headers, **_engine_auth(engine_api_key)}


def _engine_auth(engine_api_key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {engine_api_key}"} if engine_api_key else {}


async def respond_whole(resp: UpstreamResponse, transform: Callable[[bytes], bytes] | None = None) -> web.Response:
    body = await resp.read()
    if transform is not None:
        body = transform(body)
    return web.Response(body=body, status=resp.status, headers={"Content-Type": resp.content_type})


async def start_stream(request: web.BaseRequest, resp: UpstreamResponse) -> web.StreamResponse:
    out = web.StreamResponse(status=resp.status, headers={
        "Content-Type": resp.content_type, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    await out.prepare(request)
    return out


async def pump(out: web.StreamResponse, resp: UpstreamResponse, on_first_event: Callable[[], None],
               transform: Callable[[bytes], bytes] | None = None) -> None:
    """Pass the worker's SSE stream through as it arrives. `on_first_event` runs before the first
    event (not an SSE comment such as a keep-alive) is written. With `transform`, events are cut at
    the blank line that ends each one and rewritten one by one (used for the logprob merge)."""
    waiting: FirstEvent | None = FirstEvent()
    pending = b""
    async for chunk in resp.chunks():
        if transform is not None:
            pending += chunk
            cut = pending.rfind(b"\n\n") + 2
            if cut < 2:
                continue
            events = pending[:cut].split(b"\n\n")[:-1]
            chunk, pending = b"".join(transform(e + b"\n\n") for e in events), pending[cut:]
        if waiting is not None and waiting.found_in(chunk):
            waiting = None
            on_first_event()
        await _write(out, chunk)
    if pending:
        await _write(out, pending)
    await out.write_eof()


class FirstEvent:
    """Finds the first line of an SSE stream that is not a comment (`:` first), in chunks cut anywhere."""

    __slots__ = ("_line_start",)

    def __init__(self) -> None:
        self._line_start = True

    def found_in(self, chunk: bytes) -> bool:
        i, n = 0, len(chunk)
        while i < n:
            if self._line_start:
                c = chunk[i]
                if c == 10 or c == 13:  # an empty line
                    i += 1
                    continue
                if c != 58:  # not ':'
                    return True
                self._line_start = False
            end = chunk.find(b"\n", i)
            if end < 0:
                return False
            self._line_start, i = True, end + 1
        return False


async def _write(out: web.StreamResponse, data: bytes) -> None:
    try:
        await out.write(data)
    except ConnectionError as exc:  # the client's side; worker-side errors are raised by chunks()
        raise ClientGone(str(exc)) from exc


async def end_stream_with_error(out: web.StreamResponse, message: str, status: int) -> None:
    """A stream already started cannot change its status: end it with an SSE error event."""
    await end_stream_with(out, error_body(message, status))


async def end_stream_with(out: web.StreamResponse, error: bytes) -> None:
    """End a started stream with `data: <error>` (a JSON error object) and `data: [DONE]`."""
    try:
        await out.write(b"data: " + error + b"\n\ndata: [DONE]\n\n")
        await out.write_eof()
    except (ConnectionError, RuntimeError):
        pass


def as_error_object(failure: Failure) -> bytes:
    """The failure as one JSON error object: the body itself when it is one (ours, or an engine's
    {"error": ...}), else the body wrapped as the message."""
    try:
        obj = orjson.loads(failure.body)
    except orjson.JSONDecodeError:
        obj = None
    if isinstance(obj, dict) and "error" in obj:
        return orjson.dumps(obj)  # one line: an SSE data field must not span lines
    return error_body(failure.body.decode(errors="replace"), failure.status)
