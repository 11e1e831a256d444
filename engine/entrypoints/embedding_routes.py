"""Embedding routes of an engine started with --is-embedding: OpenAI's /v1/embeddings and SGLang's
/encode and /classify (the same call in SGLang: a classifier's vector is its labels' logits).

Each input is one request that ends after its prefill with its vector (layers/pooler.py), batched
in the scheduler with the other inputs. Every input is checked before any is sent, so a bad one is a
400 with nothing run. A generation engine answers these routes 400; an embedding engine answers the
generation routes 400 (http_server.GuardMiddleware, EMBEDDING_ONLY).

    /v1/embeddings  {"input", "model", "encoding_format": float | base64, "dimensions", "rid"}
                    -> {"object": "list", "data": [{"object": "embedding", "embedding", "index"}], "model",
                        "usage": {"prompt_tokens", "total_tokens"}}
    /encode         {"text" | "input_ids", one or a batch, "rid", "dimensions"}
                    -> {"embedding", "meta_info": {"id", "finish_reason", "prompt_tokens", "cached_tokens",
                        "e2e_latency"}}, a list of them for a batch
"""
from __future__ import annotations

import asyncio
import base64
import functools
import struct
from typing import Any, AsyncIterator, Optional, Union

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from baton.engine.entrypoints.http_common import ApiContext, abort_error, parse, read_json
from baton.engine.entrypoints.openai_api import _check_model
from baton.engine.entrypoints.protocol import EmbeddingRequest, EncodeRequest
from baton.engine.model_config import ModelConfig
from baton.engine.sampling.sampling_params import SamplingParams
from baton.engine.tokenizer_manager import GenerateInput, ReqOutput, RequestError

EMBEDDING_PATHS = frozenset({"/v1/embeddings", "/encode", "/classify"})
# an embedding engine's answer on the generation routes
EMBEDDING_ONLY = ("this engine serves an embedding model (--is-embedding) and generates nothing: use /v1/embeddings, "
                  "/encode or /classify")
_NOT_EMBEDDING = ("this engine serves a generation model: embeddings need an engine started with --is-embedding "
                  "(an embedding model, or a sequence classifier for /classify)")

Prompt = Union[str, list[int]]


def register_embedding_routes(app: FastAPI, ctx: ApiContext) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        _require_embedding(ctx)
        req = parse(EmbeddingRequest, await read_json(request, ctx.server_args))
        _check_model(ctx, req.model)
        prompts = prompts_of(req.input, "input")
        outs = await _embed(ctx, prompts, _rids(req.rid, len(prompts)), req.dimensions, request)
        data = [{"object": "embedding", "index": i, "embedding": _encoded(_cut(o.embedding, req.dimensions),
                                                                          req.encoding_format)}
                for i, o in enumerate(outs)]
        tokens = sum(o.prompt_tokens for o in outs)
        return JSONResponse({"object": "list", "data": data, "model": ctx.model_name,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    @app.api_route("/encode", methods=["POST", "PUT"])
    async def encode(request: Request):
        return await _native(ctx, request)

    @app.api_route("/classify", methods=["POST", "PUT"])
    async def classify(request: Request):
        return await _native(ctx, request)


async def _native(ctx: ApiContext, request: Request) -> JSONResponse:
    """SGLang's /encode and /classify: one body per input, a list for a batch."""
    _require_embedding(ctx)
    req = parse(EncodeRequest, await read_json(request, ctx.server_args))
    if req.image_data is not None:
        raise RequestError("image_data is not supported for embeddings: this server embeds text", 400)
    if (req.text is None) == (req.input_ids is None):
        raise RequestError("exactly one of text or input_ids is required", 400)
    value, name = (req.text, "text") if req.text is not None else (req.input_ids, "input_ids")
    prompts = prompts_of(value, name)
    if (name == "text") != all(isinstance(p, str) for p in prompts):
        raise RequestError("text takes strings, input_ids token ids", 400)
    batch = isinstance(value, list) and (name == "text" or isinstance(value[0], list))
    outs = await _embed(ctx, prompts, _rids(req.rid, len(prompts)), req.dimensions, request)
    bodies = [{"embedding": _cut(o.embedding, req.dimensions), "meta_info": _meta(o)} for o in outs]
    return JSONResponse(bodies if batch else bodies[0])


def _require_embedding(ctx: ApiContext) -> None:
    if not ctx.server_args.is_embedding:
        raise RequestError(_NOT_EMBEDDING, 400)


def prompts_of(value: Any, name: str) -> list[Prompt]:
    """One input or a batch: a string, strings, token ids, or lists of token ids."""
    def ids(v: Any) -> bool:
        return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)

    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if any(isinstance(v, dict) for v in value):
            raise RequestError(f"{name}: multimodal inputs are not supported; this server embeds text and token ids",
                               400)
        if all(isinstance(v, str) for v in value):
            return list(value)
        if ids(value):
            return [value]
        if all(ids(v) for v in value):
            return list(value)
    raise RequestError(f"{name} must be a string, a non-empty list of strings, token ids, or non-empty lists of "
                       "token ids", 400)


def _rids(rid: Optional[Union[str, list[str]]], count: int) -> list[Optional[str]]:
    if rid is None:
        return [None] * count
    if isinstance(rid, str):
        rid = [rid]
    if len(rid) != count:
        raise RequestError(f"rid has {len(rid)} ids for {count} inputs: give one per input", 400)
    return rid


async def _embed(ctx: ApiContext, prompts: list[Prompt], rids: list[Optional[str]], dimensions: Optional[int],
                 request: Request) -> list[ReqOutput]:
    """Each prompt's final output, its vector in `embedding`. Every prompt is checked (tokenized, its
    length) before any is sent; an input the scheduler refuses fails the call with its status."""
    _check_dimensions(ctx, dimensions)
    streams = []
    for prompt, rid in zip(prompts, rids):
        # an embedding engine ends each request after its prefill, whatever it asks for
        obj = GenerateInput(SamplingParams(max_new_tokens=0), text=prompt if isinstance(prompt, str) else None,
                            input_ids=prompt if isinstance(prompt, list) else None)
        if rid is not None:
            obj.rid = str(rid)
        streams.append(ctx.tm.generate(obj, request.is_disconnected))
    outs = await asyncio.gather(*map(_final, streams))
    for out in outs:
        if (err := abort_error(out)) is not None:
            raise err
    return outs


async def _final(stream: AsyncIterator[Optional[ReqOutput]]) -> ReqOutput:
    last = None
    async for out in stream:
        last = out
    assert last is not None
    return last


@functools.lru_cache(maxsize=4)
def _vector_shape(model_path: str) -> tuple[int, bool]:
    """(the vectors' length, whether they are unit length): a classifier's are its labels' logits."""
    config = ModelConfig.from_pretrained(model_path)
    return (config.num_labels, False) if config.num_labels else (config.text.hidden_size, True)


def _check_dimensions(ctx: ApiContext, dimensions: Optional[int]) -> None:
    if dimensions is None:
        return
    size, normalized = _vector_shape(ctx.server_args.model_path)
    if not normalized:
        raise RequestError("dimensions is for embedding models; a classifier's vector is its labels' logits", 400)
    if not 1 <= dimensions <= size:
        raise RequestError(f"dimensions must be between 1 and {size} (this model's embedding size)", 400)


def _cut(vector: list[float], dimensions: Optional[int]) -> list[float]:
    """`dimensions` (Matryoshka embeddings, as SGLang's pooler): the first values, normalised again."""
    if dimensions is None or dimensions >= len(vector):
        return vector
    return torch.nn.functional.normalize(torch.tensor(vector[:dimensions]), dim=0).tolist()


def _encoded(vector: list[float], encoding_format: str) -> Union[list[float], str]:
    """OpenAI's base64: the float32 values' little-endian bytes."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def _meta(out: ReqOutput) -> dict[str, Any]:
    return {"id": out.rid, "finish_reason": out.finished_reason.to_json() if out.finished_reason else None,
            "prompt_tokens": out.prompt_tokens, "cached_tokens": out.cached_tokens, "e2e_latency": out.e2e_latency}
