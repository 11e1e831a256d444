"""SGLang's operational routes: pause / continue, memory release / resume, tokenize / detokenize, the
profiler, slow-down, the internal state and the GC freeze. Names, bodies and answers are SGLang's, so
RL frameworks' clients (slime, verl, AReaL) drive this engine unchanged; a bad body is a 400.
The control routes among them need --admin-api-key when it is set (auth.py)."""
from __future__ import annotations

from typing import Any, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, StrictBool

from baton.engine.entrypoints.http_common import ApiContext, error_response, parse, read_json
from baton.engine.io_struct import PAUSE_MODES
from baton.engine.tokenizer_manager import RequestError


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class PauseBody(_Body):
    mode: str = "abort"


class MemoryBody(_Body):
    tags: Optional[list[str]] = None


class TokenizeBody(_Body):
    model: Optional[str] = None
    prompt: Union[str, list[str]]
    add_special_tokens: StrictBool = True


class DetokenizeBody(_Body):
    model: Optional[str] = None
    tokens: Union[list[int], list[list[int]]]
    skip_special_tokens: StrictBool = True


class ProfileBody(_Body):
    output_dir: Optional[str] = None
    start_step: Optional[int] = None
    num_steps: Optional[int] = None
    activities: Optional[list[str]] = None
    with_stack: Optional[bool] = None
    record_shapes: Optional[bool] = None


class SlowDownBody(_Body):
    forward_sleep_time: Optional[float] = None


class InternalStateBody(_Body):
    server_args: dict[str, Any] = {}


async def _body(request: Request, ctx: ApiContext) -> dict[str, Any]:
    """The JSON object of a request that may come without a body (a GET, or a POST with none): {}."""
    headers = request.headers
    no_body = headers.get("content-length") in (None, "0") and "chunked" not in headers.get("transfer-encoding", "")
    if request.method == "GET" or no_body:
        return {}
    return await read_json(request, ctx.server_args)


def register_operations_routes(app: FastAPI, ctx: ApiContext) -> None:
    _register_generation_control(app, ctx)
    _register_tokenizer_routes(app, ctx)
    _register_diagnostics(app, ctx)


def _register_generation_control(app: FastAPI, ctx: ApiContext) -> None:
    tm = ctx.tm

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        mode = parse(PauseBody, await _body(request, ctx)).mode
        if mode not in PAUSE_MODES:
            raise RequestError(f"unknown pause mode {mode!r}; use one of {', '.join(PAUSE_MODES)}", 400)
        out = await tm.pause_generation(mode)
        if not out.success:
            return error_response(out.message, 400)
        return {"message": "Generation paused successfully.", "status": "ok", "mode": mode}

    @app.post("/continue_generation")
    async def continue_generation(request: Request):
        await tm.continue_generation()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(request: Request):
        out = await tm.release_memory_occupation(parse(MemoryBody, await _body(request, ctx)).tags)
        return _memory_answer(out)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(request: Request):
        out = await tm.resume_memory_occupation(parse(MemoryBody, await _body(request, ctx)).tags)
        return _memory_answer(out)


def _memory_answer(out: Any) -> JSONResponse:
    body = {"success": out.success, "message": out.message, "released": out.released}
    if not out.success:
        return error_response(out.message, 400)
    return JSONResponse(body)


def _register_tokenizer_routes(app: FastAPI, ctx: ApiContext) -> None:
    tokenizer = ctx.tm.tokenizer

    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def tokenize(request: Request):
        req = parse(TokenizeBody, await read_json(request, ctx.server_args))
        encode = lambda text: tokenizer.encode(text, add_special_tokens=req.add_special_tokens)  # noqa: E731
        if isinstance(req.prompt, str):
            ids = encode(req.prompt)
            return {"tokens": ids, "count": len(ids), "max_model_len": ctx.tm.context_len}
        batch = [encode(text) for text in req.prompt]
        return {"tokens": batch, "count": [len(ids) for ids in batch], "max_model_len": ctx.tm.context_len}

    @app.post("/detokenize")
    @app.post("/v1/detokenize")
    async def detokenize(request: Request):
        req = parse(DetokenizeBody, await read_json(request, ctx.server_args))
        tokens = req.tokens
        batch = bool(tokens) and isinstance(tokens[0], list)
        vocab = ctx.tm.vocab_size
        if any(not 0 <= t < vocab for seq in (tokens if batch else [tokens]) for t in seq):
            raise RequestError(f"tokens must be ids in 0 .. {vocab - 1}", 400)
        decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens)  # noqa: E731
        return {"text": [decode(ids) for ids in tokens] if batch else decode(tokens)}


def _register_diagnostics(app: FastAPI, ctx: ApiContext) -> None:
    tm = ctx.tm

    @app.api_route("/start_profile", methods=["GET", "POST"])
    async def start_profile(request: Request):
        body = parse(ProfileBody, await _body(request, ctx))
        out = await tm.start_profile(**body.model_dump())
        if not out.success:
            return error_response(out.message, 400)
        return Response(f"Start profiling. {out.message}\n", status_code=200)

    @app.api_route("/stop_profile", methods=["GET", "POST"])
    async def stop_profile():
        out = await tm.stop_profile()
        if not out.success:
            return error_response(out.message, 400)
        return Response(f"Stop profiling. {out.message}\n", status_code=200)

    @app.api_route("/slow_down", methods=["GET", "POST"])
    async def slow_down(request: Request):
        seconds = parse(SlowDownBody, await _body(request, ctx)).forward_sleep_time
        if seconds is not None and not 0 <= seconds <= 60:
            raise RequestError("forward_sleep_time must be null or seconds in 0 .. 60", 400)
        await tm.slow_down(seconds)
        return {"success": True, "forward_sleep_time": seconds}

    @app.get("/get_internal_state")
    async def get_internal_state():
        return await tm.get_internal_state()

    @app.api_route("/set_internal_state", methods=["POST", "PUT"])
    async def set_internal_state(request: Request):
        outs = await tm.set_internal_state(parse(InternalStateBody, await _body(request, ctx)).server_args)
        failed = [o for o in outs if not o.updated]
        if failed:
            return error_response(failed[0].message, 400)
        return [{"updated": o.updated, "server_args": o.server_args} for o in outs]

    @app.api_route("/freeze_gc", methods=["GET", "POST"])
    async def freeze_gc():
        await tm.freeze_gc()
        return Response("Garbage collection frozen.\n", status_code=200)
