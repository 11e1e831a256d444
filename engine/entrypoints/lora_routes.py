"""LoRA adapters over HTTP (SGLang's endpoints and bodies): /load_lora_adapter, /unload_lora_adapter, and
which adapter an OpenAI request names.

    POST /load_lora_adapter    {"lora_name": "sql", "lora_path": "/adapters/sql", "pinned": false}
    POST /unload_lora_adapter  {"lora_name": "sql"}     (answers once no request runs under it)
    -> 200 {"success": true, "error_message": "", "loaded_adapters": {"sql": "/adapters/sql"}}, or 400 with
       success false and the reason

A request picks an adapter by name: /generate's `lora_path` (one per prompt for a batch), or an OpenAI
request's `model` as "base-model:adapter" (SGLang's syntax; it wins over a `lora_path` in the body) or
as an adapter's name alone (as /v1/models lists them).
"""
from __future__ import annotations

from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, StrictBool

from baton.engine.entrypoints.http_common import ApiContext, parse, read_json
from baton.engine.io_struct import LoadLoRAAdapterReqInput, LoRAUpdateOutput, UnloadLoRAAdapterReqInput
from baton.engine.server_args import parse_lora_paths


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str
    lora_path: str
    pinned: StrictBool = False


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str


def register_lora_routes(app: FastAPI, ctx: ApiContext) -> None:
    if ctx.server_args.enable_lora:
        ctx.tm.enable_lora({a.name: a.path for a in parse_lora_paths(ctx.server_args.lora_paths)})

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = parse(LoadLoRAAdapterRequest, await read_json(request, ctx.server_args))
        return _answer(await ctx.tm.load_lora_adapter(
            LoadLoRAAdapterReqInput(body.lora_name, body.lora_path, body.pinned)))

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body = parse(UnloadLoRAAdapterRequest, await read_json(request, ctx.server_args))
        return _answer(await ctx.tm.unload_lora_adapter(UnloadLoRAAdapterReqInput(body.lora_name)))


def _answer(out: LoRAUpdateOutput) -> JSONResponse:
    return JSONResponse({"success": out.success, "error_message": out.error_message,
                         "loaded_adapters": out.loaded_adapters}, status_code=200 if out.success else 400)


def requested_adapter(ctx: ApiContext, model: Optional[str], lora_path: Optional[str]) -> Optional[str]:
    """The adapter an OpenAI request names: `model` as "base:adapter" (an empty adapter: none), or a
    loaded adapter's name; else the body's `lora_path`. The served model's own name is never split."""
    if model and model not in (ctx.model_name, ctx.server_args.model_path):
        if model in (ctx.tm.lora_adapters or {}):
            return model
        if ":" in model:
            return model.split(":", 1)[1].strip() or None
    return lora_path or None


def is_adapter_model(ctx: ApiContext, model: str) -> bool:
    """Whether `model` names this server's model through an adapter ("base:adapter", or a loaded adapter's
    name), which --strict-model-name accepts too."""
    base = model.split(":", 1)[0].strip()
    return model in (ctx.tm.lora_adapters or {}) or (":" in model and base in (ctx.model_name,
                                                                               ctx.server_args.model_path))
