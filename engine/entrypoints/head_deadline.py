"""A deadline on each request's head: a client that never sends it all (slowloris) loses its connection.

uvicorn waits for a request's head as long as the client likes: a connection that sends nothing, or
half a head, holds a socket and its buffers for good, and enough of them starve the server.
HeadDeadlineProtocol closes a connection whose next request's head has not fully arrived within
--request-read-timeout of the connection or of the last response (the body has its own deadline:
http_common.read_json). A request in service, or queued behind one (pipelined), is never cut.

It is uvicorn's httptools protocol with three of its callbacks extended (connection_made,
on_headers_complete, on_response_complete): `head_deadline_protocol` checks they are there and
otherwise serves with uvicorn's own protocol, without the deadline, saying so."""
from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)


def head_deadline_protocol(timeout: float) -> Any:
    """What uvicorn.Config's `http` takes: the protocol with a `timeout`-second head deadline, or
    "auto" (uvicorn's choice, no deadline) when the timeout is 0 or this uvicorn's httptools protocol
    lacks the callbacks it extends."""
    if timeout <= 0:
        return "auto"
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # httptools missing: uvicorn serves with h11
        logger.warning("no request-head deadline: uvicorn's httptools protocol is not available")
        return "auto"
    if not all(callable(getattr(HttpToolsProtocol, name, None))
               for name in ("connection_made", "on_headers_complete", "on_response_complete", "connection_lost")):
        logger.warning("no request-head deadline: this uvicorn's httptools protocol has other callbacks")
        return "auto"
    return functools.partial(_protocol_class(HttpToolsProtocol), head_timeout=timeout)


@functools.cache
def _protocol_class(base: type) -> Callable[..., asyncio.Protocol]:
    class HeadDeadlineProtocol(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, head_timeout: float, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._head_timeout = head_timeout
            self._head_deadline: Optional[asyncio.TimerHandle] = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_head_deadline()

        def on_headers_complete(self) -> None:
            self._disarm_head_deadline()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_head_deadline()

        def connection_lost(self, exc: Optional[Exception]) -> None:
            self._disarm_head_deadline()
            super().connection_lost(exc)

        def _arm_head_deadline(self) -> None:
            self._disarm_head_deadline()
            self._head_deadline = asyncio.get_running_loop().call_later(self._head_timeout, self._head_expired)

        def _disarm_head_deadline(self) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
                self._head_deadline = None

        def _head_expired(self) -> None:
            self._head_deadline = None
            cycle = getattr(self, "cycle", None)
            if cycle is not None and not cycle.response_complete:
                return  # a request in service (or pipelined behind one): its response re-arms the deadline
            self.transport.close()

    return HeadDeadlineProtocol
