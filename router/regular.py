"""The colocated flow: one worker runs the whole request."""
from __future__ import annotations

from aiohttp import web

from baton.router.config import WorkerRole
from baton.router.dispatch import AttemptGuard, Dispatcher, NoWorkers, RequestContext
from baton.router.forward import TRANSPORT_ERRORS, Failure, inject, status_failure, transport_failure
from baton.router.worker import Worker


async def attempt_regular(d: Dispatcher, ctx: RequestContext) -> web.StreamResponse | Failure:
    try:
        target = d.pick(ctx, WorkerRole.REGULAR)
    except NoWorkers as exc:
        return d.no_workers(exc)
    fields = ctx.rid_fields if target.dp_rank is None else {**ctx.rid_fields, "data_parallel_rank": target.dp_rank}
    payload = inject(ctx.req.raw, ctx.req.body, fields) if fields else ctx.req.raw
    target.in_flight += 1
    try:
        return await d.watched(ctx, target.worker, AttemptGuard(), _call(d, ctx, target.worker, payload))
    finally:
        target.in_flight -= 1


async def _call(d: Dispatcher, ctx: RequestContext, worker: Worker, payload: bytes) -> web.StreamResponse | Failure:
    rids = ctx.rids
    settled = False  # True once the worker no longer holds the request: nothing to abort
    try:
        try:
            resp = await d.upstream.post(worker.url + ctx.req.path, payload, ctx.headers)
        except TRANSPORT_ERRORS as exc:
            settled = True
            return _failed(d, ctx, worker, transport_failure(worker.url, exc))
        try:
            if resp.status >= 400:
                settled = True
                return _failed(d, ctx, worker, await status_failure(resp))
            d.record(ctx, worker, None)
            out = await d.deliver(ctx, worker, resp)
            settled = True
            return out
        except TRANSPORT_ERRORS as exc:  # broke off while we read a whole (non-streamed) body
            settled = True
            return _failed(d, ctx, worker, transport_failure(worker.url, exc))
        finally:
            resp.release()
    finally:
        if not settled:
            d.abort(rids, worker)


def _failed(d: Dispatcher, ctx: RequestContext, worker: Worker, failure: Failure) -> Failure:
    d.record(ctx, worker, failure)
    return failure
