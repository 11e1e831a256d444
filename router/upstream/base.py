"""The contract of the HTTP client that carries inference requests to workers (the hot path).

`post` returns once the status line and headers are in; the body is then read whole (`read`) or
piece by piece as it arrives (`chunks`), exactly once. `release` must be called in all cases: it
returns a fully read keep-alive connection to the pool and closes anything else. Transport
failures raise `UpstreamError` (a ConnectionError), also from `read` and `chunks`.
"""
from __future__ import annotations

import abc
from typing import AsyncIterator


class UpstreamError(ConnectionError):
    """The worker could not be reached, or broke the connection."""


class UpstreamResponse(abc.ABC):
    status: int
    content_type: str

    @abc.abstractmethod
    async def read(self) -> bytes:
        """The whole body."""

    @abc.abstractmethod
    def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (de-chunked), without waiting for the end."""

    @abc.abstractmethod
    def release(self) -> None:
        """Done with the response (idempotent)."""

    @property
    def is_stream(self) -> bool:
        return self.content_type.startswith("text/event-stream")


class Upstream(abc.ABC):
    @abc.abstractmethod
    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> UpstreamResponse:
        """POST `body` (JSON) to `url`; `headers` are extra request headers."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Close pooled connections."""
