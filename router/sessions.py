"""SGLang's sessions through the router: every call of a session goes to the worker that holds it.

An engine keeps a session's history (its requests' KV) to itself, so `/open_session`, each `/generate`
with `session_params` and `/close_session` must reach the same worker. The worker is a function of the
session id and the registered workers (rendezvous hashing: the highest hash of id + URL wins), so the
router keeps no table, any number of router replicas agree, and adding or removing a worker moves only
the sessions that hash to it. A session whose worker left (or, after a worker was added, one that
hashes to it now) is unknown there: the engine answers 404, and the client opens a new one.
`/open_session` without a `session_id` gets one from the router, so it can be pinned.

PD engines refuse sessions; so does the router in PD mode (400).
"""
from __future__ import annotations

import hashlib
import uuid
from typing import TYPE_CHECKING, Optional, Protocol

import aiohttp
import orjson
from aiohttp import web

from baton.router.config import WorkerRole
from baton.router.forward import JSON, TRANSPORT_ERRORS, error_response, forward_headers
from baton.router.request import BadRequest, BodyTimeout, parse_object, read_body

if TYPE_CHECKING:
    from baton.router.config import RouterConfig
    from baton.router.registry import WorkerRegistry
    from baton.router.worker import Worker

PD_REFUSAL = ("sessions need colocated workers (--worker-urls): a PD engine refuses them, since its decode "
              "would need the history's KV that only a prefill computes")


def pinned_worker(session_id: str, workers: "list[Worker]") -> Optional["Worker"]:
    """The worker that holds `session_id` among `workers`: the highest hash of (id, URL); None if none."""
    def score(worker: "Worker") -> bytes:
        return hashlib.blake2b(f"{session_id}\0{worker.url}".encode(), digest_size=8).digest()

    return max(workers, key=score, default=None)


class SessionHost(Protocol):
    """What the session routes read of the router that serves them (server.py Router)."""

    config: "RouterConfig"
    workers: "WorkerRegistry"
    client: aiohttp.ClientSession

    def check_auth(self, request: web.Request) -> Optional[web.Response]: ...


def add_routes(app: web.Application, router: SessionHost) -> None:
    routes = _SessionRoutes(router)
    app.router.add_post("/open_session", routes.open)
    app.router.add_post("/close_session", routes.close)


class _SessionRoutes:
    def __init__(self, router: SessionHost) -> None:
        self.router = router

    async def open(self, request: web.Request) -> web.Response:
        return await self._relay(request, new_id=True)

    async def close(self, request: web.Request) -> web.Response:
        return await self._relay(request, new_id=False)

    async def _relay(self, request: web.Request, new_id: bool) -> web.Response:
        router = self.router
        denied = router.check_auth(request)
        if denied is not None:
            return denied
        if router.config.pd_disaggregation:
            return error_response(400, PD_REFUSAL)
        try:
            body = parse_object(await read_body(request, router.config.request_read_timeout_secs))
        except BadRequest as exc:
            return error_response(400, str(exc))
        except BodyTimeout as exc:
            return error_response(408, str(exc))
        if new_id and body.get("session_id") is None:
            body["session_id"] = uuid.uuid4().hex
        session_id = body.get("session_id")
        if not isinstance(session_id, str):
            return error_response(400, "'session_id' (a string) is required")
        worker = pinned_worker(session_id, router.workers.workers(WorkerRole.REGULAR))
        if worker is None:
            return error_response(503, "no workers")
        return await self._post(worker, request, body)

    async def _post(self, worker: "Worker", request: web.Request, body: dict) -> web.Response:
        router = self.router
        headers = {**forward_headers(request, router.config.engine_api_key), "Content-Type": JSON}
        url = worker.url + request.path
        try:
            async with router.client.post(url, data=orjson.dumps(body), headers=headers,
                                          timeout=aiohttp.ClientTimeout(total=router.config.request_timeout_secs)) as r:
                return web.Response(status=r.status, body=await r.read(),
                                    headers={"Content-Type": r.headers.get("Content-Type", JSON)})
        except TRANSPORT_ERRORS as exc:
            return error_response(502, f"session {body['session_id']!r} lives on {worker.url}, which failed: "
                                       f"{type(exc).__name__}: {exc}")

