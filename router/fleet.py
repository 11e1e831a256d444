"""Fleet operations: SGLang's control routes, answered by the router for all its workers at once.

    POST /flush_cache, /release_memory_occupation, /resume_memory_occupation,
         /load_lora_adapter, /unload_lora_adapter       the body to every worker
    POST /pause_generation {"mode"}                      every worker pauses; new requests wait at the router
    POST /continue_generation                            every worker goes on, and the waiting requests
    POST /update_weights_from_disk                       the sequence below
    GET  /get_weight_version                             each worker's version, and the fleet's when it has one

Every registered worker gets the call (prefill, decode or regular, routable or not: one left out would
serve other weights or other adapters when it is back), each URL once, all at once. The answer comes when
all have answered: 200 when all succeeded, else the workers that failed with their status and message
(the status the failures share when it is a 4xx, else 502). The engines' admin key
(--engine-admin-api-key) goes with every call when set.

A weight update never lets a request span two versions (in PD, a prefill on one and a decode on the
other would produce tokens no model would; the engines refuse that pair with a 409, this sequence keeps
it from arising):

    close the gate    new requests, and retries, wait at the router (gate.py)
    drain             the requests in flight run on, up to --weight-update-drain-secs
                      (none with abort_all_requests)
    pause (abort)     every worker: a request still running there ends now with finish_reason abort
                      and its tokens so far, all from the old weights
    update            every worker, with the client's body as sent
    continue          every worker, then the gate opens: the waiting requests go to the new weights

A pause that fails on a worker is undone on the others and nothing is updated. While the fleet is paused
through the router, an update only updates (the client continues it).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Optional, Protocol

import aiohttp
import orjson
from aiohttp import web

from baton.router.forward import JSON, TRANSPORT_ERRORS, error_response, forward_headers
from baton.router.request import BadRequest, BodyTimeout, parse_object, read_body

if TYPE_CHECKING:
    from baton.router.config import RouterConfig
    from baton.router.registry import WorkerRegistry
    from baton.router.worker import Worker

logger = logging.getLogger(__name__)

FAN_OUT = ("/flush_cache", "/release_memory_occupation", "/resume_memory_occupation", "/load_lora_adapter",
           "/unload_lora_adapter")
PAUSE, CONTINUE, UPDATE, VERSION = ("/pause_generation", "/continue_generation", "/update_weights_from_disk",
                                    "/get_weight_version")
PAUSED, UPDATING = "paused", "weight update"  # why the gate is closed
_PER_ENGINE = ("post it to each engine (between the router's /pause_generation and /continue_generation "
               "to keep versions apart)")
NOT_ROUTED = {
    "/update_weights_from_tensor": "the serialized tensors are handles valid on one engine's host (shared "
                                   "memory, CUDA IPC), one per TP rank of that engine",
    "/init_weights_update_group": "each engine joins the trainer's group with a rank_offset of its own",
    "/update_weights_from_distributed": "each engine receives the broadcasts of its own weight-update group",
    "/destroy_weights_update_group": "each engine leaves its own weight-update group",
}


class FleetHost(Protocol):
    """What fleet operations read of the router that serves them (server.py Router)."""

    config: "RouterConfig"
    workers: "WorkerRegistry"
    client: aiohttp.ClientSession
    dispatcher: Any  # dispatch.Dispatcher: its gate

    def check_auth(self, request: web.Request) -> Optional[web.Response]: ...


@dataclass(frozen=True)
class WorkerAnswer:
    worker: "Worker"
    status: int | None  # None: no HTTP answer
    body: Any  # the worker's JSON answer, or its text
    error: str  # why it failed, in words; "" when it succeeded

    @property
    def ok(self) -> bool:
        return not self.error

    def describe(self) -> dict[str, Any]:
        out = {"url": self.worker.url, "role": self.worker.role.value, "status": self.status, "response": self.body}
        return {**out, "error": self.error} if self.error else out


def add_routes(app: web.Application, router: FleetHost) -> "Fleet":
    fleet = Fleet(router)
    for path in FAN_OUT:
        app.router.add_post(path, fleet.guarded(fleet.fan_out))
    app.router.add_post(PAUSE, fleet.guarded(fleet.pause))
    app.router.add_post(CONTINUE, fleet.guarded(fleet.resume))
    app.router.add_post(UPDATE, fleet.guarded(fleet.update_weights))
    app.router.add_get(VERSION, fleet.guarded(fleet.weight_version))
    for path, why in NOT_ROUTED.items():
        app.router.add_post(path, fleet.guarded(_refusal(f"{path} is not sent through the router: {why}; "
                                                         f"{_PER_ENGINE}")))
    return fleet


class Fleet:
    def __init__(self, router: FleetHost) -> None:
        self.router = router
        self.config = router.config
        self.paused_mode: str | None = None  # set by the router's /pause_generation until /continue_generation
        self._lock = asyncio.Lock()  # one pause, continue or update at a time

    def guarded(self, handler: Callable[[web.Request], Awaitable[web.Response]]
                ) -> Callable[[web.Request], Awaitable[web.Response]]:
        """`handler` behind the router's API key, a bad body answered 400 (a slow one 408)."""
        async def run(request: web.Request) -> web.Response:
            denied = self.router.check_auth(request)
            if denied is not None:
                return denied
            try:
                return await handler(request)
            except BadRequest as exc:
                return error_response(400, str(exc))
            except BodyTimeout as exc:
                return error_response(408, str(exc))

        return run

    # ---- routes ----
    async def fan_out(self, request: web.Request) -> web.Response:
        op = request.path.lstrip("/")
        raw = await read_body(request, self.config.request_read_timeout_secs)
        return summary(op, await self.call_all("POST", request.path, raw, self._headers(request)))

    async def pause(self, request: web.Request) -> web.Response:
        raw = await read_body(request, self.config.request_read_timeout_secs)
        body = parse_object(raw)
        async with self._lock:
            answers = await self._pause(raw, self._headers(request))
            if all(a.ok for a in answers):
                self.paused_mode = str(body.get("mode") or "abort")
                self.router.dispatcher.gate.close(PAUSED)
        return summary("pause_generation", answers)

    async def resume(self, request: web.Request) -> web.Response:
        async with self._lock:
            answers = await self.call_all("POST", CONTINUE, b"{}", self._headers(request))
            self.paused_mode = None
            self.router.dispatcher.gate.open(PAUSED)
        return summary("continue_generation", answers)

    async def weight_version(self, request: web.Request) -> web.Response:
        answers = await self.call_all("GET", VERSION, None, self._headers(request))
        return summary("get_weight_version", answers, weight_version=_common_version(answers))

    async def update_weights(self, request: web.Request) -> web.Response:
        raw = await read_body(request, self.config.request_read_timeout_secs)
        abort = bool(parse_object(raw).get("abort_all_requests"))
        headers = self._headers(request)
        gate = self.router.dispatcher.gate
        async with self._lock:
            gate.close(UPDATING)
            try:
                return await self._update(raw, headers, abort)
            finally:
                gate.open(UPDATING)

    # ---- the weight update ----
    async def _update(self, raw: bytes, headers: dict[str, str], abort: bool) -> web.Response:
        held = self.paused_mode is not None  # paused by the client: it continues, not this update
        notes: dict[str, Any] = {}
        if not held:
            gate = self.router.dispatcher.gate
            if not abort:
                await gate.drain(self.config.weight_update_drain_secs)
            notes["requests_in_flight_at_pause"] = gate.active  # they end now, with finish_reason abort
            paused = await self._pause(orjson.dumps({"mode": "abort"}), headers)
            if not all(a.ok for a in paused):
                return summary("update_weights_from_disk", paused, **notes,
                               message_prefix="pause_generation before the update (nothing was updated)")
        updated = await self.call_all("POST", UPDATE, raw, headers)
        if not held:
            continued = await self.call_all("POST", CONTINUE, b"{}", headers)
            if not all(a.ok for a in continued):
                notes["continue_generation"] = [a.describe() for a in continued]
        versions = await self.call_all("GET", VERSION, None, headers)
        notes["weight_version"] = _common_version(versions)
        notes["weight_versions"] = {a.worker.url: _version_of(a) for a in versions}
        notes["num_paused_requests"] = sum(_int(a.body, "num_paused_requests") for a in updated)
        logger.info("fleet weight update: %s", {a.worker.url: a.status for a in updated})
        return summary("update_weights_from_disk", updated, **notes)

    async def _pause(self, raw: bytes, headers: dict[str, str]) -> list[WorkerAnswer]:
        """Every worker pauses, or none: where one fails, those that paused continue."""
        answers = await self.call_all("POST", PAUSE, raw, headers)
        if not all(a.ok for a in answers):
            paused = [a.worker for a in answers if a.ok]
            logger.warning("pause_generation failed on %s; continuing the others",
                           [a.worker.url for a in answers if not a.ok])
            await self.call_all("POST", CONTINUE, b"{}", headers, paused)
        return answers

    # ---- calls ----
    async def call_all(self, method: str, path: str, body: bytes | None, headers: dict[str, str],
                       workers: "list[Worker] | None" = None) -> list[WorkerAnswer]:
        """`path` on every worker (each URL once), all at once; their answers in the registry's order."""
        if workers is None:
            workers = list({w.url: w for w in self.router.workers.workers()}.values())
        return list(await asyncio.gather(*(self._call(w, method, path, body, headers) for w in workers)))

    async def _call(self, worker: "Worker", method: str, path: str, body: bytes | None,
                    headers: dict[str, str]) -> WorkerAnswer:
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_secs)
        try:
            async with self.router.client.request(method, worker.url + path, data=body, headers=headers,
                                                  timeout=timeout) as r:
                return _answer(worker, r.status, await r.read())
        except TRANSPORT_ERRORS as exc:
            return WorkerAnswer(worker, None, None, f"no answer: {type(exc).__name__}: {exc}")

    def _headers(self, request: web.Request) -> dict[str, str]:
        headers = {**forward_headers(request, self.config.engine_api_key), "Content-Type": JSON}
        if self.config.engine_admin_api_key:
            headers["authorization"] = f"Bearer {self.config.engine_admin_api_key}"
        return headers


def summary(op: str, answers: list[WorkerAnswer], message_prefix: str = "", **extra: Any) -> web.Response:
    """One answer for all workers: {"success", "message", **extra, "workers": [each worker's answer]}."""
    if not answers:
        return error_response(503, f"{op}: no workers")
    failed = [a for a in answers if not a.ok]
    what = message_prefix or op
    if failed:
        reasons = "; ".join(f"{a.worker.role.value} {a.worker.url}: {a.error}" for a in failed)
        message = f"{what} failed on {len(failed)} of {len(answers)} workers: {reasons}"
    else:
        message = f"{what} succeeded on all {len(answers)} workers"
    body = {"success": not failed, "message": message, **extra, "workers": [a.describe() for a in answers]}
    return web.Response(status=_status(failed), body=orjson.dumps(body), headers={"Content-Type": JSON})


def _status(failed: list[WorkerAnswer]) -> int:
    """200; the status all failures share when it is the client's (a 4xx other than a refused key); else 502."""
    statuses = {a.status for a in failed}
    if not failed:
        return 200
    status = statuses.pop() if len(statuses) == 1 else None
    return status if status is not None and 400 <= status < 500 and status != 401 else 502


def _answer(worker: "Worker", status: int, raw: bytes) -> WorkerAnswer:
    try:
        body: Any = orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError:
        body = raw.decode(errors="replace")
    if status == 401:
        return WorkerAnswer(worker, status, body, f"refused the router's credentials (401: {_message(body)}); give "
                                                  "the router the engines' admin key: --engine-admin-api-key or "
                                                  "$BATON_ENGINE_ADMIN_API_KEY")
    if not 200 <= status < 300:
        return WorkerAnswer(worker, status, body, f"{status}: {_message(body)}")
    if isinstance(body, dict) and body.get("success") is False:  # an engine that answers a refusal with 200
        return WorkerAnswer(worker, status, body, f"{status}: {_message(body)}")
    return WorkerAnswer(worker, status, body, "")


def _message(body: Any) -> str:
    """The reason in an engine's answer: SGLang's and Baton's error shapes."""
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        for key in ("message", "error_message", "detail", "error"):
            if body.get(key):
                return str(body[key])
    return str(body)[:300] if body else "no message"


def _version_of(answer: WorkerAnswer) -> str | None:
    return answer.body.get("weight_version") if answer.ok and isinstance(answer.body, dict) else None


def _common_version(answers: list[WorkerAnswer]) -> str | None:
    """The version every worker reports; None when they differ or one did not say."""
    versions = {_version_of(a) for a in answers}
    return versions.pop() if len(versions) == 1 else None


def _int(body: Any, key: str) -> int:
    value = body.get(key) if isinstance(body, dict) else None
    return value if isinstance(value, int) else 0


def _refusal(message: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def refuse(request: web.Request) -> web.Response:
        return error_response(400, message)

    return refuse
