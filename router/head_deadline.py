"""A deadline on a connection's first request head: a client that never sends it all loses the connection.

aiohttp waits for it as long as the client likes: a connection that sends nothing, or half a head
(slowloris), holds a socket and a handler task for good.
HeadDeadlineRunner's connections close unless the first head has all arrived (its blank line) within
--request-read-timeout-secs; later heads on a keep-alive connection are aiohttp's keep-alive timeout's
(it closes a connection still waiting for a whole head that long after a response), and bodies have
their own deadline (request.read_body).

The deadline wraps aiohttp's protocol from outside (every protocol call passes through), so nothing
of aiohttp's inside is touched: the runner's `server`, the protocol factory its sites listen with,
makes the wrapped protocol."""
from __future__ import annotations

import asyncio
from typing import Any, Callable, Optional

from aiohttp import web


class HeadDeadline(asyncio.Protocol):
    """`inner` (aiohttp's request handler), with the transport closed `timeout` seconds after the
    connection unless the first head's end (CRLF CRLF) has arrived."""

    def __init__(self, make_inner: Callable[[], asyncio.Protocol], timeout: float) -> None:
        self._inner = make_inner()
        self._timeout = timeout
        self._timer: Optional[asyncio.TimerHandle] = None
        self._tail = b""  # the last bytes seen, for a head's end split across reads

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._timer = asyncio.get_running_loop().call_later(self._timeout, transport.close)
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._timer is not None:
            seen = self._tail + data
            if b"\r\n\r\n" in seen:
                self._disarm()
            else:
                self._tail = seen[-3:]
        self._inner.data_received(data)

    def eof_received(self) -> Optional[bool]:
        return self._inner.eof_received()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._disarm()
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self._tail = b""


class HeadDeadlineRunner(web.AppRunner):
    """aiohttp's AppRunner whose sites' connections get HeadDeadline (`head_timeout` 0: none)."""

    def __init__(self, app: web.Application, head_timeout: float, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.head_timeout = head_timeout

    @property
    def server(self) -> Any:
        inner = super().server
        if inner is None or not self.head_timeout:
            return inner
        return lambda: HeadDeadline(inner, self.head_timeout)
