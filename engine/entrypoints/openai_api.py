"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions (stream or whole)."""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from baton.engine.entrypoints import chat_content, chat_tools
from baton.engine.entrypoints.http_common import (SSE_DONE, SSE_KEEPALIVE, ApiContext, abort_error, collect, parse,
                                                  read_json, sse, sse_error)
from baton.engine.entrypoints.protocol import ChatCompletionRequest, CompletionRequest, SamplingExtras
from baton.engine.parsers import make_tool_parser
from baton.engine.sampling.sampling_params import GRAMMAR_KINDS, SamplingParams
from baton.engine.entrypoints.expansion import expand, pd_fields
from baton.engine.entrypoints.lora_routes import is_adapter_model, requested_adapter
from baton.engine.tokenizer_manager import GenerateInput, ReqOutput, RequestError


def register_openai_routes(app: FastAPI, ctx: ApiContext) -> None:
    @app.get("/v1/models")
    async def models():
        """The model, then each loaded LoRA adapter as a model whose parent it is (SGLang's listing)."""
        now = int(time.time())
        cards = [{"id": ctx.model_name, "object": "model", "created": now, "owned_by": "baton",
                  "root": ctx.server_args.model_path, "max_model_len": ctx.tm.context_len}]
        cards += [{"id": name, "object": "model", "created": now, "owned_by": "baton", "root": path,
                   "parent": ctx.model_name, "max_model_len": ctx.tm.context_len}
                  for name, path in (ctx.tm.lora_adapters or {}).items()]
        return {"object": "list", "data": cards}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_json(request, ctx.server_args)
        _reject_prompt_parts(body.get("prompt"))
        req = parse(CompletionRequest, body)
        _check_model(ctx, req.model)
        reject_unsupported(req)
        prompts = _completion_prompts(req.prompt)
        # the n choices of each prompt (parallel sampling), prompt-major
        objs = expand([_input(ctx, req, p, req.max_tokens, req.logprobs, echo=req.echo, rid=rid,
                              lora_path=requested_adapter(ctx, req.model, req.lora_path))
                       for p, rid in zip(prompts, _prompt_rids(req.rid, len(prompts)))],
                      [req.n] * len(prompts), pd_fields(req))
        if req.stream:  # every choice of every prompt in one stream, by index
            return await _stream(ctx, objs, request, req, chat=False)
        outs = await _collect_all(ctx, objs, request)
        # choice k is copy k % n of prompt k // n, as OpenAI orders them
        echoes = [prompts[k // req.n] if req.echo else None for k in range(len(outs))]
        choices = [{"index": k, "text": _echo_text(ctx, echoes[k]) + o.text,
                    "logprobs": _completion_logprobs(ctx, o, 0, 0, echoes[k]) if req.logprobs is not None else None,
                    "finish_reason": _reason(o), "matched_stop": _matched(o)} for k, o in enumerate(outs)]
        return JSONResponse({"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                             "created": int(time.time()), "model": ctx.model_name, "choices": choices,
                             "usage": _usage(outs, req.n), "metadata": _metadata(outs)})

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = parse(ChatCompletionRequest, await read_json(request, ctx.server_args))
        _check_model(ctx, req.model)
        reject_unsupported(req, chat=True)
        args, tool_parser = ctx.server_args, ctx.tool_call_parser
        plan = chat_tools.plan_tools(req, tool_parser, args.constrained_json_disable_any_whitespace,
                                     ctx.template_tool_format)
        messages, image_data = _chat_messages(ctx, req)
        kwargs = chat_tools.template_kwargs(req)
        ids = ctx.tm.apply_chat_template(messages, tools=plan.tools if plan else None, **kwargs)
        top = (req.top_logprobs or 0) if req.logprobs else None
        overrides: dict[str, Any] = {}
        if plan is not None and plan.schema is not None:
            overrides["json_schema"] = plan.schema
        if plan is not None and plan.structural_tag is not None:
            overrides["structural_tag"] = plan.structural_tag
        if plan is not None and plan.mode != "none" and plan.schema is None \
                and not make_tool_parser(tool_parser).skip_special_tokens:
            overrides["skip_special_tokens"] = False  # the format's marker is a special token
        obj = _input(ctx, req, ids, req.max_completion_tokens or req.max_tokens, top, overrides=overrides,
                     rid=req.rid, lora_path=requested_adapter(ctx, req.model, req.lora_path))
        obj.require_reasoning = chat_tools.reasons(args.reasoning_parser, kwargs)
        obj.image_data = image_data or None
        objs = expand([obj], [req.n], pd_fields(req))
        await ctx.tm.attach_images(objs)  # a bad image is a status code, before anything streams
        parser = chat_tools.choice_parser_factory(plan, req, tool_parser, args.reasoning_parser, obj.require_reasoning)
        if req.stream:
            return await _stream(ctx, objs, request, req, chat=True, parser=parser)
        outs = await _collect_all(ctx, objs, request)
        with_reasoning = args.reasoning_parser is not None and req.separate_reasoning
        choices = []
        for k, out in enumerate(outs):
            p = parser() if parser else None
            msg = (chat_tools.message(p.whole(out.text), with_reasoning) if p
                   else {"role": "assistant", "content": out.text})
            reason = p.finish_reason(_reason(out)) if p else _reason(out)
            choices.append({"index": k, "message": msg,
                            "logprobs": {"content": _chat_logprobs(ctx, out, 0)} if req.logprobs else None,
                            "finish_reason": reason, "matched_stop": _matched(out)})
        return JSONResponse({"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                             "created": int(time.time()), "model": ctx.model_name, "choices": choices,
                             "usage": _usage(outs, req.n), "metadata": _metadata(outs)})


def _metadata(outs: list[ReqOutput]) -> dict[str, Any]:
    """SGLang's extra field of a whole (not streamed) response: the weights' version that produced it."""
    return {"weight_version": outs[0].weight_version if outs else ""}


def _check_model(ctx: ApiContext, model: Optional[str]) -> None:
    """Any name is served (SGLang's behaviour: clients send whatever their config says); with
    --strict-model-name only this server's (or a LoRA adapter of it: lora_routes.py)."""
    if ctx.server_args.strict_model_name and model and model not in (ctx.model_name, ctx.server_args.model_path) \
            and not is_adapter_model(ctx, model):
        raise RequestError(f"the model {model!r} does not exist; this server serves {ctx.model_name!r}", 404,
                           "model_not_found")


def reject_unsupported(req: SamplingExtras, chat: bool = False) -> None:
    """A request for an OpenAI feature this server lacks gets a 400 that names it, not an answer
    that silently ignores it (free text where JSON was asked for, no tool call where one was)."""
    if req.tools and not chat:
        raise RequestError("tools are for /v1/chat/completions", 400)
    if req.functions:
        raise RequestError("functions (deprecated by OpenAI) is not supported by this server; use tools", 400)
    if req.suffix:
        raise RequestError("suffix (insertion) is not supported by this server", 400)
    if req.best_of is not None and req.best_of != getattr(req, "n", 1):
        raise RequestError("best_of other than n is not supported by this server", 400)


def grammar_fields(req: SamplingExtras) -> dict[str, Any]:
    """The sampling fields of a request's structured output: OpenAI's response_format (json_object:
    any JSON object; json_schema: its schema) or SGLang's json_schema / regex / ebnf."""
    fields = {k: getattr(req, k) for k in GRAMMAR_KINDS if getattr(req, k) is not None}
    fmt = req.response_format
    if fmt is None:
        return fields
    kind = fmt.get("type", "text")
    if kind == "text":
        return fields
    if fields:
        raise RequestError("response_format and json_schema / regex / ebnf are exclusive", 400)
    if kind == "json_object":
        return {"json_schema": '{"type": "object"}'}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema", spec.get("schema_")) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise RequestError("response_format json_schema needs json_schema.schema, a JSON schema object", 400)
        return {"json_schema": schema}  # SamplingParams.verify turns the object into its text
    raise RequestError(f"response_format type {kind!r} is not supported by this server "
                       "(text, json_object, json_schema)", 400)


def _chat_messages(ctx: ApiContext, req: ChatCompletionRequest) -> tuple[list[dict[str, Any]], list[str]]:
    """The messages as the chat template takes them, and the sources of their images in order (a
    text-only model, or more images than the limit: a 400 before any image is loaded)."""
    content = chat_content.parse_messages([m.model_dump(exclude_none=True) for m in req.messages])
    images = None
    if content.image_data:
        ctx.check_images(len(content.image_data))
        images = ctx.image_template
    return chat_tools.template_messages(content.for_template(images)), content.image_data


def _reject_prompt_parts(prompt: Any) -> None:
    """A completion prompt of content parts (as a chat message's) is refused by name, not as a bad field."""
    if isinstance(prompt, list):
        for part in prompt:
            if isinstance(part, dict):
                raise RequestError(f"a completion prompt of content parts ({part.get('type')!r}) is not supported: "
                                   "/v1/completions takes text or token ids; send images to /v1/chat/completions, "
                                   "or to /generate as image_data", 400)


def _completion_prompts(prompt: Any) -> list:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise RequestError("the prompt is empty", 400)
    if all(isinstance(p, int) for p in prompt):
        return [prompt]
    return list(prompt)


def _prompt_rids(rid: Any, count: int) -> list[Optional[str]]:
    """The request id of each of a completion's `count` prompts: a batch's come as a list, one per prompt."""
    if not isinstance(rid, list):
        return [rid] * count
    if len(rid) != count:
        raise RequestError(f"rid has {len(rid)} ids for {count} prompts: give one per prompt", 400)
    return rid


def _input(ctx: ApiContext, req: SamplingExtras, prompt: Any, max_tokens: Optional[int],
           top_logprobs: Optional[int], overrides: Optional[dict[str, Any]] = None, echo: bool = False,
           rid: Optional[str] = None, lora_path: Optional[str] = None) -> GenerateInput:
    """One prompt's request, before expansion (n copies, PD fields: expansion.py). `echo` with
    logprobs: the prompt's logprobs too (completions)."""
    if max_tokens is not None and max_tokens < 0:
        raise RequestError("max_tokens must be >= 0 (0: the prompt only, e.g. for its logprobs)", 400)
    fields = dict(
        max_new_tokens=max_tokens if max_tokens is not None else ctx.tm.context_len,
        min_new_tokens=req.min_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
        min_p=req.min_p, repetition_penalty=req.repetition_penalty, frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty, seed=req.seed, ignore_eos=req.ignore_eos, stop=req.stop or [],
        stop_token_ids=req.stop_token_ids or [], skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens, no_stop_trim=req.no_stop_trim,
        logit_bias=req.logit_bias, **grammar_fields(req))
    params = SamplingParams(**{**fields, **(overrides or {})})
    given = max_tokens is not None and bool({"max_tokens", "max_completion_tokens"} & req.model_fields_set)
    obj = GenerateInput(params, text=prompt if isinstance(prompt, str) else None,
                        input_ids=prompt if isinstance(prompt, list) else None, stream=req.stream,
                        return_logprob=top_logprobs is not None, top_logprobs_num=top_logprobs or 0,
                        priority=req.priority, fit_max_new_tokens=not given,
                        logprob_start_len=0 if echo and top_logprobs is not None else -1, lora_path=lora_path)
    if rid:
        obj.rid = rid
    return obj


async def _collect_all(ctx: ApiContext, objs: list[GenerateInput], request: Request) -> list[ReqOutput]:
    outs = await asyncio.gather(*[collect(ctx.tm, o, request.is_disconnected) for o in objs])
    for out in outs:
        if (err := abort_error(out)) is not None:
            raise err
    return outs


def _echo_text(ctx: ApiContext, prompt: Any) -> str:
    """The echoed prompt (None: no echo) as it opens the choice's text."""
    if prompt is None:
        return ""
    return prompt if isinstance(prompt, str) else ctx.tm.tokenizer.decode(prompt)


def _reason(out: ReqOutput) -> Optional[str]:
    return out.finished_reason.openai_reason if out.finished_reason else None


def _matched(out: ReqOutput) -> Any:
    return out.finished_reason.matched if out.finished_reason and out.finished_reason.kind == "stop" else None


def _usage(outs: list[ReqOutput], n: int = 1) -> dict[str, Any]:
    """A prompt counts once however many choices it has (outs: n consecutive copies per prompt)."""
    firsts = outs[::n]
    prompt = sum(o.prompt_tokens for o in firsts)
    completion = sum(o.completion_tokens for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.cached_tokens for o in firsts)}}


def _token_text(ctx: ApiContext, tid: int) -> str:
    return ctx.tm.tokenizer.decode([tid])


def _completion_logprobs(ctx: ApiContext, out: ReqOutput, start: int, offset: int,
                         echo: Any = None) -> dict[str, Any]:
    """OpenAI's legacy logprobs of the output tokens from `start`, after the prompt's tokens when
    `echo` is the prompt (the first with a null logprob: nothing predicts it); `offset`: where the
    first of them begins in the choice's text. Each text_offset is that plus the lengths of the tokens
    before it (as vLLM and SGLang count)."""
    entries = out.output_token_logprobs[start:]
    tops = out.output_top_logprobs[start:] if out.output_top_logprobs else [None] * len(entries)
    if echo is not None:
        prompt, prompt_tops = _prompt_logprobs(ctx, out, echo)
        entries, tops = prompt + entries, prompt_tops + tops
    tokens = [_token_text(ctx, t) for _, t in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": [lp for lp, _ in entries],
            "top_logprobs": [None if not top else {_token_text(ctx, t): lp for lp, t in top} for top in tops],
            "text_offset": offsets}


def _prompt_logprobs(ctx: ApiContext, out: ReqOutput, prompt: Any) -> tuple[list, list]:
    """The echoed prompt's (logprob, token id) entries and top logprobs. A PD decode engine never ran
    the prompt (its prefill did): it lists the prompt's tokens with null logprobs, so its answer has a
    colocated engine's tokens and text offsets, and a PD router fills the logprobs in from the
    prefill's answer (baton router does; sglang-router leaves them null)."""
    if out.input_token_logprobs:
        return out.input_token_logprobs, out.input_top_logprobs or [None] * len(out.input_token_logprobs)
    # the tokens the engine ran: a prompt cut by --allow-auto-truncate keeps its first ones
    ids = (prompt if isinstance(prompt, list) else ctx.tm.tokenize(prompt))[:out.prompt_tokens]
    return [(None, t) for t in ids], [None] * len(ids)


def _chat_logprobs(ctx: ApiContext, out: ReqOutput, start: int) -> list[dict[str, Any]]:
    entries = out.output_token_logprobs[start:]
    tops = out.output_top_logprobs[start:] if out.output_top_logprobs else [None] * len(entries)
    items = []
    for (lp, tid), top in zip(entries, tops):
        text = _token_text(ctx, tid)
        items.append({"token": text, "logprob": lp, "bytes": list(text.encode()),
                      "top_logprobs": [{"token": _token_text(ctx, t), "logprob": v, "bytes": list(_token_text(ctx, t).encode())}
                                       for v, t in (top or [])]})
    return items


async def _stream(ctx: ApiContext, objs: list[GenerateInput], request: Request, req: Any, chat: bool,
                  parser: Optional[Callable[[], chat_tools.ChoiceParser]] = None) -> StreamingResponse:
    """One SSE stream for all choices (n per prompt, prompt-major, as in the whole response); each
    chunk carries its choice's index. At most one read per choice is outstanding. With a chat
    `parser`, each choice's text becomes reasoning / content / tool-call deltas. The headers go out
    at once; a choice refused by the scheduler ends the stream with an error event (and aborts the
    others); a silence gets a keep-alive comment."""
    # every copy is checked here, before the response starts (a refusal is a status code); a stream
    # holds nothing before its first read (a copy after a refused one is just dropped)
    reader = _ChoiceReader([ctx.tm.generate(o, keepalive=True) for o in objs])
    chunks = _StreamChunks(ctx, req, chat, objs[0].return_logprob, parser, len(objs))
    return StreamingResponse(_sse_body(reader, chunks), media_type="text/event-stream")


class _ChoiceReader:
    """The choices' output streams, read together: at most one read per choice outstanding."""

    def __init__(self, streams: list[AsyncIterator[Optional[ReqOutput]]]) -> None:
        self.streams = streams
        self.pending: dict[asyncio.Future, int] = {}  # the outstanding read of each unfinished choice

    async def next_outputs(self, unfinished: list[int]) -> list[tuple[int, Optional[ReqOutput]]]:
        """The next output(s) of the choices still running: at least one, or none when all ended.
        A None output: that choice was silent for the keep-alive time."""
        if len(self.streams) == 1:  # one choice: read it in place, no task per step
            return [(0, await anext(self.streams[0]))] if unfinished else []
        for k in unfinished:
            self.pending[asyncio.ensure_future(anext(self.streams[k]))] = k
        if not self.pending:
            return []
        done, _ = await asyncio.wait(self.pending, return_when=asyncio.FIRST_COMPLETED)
        return sorted(((self.pending.pop(f), f.result()) for f in done), key=lambda ko: ko[0])

    async def close(self) -> None:
        for f in self.pending:  # a read in flight must end before its stream can be closed
            f.cancel()
        await asyncio.gather(*self.pending, return_exceptions=True)
        for s in self.streams:
            await s.aclose()


class _StreamChunks:
    """The SSE chunks of one streamed response: each choice's step as OpenAI's chunk object."""

    def __init__(self, ctx: ApiContext, req: Any, chat: bool, want_logprobs: bool,
                 parser: Optional[Callable[[], chat_tools.ChoiceParser]], n_choices: int) -> None:
        self.ctx, self.req, self.chat, self.want_logprobs = ctx, req, chat, want_logprobs
        self.cid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created, self.obj_name = int(time.time()), "chat.completion.chunk" if chat else "text_completion"
        self.parsers = [parser() for _ in range(n_choices)] if parser else None
        self.text_offsets = [0] * n_choices  # completions' logprobs: where each choice's next token starts
        self.outs: list[Optional[ReqOutput]] = [None] * n_choices  # each choice's output (one object, every step)

    def chunk(self, choice: dict[str, Any]) -> bytes:
        return sse({"id": self.cid, "object": self.obj_name, "created": self.created, "model": self.ctx.model_name,
                    "choices": [choice]})

    def role_chunks(self) -> list[bytes]:
        """Chat: each choice opens with the assistant's role."""
        if not self.chat:
            return []
        return [self.chunk({"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}) for k in range(len(self.outs))]

    def usage(self) -> Optional[bytes]:
        """The last chunk with stream_options.include_usage."""
        if not (self.req.stream_options and self.req.stream_options.include_usage):
            return None
        return sse({"id": self.cid, "object": self.obj_name, "created": self.created, "model": self.ctx.model_name,
                    "choices": [], "usage": _usage(self.outs, self.req.n)})

    def step(self, k: int, out: ReqOutput) -> Optional[bytes]:
        """Choice k's new text (and logprobs), or None when there is nothing to send yet."""
        self.outs[k] = out
        if not (out.delta or out.finished_reason is not None):
            return None
        lp = self._logprobs(k, out)
        choice = {"index": k, "logprobs": lp, "finish_reason": _reason(out)}
        if self.parsers is not None:
            if not self._parsed_delta(self.parsers[k], out, choice) and out.finished_reason is None and lp is None:
                return None  # held back (a marker may be starting); nothing to send yet
        else:
            choice.update({"delta": {"content": out.delta}} if self.chat else {"text": out.delta})
        if out.finished_reason is not None:
            choice["matched_stop"] = _matched(out)
        return self.chunk(choice)

    def _logprobs(self, k: int, out: ReqOutput) -> Optional[dict[str, Any]]:
        if not self.want_logprobs:
            return None
        if self.chat:
            return {"content": _chat_logprobs(self.ctx, out, out.new_logprobs_from)}
        lp = _completion_logprobs(self.ctx, out, out.new_logprobs_from, self.text_offsets[k])
        self.text_offsets[k] += sum(len(t) for t in lp["tokens"])
        return lp

    @staticmethod
    def _parsed_delta(p: chat_tools.ChoiceParser, out: ReqOutput, choice: dict[str, Any]) -> bool:
        """The parser's reasoning / content / tool-call delta into `choice`; whether it has any."""
        fields = p.feed(out.delta)
        if out.finished_reason is not None:
            rest = p.finish()
            fields = {key: fields[key] + rest[key] for key in fields}
        choice["delta"] = chat_tools.delta(fields)
        choice["finish_reason"] = p.finish_reason(choice["finish_reason"])
        return bool(choice["delta"])


async def _sse_body(reader: _ChoiceReader, chunks: _StreamChunks) -> AsyncIterator[bytes]:
    """The stream's bytes: every choice's steps as they come, keep-alives, usage, [DONE]; an error
    event ends it early."""
    try:
        for data in chunks.role_chunks():
            yield data
        ready = await reader.next_outputs(list(range(len(reader.streams))))
        while ready:
            unfinished, silent = [], False
            for k, out in ready:
                if out is None:
                    silent = True
                    unfinished.append(k)
                    continue
                if (err := abort_error(out)) is not None:
                    yield sse_error(err)
                    return
                if (data := chunks.step(k, out)) is not None:
                    yield data
                if out.finished_reason is None:
                    unfinished.append(k)
            if silent:
                yield SSE_KEEPALIVE
            ready = await reader.next_outputs(unfinished)
        if (usage := chunks.usage()) is not None:
            yield usage
        yield SSE_DONE
    except RequestError as e:  # refused on the way in (the headers are out already)
        yield sse_error(e)
    finally:
        await reader.close()
