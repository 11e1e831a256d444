"""One client request, end to end: deadline, attempts with retries (each with a new pick), aborting
workers left behind, and turning the last failure into one clear error.

The flows themselves (one worker, or a prefill/decode pair) live in `regular.py` and `pd.py`; both
return either a finished response or a `Failure` that has sent nothing to the client yet. Each request
they send to a worker goes through `Dispatcher.call`: post, record the outcome, and abort the worker's
request on any exit that left it holding the request.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, TypeVar

import aiohttp
from aiohttp import web

from baton.router.config import RouterConfig, WorkerRole
from baton.router.forward import (
    ABORTED,
    DRAINING,
    JSON,
    TRANSPORT_ERRORS,
    WORKER_AUTH,
    ClientGone,
    Failure,
    as_error_object,
    end_stream_with,
    end_stream_with_error,
    error_body,
    forward_headers,
    pump,
    respond_whole,
    start_stream,
    status_failure,
    transport_failure,
)
from baton.router.gate import Gate
from baton.router.metrics import RouterMetrics
from baton.router.policies import Policy, create_policy
from baton.router.registry import WorkerRegistry
from baton.router.request import ParsedRequest, routing_text
from baton.router.retry import backoff_secs
from baton.router.sessions import pinned_worker
from baton.router.stall import StallWatch
from baton.router.timeouts import Deadline
from baton.router.upstream import Upstream, UpstreamResponse, create_upstream
from baton.router.worker import Target, Worker

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(eq=False, slots=True)
class RequestContext:
    request: web.BaseRequest
    req: ParsedRequest
    started: float  # time.perf_counter() at arrival
    headers: dict[str, str]  # forwarded to workers
    rids: list[str]  # what /abort_request needs, for the current attempt
    rid_fields: dict[str, Any]  # {"rid": ...} to send when the router chose the rid or renewed it, else {}
    own_rids: bool  # the router chose the rids (the client sent none)
    text: str | None = None  # routing text, extracted once, on first need
    response: web.StreamResponse | None = None  # set when a stream to the client has started (its headers)
    committed: bool = False  # an event went to the client: no retry any more (a retry may reuse `response`)
    failed: set[Worker] = field(default_factory=set)  # avoided by the next attempt if possible


# A flow's one try at a request (regular.attempt_regular, pd.attempt_pd), chosen by the Router
Attempt = Callable[["Dispatcher", RequestContext], Awaitable[web.StreamResponse | Failure]]


class NoWorkers(Exception):
    pass


class Abandon(Exception):
    """Raised by a `Dispatcher.call` receiver that gives up on a 2xx response the worker is still
    producing: the call returns `failure`, and the worker is told to drop the request."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.reason)
        self.failure = failure


class AttemptGuard:
    """Runs one side of an attempt in the current task and turns an interrupt from outside (its
    worker stalled; in PD, the prefill failed before the decode took over) into that side's Failure.
    The task is cancelled wherever it waits, so the side's own cleanup runs (abort the worker,
    release the connection); a cancel from anyone else (client gone, deadline) passes through."""

    __slots__ = ("failure", "_task", "_armed")

    def __init__(self) -> None:
        self.failure: Failure | None = None
        self._task = asyncio.current_task()
        self._armed = False

    async def run(self, coro: Awaitable[Any], release: Callable[[], None] | None = None) -> Any:
        """Await `coro`; `release` runs when it is done, however it ends."""
        self._armed = True
        try:
            return await coro
        except asyncio.CancelledError:
            if self.failure is None or not self._own_cancel():
                raise
            return self.failure
        finally:
            self._armed = False
            if release is not None:
                release()

    def interrupt(self, failure: Failure) -> None:
        if self._armed and self.failure is None:
            self.failure = failure
            self._task.cancel()

    def _own_cancel(self) -> bool:
        uncancel = getattr(self._task, "uncancel", None)  # Python 3.11+: keep timeout bookkeeping right
        return uncancel is None or uncancel() == 0


class Dispatcher:
    def __init__(self, config: RouterConfig, workers: WorkerRegistry, metrics: RouterMetrics,
                 client: aiohttp.ClientSession, attempt: Attempt) -> None:
        self.config = config
        self.workers = workers
        self.metrics = metrics
        self.client = client  # control plane: aborts
        self.upstream: Upstream = create_upstream(config.upstream_client, client)  # inference requests
        self.policies: dict[WorkerRole, Policy] = {
            role: create_policy(config.policy_for(role), config.cache_aware) for role in config.roles}
        self._background: set[asyncio.Task] = set()
        self.gate = Gate()  # closed by fleet operations (fleet.py): attempts wait there
        self.stalls = StallWatch(config.worker_stall_timeout_secs, config.health.endpoint,
                                 config.health.startup_check_interval_secs, workers, client)
        workers.on_removed.append(lambda worker, targets: self.policies[worker.role].forget(targets))
        self._attempt = attempt  # the flow: regular.attempt_regular or pd.attempt_pd

    async def handle(self, request: web.BaseRequest, req: ParsedRequest) -> web.StreamResponse:
        ctx = self._context(request, req)
        deadline = Deadline(self.config.request_timeout_secs)
        try:
            return await self._with_retries(ctx)
        except asyncio.CancelledError:
            if not deadline.absorb():  # the client went away while we waited on a worker
                self._count_error(req, "client_disconnected")
                raise
            message = f"request timed out after {self.config.request_timeout_secs}s"
            return await self._fail(ctx, Failure(504, error_body(message, 504), JSON, False, "timeout"))
        except ClientGone:
            self._count_error(req, "client_disconnected")
            return ctx.response
        finally:
            deadline.cancel()

    # -- attempts --------------------------------------------------------------------------
    async def _with_retries(self, ctx: RequestContext) -> web.StreamResponse:
        retry = self.config.retry
        for attempt in range(1, retry.max_retries + 1):
            if attempt > 1:
                _renew_rids(ctx, attempt)
            await self.gate.enter()
            try:
                result = await self._attempt(self, ctx)
            finally:
                self.gate.leave()
            if not isinstance(result, Failure):
                return result
            if not result.retryable or attempt == retry.max_retries or ctx.committed:
                break
            self.metrics.child(self.metrics.retries, ctx.req.path).inc()
            logger.warning("%s: attempt %d failed (%s): %s; retrying", ctx.req.path, attempt, result.reason,
                           result.body[:300].decode(errors="replace"))
            await asyncio.sleep(backoff_secs(retry, attempt))
        return await self._fail(ctx, result)

    def pick(self, ctx: RequestContext, role: WorkerRole) -> Target:
        if ctx.req.session_id is not None:
            return self._pinned(ctx, role)
        targets = self.workers.routable(role)
        if ctx.failed and len(targets) > 1:
            targets = [t for t in targets if t.worker not in ctx.failed] or targets
        if not targets:
            raise NoWorkers(self.workers.why_none_routable(role))
        policy = self.policies[role]
        if policy.needs_text and ctx.text is None:
            ctx.text = routing_text(ctx.req)
        target, reason = policy.select(targets, ctx.text)
        worker = target.worker
        self.metrics.child(self.metrics.decisions, worker.side, policy.name, reason).inc()
        self.metrics.child(self.metrics.worker_requests, worker.url, worker.side, ctx.req.path).inc()
        return target

    def _pinned(self, ctx: RequestContext, role: WorkerRole) -> Target:
        """A session's worker: the one that holds its history (sessions.py), routable or not."""
        worker = pinned_worker(ctx.req.session_id or "", self.workers.workers(role))
        if worker is None:
            raise NoWorkers(f"no {role.value} worker for session {ctx.req.session_id!r}")
        if not worker.routable():
            raise NoWorkers(f"session {ctx.req.session_id!r} lives on {worker.url}, which is not routable now "
                            f"({worker.unroutable_reason()})")
        self.metrics.child(self.metrics.decisions, worker.side, "session", "pinned").inc()
        self.metrics.child(self.metrics.worker_requests, worker.url, worker.side, ctx.req.path).inc()
        return worker.targets[0]

    def call(self, ctx: RequestContext, worker: Worker, payload: bytes, rids: list[str],
             receive: Callable[[UpstreamResponse], Awaitable[T]], guard: AttemptGuard | None = None
             ) -> Awaitable[T | Failure]:
        """One side's request to `worker`, run under `guard` (a new one if None): POST `payload`;
        an error status or a transport error is that worker's recorded Failure; a 2xx response goes
        to `receive`, which records the success itself when it counts as one. On any other exit
        (cancelled, the worker stalled, `receive` raised or gave up with `Abandon`), the worker is
        told to drop `rids`, the ids this attempt sent."""
        guard = AttemptGuard() if guard is None else guard
        release = self.stalls.hold(worker, lambda: guard.interrupt(self._stalled(ctx, worker)))
        return guard.run(self._post(ctx, worker, payload, rids, receive), release)

    async def _post(self, ctx: RequestContext, worker: Worker, payload: bytes, rids: list[str],
                    receive: Callable[[UpstreamResponse], Awaitable[T]]) -> T | Failure:
        settled = False  # True once the worker no longer holds the request: nothing to abort
        try:
            try:
                resp = await self.upstream.post(worker.url + ctx.req.path, payload, ctx.headers)
            except TRANSPORT_ERRORS as exc:
                settled = True
                return self._failed(ctx, worker, transport_failure(worker.url, exc))
            try:
                if resp.status >= 400:
                    settled = True
                    return self._failed(ctx, worker, await status_failure(worker.url, resp))
                out = await receive(resp)
                settled = True
                return out
            except TRANSPORT_ERRORS as exc:  # broke off while we read a whole (non-streamed) body
                settled = True
                return self._failed(ctx, worker, transport_failure(worker.url, exc))
            except Abandon as exc:
                return exc.failure
            finally:
                resp.release()
        finally:
            if not settled:
                self.abort(rids, worker)

    async def deliver(self, ctx: RequestContext, worker: Worker, resp: UpstreamResponse,
                      transform: Callable[[bytes], bytes] | None = None,
                      on_first_event: Callable[[], None] | None = None) -> web.StreamResponse | Failure:
        """Send a worker's 2xx response on to the client (a success for the worker so far): whole, or
        streamed as it comes. A stream the worker breaks off before its first event is a Failure (a
        retry may still serve the client, on the stream whose headers went out); after that it ends
        with an error event."""
        self.record(ctx, worker, None)
        if not resp.is_stream and ctx.response is None:
            if on_first_event is not None:
                on_first_event()
            return await respond_whole(resp, transform)
        if ctx.response is None:
            ctx.response = await start_stream(ctx.request, resp)
        ttft = self.metrics.child(self.metrics.ttft, ctx.req.path)

        def first_event() -> None:
            ctx.committed = True
            ttft.observe(time.perf_counter() - ctx.started)
            if on_first_event is not None:
                on_first_event()

        try:
            await pump(ctx.response, resp, first_event, transform)
        except TRANSPORT_ERRORS as exc:
            failure = transport_failure(worker.url, exc)
            self.record(ctx, worker, failure)
            if not ctx.committed:
                return failure
            await end_stream_with_error(ctx.response, f"worker {worker.url} broke off the stream: {exc}", 502)
        return ctx.response

    def _stalled(self, ctx: RequestContext, worker: Worker) -> Failure:
        message = (f"{worker.side} worker {worker.url} stopped answering (no answer to health probes for "
                   f"{self.config.worker_stall_timeout_secs:g}s); the request was aborted")
        failure = Failure(504, error_body(message, 504), JSON, True, "stalled")
        self.record(ctx, worker, failure)
        return failure

    def _failed(self, ctx: RequestContext, worker: Worker, failure: Failure) -> Failure:
        self.record(ctx, worker, failure)
        return failure

    def no_workers(self, exc: NoWorkers) -> Failure:
        return Failure(503, error_body(str(exc), 503), JSON, True, "no_workers")

    def record(self, ctx: RequestContext, worker: Worker, failure: Failure | None) -> None:
        """Outcome of one request to one worker: breaker, error metrics, avoidance on retry."""
        if failure is None:
            self.workers.record_outcome(worker, ok=True)
            return
        self.metrics.child(self.metrics.worker_errors, worker.url, worker.side, failure.reason).inc()
        if failure.retryable:
            ctx.failed.add(worker)
        if failure.reason == "stalled":  # the stall watch keeps it out until it answers, not the breaker
            return
        if failure.reason == DRAINING:  # leaving service on purpose: out at once, not a fault to count
            self.workers.set_draining(worker, True)
            return
        if failure.reason in (WORKER_AUTH, ABORTED):  # the router's key is wrong; the worker was told to abort
            return
        if failure.status >= 500 or failure.reason == "transport":
            self.workers.record_outcome(worker, ok=False, unreachable=failure.reason == "transport")

    # -- aborts ----------------------------------------------------------------------------
    def abort(self, rids: list[str], worker: Worker) -> None:
        """Tell `worker` to drop an attempt's request, by the rids that attempt sent (fire and forget:
        the client is not kept waiting)."""
        self.metrics.child(self.metrics.aborts, worker.side).inc()
        for rid in rids:
            task = asyncio.ensure_future(self._send_abort(worker, rid))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def linger(self, task: asyncio.Future, grace_secs: float) -> None:
        """Let `task` finish in the background, cancelled if it takes longer than `grace_secs`."""
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        asyncio.get_running_loop().call_later(grace_secs, task.cancel)

    async def _send_abort(self, worker: Worker, rid: str) -> None:
        try:
            async with self.client.post(worker.url + "/abort_request", json={"rid": rid},
                                        timeout=aiohttp.ClientTimeout(total=self.config.abort_timeout_secs)) as r:
                await r.read()
        except Exception as exc:  # the worker may be the one that is gone
            logger.debug("abort of %s on %s failed: %s", rid, worker.url, exc)

    async def drain(self) -> None:
        await self.stalls.stop()
        if self._background:
            await asyncio.wait(self._background, timeout=self.config.abort_timeout_secs)
        await self.upstream.close()

    # -- helpers ---------------------------------------------------------------------------
    def _context(self, request: web.BaseRequest, req: ParsedRequest) -> RequestContext:
        rid = req.body.get("rid")
        fields: dict[str, Any] = {}
        if rid is None:
            n = req.batch_size
            rid = _new_rid() if n is None else [_new_rid() for _ in range(n)]
            fields = {"rid": rid}
        return RequestContext(request, req, time.perf_counter(),
                              forward_headers(request, self.config.engine_api_key), _rid_list(rid), fields,
                              own_rids=bool(fields))

    async def _fail(self, ctx: RequestContext, failure: Failure) -> web.StreamResponse:
        self._count_error(ctx.req, failure.reason)
        if ctx.response is not None:  # a stream had started: its status cannot change any more
            await end_stream_with(ctx.response, as_error_object(failure))
            return ctx.response
        return web.Response(status=failure.status, body=failure.body, headers={"Content-Type": failure.content_type})

    def _count_error(self, req: ParsedRequest, reason: str) -> None:
        self.metrics.child(self.metrics.errors, req.path, reason).inc()


def _new_rid() -> str:
    return "%032x" % random.getrandbits(128)


def _renew_rids(ctx: RequestContext, attempt: int) -> None:
    """Ids of their own for a retry: a worker may still hold the failed attempt's request (the other
    side of a PD pair, a connection that broke, an abort still on its way), and an engine refuses a
    second request under an id it holds. The router's own ids are drawn again; a client's get a
    `-retry<k>` suffix. Assigned as new objects: an abort still to be sent keeps the old ids."""
    def renew(r: Any) -> Any:
        if ctx.own_rids:
            return _new_rid()
        return f"{r}-retry{attempt}" if isinstance(r, str) else r

    old = ctx.rid_fields["rid"] if ctx.own_rids else ctx.req.body["rid"]
    rid = [renew(r) for r in old] if isinstance(old, list) else renew(old)
    ctx.rid_fields, ctx.rids = {"rid": rid}, _rid_list(rid)


def _rid_list(rid: Any) -> list[str]:
    return [r for r in (rid if isinstance(rid, list) else [rid]) if isinstance(r, str)]
