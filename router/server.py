"""The router process: the `Router` (registry, health, discovery, dispatcher) behind an aiohttp server.

Routes: inference (/generate, /v1/completions, /v1/chat/completions; embeddings: /v1/embeddings,
/encode, /classify), /v1/models, /get_model_info, /get_server_info, /health, /health_generate, /liveness,
/readiness, /metrics, /workers (`workers_api.py`), the fleet's control routes (`fleet.py`) and sessions
(`sessions.py`). All but the probes and /metrics need the API key when one is set.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time

import aiohttp
from aiohttp import web

from baton.router import fleet, pd, regular, sessions
from baton.router.admission import Admission, QueueFull, QueueTimeout
from baton.router.config import RouterConfig, WorkerRole
from baton.router.dispatch import Dispatcher
from baton.router.forward import JSON, error_body, forward_headers, new_client
from baton.router.head_deadline import HeadDeadlineRunner
from baton.router.health import HealthChecker
from baton.router.metrics import CONTENT_TYPE, RouterMetrics
from baton.router.registry import WorkerRegistry
from baton.router.request import BadRequest, BodyTimeout, ParsedRequest, Route, parse_request, read_body

logger = logging.getLogger(__name__)


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.workers = WorkerRegistry(config)
        self.admission = Admission(config.max_concurrent_requests, config.queue_size, config.queue_timeout_secs)
        self.metrics = RouterMetrics(self.workers, lambda: {"in_flight": self.admission.in_flight,
                                                            "queued": self.admission.queued})
        for spec in config.workers:
            self.workers.add(spec, "static")
        self._api_key = config.api_key.encode() if config.api_key else None
        self.port: int | None = None  # the bound port, known after start()
        self._runner: web.AppRunner | None = None
        self._discovery = None
        self.fleet: fleet.Fleet | None = None  # the control routes' state, set by build_app

    async def start(self) -> None:
        self.client = new_client(self.config.engine_api_key)
        attempt = pd.attempt_pd if self.config.pd_disaggregation else regular.attempt_regular
        self.dispatcher = Dispatcher(self.config, self.workers, self.metrics, self.client, attempt)
        self.health = HealthChecker(self.config, self.workers, self.client)
        self.health.start()
        if self.config.discovery.enabled:
            from baton.router.discovery.kubernetes import KubernetesDiscovery  # needs `kubernetes`
            self._discovery = KubernetesDiscovery(self.config, self.workers, self.metrics)
            self._discovery.start()
        self._runner = HeadDeadlineRunner(self.build_app(), self.config.request_read_timeout_secs,
                                          handler_cancellation=True, access_log=None,
                                          shutdown_timeout=self.config.shutdown_timeout_secs)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port, backlog=1024)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        logger.info("router listening on %s:%s (%s)", self.config.host, self.port,
                    "pd" if self.config.pd_disaggregation else "regular")

    async def stop(self) -> None:
        if self._discovery is not None:
            await self._discovery.stop()
        if self._runner is not None:
            await self._runner.cleanup()
        await self.health.stop()
        await self.dispatcher.drain()
        await self.client.close()

    def build_app(self) -> web.Application:
        from baton.router import workers_api
        app = web.Application(client_max_size=self.config.max_payload_size)
        for route in Route:
            refused = route.embeds and self.config.pd_disaggregation
            app.router.add_post(route.value, self._refuse_in_pd(route) if refused else self._inference_handler(route))
        app.router.add_get("/v1/models", self._passthrough("/v1/models"))
        app.router.add_get("/get_model_info", self._passthrough("/get_model_info"))
        app.router.add_get("/get_server_info", self._passthrough("/get_server_info"))
        app.router.add_get("/health", self.readiness)
        app.router.add_get("/readiness", self.readiness)
        app.router.add_get("/liveness", self.liveness)
        app.router.add_get("/health_generate", self.health_generate)
        app.router.add_get("/metrics", self.render_metrics)
        workers_api.add_routes(app, self)
        self.fleet = fleet.add_routes(app, self)
        sessions.add_routes(app, self)
        return app

    # -- inference -------------------------------------------------------------------------
    def _inference_handler(self, route: Route):
        requests = self.metrics.child(self.metrics.requests, route.value)
        latency = self.metrics.child(self.metrics.latency, route.value)

        async def handler(request: web.Request) -> web.StreamResponse:
            started = time.perf_counter()
            requests.inc()
            try:
                admitted = self.check_auth(request) or await self._admit(request, route)
                if isinstance(admitted, web.Response):
                    return admitted
                try:
                    return await self.dispatcher.handle(request, admitted)
                finally:
                    self.admission.release()
            finally:
                latency.observe(time.perf_counter() - started)

        return handler

    def _refuse_in_pd(self, route: Route):
        message = (f"{route.value} needs colocated workers (--worker-urls): an embedding is one prefill, and PD "
                   "engines serve generation only")

        async def handler(request: web.Request) -> web.Response:
            return self.check_auth(request) or self._error(route, 400, message, "bad_request", "invalid_request_error")

        return handler

    async def _admit(self, request: web.Request, route: Route) -> ParsedRequest | web.Response:
        """The parsed request with a slot taken, or the error response."""
        try:
            req = parse_request(route, await read_body(request, self.config.request_read_timeout_secs))
        except BadRequest as exc:
            return self._error(route, 400, str(exc), "bad_request", "invalid_request_error")
        except BodyTimeout as exc:
            return self._error(route, 408, str(exc), "body_timeout", "invalid_request_error")
        except web.HTTPRequestEntityTooLarge:
            message = f"request body exceeds {self.config.max_payload_size} bytes"
            return self._error(route, 413, message, "payload_too_large", "invalid_request_error")
        if req.session_id is not None and self.config.pd_disaggregation:
            return self._error(route, 400, sessions.PD_REFUSAL, "bad_request", "invalid_request_error")
        try:
            await self.admission.acquire()
        except QueueFull as exc:
            return self._error(route, 429, f"router queue is full: {exc}", "queue_full")
        except QueueTimeout as exc:
            return self._error(route, 408, str(exc), "queue_timeout")
        return req

    def _error(self, route: Route, status: int, message: str, reason: str, kind: str = "router_error"
               ) -> web.Response:
        self.metrics.child(self.metrics.errors, route.value, reason).inc()
        return web.Response(status=status, body=error_body(message, status, kind), headers={"Content-Type": JSON})

    def check_auth(self, request: web.Request) -> web.Response | None:
        if self._api_key is None:
            return None
        header = request.headers.get("Authorization", "")
        token = header[7:].strip() if header[:7].lower() == "bearer " else ""
        # aiohttp keeps a header's bytes that are not UTF-8 as surrogates: compare the bytes the client sent
        if hmac.compare_digest(token.encode("utf-8", "surrogateescape"), self._api_key):
            return None
        return web.Response(status=401, body=error_body("invalid or missing API key", 401, "authentication_error"),
                            headers={"Content-Type": JSON})

    # -- everything else -------------------------------------------------------------------
    def routable(self) -> tuple[bool, str]:
        missing = [self.workers.why_none_routable(role) for role in self.config.roles
                   if not self.workers.routable(role)]
        if missing:
            return False, "; ".join(missing)
        return True, "ok"

    async def liveness(self, request: web.Request) -> web.Response:
        return _ok("ok")

    async def readiness(self, request: web.Request) -> web.Response:
        ok, message = self.routable()
        return _ok(message) if ok else web.Response(status=503, text=message)

    async def health_generate(self, request: web.Request) -> web.Response:
        rejected = self.check_auth(request)
        if rejected is not None:
            return rejected
        picks = [self.workers.routable(role) for role in self.config.roles]
        if not all(picks):
            return web.Response(status=503, text=self.routable()[1])
        workers = [targets[0].worker for targets in picks]
        results = await asyncio.gather(*(self._get(w.url + "/health_generate", request) for w in workers))
        bad = [f"{w.role.value} {w.url}: {status}" for w, (status, _, _) in zip(workers, results) if status != 200]
        return web.Response(status=503, text="; ".join(bad)) if bad else _ok("ok")

    def _passthrough(self, path: str):
        async def handler(request: web.Request) -> web.Response:
            rejected = self.check_auth(request)
            if rejected is not None:
                return rejected
            side = WorkerRole.DECODE if self.config.pd_disaggregation else WorkerRole.REGULAR
            targets = self.workers.routable(side)
            if not targets:
                return web.Response(status=503, body=error_body(self.routable()[1], 503),
                                    headers={"Content-Type": JSON})
            status, body, ctype = await self._get(targets[0].worker.url + path, request)
            return web.Response(status=status, body=body, headers={"Content-Type": ctype})

        return handler

    async def _get(self, url: str, request: web.Request) -> tuple[int, bytes, str]:
        try:
            async with self.client.get(url, headers=forward_headers(request, self.config.engine_api_key),
                                       timeout=aiohttp.ClientTimeout(total=self.config.health.timeout_secs)) as r:
                return r.status, await r.read(), r.headers.get("Content-Type", JSON)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            return 502, error_body(f"{url}: {type(exc).__name__}: {exc}", 502), JSON

    async def render_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


def _ok(text: str) -> web.Response:
    return web.Response(text=text)
