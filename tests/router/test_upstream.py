"""The hot-path HTTP clients: the lean one against raw servers that frame bodies every legal way and
split them at awkward places, and both clients (lean, aiohttp) through the router's main flows."""
import asyncio

import aiohttp
import pytest
from router_support import make_config, url_of

from baton.router.config import UpstreamClient
from baton.router.upstream import UpstreamError
from baton.router.upstream.aiohttp_client import AiohttpUpstream
from baton.router.upstream.lean import LeanUpstream


class RawServer:
    """Answers each request with canned bytes, written in the given pieces with a pause between."""

    def __init__(self, pieces: list[bytes], close_after: bool = False) -> None:
        self.pieces, self.close_after = pieces, close_after
        self.connections = 0
        self.requests: list[bytes] = []

    async def __aenter__(self) -> "RawServer":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/generate"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                self.requests.append(head + await reader.readexactly(length))
                for piece in self.pieces:
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0.01)
                if self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


@pytest.fixture
async def lean():
    async with aiohttp.ClientSession() as session:
        client = LeanUpstream(AiohttpUpstream(session))
        yield client
        await client.close()


async def test_content_length_body_split_across_reads(lean):
    pieces = [b"HTTP/1.1 200 OK\r\nContent-Ty", b"pe: application/json\r\nContent-Length: 11\r\n\r\n{\"a\":", b" 1234}"]
    async with RawServer(pieces) as server:
        for _ in range(2):
            resp = await lean.post(server.url, b'{"text": "x"}', {"x-request-id": "r1"})
            assert resp.status == 200 and resp.content_type == "application/json"
            assert await resp.read() == b'{"a": 1234}'
            resp.release()
        assert server.connections == 1  # kept alive and reused
        assert b"x-request-id: r1\r\n" in server.requests[0] and server.requests[0].endswith(b'{"text": "x"}')


async def test_chunked_stream_with_extensions_and_trailers(lean):
    pieces = [b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n",
              b"6;ext=1\r\ndata: \r", b"\n1\r\na\r\n", b"3\r\nxyz\r\n0\r\nX-Trailer: t\r\n\r\n"]
    async with RawServer(pieces) as server:
        resp = await lean.post(server.url, b"{}", {})
        assert resp.is_stream
        assert b"".join([piece async for piece in resp.chunks()]) == b"data: axyz"
        resp.release()


async def test_bad_chunk_framing_is_an_upstream_error(lean):
    pieces = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", b"2\r\nabXY\r\n0\r\n\r\n"]
    async with RawServer(pieces) as server:
        resp = await lean.post(server.url, b"{}", {})
        with pytest.raises(UpstreamError):
            await resp.read()
        resp.release()


async def test_chunked_body_is_dechunked_exactly(lean):
    body = b"data: {\"x\": 1}\n\n" * 3
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 7]), body[i:i + 7]) for i in range(0, len(body), 7))
    pieces = [b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"]
    pieces += [chunks[i:i + 5] for i in range(0, len(chunks), 5)] + [b"0\r\n\r\n"]
    async with RawServer(pieces) as server:
        resp = await lean.post(server.url, b"{}", {})
        assert await resp.read() == body
        resp.release()
        resp = await lean.post(server.url, b"{}", {})  # the connection is reusable afterwards
        assert await resp.read() == body
        resp.release()
        assert server.connections == 1


async def test_body_until_close_and_connection_close(lean):
    async with RawServer([b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it"], close_after=True) as server:
        resp = await lean.post(server.url, b"{}", {})
        assert await resp.read() == b"all of it"
        resp.release()
        resp = await lean.post(server.url, b"{}", {})
        await resp.read()
        resp.release()
        assert server.connections == 2


async def test_truncated_body_and_refused_connection_raise_upstream_error(lean):
    async with RawServer([b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort"], close_after=True) as server:
        resp = await lean.post(server.url, b"{}", {})
        with pytest.raises(UpstreamError):
            await resp.read()
        resp.release()
    with pytest.raises(UpstreamError):
        await lean.post(server.url, b"{}", {})


async def test_malformed_head_is_an_upstream_error(lean):
    async with RawServer([b"HTTP/1.1 OK-ish\r\nContent-Length: x\r\n\r\n"]) as server:
        with pytest.raises(UpstreamError, match="malformed"):
            await lean.post(server.url, b"{}", {})


async def test_stale_pooled_connection_is_replaced_transparently(lean):
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    async with RawServer([ok], close_after=True) as server:
        resp = await lean.post(server.url, b"{}", {})
        assert await resp.read() == b"ok"
        resp.release()  # keep-alive per headers, but the server closes it right after
        await asyncio.sleep(0.05)
        resp = await lean.post(server.url, b"{}", {})
        assert await resp.read() == b"ok"
        resp.release()


@pytest.mark.parametrize("client", list(UpstreamClient))
async def test_router_flows_on_both_clients(client, fake_workers, routers, http):
    prefill = await fake_workers("prefill")
    decode = await fake_workers("decode", stream_chunks=4)
    router = await routers(make_config(prefill=[prefill.url], decode=[decode.url], upstream_client=client))
    async with http.post(url_of(router, "/generate"), json={"text": "x", "stream": True}) as resp:
        text = (await resp.read()).decode()
    assert text.count("tok") == 4 and text.endswith("data: [DONE]\n\n")
    async with http.post(url_of(router, "/v1/completions"), json={"prompt": "x"}) as resp:
        assert (await resp.json())["choices"][0]["text"] == "hello from decode"
    prefill.behavior.status, decode.behavior.delay = 400, 0.3  # a real decode waits for the KV
    async with http.post(url_of(router, "/v1/completions"), json={"prompt": "x"}) as resp:
        assert resp.status == 400


@pytest.mark.parametrize("client", ["lean", "aiohttp"])
async def test_a_cancelled_post_is_cancelled_at_every_point(client):
    """Cancelling a post must cancel it, wherever it is: while connecting, just as the connection
    completes, while waiting for the head. A post that swallows its cancellation keeps waiting on a
    worker that never answers (the router's prefill side waited out a 150 s bootstrap timeout that
    way, its in-flight gauge held, after the client had gone). Python 3.11's `asyncio.wait_for`
    returns the result, dropping the cancel, when both land in one loop iteration."""
    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.read()  # until the client closes
        except (asyncio.CancelledError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/generate"
    async with aiohttp.ClientSession() as session:
        upstream = LeanUpstream(AiohttpUpstream(session)) if client == "lean" else AiohttpUpstream(session)
        try:
            for spins in range(40):  # cancel after 0, 1, 2, ... loop iterations
                task = asyncio.ensure_future(upstream.post(url, b"{}", {}))
                for _ in range(spins):
                    await asyncio.sleep(0)
                task.cancel()
                done, _ = await asyncio.wait([task], timeout=2.0)
                assert done and task.cancelled(), f"cancelled after {spins} loop iterations, the post went on"
        finally:
            await upstream.close()
            server.close()
            await server.wait_closed()
