"""The engine's HTTP server: SGLang-native routes, health, metrics; OpenAI routes in openai_api.py."""
from __future__ import annotations

import asyncio
import contextlib
import secrets
import logging
from typing import Any, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from baton.engine.disaggregation.no_peer import FAKE_BOOTSTRAP_HOST
from baton.engine.entrypoints import auth
from baton.engine.entrypoints.drain import GENERATION_PATHS
from baton.engine.entrypoints.embedding_routes import EMBEDDING_ONLY, EMBEDDING_PATHS, register_embedding_routes
from baton.engine.entrypoints.expansion import expand, pd_fields
from baton.engine.entrypoints.lora_routes import register_lora_routes
from baton.engine.entrypoints.http_common import (SSE_DONE, SSE_KEEPALIVE, ApiContext, abort_error, collect,
                                                  error_response, parse, read_json, sampling_params_from, sse,
                                                  sse_error)
from baton.engine.entrypoints.openai_api import register_openai_routes
from baton.engine.entrypoints.operations_routes import register_operations_routes
from baton.engine.entrypoints.protocol import GenerateRequest
from baton.engine.entrypoints.session_routes import register_session_routes, session_params_of
from baton.engine.entrypoints.weights_routes import register_weights_routes
from baton.engine.sampling.sampling_params import SamplingParams, SamplingParamsError
from baton.engine.server_args import ServerArgs
from baton.engine.tokenizer_manager import GenerateInput, ReqOutput, RequestError

logger = logging.getLogger(__name__)

class GuardMiddleware:
    """API key and body-size checks as a plain ASGI middleware. (Starlette's BaseHTTPMiddleware would
    pass every streamed chunk through an extra task and memory stream: a tenth of the HTTP process's
    CPU under a streaming load.)"""

    def __init__(self, app: Any, ctx: ApiContext) -> None:
        self.app, self.ctx = app, ctx

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self._refusal(scope["path"], Headers(scope=scope))
        if refusal is not None:
            return await refusal(scope, receive, send)
        started = False

        async def send_tracked(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except RequestError as e:
            if started:
                raise
            self.ctx.tm.metrics.error(e.status)
            await error_response(e.message, e.status, e.err_type)(scope, receive, send)

    def _refusal(self, path: str, headers: Headers) -> Optional[Response]:
        args = self.ctx.server_args
        why = auth.refusal(path, headers, args.api_key, args.admin_api_key)  # the API key or the admin key
        if why is not None:
            self.ctx.tm.metrics.error(401)
            return error_response(why, 401, "authentication_error")
        length = headers.get("content-length")
        if length and length.isdigit() and int(length) > args.max_request_bytes:
            return error_response(f"request body too large (limit {args.max_request_bytes} bytes)", 413)
        if self.ctx.drain.active and (path in GENERATION_PATHS or path in EMBEDDING_PATHS):
            self.ctx.tm.metrics.error(503)
            return self.ctx.drain.refusal()
        if args.is_embedding and path in GENERATION_PATHS:
            self.ctx.tm.metrics.error(400)
            return error_response(EMBEDDING_ONLY, 400)
        return None


def create_app(ctx: ApiContext) -> FastAPI:

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await ctx.tm.start()
        await ctx.tm.freeze_gc()  # start-up is over (the scheduler compiled its graphs before it reported ready)
        yield

    app = FastAPI(title="baton engine", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.ctx = ctx

    app.add_middleware(GuardMiddleware, ctx=ctx)

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, e: RequestError):
        ctx.tm.metrics.error(e.status)
        return error_response(e.message, e.status, e.err_type)

    @app.exception_handler(SamplingParamsError)
    async def _sampling_error(_: Request, e: SamplingParamsError):
        ctx.tm.metrics.error(400)
        return error_response(str(e), 400)

    _register_native_routes(app, ctx)
    register_openai_routes(app, ctx)
    register_embedding_routes(app, ctx)
    register_session_routes(app, ctx)
    register_operations_routes(app, ctx)
    register_weights_routes(app, ctx)
    register_lora_routes(app, ctx)
    return app


def _register_native_routes(app: FastAPI, ctx: ApiContext) -> None:
    @app.get("/health")
    async def health():
        if not ctx.scheduler_alive():
            return error_response("the scheduler process is not running", 503, "server_error")
        if ctx.drain.active:  # readiness fails: the pod leaves its Service and the router's list
            return ctx.drain.refusal()
        return Response(status_code=200)

    @app.post("/drain")
    async def drain():
        """Leave service without losing a request (drain.py): what SIGTERM does, on request. A control
        route: behind the admin key where there is one (auth.py)."""
        ctx.drain.begin("POST /drain")
        return {"draining": True, "running_requests": len(ctx.tm.states)}

    @app.get("/health_generate")
    async def health_generate():
        """One real generation through the scheduler and model. On a PD engine the request runs
        without a peer (no KV moves); a decode generates 2 tokens so it runs a forward pass."""
        pd = ctx.server_args.disaggregation_mode != "null"
        obj = local_request(ctx.server_args, [0], max_new_tokens=2 if pd else 1)
        try:
            await asyncio.wait_for(collect(ctx.tm, obj), 20.0)
        except (asyncio.TimeoutError, RequestError) as e:
            return error_response(f"generation health check failed: {e!r}", 503, "server_error")
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def model_info():
        return {**ctx.model_info, "weight_version": ctx.tm.weight_version}

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info():
        args = {k: v for k, v in ctx.server_args.__dict__.items() if k not in ("api_key", "admin_api_key")}
        args["tool_call_parser"] = ctx.tool_call_parser  # the one in use: given, or picked from the template
        return {**args, **(await ctx.tm.get_server_info()), **ctx.extra, "version": _version()}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        out = await ctx.tm.flush_cache()
        if not out.success:
            return error_response(f"cache not flushed: {out.message}", 400)
        return Response("Cache flushed.\n", status_code=200)

    @app.post("/abort_request")
    async def abort_request(request: Request):
        data = await read_json(request, ctx.server_args)
        rid = data.get("rid")
        if not isinstance(rid, str) and not data.get("abort_all"):
            raise RequestError("abort_request needs a string rid (or abort_all: true)", 400)
        for r in (list(ctx.tm.states) if data.get("abort_all") else ctx.tm.rids_of(rid)):
            await ctx.tm.abort(r)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        try:
            ctx.tm.metrics.update_from_server_infos(await ctx.tm.get_server_infos())
        except asyncio.TimeoutError:
            logger.warning("scheduler did not answer for /metrics; gauges are stale")
        return Response(generate_latest(ctx.tm.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/generate")
    async def generate(request: Request):
        req = parse(GenerateRequest, await read_json(request, ctx.server_args))
        objs = await _native_inputs_with_images(ctx, req)
        if req.stream:
            if len(objs) != 1:
                raise RequestError("streaming a batch (or n > 1) is not supported; send one request per prompt",
                                   400)
            return await _stream_native(ctx, objs[0], request)
        outs = await asyncio.gather(*[collect(ctx.tm, o, request.is_disconnected) for o in objs])
        for out in outs:
            if (err := abort_error(out)) is not None:
                raise err
        bodies = [native_body(o, obj.return_logprob) for o, obj in zip(outs, objs)]
        return JSONResponse(bodies if _is_batch(req) or len(bodies) > 1 else bodies[0])


def local_request(args: ServerArgs, input_ids: list[int], max_new_tokens: int) -> GenerateInput:
    """A greedy request the engine generates for itself (probes, warm-up). On a PD engine it carries
    the fake bootstrap host, so it runs through the queues and the model without a peer."""
    obj = GenerateInput(SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True),
                        input_ids=input_ids)
    if args.disaggregation_mode != "null":
        obj.bootstrap_host, obj.bootstrap_room = FAKE_BOOTSTRAP_HOST, secrets.randbits(63)
    return obj


def _is_batch(req: GenerateRequest) -> bool:
    return isinstance(req.text, list) or (isinstance(req.input_ids, list) and bool(req.input_ids)
                                          and isinstance(req.input_ids[0], list))


def _pick(req: GenerateRequest, name: str, i: int, batch: int) -> Any:
    """Field `name` for prompt i: a list gives one value per prompt of a batch (`batch`: how many; 0 when
    the request has one prompt), anything else is every prompt's."""
    value = getattr(req, name)
    if not isinstance(value, list):
        return value
    if not batch:
        raise RequestError(f"{name} is a list, which needs a batch of prompts (text or input_ids as a list)", 400)
    if len(value) != batch:
        raise RequestError(f"{name} has {len(value)} values for {batch} prompts", 400)
    return value[i]


def _native_inputs(req: GenerateRequest) -> list[GenerateInput]:
    if (req.text is None) == (req.input_ids is None):
        raise RequestError("exactly one of text or input_ids is required", 400)
    batch = _is_batch(req)
    prompts = (req.text if req.text is not None else req.input_ids) if batch else [req.text if req.text is not None else req.input_ids]
    if batch and not prompts:
        raise RequestError("the batch is empty", 400)
    if req.video_data is not None or req.audio_data is not None:
        raise RequestError("video_data and audio_data are not supported: this server takes text and images", 400)
    objs, ns = [], []
    size = len(prompts) if batch else 0
    for i, prompt in enumerate(prompts):
        sp = _pick(req, "sampling_params", i, size)
        obj = GenerateInput(sampling_params_from(sp if isinstance(sp, dict) else None),
                            text=prompt if isinstance(prompt, str) else None,
                            input_ids=prompt if isinstance(prompt, list) else None,
                            stream=req.stream, return_logprob=bool(_pick(req, "return_logprob", i, size)),
                            logprob_start_len=int(_pick(req, "logprob_start_len", i, size)),
                            top_logprobs_num=int(_pick(req, "top_logprobs_num", i, size)),
                            priority=_pick(req, "priority", i, size), require_reasoning=req.require_reasoning,
                            fit_max_new_tokens=not (isinstance(sp, dict) and "max_new_tokens" in sp),
                            lora_path=_pick(req, "lora_path", i, size))
        if obj.return_logprob and obj.logprob_start_len < 0 and req.logprob_start_len == -1:
            obj.logprob_start_len = -1  # output logprobs only, as SGLang's default
        obj.image_data = _prompt_images(req.image_data, i, size)
        obj.session_params = session_params_of(_pick(req, "session_params", i, size))
        rid = _pick(req, "rid", i, size)
        if rid is not None:
            obj.rid = str(rid)
        objs.append(obj)
        ns.append(_parallel_n(sp))  # SGLang's sampling_params.n: n outputs per prompt
    return expand(objs, ns, pd_fields(req))


async def _native_inputs_with_images(ctx: ApiContext, req: GenerateRequest) -> list[GenerateInput]:
    """The request's prompts, their images loaded and processed: a bad image is a status code, before
    anything streams."""
    objs = _native_inputs(req)
    _check_images(ctx, objs)
    await ctx.tm.attach_images(objs)
    return objs


def _check_images(ctx: ApiContext, objs: list[GenerateInput]) -> None:
    """Each prompt's images, before any is loaded (a text-only model, too many: a 400)."""
    for obj in objs:
        if obj.image_data:
            ctx.check_images(len(obj.image_data))


def _prompt_images(value: Any, i: int, batch: int) -> Optional[list[str]]:
    """SGLang's image_data for prompt i: a source or a list of sources for one prompt; for a batch one
    entry per prompt (a source, a list, or null), or one source every prompt shows."""
    if value is None or isinstance(value, str):
        return None if value is None else [value]
    if not batch:
        if not all(isinstance(v, str) for v in value):
            raise RequestError("image_data of one prompt is a source or a list of sources (strings)", 400)
        return list(value) or None
    if len(value) != batch:
        raise RequestError(f"image_data has {len(value)} entries for {batch} prompts: give one per prompt (a "
                           "source, a list of sources, or null)", 400)
    entry = value[i]
    return None if entry is None else [entry] if isinstance(entry, str) else list(entry) or None


def _parallel_n(sp: Any) -> int:
    n = sp.get("n", 1) if isinstance(sp, dict) else 1
    if not isinstance(n, int) or isinstance(n, bool):
        raise RequestError("sampling_params.n must be an integer", 400)
    return n


def _lp_triples(entries: Optional[list]) -> Optional[list]:
    if entries is None:
        return None
    return [[lp, tid, None] for lp, tid in entries]


def _top_triples(entries: Optional[list]) -> Optional[list]:
    if entries is None:
        return None
    return [None if e is None else [[lp, tid, None] for lp, tid in e] for e in entries]


def native_body(out: ReqOutput, return_logprob: bool, cumulative: bool = True) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": out.rid,
        "finish_reason": out.finished_reason.to_json() if out.finished_reason else None,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "cached_tokens": out.cached_tokens,
        "e2e_latency": out.e2e_latency,
        "weight_version": out.weight_version,
    }
    if return_logprob:
        meta["input_token_logprobs"] = _lp_triples(out.input_token_logprobs) or []
        meta["output_token_logprobs"] = _lp_triples(out.output_token_logprobs)
        meta["input_top_logprobs"] = _top_triples(out.input_top_logprobs) or []
        meta["output_top_logprobs"] = _top_triples(out.output_top_logprobs) or []
    return {"text": out.text, "output_ids": out.output_ids, "meta_info": meta}


async def _stream_native(ctx: ApiContext, obj: GenerateInput, request: Request) -> StreamingResponse:
    """The headers go out at once (a PD router waits for both engines' headers; the prefill's first
    output comes only after its KV has moved); a refusal found before the request reaches the
    scheduler is a status code, a later one an error event."""
    stream = ctx.tm.generate(obj, keepalive=True)

    async def body():
        try:
            async for out in stream:
                if out is None:
                    yield SSE_KEEPALIVE
                    continue
                if (err := abort_error(out)) is not None:
                    yield sse_error(err)
                    break
                yield sse(native_body(out, obj.return_logprob))
                if out.finished_reason is not None:
                    break
            yield SSE_DONE
        except RequestError as e:  # refused on the way in (the headers are out already)
            yield sse_error(e)
        finally:
            await stream.aclose()

    return StreamingResponse(body(), media_type="text/event-stream")


def _version() -> str:
    from baton import __version__

    return __version__
