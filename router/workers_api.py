"""Runtime worker management: `/workers` (list, add, remove), plus sglang-router's older
`/list_workers`, `/add_worker?url=` and `/remove_worker?url=` for scripts written against it.

POST /workers {"url": ..., "role"|"worker_type": "regular"|"prefill"|"decode", "bootstrap_port": int|null}
DELETE /workers?url=...[&role=...]   or   DELETE /workers/{url}
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol

import orjson
from aiohttp import web

from baton.router.config import WorkerRole, WorkerSpec
from baton.router.forward import JSON, error_body
from baton.router.registry import WorkerExistsError
from baton.router.request import BodyTimeout, read_body

if TYPE_CHECKING:
    from baton.router.config import RouterConfig
    from baton.router.registry import WorkerRegistry


class WorkerAdmin(Protocol):
    """What the worker API reads of the router that serves it (server.py Router)."""

    config: "RouterConfig"
    workers: "WorkerRegistry"

    def check_auth(self, request: web.Request) -> Optional[web.Response]: ...


def add_routes(app: web.Application, router: WorkerAdmin) -> None:
    api = _WorkersApi(router)
    app.router.add_get("/workers", api.list)
    app.router.add_post("/workers", api.add)
    app.router.add_delete("/workers", api.remove)
    app.router.add_delete("/workers/{url:.+}", api.remove)
    app.router.add_get("/list_workers", api.list)
    app.router.add_post("/add_worker", api.add)
    app.router.add_post("/remove_worker", api.remove)


class _WorkersApi:
    def __init__(self, router: WorkerAdmin) -> None:
        self.router = router

    async def list(self, request: web.Request) -> web.Response:
        denied = self.router.check_auth(request)
        if denied is not None:
            return denied
        workers = [w.describe() for w in self.router.workers.workers()]
        return _json({"workers": workers, "urls": [w["url"] for w in workers]})

    async def add(self, request: web.Request) -> web.Response:
        denied = self.router.check_auth(request)
        if denied is not None:
            return denied
        try:
            spec = self._spec(await self._fields(request, self.router.config.request_read_timeout_secs))
            worker = self.router.workers.add(spec, source="api")
        except WorkerExistsError as exc:
            return _error(409, str(exc))
        except BodyTimeout as exc:
            return _error(408, str(exc))
        except (ValueError, TypeError, AssertionError) as exc:
            return _error(400, f"bad worker: {exc}")
        return _json(worker.describe(), status=201)

    async def remove(self, request: web.Request) -> web.Response:
        denied = self.router.check_auth(request)
        if denied is not None:
            return denied
        url = request.match_info.get("url") or request.query.get("url")
        if not url:
            return _error(400, "give the worker url: DELETE /workers?url=... or /workers/{url}")
        try:
            role = WorkerRole(request.query["role"]) if "role" in request.query else None
        except ValueError:
            return _error(400, f"unknown role {request.query['role']!r}")
        url = url if "://" in url else f"http://{url}"
        gone = self.router.workers.remove(url, role)
        if not gone:
            return _error(404, f"no worker {url}")
        return _json({"removed": [w.describe() for w in gone]})

    @staticmethod
    async def _fields(request: web.Request, timeout: float) -> dict[str, Any]:
        fields: dict[str, Any] = dict(request.query)
        raw = await read_body(request, timeout)
        if raw:
            body = orjson.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("body must be a JSON object")
            fields.update(body)
        return fields

    def _spec(self, fields: dict[str, Any]) -> WorkerSpec:
        url = fields.get("url")
        if not isinstance(url, str):
            raise ValueError("'url' (a string) is required")
        default = None if self.router.config.pd_disaggregation else "regular"
        role = fields.get("role") or fields.get("worker_type") or default
        if role is None:
            raise ValueError("'role' (prefill or decode) is required in PD mode")
        port = fields.get("bootstrap_port")
        port = None if port in (None, "", "none") else int(port)
        return WorkerSpec(url, WorkerRole(role), port)


def _json(value: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(value), headers={"Content-Type": JSON})


def _error(status: int, message: str) -> web.Response:
    return web.Response(status=status, body=error_body(message, status, "invalid_request_error"),
                        headers={"Content-Type": JSON})
