"""The colocated flow: one worker runs the whole request."""
from __future__ import annotations

import functools

from aiohttp import web

from baton.router.config import WorkerRole
from baton.router.dispatch import Dispatcher, NoWorkers, RequestContext
from baton.router.forward import Failure, inject


async def attempt_regular(d: Dispatcher, ctx: RequestContext) -> web.StreamResponse | Failure:
    try:
        target = d.pick(ctx, WorkerRole.REGULAR)
    except NoWorkers as exc:
        return d.no_workers(exc)
    # a session's DP rank is the engine's to pick (it hashes the session id): no rank is named
    rank = None if ctx.req.session_id is not None else target.dp_rank
    fields = ctx.rid_fields if rank is None else {**ctx.rid_fields, "data_parallel_rank": rank}
    payload = inject(ctx.req.raw, ctx.req.body, fields) if fields else ctx.req.raw
    worker = target.worker
    target.in_flight += 1
    try:
        return await d.call(ctx, worker, payload, ctx.rids, functools.partial(d.deliver, ctx, worker))
    finally:
        target.in_flight -= 1
