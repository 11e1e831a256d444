"""A fake engine fast enough that the router, not the backend, is what a benchmark measures: a bare
asyncio HTTP/1.1 keep-alive server answering every POST with one canned completion (or a canned SSE
stream when the body asks for `"stream": true`), and the engine's info routes for worker discovery.

    python -m baton.router.bench.backend --port 31000
"""
from __future__ import annotations

import argparse
import asyncio

import orjson

COMPLETION = orjson.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "fake-model",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "benchmark reply " * 4},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 16, "completion_tokens": 16, "total_tokens": 32}})
STREAM = b"".join(b"data: " + orjson.dumps({"id": "chatcmpl-bench", "object": "chat.completion.chunk",
                                            "choices": [{"index": 0, "delta": {"content": f"t{i} "}}]}) + b"\n\n"
                  for i in range(8)) + b"data: [DONE]\n\n"
INFO = {
    b"/health": b"{}", b"/health_generate": b"{}", b"/liveness": b"{}", b"/readiness": b"{}",
    b"/get_server_info": orjson.dumps({"dp_size": 1, "model_path": "fake-model", "tokenizer_path": "fake-model",
                                       "disaggregation_mode": "null"}),
    b"/server_info": orjson.dumps({"dp_size": 1, "model_path": "fake-model"}),
    b"/get_model_info": orjson.dumps({"model_path": "fake-model", "tokenizer_path": "fake-model",
                                      "is_generation": True, "model_type": "llama"}),
    b"/v1/models": orjson.dumps({"object": "list", "data": [{"id": "fake-model", "object": "model"}]}),
}


def _response(status: bytes, content_type: bytes, body: bytes) -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\nContent-Type: " + content_type + b"\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


JSON_OK = _response(b"200 OK", b"application/json", COMPLETION)
STREAM_OK = _response(b"200 OK", b"text/event-stream", STREAM)
NOT_FOUND = _response(b"404 Not Found", b"application/json", b'{"error": "not found"}')


class _Connection(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end]
            total = end + 4 + _content_length(head)
            if len(self.buffer) < total:
                return
            body, self.buffer = self.buffer[end + 4:total], self.buffer[total:]
            self.transport.write(_answer(head, body))  # type: ignore[attr-defined]


def _content_length(head: bytes) -> int:
    at = head.lower().find(b"\r\ncontent-length:")
    if at < 0:
        return 0
    stop = head.find(b"\r\n", at + 2)
    return int(head[at + 17:stop if stop >= 0 else len(head)].strip())


def _answer(head: bytes, body: bytes) -> bytes:
    method, path = head.split(b" ", 2)[:2]
    if method == b"POST":
        if path.startswith(b"/abort_request"):
            return _response(b"200 OK", b"application/json", b"{}")
        return STREAM_OK if b'"stream":true' in body.replace(b" ", b"") else JSON_OK
    info = INFO.get(path.split(b"?", 1)[0])
    return NOT_FOUND if info is None else _response(b"200 OK", b"application/json", info)


async def serve(host: str, port: int) -> None:
    server = await asyncio.get_running_loop().create_server(_Connection, host, port, backlog=4096)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    try:
        import uvloop
        uvloop.run(serve(args.host, args.port))
    except ImportError:
        asyncio.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
