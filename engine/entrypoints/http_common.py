"""What the native routes (http_server.py) and the OpenAI routes (openai_api.py) share: the app's
context, reading and validating a request body, error bodies, SSE framing, collecting a whole output."""
from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from baton.engine.entrypoints.chat_content import ImageTemplate
from baton.engine.entrypoints.drain import Drain
from baton.engine.model_config import ModelConfig, VisionConfig
from baton.engine.multimodal.media import MediaError, MediaPolicy
from baton.engine.parsers import AUTO_TOOL_PARSERS, template_tool_parser
from baton.engine.sampling.sampling_params import SamplingParams, SamplingParamsError
from baton.engine.server_args import ServerArgs
from baton.engine.tokenizer_manager import GenerateInput, ReqOutput, RequestError, TokenizerManager

logger = logging.getLogger(__name__)


@dataclass
class ApiContext:
    server_args: ServerArgs
    tm: TokenizerManager
    model_info: dict[str, Any]
    scheduler_alive: Callable[[], bool] = lambda: True
    extra: dict[str, Any] = field(default_factory=dict)
    drain: Drain = field(default_factory=Drain)  # SIGTERM or POST /drain (drain.py)

    @property
    def model_name(self) -> str:
        return self.server_args.model_name

    @functools.cached_property
    def template_tool_format(self) -> Optional[str]:
        """The tool-call parser whose format the chat template writes (None: no format known here)."""
        return template_tool_parser(getattr(self.tm.tokenizer, "chat_template", None))

    @functools.cached_property
    def tool_call_parser(self) -> Optional[str]:
        """--tool-call-parser, else the chat template's where the model is of a family whose format
        is picked without the flag (Qwen, Llama: AUTO_TOOL_PARSERS)."""
        if self.server_args.tool_call_parser is not None:
            return self.server_args.tool_call_parser
        if self.template_tool_format not in AUTO_TOOL_PARSERS:
            return None
        logger.info("tool calls: --tool-call-parser %s, picked from the chat template", self.template_tool_format)
        return self.template_tool_format

    @functools.cached_property
    def vision(self) -> Optional[VisionConfig]:
        """The model's vision tower; None for a text-only model. Read on the first request with images."""
        return ModelConfig.from_pretrained(self.server_args.model_path).vision

    @functools.cached_property
    def media_policy(self) -> MediaPolicy:
        return self.server_args.view(MediaPolicy)

    @functools.cached_property
    def image_template(self) -> ImageTemplate:
        """How the chat template takes images (a vision-language model's only)."""
        assert self.vision is not None
        return ImageTemplate.probe(self.tm.tokenizer, self.vision)

    def check_images(self, count: int) -> None:
        """A prompt's `count` images, before any is loaded: a 400 for a text-only model, or for more
        than --limit-mm-data-per-request."""
        if self.vision is None:
            raise RequestError(f"image input needs a vision-language model; {self.model_name} takes text only", 400)
        try:
            self.media_policy.check_image_count(count)
        except MediaError as e:
            raise RequestError(e.message, e.status) from None


def error_response(message: str, status: int, err_type: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": err_type, "code": status}}, status_code=status)


async def read_json(request: Request, args: ServerArgs) -> dict[str, Any]:
    """The request's body as a JSON object. Read as it arrives: a body past --max-request-bytes is a
    413 once it passes it (a chunked one has no Content-Length for the guard to check first), one not
    all sent within --request-read-timeout a 408."""
    limit, parts, size = args.max_request_bytes, [], 0
    try:
        async with asyncio.timeout(args.request_read_timeout or None):
            async for part in request.stream():
                size += len(part)
                if size > limit:
                    raise RequestError(f"request body exceeds the limit of {limit} bytes", 413)
                parts.append(part)
    except TimeoutError:
        raise RequestError(f"request body not received within {args.request_read_timeout:g} s", 408) from None
    body = b"".join(parts)
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise RequestError(f"malformed JSON: {e}", 400) from e
    if not isinstance(data, dict):
        raise RequestError("the request body must be a JSON object", 400)
    return data


def parse(model_cls, data: dict[str, Any]):
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ())) or "body"
        raise RequestError(f"invalid field {where}: {first.get('msg')}", 400) from e


def sampling_params_from(d: Optional[dict[str, Any]]) -> SamplingParams:
    d = dict(d or {})
    if "sampling_seed" in d:  # SGLang's name
        d["seed"] = d.pop("sampling_seed")
    try:
        return SamplingParams(**d)
    except SamplingParamsError as e:  # a value of the wrong type: its message starts with the field's name
        raise RequestError(f"sampling_params.{e}", 400) from e
    except TypeError as e:
        raise RequestError(f"invalid sampling_params: {e}", 400) from e


def abort_error(out: ReqOutput) -> Optional[RequestError]:
    """The error an aborted request answers with; None for one that ended otherwise, or whose abort
    answers as a normal output (status 200: a /pause_generation abort gives the output so far with
    finish_reason abort, as SGLang does, so an RL client keeps the partial rollout)."""
    r = out.finished_reason
    if r is not None and r.kind == "abort" and r.status_code != 200:
        status = r.status_code if r.status_code >= 400 else 500
        return RequestError(r.message, status, "server_error" if status >= 500 else "invalid_request_error")
    return None


def sse(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


def sse_error(err: RequestError) -> bytes:
    return sse({"error": {"message": err.message, "type": err.err_type, "code": err.status}})


SSE_DONE = b"data: [DONE]\n\n"
SSE_KEEPALIVE = b": keep-alive\n\n"  # an SSE comment: clients skip it


async def collect(tm: TokenizerManager, obj: GenerateInput, is_disconnected=None) -> ReqOutput:
    last = None
    async for out in tm.generate(obj, is_disconnected):
        last = out
    assert last is not None
    return last
