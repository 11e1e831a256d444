"""The prefill/decode flow (ARCHITECTURE.md, "The PD wire protocol").

Pick a pair, add bootstrap_host/port/room to the body, POST it to both at once, hand the decode's
response to the client (streams pass through unbuffered), with the prompt's logprobs, which only
the prefill computes, merged into it: on /generate the prefill's input logprobs in front of the
decode's, on a completion with echo the prefill's over the decode's null ones. If either side
fails, the other is aborted and the client gets the failing side's error (or a retry on a new pair
with a new room). A prefill that answers its request aborted (finish_reason abort: a pause in abort
mode, a weight update with abort_all_requests) has failed too: its KV never reaches the decode.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import random
from typing import Any, Callable, NamedTuple

import orjson
from aiohttp import web

from baton.router.config import WorkerRole
from baton.router.dispatch import Abandon, AttemptGuard, Dispatcher, NoWorkers, RequestContext
from baton.router.forward import ABORTED, JSON, Failure, error_body, inject, stream_refusal
from baton.router.request import Route
from baton.router.upstream import UpstreamResponse
from baton.router.worker import Target, Worker

logger = logging.getLogger(__name__)

ROOM_LIMIT = 2**63
PREFILL_GRACE_SECS = 1.0  # how long a finished decode waits for its prefill's answer before aborting it


class PrefillResult(NamedTuple):
    failure: Failure | None
    body: bytes | None  # kept only when logprobs must be merged


async def attempt_pd(d: Dispatcher, ctx: RequestContext) -> web.StreamResponse | Failure:
    try:
        prefill, decode = d.pick(ctx, WorkerRole.PREFILL), d.pick(ctx, WorkerRole.DECODE)
    except NoWorkers as exc:
        return d.no_workers(exc)
    d.metrics.child(d.metrics.pd_pairs, prefill.worker.url, decode.worker.url).inc()
    p_payload, d_payload = bootstrap_payloads(ctx, prefill, decode)
    prefill.in_flight += 1
    decode.in_flight += 1
    rids = ctx.rids  # this attempt's: a retry sends others (an abort may come after it started)
    p_task = asyncio.ensure_future(_prefill(d, ctx, prefill.worker, p_payload, rids))
    p_task.add_done_callback(functools.partial(_give_back, prefill))  # even if cancelled before it ran
    handover = _Handover(p_task)
    result: web.StreamResponse | Failure | None = None
    try:
        receive = functools.partial(_receive_decode, d, ctx, decode.worker, p_task, handover.take_over)
        result = await d.call(ctx, decode.worker, d_payload, rids, receive, handover.guard)
        return result
    finally:
        decode.in_flight -= 1
        if not p_task.done():
            if result is None or isinstance(result, Failure):
                p_task.cancel()  # its task aborts the prefill worker
            else:  # the decode is done; its prefill answers about now: let it, within a grace period
                d.linger(p_task, PREFILL_GRACE_SECS)


class _Handover:
    """The decode side runs in the request's own task (no second task per request). Until the decode
    takes the request over (its first event, or its whole answer), a prefill that fails or stalls
    interrupts it: the decode would only wait for KV that never comes, and the attempt is retried
    with another pair. After that, the prefill's fate no longer touches the client's stream (a
    prefill that dies with its response still open must not end a stream that is decoding fine)."""

    def __init__(self, p_task: asyncio.Future) -> None:
        self.guard = AttemptGuard()
        self.took_over = False
        p_task.add_done_callback(self._on_prefill_done)

    def take_over(self) -> None:
        self.took_over = True

    def _on_prefill_done(self, task: asyncio.Future) -> None:
        if not self.took_over and not task.cancelled() and task.result().failure is not None:
            self.guard.interrupt(task.result().failure)


def bootstrap_payloads(ctx: RequestContext, prefill: Target, decode: Target) -> tuple[bytes, bytes]:
    """The bodies for both sides. They are the same bytes unless DP ranks are pinned. A pinned
    prefill rank is also encoded in the room (room % dp_size == rank), the convention by which a
    decode engine finds the prefill rank that holds the KV."""
    n = ctx.req.batch_size
    host, port = prefill.worker.host, prefill.worker.spec.bootstrap_port
    rooms = [new_room(prefill.dp_rank, prefill.worker.dp_size) for _ in range(n or 1)]
    fields: dict[str, Any] = dict(ctx.rid_fields)
    if n is None:
        fields.update(bootstrap_host=host, bootstrap_port=port, bootstrap_room=rooms[0])
    else:
        fields.update(bootstrap_host=[host] * n, bootstrap_port=[port] * n, bootstrap_room=rooms)
    raw, body = ctx.req.raw, ctx.req.body
    if prefill.dp_rank is None and decode.dp_rank is None:
        payload = inject(raw, body, fields)
        return payload, payload
    return (inject(raw, body, _with_rank(fields, prefill.dp_rank)),
            inject(raw, body, _with_rank(fields, decode.dp_rank)))


def new_room(dp_rank: int | None = None, dp_size: int = 1) -> int:
    room = random.getrandbits(63)
    if dp_rank is not None:
        room = room - room % dp_size + dp_rank
        if room >= ROOM_LIMIT:
            room -= dp_size
    return room


def _with_rank(fields: dict[str, Any], rank: int | None) -> dict[str, Any]:
    return fields if rank is None else {**fields, "data_parallel_rank": rank}


def _give_back(target: Target, _: asyncio.Future) -> None:
    target.in_flight -= 1


async def _prefill(d: Dispatcher, ctx: RequestContext, worker: Worker, payload: bytes,
                   rids: list[str]) -> PrefillResult:
    result = await d.call(ctx, worker, payload, rids, functools.partial(_receive_prefill, d, ctx, worker))
    return PrefillResult(result, None) if isinstance(result, Failure) else PrefillResult(None, result)


async def _receive_prefill(d: Dispatcher, ctx: RequestContext, worker: Worker, resp: UpstreamResponse
                           ) -> bytes | Failure | None:
    body = await resp.read()  # drained either way; kept for the logprob merge
    # a stream refused after its headers (the prefill's queue was full): its decode waits for KV that
    # never comes, so this is the prefill's failure, as a refusal by status is
    failure = stream_refusal(body) if resp.is_stream else None
    if failure is None and b"abort" in body and _aborted(body, resp.is_stream):
        message = (f"prefill worker {worker.url} aborted the request (finish_reason abort) before its KV reached "
                   "the decode")
        failure = Failure(503, error_body(message, 503), JSON, True, ABORTED)
    d.record(ctx, worker, failure)
    if failure is not None:
        return failure
    return body if ctx.req.return_logprob else None  # the prompt's logprobs, merged into the decode's


async def _receive_decode(d: Dispatcher, ctx: RequestContext, worker: Worker, p_task: asyncio.Future,
                          take_over: Callable[[], None], resp: UpstreamResponse) -> web.StreamResponse | Failure:
    transform = None
    if ctx.req.return_logprob:
        prefilled: PrefillResult = await asyncio.shield(p_task)
        if prefilled.failure is not None:
            raise Abandon(prefilled.failure)  # the decode still holds the request: it gets aborted
        transform = logprob_merger(prefilled.body or b"", resp.is_stream, ctx.req.route)
    return await d.deliver(ctx, worker, resp, transform, take_over)


# -- logprob merge --------------------------------------------------------------------------------
# /generate: sglang-router's rule, the prefill's input_token_logprobs go in front of the decode's.
# A completion with echo: the decode lists the prompt's tokens, text offsets counted as one engine
# counts them, with null logprobs (it never ran the prompt); the prefill's answer lists the same
# tokens with their logprobs (then its first output token). Each null is filled from the prefill's
# entry at the same place of the same choice while both list the same token, so a decode that lists
# only its output tokens (as SGLang's does) is left as it is.
def merge_input_logprobs(prefill: Any, decode: Any) -> Any:
    """Merge one response object (or a batch: lists of them, element by element)."""
    if isinstance(prefill, list) and isinstance(decode, list):
        return [merge_input_logprobs(p, q) for p, q in zip(prefill, decode)]
    if isinstance(prefill, dict) and isinstance(decode, dict):
        _prepend(decode, _input_logprobs(prefill))
    return decode


def merge_echo_logprobs(prefill: Any, decode: Any) -> Any:
    """Merge one whole /v1/completions answer, choice by choice (by index)."""
    if not (isinstance(prefill, dict) and isinstance(decode, dict)):
        return decode
    by_index = {c.get("index"): c.get("logprobs") for c in _choices(prefill)}
    for choice in _choices(decode):
        _fill_nulls(choice.get("logprobs"), by_index.get(choice.get("index")))
    return decode


def logprob_merger(prefill_body: bytes, stream: bool, route: Route) -> Callable[[bytes], bytes]:
    if not stream:
        prefill = _loads(prefill_body)
        merge = merge_echo_logprobs if route is Route.COMPLETIONS else merge_input_logprobs
        return lambda body: _merge_whole(body, prefill, merge)
    by_index: dict[int, list] = {}
    for event in _sse_objects(prefill_body):
        lp = _input_logprobs(event)
        if lp is not None:
            by_index.setdefault(event.get("index", 0), lp)
    return lambda event: _merge_event(event, by_index)


def _merge_whole(body: bytes, prefill: Any, merge: Callable[[Any, Any], Any]) -> bytes:
    decode = _loads(body)
    return body if decode is None else orjson.dumps(merge(prefill, decode))


def _merge_event(event: bytes, by_index: dict[int, list]) -> bytes:
    if not event.startswith(b"data:") or event.startswith(b"data: [DONE]"):
        return event
    obj = _loads(event[5:])
    if not isinstance(obj, dict) or not _prepend(obj, by_index.get(obj.get("index", 0))):
        return event
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _prepend(decode: dict, prefix: list | None) -> bool:
    meta = decode.get("meta_info")
    if prefix is None or not isinstance(meta, dict) or not isinstance(meta.get("input_token_logprobs"), list):
        return False
    meta["input_token_logprobs"] = prefix + meta["input_token_logprobs"]
    return True


def _choices(answer: dict) -> list[dict]:
    choices = answer.get("choices")
    return [c for c in choices if isinstance(c, dict)] if isinstance(choices, list) else []


def _fill_nulls(decode: Any, prefill: Any) -> None:
    """The decode's null logprobs (and their top logprobs) from the prefill's, where both list the
    same token at the same place."""
    if not (_legacy_logprobs(decode) and _legacy_logprobs(prefill)):
        return
    for i, token in enumerate(prefill["tokens"]):
        if i >= len(decode["tokens"]) or decode["tokens"][i] != token:
            return
        if decode["token_logprobs"][i] is None:
            decode["token_logprobs"][i] = prefill["token_logprobs"][i]
            decode["top_logprobs"][i] = prefill["top_logprobs"][i]


def _legacy_logprobs(obj: Any) -> bool:
    """Whether `obj` is OpenAI's legacy logprobs object, with its per-token lists of one length."""
    if not isinstance(obj, dict):
        return False
    lists = [obj.get(key) for key in ("tokens", "token_logprobs", "top_logprobs")]
    return all(isinstance(v, list) for v in lists) and len({len(v) for v in lists}) == 1


def _input_logprobs(obj: Any) -> list | None:
    meta = obj.get("meta_info") if isinstance(obj, dict) else None
    value = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
    return value if isinstance(value, list) else None


def _sse_objects(body: bytes) -> list[Any]:
    out = []
    for line in body.split(b"\n"):
        if line.startswith(b"data:") and not line.startswith(b"data: [DONE]"):
            obj = _loads(line[5:])
            if isinstance(obj, dict):
                out.append(obj)
    return out


def _aborted(body: bytes, stream: bool) -> bool:
    """Whether a prefill's answer (whole, or its stream's events) ends its request as aborted: SGLang's
    finish_reason abort, in /generate's meta_info or an OpenAI choice."""
    objects = _sse_objects(body) if stream else [_loads(body)]
    items = [o for obj in objects for o in (obj if isinstance(obj, list) else [obj]) if isinstance(o, dict)]
    for item in items:
        meta = item.get("meta_info")
        reason = meta.get("finish_reason") if isinstance(meta, dict) else None
        if isinstance(reason, dict) and reason.get("type") == "abort":
            return True
        if any(c.get("finish_reason") == "abort" for c in _choices(item)):
            return True
    return False


def _loads(data: bytes) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
