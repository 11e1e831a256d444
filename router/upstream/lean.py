"""A lean HTTP/1.1 client for the hot path: pooled keep-alive connections, one small protocol object
per connection, no per-request header machinery. It speaks exactly what engines answer: a status
line, headers, and a body framed by Content-Length, chunked encoding, or connection close.

Why: per request, aiohttp's client builds request/response objects, multidicts and timers that cost
more CPU than the rest of the router's hot path together (measured with cProfile, docs/router.md).
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator
from urllib.parse import urlsplit

from baton.router.upstream.base import Upstream, UpstreamError, UpstreamResponse

_HIGH_WATER = 1 << 20  # pause reading from a worker while this much is buffered, unread
_MAX_HEAD = 64 * 1024


class _Connection(asyncio.Protocol):
    """Buffers what the worker sends; a reader awaits `wait()` for more."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.closed = False  # EOF or connection lost: nothing more will arrive
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) > _HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.closed = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._wake()

    async def wait(self) -> None:
        """Until more data arrives or the connection closes."""
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def reusable(self) -> bool:
        return not self.closed and not self.buffer and self.transport is not None and not self.transport.is_closing()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class LeanResponse(UpstreamResponse):
    def __init__(self, pool: "LeanUpstream", key: tuple[str, int], conn: _Connection) -> None:
        self._pool, self._key, self._conn = pool, key, conn
        self._length: int | None = None  # bytes left (Content-Length framing)
        self._chunked = False
        self._chunk_left = 0
        self._need_crlf = False
        self._done = False
        self._keep_alive = True
        self._released = False

    async def read_head(self) -> None:
        conn, start = self._conn, 0
        while (end := conn.buffer.find(b"\r\n\r\n", start)) < 0:
            if conn.closed or len(conn.buffer) > _MAX_HEAD:
                raise UpstreamError("connection closed before the response head")
            start = max(0, len(conn.buffer) - 3)
            await conn.wait()
        head = bytes(conn.buffer[:end]).lower()
        del conn.buffer[:end + 4]
        try:
            self._parse_head(head)
        except ValueError as exc:
            raise UpstreamError(f"malformed response head: {exc}") from None
        self._done = self._length == 0

    def _parse_head(self, head: bytes) -> None:
        self.status = int(head[9:12])  # "http/1.1 200 ok"
        self.content_type = _header(head, b"content-type") or "application/json"
        self._keep_alive = head.startswith(b"http/1.1") and _header(head, b"connection") != "close"
        length = _header(head, b"content-length")
        if "chunked" in (_header(head, b"transfer-encoding") or ""):
            self._chunked = True
        elif length is not None:
            self._length = int(length)
        elif self.status in (204, 304) or 100 <= self.status < 200:
            self._length = 0
        else:
            self._keep_alive = False  # the body ends when the worker closes the connection

    async def read(self) -> bytes:
        buf = self._conn.buffer
        if self._length is not None and not self._done and len(buf) >= self._length:  # all in already
            body = bytes(buf[:self._length])
            del buf[:self._length]
            self._length, self._done = 0, True
            return body
        parts = [piece async for piece in self.chunks()]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def chunks(self) -> AsyncIterator[bytes]:
        while (piece := await self._next_piece()) is not None:
            yield piece

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        if self._done and self._keep_alive and self._conn.reusable():
            self._pool.put_idle(self._key, self._conn)
        else:
            self._conn.close()

    # -- body framing ----------------------------------------------------------------------
    async def _next_piece(self) -> bytes | None:
        if self._done:
            return None
        if self._chunked:
            return await self._next_chunk_piece()
        buf = self._conn.buffer
        if not buf:
            if self._conn.closed:
                if self._length is not None:
                    raise UpstreamError(f"connection closed with {self._length} body bytes missing")
                self._done = True
                return None
            await self._conn.wait()
            return await self._next_piece()
        n = len(buf) if self._length is None else min(len(buf), self._length)
        piece = bytes(buf[:n])
        del buf[:n]
        if self._length is not None:
            self._length -= n
            self._done = self._length == 0
        return piece

    async def _next_chunk_piece(self) -> bytes | None:
        if self._need_crlf:
            if await self._line():
                raise UpstreamError("bad chunked framing: no CRLF after a chunk")
            self._need_crlf = False
        if self._chunk_left == 0:
            try:
                size = int((await self._line()).split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise UpstreamError("bad chunked framing: no chunk size") from None
            if size == 0:
                while await self._line():  # trailers, then the empty line
                    pass
                self._done = True
                return None
            self._chunk_left = size
        await self._fill(1)
        buf = self._conn.buffer
        n = min(len(buf), self._chunk_left)
        piece = bytes(buf[:n])
        del buf[:n]
        self._chunk_left -= n
        self._need_crlf = self._chunk_left == 0
        return piece

    async def _line(self) -> bytes:
        conn = self._conn
        while (end := conn.buffer.find(b"\r\n")) < 0:
            if conn.closed:
                raise UpstreamError("connection closed inside a chunked body")
            await conn.wait()
        line = bytes(conn.buffer[:end])
        del conn.buffer[:end + 2]
        return line

    async def _fill(self, n: int) -> None:
        while len(self._conn.buffer) < n:
            if self._conn.closed:
                raise UpstreamError("connection closed inside the body")
            await self._conn.wait()


def _header(head: bytes, name: bytes) -> str | None:
    """The value of header `name` in a lower-cased response head (a few finds, no header dict)."""
    at = head.find(b"\r\n" + name + b":")
    if at < 0:
        return None
    start = at + len(name) + 3
    stop = head.find(b"\r\n", start)
    return head[start:stop if stop >= 0 else len(head)].strip().decode("latin-1")


class LeanUpstream(Upstream):
    def __init__(self, fallback: Upstream, connect_timeout: float = 10.0) -> None:
        self._fallback = fallback  # for https workers
        self._connect_timeout = connect_timeout
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._targets: dict[str, tuple[tuple[str, int], bytes] | None] = {}  # url -> (key, request head)

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> UpstreamResponse:
        target = self._targets.get(url) or self._parse(url)
        if target is None:
            return await self._fallback.post(url, body, headers)
        key, head = target
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items() if k.lower() != "content-type")
        request = b"".join((head, extra.encode("latin-1"), b"Content-Length: %d\r\n\r\n" % len(body), body))
        conn, reused = await self._acquire(key)
        try:
            return await self._exchange(key, conn, request)
        except UpstreamError:
            if not reused or conn.buffer:
                raise
        # A pooled connection the worker had just closed: once more on a fresh one.
        conn, _ = await self._acquire(key, fresh=True)
        return await self._exchange(key, conn, request)

    async def _exchange(self, key: tuple[str, int], conn: _Connection, request: bytes) -> LeanResponse:
        try:
            conn.transport.write(request)  # type: ignore[union-attr]
            resp = LeanResponse(self, key, conn)
            await resp.read_head()
            return resp
        except BaseException:
            conn.close()
            raise

    def put_idle(self, key: tuple[str, int], conn: _Connection) -> None:
        self._idle.setdefault(key, []).append(conn)

    async def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
        await self._fallback.close()

    async def _acquire(self, key: tuple[str, int], fresh: bool = False) -> tuple[_Connection, bool]:
        idle = None if fresh else self._idle.get(key)
        while idle:
            conn = idle.pop()
            if conn.reusable():
                return conn, True
            conn.close()
        try:
            loop = asyncio.get_running_loop()
            # asyncio.timeout, not wait_for: 3.11's wait_for drops a cancel that lands as the connection
            # completes, and the cancelled request would go on waiting for its worker's answer
            async with asyncio.timeout(self._connect_timeout):
                _, conn = await loop.create_connection(_Connection, *key)
        except (OSError, asyncio.TimeoutError) as exc:
            raise UpstreamError(f"cannot connect to {key[0]}:{key[1]}: {exc or type(exc).__name__}") from exc
        return conn, False

    def _parse(self, url: str) -> tuple[tuple[str, int], bytes] | None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            self._targets[url] = None
            return None
        port = parts.port or 80
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                f"Accept: */*\r\n").encode("latin-1")
        self._targets[url] = target = ((parts.hostname, port), head)
        return target
