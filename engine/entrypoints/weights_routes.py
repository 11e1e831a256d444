"""The weight endpoints, with SGLang's names, bodies and answers (what slime, verl and AReaL call).


    POST /update_weights_from_disk        {model_path, load_format, abort_all_requests, weight_version,
                                           flush_cache} -> {success, message, num_paused_requests}
    POST /update_weights_from_tensor      {serialized_named_tensors, load_format, flush_cache,
                                           abort_all_requests, weight_version} -> {success, message}
    POST /init_weights_update_group       {master_address, master_port, rank_offset, world_size,
                                           group_name, backend} -> {success, message}
    POST /update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache,
                                           abort_all_requests, weight_version} -> {success, message}
    POST /destroy_weights_update_group    {group_name} -> {success, message}
    GET|POST /get_weights_by_name         {name, truncate_size} -> the tensor's first rows (nested list)
    GET /get_weight_version               -> {weight_version}

A refused update answers 400 with success false and why; the weights it would have changed still
serve. The scheduler does the work (scheduler/weights.py); every DP rank updates.
"""
from __future__ import annotations

import base64
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from baton.engine.entrypoints.http_common import ApiContext, error_response, parse, read_json
from baton.engine.io_struct import (DestroyWeightsUpdateGroupReqInput, GetWeightsByNameReqInput,
                                    GetWeightsByNameReqOutput, InitWeightsUpdateGroupReqInput,
                                    UpdateWeightFromDiskReqInput, UpdateWeightsFromDistributedReqInput,
                                    UpdateWeightsFromTensorReqInput, UpdateWeightsReqOutput)
from baton.engine.tokenizer_manager import RequestError

# An update waits for a checkpoint's read, a trainer's broadcasts or its rendezvous: minutes, not seconds.
UPDATE_TIMEOUT_S = 1800.0


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # SGLang's other fields (is_async, torch_empty_cache, ...)


class DiskBody(_Body):
    model_path: str
    load_format: Optional[str] = None
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    flush_cache: bool = True


class TensorBody(_Body):
    serialized_named_tensors: list[str]  # base64, one per TP rank (or one for all)
    load_format: Optional[str] = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = None


class DistributedBody(_Body):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    load_format: Optional[str] = None


class InitGroupBody(_Body):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: Optional[str] = None


class DestroyGroupBody(_Body):
    group_name: str = "weight_update_group"


class GetWeightsBody(_Body):
    name: str
    truncate_size: int = 100


def register_weights_routes(app: FastAPI, ctx: ApiContext) -> None:
    ctx.tm.weight_version = ctx.server_args.weight_version

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body = parse(DiskBody, await read_json(request, ctx.server_args))
        out = await _update(ctx, UpdateWeightFromDiskReqInput(**body.model_dump()))
        return _answer(out, num_paused_requests=out.num_paused_requests)

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request):
        body = parse(TensorBody, await read_json(request, ctx.server_args))
        fields = body.model_dump()
        # the pickles' bytes; each rank's scheduler maps the tensors (utils/named_tensors.py)
        fields["serialized_named_tensors"] = [_base64(s) for s in body.serialized_named_tensors]
        return _answer(await _update(ctx, UpdateWeightsFromTensorReqInput(**fields)))

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        body = parse(DistributedBody, await read_json(request, ctx.server_args))
        _one_replica(ctx, "update_weights_from_distributed")
        return _answer(await _update(ctx, UpdateWeightsFromDistributedReqInput(**body.model_dump())))

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        body = parse(InitGroupBody, await read_json(request, ctx.server_args))
        _one_replica(ctx, "init_weights_update_group")
        return _answer(await _update(ctx, InitWeightsUpdateGroupReqInput(**body.model_dump())))

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request):
        body = parse(DestroyGroupBody, await read_json(request, ctx.server_args))
        return _answer(await _update(ctx, DestroyWeightsUpdateGroupReqInput(**body.model_dump())))

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request):
        data = dict(request.query_params) if request.method == "GET" and request.query_params else \
            await read_json(request, ctx.server_args)
        body = parse(GetWeightsBody, data)
        outs = await ctx.tm._control(GetWeightsByNameReqInput(body.name, body.truncate_size),
                                     GetWeightsByNameReqOutput, timeout=UPDATE_TIMEOUT_S)
        if outs[0].parameter is None:
            return error_response(f"get_weights_by_name: {outs[0].message}", 400)
        return JSONResponse(outs[0].parameter)

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": ctx.tm.weight_version}


def _base64(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except ValueError as e:
        raise RequestError(f"serialized_named_tensors: not base64 ({e})", 400) from e


def _one_replica(ctx: ApiContext, what: str) -> None:
    """A weight-update group holds one engine replica's TP ranks at fixed ranks: one DP rank only."""
    if ctx.server_args.dp_size > 1:
        raise RequestError(f"{what} needs --dp-size 1: the group's ranks are one replica's TP ranks", 400)


async def _update(ctx: ApiContext, req: object) -> UpdateWeightsReqOutput:
    """Every DP rank's answer as one: a success where all succeeded, else the first failure."""
    outs = await ctx.tm._control(req, UpdateWeightsReqOutput, timeout=UPDATE_TIMEOUT_S)
    failed = [o for o in outs if not o.success]
    if failed:
        out = failed[0]
        if len(outs) > 1:
            out.message = f"DP rank {out.dp_rank}: {out.message}"
        return out
    ctx.tm.weight_version = outs[0].weight_version
    return outs[0]


def _answer(out: UpdateWeightsReqOutput, **extra: object) -> JSONResponse:
    return JSONResponse({"success": out.success, "message": out.message, **extra},
                        status_code=200 if out.success else 400)
