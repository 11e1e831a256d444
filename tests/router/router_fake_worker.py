"""A small fake engine with the HTTP API the router talks to, with knobs for fault cases.

It answers /health, /health_generate, /get_server_info (dp_size), /get_model_info, /v1/models,
/abort_request, the three inference routes (whole or as SSE), the embedding routes, the control routes
the router fans out (recorded in `controls`, a weight update sets the version /generate reports) and
sessions. `behavior` changes take effect on the next request.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web


@dataclass
class Behavior:
    healthy: bool = True
    dp_size: int | None = 1  # None: /get_server_info has no dp_size
    status: int = 200  # status of inference responses (non-2xx: an error body)
    fail_first: int = 0  # the first N inference requests answer `fail_status`
    fail_status: int = 503
    delay: float = 0.0  # seconds before the response starts
    hang: bool = False  # never answer; the request ends when aborted or disconnected
    hang_first: int = 0  # the first N inference requests hang like `hang` (a decode waiting for KV that never comes)
    stream_chunks: int = 3
    headers_at_once: bool = False  # a stream's headers and a keep-alive comment go out before any wait
    chunk_interval: float = 0.0
    break_stream_after: int | None = None  # drop the connection after this many chunks
    stream_error: int | None = None  # a stream answers 200 with one error event of this code (an engine's scheduler refused)
    input_logprobs: list[Any] = field(default_factory=list)  # meta_info.input_token_logprobs of /generate
    draining: bool = False  # as an engine after SIGTERM: /health and new requests get the draining 503
    api_key: str | None = None  # as an engine with --api-key: every route but /health needs it (else 401)
    abort_first: int = 0  # the first N inference requests end aborted (200, finish_reason abort), as a pause aborts
    control_status: dict[str, int] = field(default_factory=dict)  # a control route's status (default 200)
    control_delay: float = 0.0  # seconds before a control route answers


CONTROL_POSTS = ("/flush_cache", "/pause_generation", "/continue_generation", "/update_weights_from_disk",
                 "/release_memory_occupation", "/resume_memory_occupation", "/load_lora_adapter",
                 "/unload_lora_adapter", "/open_session", "/close_session")


class FakeWorker:
    def __init__(self, name: str, host: str = "127.0.0.1", port: int = 0, **behavior: Any) -> None:
        self.name, self.host, self.port = name, host, port
        self.behavior = Behavior(**behavior)
        self.requests: list[tuple[str, dict[str, Any]]] = []  # (path, body) of inference requests
        self.aborts: list[Any] = []  # rids from /abort_request
        self.disconnects = 0  # inference requests whose client went away before the answer
        self.health_checks = 0
        self.refused: list[str] = []  # paths refused for a missing or wrong API key
        self.controls: list[tuple[str, dict[str, Any], str | None]] = []  # (path, body, Authorization) of controls
        self.log: list[str] = []  # in order: "start <path>", "end <path>" of inference; control paths
        self.weight_version = "default"
        self._runner: web.AppRunner | None = None
        self._aborted: dict[str, asyncio.Event] = {}
        self._running = asyncio.Event()  # cleared by freeze(): every route waits, as in a SIGSTOPped process
        self._running.set()
        self._open: set[asyncio.BaseTransport] = set()  # connections of inference requests in progress

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> "FakeWorker":
        app = web.Application(middlewares=[self._check_key])
        app.router.add_get("/health", self._health)
        app.router.add_get("/health_generate", self._health)
        app.router.add_get("/get_server_info", self._server_info)
        app.router.add_get("/get_model_info", self._model_info)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/abort_request", self._abort)
        for path in ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/encode", "/classify"):
            app.router.add_post(path, self._inference)
        for path in CONTROL_POSTS:
            app.router.add_post(path, self._control)
        app.router.add_get("/get_weight_version", self._control)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        self.thaw()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def bodies(self, path: str | None = None) -> list[dict[str, Any]]:
        return [body for p, body in self.requests if path is None or p == path]

    def freeze(self) -> None:
        """Stop answering anything (health included) until `thaw()`; connections stay open."""
        self._running.clear()

    def thaw(self) -> None:
        self._running.set()

    def drop_connections(self) -> None:
        """Close the connections of the inference requests in progress, as a dying process would."""
        for transport in list(self._open):
            transport.close()

    # -- handlers --------------------------------------------------------------------------
    @web.middleware
    async def _check_key(self, request: web.Request, handler: Any) -> web.StreamResponse:
        key = self.behavior.api_key
        if key is not None and request.path != "/health" and request.headers.get("Authorization") != f"Bearer {key}":
            self.refused.append(request.path)
            return _json({"error": {"message": "invalid or missing API key", "type": "authentication_error",
                                    "code": 401}}, status=401)
        return await handler(request)

    async def _health(self, request: web.Request) -> web.Response:
        await self._running.wait()
        self.health_checks += 1
        ok = self.behavior.healthy and not self.behavior.draining
        return web.Response(status=200 if ok else 503, text=self.name)

    async def _server_info(self, request: web.Request) -> web.Response:
        info: dict[str, Any] = {"model_path": "fake-model", "worker": self.name}
        if self.behavior.dp_size is not None:
            info["dp_size"] = self.behavior.dp_size
        return _json(info)

    async def _model_info(self, request: web.Request) -> web.Response:
        return _json({"model_path": "fake-model", "is_generation": True})

    async def _models(self, request: web.Request) -> web.Response:
        return _json({"object": "list", "data": [{"id": "fake-model", "object": "model", "owned_by": "baton"}]})

    async def _abort(self, request: web.Request) -> web.Response:
        await self._running.wait()
        rid = (await request.json()).get("rid")
        self.aborts.append(rid)
        self._aborted.setdefault(str(rid), asyncio.Event()).set()
        return _json({"aborted": rid})

    async def _inference(self, request: web.Request) -> web.StreamResponse:
        self._open.add(request.transport)
        self.log.append(f"start {request.path}")
        try:
            return await self._answer_inference(request)
        finally:
            self.log.append(f"end {request.path}")
            self._open.discard(request.transport)

    async def _control(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        self.controls.append((request.path, body, request.headers.get("Authorization")))
        self.log.append(request.path)
        if self.behavior.control_delay:
            await asyncio.sleep(self.behavior.control_delay)
        status = self.behavior.control_status.get(request.path, 200)
        if status >= 400:
            return _json({"success": False, "message": f"{self.name} refuses {request.path}"}, status=status)
        if request.path == "/update_weights_from_disk":
            self.weight_version = body.get("weight_version") or "updated"
            return _json({"success": True, "message": "updated", "num_paused_requests": 1})
        if request.path == "/get_weight_version":
            return _json({"weight_version": self.weight_version})
        if request.path == "/open_session":
            return _json(body.get("session_id"))
        return _json({"success": True, "message": f"{request.path} on {self.name}"})

    async def _answer_inference(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append((request.path, body))
        b = self.behavior
        out = None
        try:
            await self._running.wait()
            if body.get("stream") and b.headers_at_once:
                out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await out.prepare(request)
                await out.write(b": keep-alive\n\n")
            if b.hang or len(self.requests) <= b.hang_first:
                await self._aborted.setdefault(str(body.get("rid")), asyncio.Event()).wait()
                return out or _json({"error": "aborted"}, status=499)
            if b.delay:
                await asyncio.sleep(b.delay)
        except asyncio.CancelledError:
            self.disconnects += 1
            raise
        if b.draining:  # the engine's refusal (engine/entrypoints/drain.py)
            refusal = _json({"error": {"message": f"{self.name} is draining", "type": "draining", "code": 503}},
                            status=503)
            refusal.headers["Retry-After"] = "1"
            return refusal
        if len(self.requests) <= b.fail_first:
            return _json({"error": {"message": f"{self.name} failing on purpose"}}, status=b.fail_status)
        if b.status >= 400:
            return _json({"error": {"message": f"{self.name} says {b.status}"}}, status=b.status)
        if body.get("stream") and b.stream_error is not None:
            if out is None:
                out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await out.prepare(request)
            error = {"error": {"message": f"{self.name} refused it", "type": "server_error", "code": b.stream_error}}
            await out.write(b"data: " + orjson.dumps(error) + b"\n\ndata: [DONE]\n\n")
            await out.write_eof()
            return out
        if body.get("stream"):
            return await self._stream(request, body, out)
        answer = self._answer(request.path, body)
        if len(self.requests) <= b.abort_first and request.path == "/generate":
            answer["meta_info"]["finish_reason"] = {"type": "abort", "message": "aborted by /pause_generation"}
        return _json(answer)

    async def _stream(self, request: web.Request, body: dict[str, Any],
                      out: web.StreamResponse | None) -> web.StreamResponse:
        if out is None:
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
        b = self.behavior
        try:
            for i in range(b.stream_chunks):
                if b.break_stream_after is not None and i == b.break_stream_after:
                    request.transport.close()
                    return out
                await self._running.wait()
                await out.write(b"data: " + orjson.dumps(self._chunk(request.path, body, i)) + b"\n\n")
                if b.chunk_interval:
                    await asyncio.sleep(b.chunk_interval)
            await out.write(b"data: [DONE]\n\n")
        except (asyncio.CancelledError, ConnectionError):
            self.disconnects += 1
            raise
        await out.write_eof()
        return out

    # -- response shapes -------------------------------------------------------------------
    def _answer(self, path: str, body: dict[str, Any]) -> Any:
        if path == "/generate":
            items = body.get("text", body.get("input_ids"))
            if isinstance(items, list) and items and isinstance(items[0], (str, list)):
                return [self._generate_item(body, i) for i in range(len(items))]
            return self._generate_item(body, 0)
        if path in ("/v1/embeddings", "/encode", "/classify"):
            return {"embedding": [0.5], "worker": self.name, "rid": body.get("rid")}
        if path == "/v1/completions":
            return {"id": "cmpl-fake", "object": "text_completion", "created": int(time.time()), "model": "fake-model",
                    "choices": [{"index": 0, "text": f"hello from {self.name}", "finish_reason": "stop",
                                 "logprobs": None}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}}
        return {"id": "chatcmpl-fake", "object": "chat.completion", "created": int(time.time()), "model": "fake-model",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": f"hello from {self.name}"},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}}

    def _generate_item(self, body: dict[str, Any], index: int) -> dict[str, Any]:
        meta: dict[str, Any] = {"id": body.get("rid"), "finish_reason": {"type": "stop"}, "worker": self.name,
                                "weight_version": self.weight_version}
        if body.get("return_logprob"):
            meta["input_token_logprobs"] = list(self.behavior.input_logprobs)
        return {"text": f"hello from {self.name}", "meta_info": meta, "index": index}

    def _chunk(self, path: str, body: dict[str, Any], i: int) -> dict[str, Any]:
        if path == "/generate":
            item = self._generate_item(body, 0)
            item["text"] = f"tok{i}"
            return item
        if path == "/v1/completions":
            return {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": "fake-model",
                    "choices": [{"index": 0, "text": f"tok{i} ", "finish_reason": None, "logprobs": None}]}
        return {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": "fake-model",
                "choices": [{"index": 0, "delta": {"content": f"tok{i} "}, "finish_reason": None}]}


def _json(value: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(value), content_type="application/json")


async def _serve(argv: list[str]) -> None:
    """Run as a process (a real one can be SIGSTOPped): prints its URL, serves until killed."""
    import argparse
    parser = argparse.ArgumentParser()
    parser.add_argument("--stream-chunks", type=int, default=3)
    parser.add_argument("--chunk-interval", type=float, default=0.0)
    args = parser.parse_args(argv)
    worker = await FakeWorker("process", stream_chunks=args.stream_chunks, chunk_interval=args.chunk_interval).start()
    print(worker.url, flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    import sys
    asyncio.run(_serve(sys.argv[1:]))
